"""The static dispatch's row gather: the Triton kernel (run by Triton's interpreter on the CPU)
gives torch's gather-then-fill to the bit, zero rows where the index is out of range included, and
its backward is the gather through the inverse map."""

import pytest
import torch

from megatron.patchset.features.static_dispatch import gather
from tests.unit.conftest import triton_interpreter

pytest.importorskip("triton")


@pytest.fixture
def interpreter(monkeypatch):
    yield from triton_interpreter(monkeypatch, gather._kernel)


def torch_form(src, index):
    out = src.index_select(0, index.clamp(max=src.shape[0] - 1))
    return out.masked_fill_((index >= src.shape[0]).reshape(-1, *([1] * (src.dim() - 1))), 0)


@pytest.mark.parametrize(
    "shape, dtype",
    [((37, 3000), torch.bfloat16), ((37, 5), torch.float32), ((37,), torch.float32)],
)
def test_the_kernel_is_torchs_gather_and_fill_to_the_bit(interpreter, shape, dtype):
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(shape, generator=gen).to(dtype)
    # every source row at most once, a third of the outputs padding (index == or > len(src))
    index = torch.randperm(60, generator=gen)[:45]
    assert gather.triton_runs_on(src.device)
    out = gather._gather_rows(src, index)
    expected = torch_form(src, index)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert (index >= src.shape[0]).any() and not out[index >= src.shape[0]].any()


def test_without_the_interpreter_torchs_form_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src = torch.arange(12.0).reshape(4, 3)
    index = torch.tensor([3, 9, 0])
    assert not gather.triton_runs_on(src.device)
    assert torch.equal(gather._gather_rows(src, index), torch_form(src, index))


def test_the_gradient_is_the_gather_through_the_inverse_map(interpreter):
    src = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([4, 0, 7, 2, 9])  # rows 1, 3, 5 of src taken by no output
    inverse = torch.full((6,), 5)
    inverse[index[index < 6]] = torch.nonzero(index < 6).flatten()
    out = gather.gather_rows(src, index, inverse)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = torch.zeros_like(src)
    for i, r in enumerate(index.tolist()):
        if r < 6:
            expected[r] = grad[i]
    assert torch.equal(src.grad, expected)


@pytest.fixture
def sum_interpreter(monkeypatch):
    yield from triton_interpreter(monkeypatch, gather._sum_kernel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_sum_kernel_adds_the_fan_in_in_order_to_the_bit(sum_interpreter, dtype):
    """Each output row is the sum of its fan-in rows in the map's order, in fp32 (16-bit rows
    rounded once), rows out of range adding nothing: what torch's form computes."""
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(23, 700, generator=gen).to(dtype)
    fanin = torch.randint(0, 30, (19, 4), generator=gen)  # about a quarter out of range
    assert gather.triton_runs_on(src.device)
    out = gather._gather_sum(src, fanin)
    padded = torch.cat([src.float(), torch.zeros(1, 700)])
    expected = torch.zeros(19, 700)
    for k in range(4):
        expected += padded[fanin[:, k].clamp(max=23)]
    assert out.dtype == dtype and torch.equal(out, expected.to(dtype))
    assert (fanin >= 23).any()


def test_fan_out_and_fan_in_are_each_others_gradients():
    """``gather_expand`` (a row taken by several outputs) and ``gather_sum`` pass gradient
    checks in fp64 with the maps of one token sent to two experts."""
    index = torch.tensor([0, 2, 0, 5, 1])  # row 0 feeds outputs 0 and 2; output 3 is padding
    fanin = torch.tensor([[0, 2], [4, 5], [1, 5]])  # the outputs each source row feeds
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gather.gather_expand(t, index, fanin), (x,))
    y = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    owner = torch.tensor([0, 2, 0, 3, 1])  # row 3 adds into no output
    assert torch.autograd.gradcheck(lambda t: gather.gather_sum(t, fanin, owner), (y,))
    assert torch.equal(gather.gather_sum(y, fanin, owner)[0], (y[0] + y[2]).detach())
