"""The experts' probability-weighted SwiGLU in two Triton kernels, with megatron-core's interface.

For an input ``y = [a | b]`` (``rows x 2F``) and per-row probabilities ``p``, forward is
``silu(a) * b * p`` and backward gives ``dy`` and ``dp = sum_j silu(a_j) * b_j * g_j``, as
megatron-core's ``weighted_swiglu`` and ``weighted_swiglu_back``. megatron-core compiles those with
``torch.compile``: inductor generates the backward's row reduction for the row count it is
compiled for (or for the hint of a dynamic one), and the threads that sum a row, with them the
order of the sum, differ between such kernels. A step whose experts see capacity-padded inputs
then gets other bits in ``dp`` than one with exact inputs.

Here a program takes :data:`BLOCK_ROWS` rows and walks their ``F`` columns in blocks of
``min(256, next power of two of F)``, each lane accumulating its column's products; the lanes are
summed at the end. The order depends on ``F`` only: every row gets the same bits whatever the
number of rows (the kernels are not specialised on it). All arithmetic is fp32; outputs take the
inputs' dtypes.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # module globals: Triton's interpreter patches the ``tl`` its kernels' module holds
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA builds ship Triton
    triton = tl = None

BLOCK_ROWS = 16
MAX_BLOCK_COLS = 256
NUM_WARPS = 4
# The row sum's combine function, made by _kernels() with the kernels (a module global: Triton's
# interpreter runs a kernel's source against its module's globals, and runs only jit functions made
# while it is on, which tl.sum, tl.sigmoid and tl.zeros, made when triton was imported, may not be).
_add = None


def block_cols(ffn: int) -> int:
    """The column block for an ``F``-wide SwiGLU: at most :data:`MAX_BLOCK_COLS`."""
    return min(MAX_BLOCK_COLS, triton.next_power_of_2(ffn))


@functools.cache
def _kernels():
    global _add

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit(do_not_specialize=["rows"])
    def forward_kernel(
        y, p, out, rows, ffn: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        row_ok = row < rows
        mask = row_ok[:, None] & (col < ffn)[None, :]
        at = y + row[:, None] * (2 * ffn) + col[None, :]
        a = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(at + ffn, mask=mask, other=0.0).to(tl.float32)
        prob = tl.load(p + row, mask=row_ok, other=0.0).to(tl.float32)
        act = a / (1.0 + tl.exp(-a)) * b * prob[:, None]
        tl.store(out + row[:, None] * ffn + col[None, :], act.to(out.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["rows"])
    def backward_kernel(
        g, y, p, dy, dp, rows, ffn: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = row < rows
        prob = tl.load(p + row, mask=row_ok, other=0.0).to(tl.float32)
        lanes = tl.full([BLOCK_ROWS, BLOCK_COLS], 0.0, tl.float32)
        for start in tl.static_range(0, ffn, BLOCK_COLS):
            col = start + tl.arange(0, BLOCK_COLS)
            mask = row_ok[:, None] & (col < ffn)[None, :]
            at = row[:, None] * (2 * ffn) + col[None, :]
            a = tl.load(y + at, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(y + at + ffn, mask=mask, other=0.0).to(tl.float32)
            grad = tl.load(g + row[:, None] * ffn + col[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
            sig = 1.0 / (1.0 + tl.exp(-a))
            silu = a * sig
            weighted = grad * prob[:, None]
            da = weighted * sig * (1.0 + a * (1.0 - sig)) * b
            tl.store(dy + at, da.to(dy.dtype.element_ty), mask=mask)
            tl.store(dy + at + ffn, (weighted * silu).to(dy.dtype.element_ty), mask=mask)
            lanes += silu * b * grad
        tl.store(dp + row, tl.reduce(lanes, 1, _add).to(dp.dtype.element_ty), mask=row_ok)

    return forward_kernel, backward_kernel


def available(device) -> bool:
    """Whether the kernels run on ``device``: CUDA with Triton, or any device under Triton's
    interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


class WeightedSwiGLU(torch.autograd.Function):
    """``silu(a) * b * p`` for ``y = [a | b]`` (``rows x 2F``) and ``p`` (``rows`` values)."""

    @staticmethod
    def forward(ctx, y, probs):
        forward_kernel, _ = _kernels()
        y = y.contiguous()
        rows, ffn = y.shape[0], y.shape[1] // 2
        flat = probs.reshape(-1).contiguous()
        out = torch.empty(rows, ffn, dtype=y.dtype, device=y.device)
        if rows:
            cols = block_cols(ffn)
            grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(ffn, cols))
            forward_kernel[grid](
                y, flat, out, rows, ffn, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=cols,
                num_warps=NUM_WARPS,
            )  # fmt: skip
        ctx.save_for_backward(y, flat)
        ctx.probs_shape = probs.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _, backward_kernel = _kernels()
        y, flat = ctx.saved_tensors
        rows, ffn = y.shape[0], y.shape[1] // 2
        dy = torch.empty_like(y)
        dp = torch.empty_like(flat)
        if rows:
            backward_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
                grad_out.contiguous(), y, flat, dy, dp, rows, ffn, BLOCK_ROWS=BLOCK_ROWS,
                BLOCK_COLS=block_cols(ffn), num_warps=NUM_WARPS,
            )  # fmt: skip
        return dy, dp.view(ctx.probs_shape)


def weighted_swiglu(y: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b * probs`` for ``y = [a | b]`` (``rows x 2F``, ``probs``: ``rows`` values in
    any shape, e.g. ``rows x 1``); differentiable in both."""
    if y.dim() != 2 or y.shape[1] % 2:
        raise ValueError(
            f"weighted SwiGLU: the input is {tuple(y.shape)}; it needs rows x 2F (both halves)"
        )
    if probs.numel() != y.shape[0]:
        raise ValueError(
            f"weighted SwiGLU: {probs.numel()} probabilities for {y.shape[0]} rows; one per row"
        )
    if not available(y.device):
        raise RuntimeError(
            f"triton weighted SwiGLU: no Triton kernel runs on {y.device} (a CUDA device, or "
            "TRITON_INTERPRET=1)"
        )
    return WeightedSwiGLU.apply(y, probs)
