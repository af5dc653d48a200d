"""Zeroing the padding rows of a grouped GEMM's result: the Triton kernel (run by Triton's
interpreter on the CPU) writes zeros exactly from the device-side end offset on, as torch's mask
fill does, and leaves every other row as it was."""

import pytest
import torch

from megatron.patchset.features.grouped_mm import tail
from tests.unit.conftest import triton_interpreter

pytest.importorskip("triton")


@pytest.fixture
def interpreter(monkeypatch):
    yield from triton_interpreter(monkeypatch, tail._kernel)


def torch_form(t, offs):
    rows = torch.arange(t.shape[0])
    return t.masked_fill((rows >= offs[-1]).unsqueeze(-1), 0)


@pytest.mark.parametrize("row_len, end", [(3000, 29), (5, 0), (5, 41), (1536, 40)])
def test_the_kernel_zeros_the_rows_after_the_last_offset_only(interpreter, row_len, end):
    t = torch.randn(41, row_len).to(torch.bfloat16)
    offs = torch.tensor([3, end // 2, end], dtype=torch.int32)
    expected = torch_form(t, offs)
    assert tail.zero_tail(t, offs) is t
    assert torch.equal(t, expected)
    assert not t[end:].any() and (end == 0 or t[:end].any())


def test_without_the_interpreter_the_mask_fill_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = torch.ones(6, 4)
    tail.zero_tail(t, torch.tensor([2, 4]))
    assert t[:4].eq(1).all() and not t[4:].any()
