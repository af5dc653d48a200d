"""Row gathers whose backward is a gather too: ``out[i] = src[index[i]]`` (zeros where ``index[i]``
is ``len(src)`` or more), differentiated through the inverse map ``inverse[r]`` = the output row
that took source row ``r`` (or ``len(out)`` or more where none did).

``index`` is injective on its valid entries (every map of :mod:`.plan` is), so the gradient of
``src`` is a gather of the output's gradient: no scatter-add, no atomics, the same bits on every
run.
"""

from __future__ import annotations

import functools


def _gather_rows(src, index):
    """``src[index]`` with zero rows where ``index`` is out of range."""
    rows = src.shape[0]
    if rows == 0:
        return src.new_zeros((index.shape[0], *src.shape[1:]))
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
