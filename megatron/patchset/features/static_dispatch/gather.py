"""Row gathers whose backward is a gather too: ``out[i] = src[index[i]]`` (zeros where ``index[i]``
is ``len(src)`` or more), differentiated through the inverse map ``inverse[r]`` = the output row
that took source row ``r`` (or ``len(out)`` or more where none did).

``index`` is injective on its valid entries (every map of :mod:`.plan` is), so the gradient of
``src`` is a gather of the output's gradient: no scatter-add, no atomics, the same bits on every
run.

On a GPU one Triton kernel gathers and writes the zero rows in the same pass (each output row read
once from ``src`` or not at all, written once). torch's form, a gather of clamped indices and then a
mask fill broadcast over the hidden dimension, reads and writes the output twice, the second time
through torch's non-vectorised broadcast kernel; it stays for CPU tensors (and without Triton) and
gives the same bits.
"""

from __future__ import annotations

import functools

from megatron.patchset.core.triton_kernels import row_block, triton_runs_on


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows_kernel(
        out, src, index, n_out, n_src, row_len, ROWS: tl.constexpr, BLOCK: tl.constexpr
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = rows < n_out
        taken = tl.load(index + rows, mask=inside, other=n_src).to(tl.int64)
        in_row = cols[None, :] < row_len
        valid = (taken < n_src)[:, None] & in_row
        value = tl.load(src + taken[:, None] * row_len + cols[None, :], mask=valid, other=0)
        tl.store(
            out + rows[:, None] * row_len + cols[None, :], value, mask=inside[:, None] & in_row
        )

    return gather_rows_kernel


def _launch(kernel, src, index, **meta):
    """``kernel`` over one output row per entry of ``index`` (its first dimension), tiled as
    :func:`row_block` tiles a row of ``src``."""
    import triton

    out = src.new_empty((index.shape[0], *src.shape[1:]))
    row_len = src[0].numel()
    if out.numel():
        per, block = row_block(row_len)
        grid = (triton.cdiv(index.shape[0], per), triton.cdiv(row_len, block))
        n_out, n_src = index.shape[0], src.shape[0]
        kernel[grid](out, src, index, n_out, n_src, row_len, ROWS=per, BLOCK=block, **meta)
    return out


def _gather_rows(src, index):
    """``src[index]`` with zero rows where ``index`` is out of range."""
    rows = src.shape[0]
    if rows == 0:
        return src.new_zeros((index.shape[0], *src.shape[1:]))
    if triton_runs_on(src.device) and src.is_contiguous() and index.is_contiguous():
        return _launch(_kernel(), src, index)
    out = src.index_select(0, index.clamp(max=rows - 1))
    pad = (index >= rows).reshape(-1, *([1] * (src.dim() - 1)))
    return out.masked_fill_(pad, 0)


@functools.cache
def _mapped(forward, backward):
    """A differentiable ``forward(src, index)`` whose gradient is ``backward(grad, back)``, with
    ``back`` the map that undoes ``index``."""
    import torch

    class Mapped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, src, index, back):
            ctx.save_for_backward(back)
            return forward(src, index)

        @staticmethod
        def backward(ctx, grad):
            (back,) = ctx.saved_tensors
            return backward(grad.contiguous(), back), None, None

    Mapped.__name__ = Mapped.__qualname__ = f"Mapped_{forward.__name__}"
    return Mapped


def gather_rows(src, index, inverse):
    """Differentiable ``src[index]`` (see the module docstring)."""
    return _mapped(_gather_rows, _gather_rows).apply(src, index, inverse)


# --- Fan-out and fan-in (``--moe-static-dispatch-dedup``) ------------------------------------
#
# A token sent once to a peer feeds several rows there (one per local expert it picked), and its
# output is the sum of rows: a gather whose index repeats (fan-out) is differentiated by a sum
# over a fan-in map ``[n_src, K]``, and a sum over a fan-in map by a gather through the owner of
# each row. Both sums add their ``K`` rows in the map's order, in fp32 for 16-bit rows: no
# atomics, the same bits on every run. The kernel's bf16 rounding gives torch's bits for every
# number; a NaN comes out as the quiet NaN 0x7FC0 whatever its payload.


@functools.cache
def _sum_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum_kernel(
        out,
        src,
        fanin,
        n_out,
        n_src,
        row_len,
        FAN: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        BF16: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = rows < n_out
        in_row = cols[None, :] < row_len
        acc = tl.full((ROWS, BLOCK), 0.0, tl.float32)
        for k in tl.static_range(FAN):
            taken = tl.load(fanin + rows * FAN + k, mask=inside, other=n_src).to(tl.int64)
            valid = (taken < n_src)[:, None] & in_row
            value = tl.load(src + taken[:, None] * row_len + cols[None, :], mask=valid, other=0)
            acc += value.to(tl.float32)
        where = out + rows[:, None] * row_len + cols[None, :]
        if BF16:
            # rounded to nearest even in integer arithmetic, so that Triton's interpreter (which
            # truncates) rounds as the GPU and torch do
            bits = acc.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(acc != acc, 0x7FC0, bits).to(tl.uint16)
            tl.store(where, bits.to(tl.bfloat16, bitcast=True), mask=inside[:, None] & in_row)
        else:
            tl.store(where, acc, mask=inside[:, None] & in_row)

    return gather_sum_kernel


def _accumulator(dtype):
    import torch

    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _gather_sum(src, fanin):
    """``out[i] = sum over k of src[fanin[i, k]]`` (rows out of range add nothing), in ``k``
    order."""
    import torch

    rows, fan = src.shape[0], fanin.shape[1]
    if rows == 0 or fan == 0:
        return src.new_zeros((fanin.shape[0], *src.shape[1:]))
    if (
        triton_runs_on(src.device)
        and src.is_contiguous()
        and fanin.is_contiguous()
        and src.dtype in (torch.bfloat16, torch.float32)
    ):
        return _launch(_sum_kernel(), src, fanin, FAN=fan, BF16=src.dtype == torch.bfloat16)
    acc = _accumulator(src.dtype)
    out = src.new_zeros((fanin.shape[0], *src.shape[1:]), dtype=acc)
    for k in range(fan):
        out += _gather_rows(src, fanin[:, k].contiguous()).to(acc)
    return out.to(src.dtype)


def gather_expand(src, index, fanin):
    """Differentiable ``src[index]`` where ``index`` may repeat a row: ``fanin[r]`` lists the
    outputs that took source row ``r`` (``len(out)`` or more where fewer did)."""
    return _mapped(_gather_rows, _gather_sum).apply(src, index, fanin)


def gather_sum(src, fanin, owner):
    """Differentiable ``sum over k of src[fanin[i, k]]``: ``owner[r]`` is the output that row
    ``r`` of ``src`` adds into (``len(out)`` or more where none does)."""
    return _mapped(_gather_sum, _gather_rows).apply(src, fanin, owner)
