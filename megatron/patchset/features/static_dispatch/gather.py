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


def _gather_rows(src, index):
    """``src[index]`` with zero rows where ``index`` is out of range."""
    rows = src.shape[0]
    if rows == 0:
        return src.new_zeros((index.shape[0], *src.shape[1:]))
    if triton_runs_on(src.device) and src.is_contiguous() and index.is_contiguous():
        import triton

        out = src.new_empty((index.shape[0], *src.shape[1:]))
        row_len = src[0].numel()
        if out.numel():
            per, block = row_block(row_len)
            grid = (triton.cdiv(index.shape[0], per), triton.cdiv(row_len, block))
            _kernel()[grid](out, src, index, index.shape[0], rows, row_len, ROWS=per, BLOCK=block)
        return out
    out = src.index_select(0, index.clamp(max=rows - 1))
    pad = (index >= rows).reshape(-1, *([1] * (src.dim() - 1)))
    return out.masked_fill_(pad, 0)


@functools.cache
def _function():
    import torch

    class GatherRows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, src, index, inverse):
            ctx.save_for_backward(inverse)
            return _gather_rows(src, index)

        @staticmethod
        def backward(ctx, grad):
            (inverse,) = ctx.saved_tensors
            return _gather_rows(grad.contiguous(), inverse), None, None

    return GatherRows


def gather_rows(src, index, inverse):
    """Differentiable ``src[index]`` (see the module docstring)."""
    return _function().apply(src, index, inverse)
