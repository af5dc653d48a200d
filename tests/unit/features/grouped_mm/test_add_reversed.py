"""The Triton kernel that adds bf16 expert weight gradients into fp32 main grads lying in reverse
order, run by Triton's interpreter on the CPU: bitwise torch's promoted add, the overwrite form, and
its place in the grouped GEMM's backward."""

import pytest
import torch

from megatron.patchset.features.grouped_mm import linears
from megatron.patchset.features.grouped_mm import torch_grouped_gemm as accumulate
from tests.unit.conftest import triton_interpreter
from tests.unit.features.grouped_mm.conftest import (
    IN,
    OUT,
    SPLITS,
    ddp_main_grads,
    expert_weights,
    rows,
)

pytest.importorskip("triton")


@pytest.fixture
def interpreter(monkeypatch):
    yield from triton_interpreter(monkeypatch, accumulate._add_reversed_kernel)


def test_without_a_gpu_or_the_interpreter_it_is_not_available(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not accumulate.add_reversed_available(torch.device("cpu"))


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("overwrite", [False, True])
def test_it_is_torchs_promoted_add_into_the_reversed_stack_to_the_bit(
    interpreter, overwrite, descending
):
    assert accumulate.add_reversed_available(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    n, shape = 5, (7, accumulate.ADD_REVERSED_BLOCK // 3)  # rows not a multiple of the block
    stack = torch.randn((n, *shape), generator=gen)
    dw = torch.randn((n, *shape), generator=gen).to(torch.bfloat16)
    expected = stack.clone()
    for e in range(n):
        row = expected[n - 1 - e] if descending else expected[e]
        if overwrite:
            row.copy_(dw[e])
        else:
            row.add_(dw[e])
    accumulate.add_reversed(stack, dw, overwrite=overwrite, descending=descending)
    assert torch.equal(stack, expected)


def test_a_mismatched_or_strided_stack_is_refused(interpreter):
    with pytest.raises(ValueError, match="contiguous stack"):
        accumulate.add_reversed(torch.zeros(3, 4), torch.zeros(3, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous stack"):
        accumulate.add_reversed(torch.zeros(4, 3).t(), torch.zeros(3, 4, dtype=torch.bfloat16))


def test_the_backward_takes_it_for_main_grads_in_reverse(interpreter, monkeypatch):
    weights = expert_weights()
    ddp_main_grads(weights)
    calls = []
    real = accumulate.add_reversed

    def record(stack, dw, overwrite=False, descending=True):
        calls.append((tuple(stack.shape), dw.dtype, overwrite, descending))
        return real(stack, dw, overwrite=overwrite, descending=descending)

    def refuse(*args, **kwargs):
        raise AssertionError("torch's reversed copy or per-expert add used")

    monkeypatch.setattr(accumulate, "add_reversed", record)
    monkeypatch.setattr(torch.Tensor, "flip", refuse)
    monkeypatch.setattr(torch.Tensor, "add_", refuse)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    linears.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    assert calls == [((len(weights), OUT, IN), torch.bfloat16, False, True)]
    dw = torch.nn.functional.grouped_mm(
        dy.t(), x, offs=linears.group_offsets(SPLITS, x.device)
    )  # the backward's own weight gradient: the main grads hold exactly 0.5 + it
    for w, part in zip(weights, dw.unbind(0)):
        assert torch.equal(w.main_grad, torch.full_like(w.main_grad, 0.5) + part.float())
