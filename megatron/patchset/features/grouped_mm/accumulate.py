"""bf16 expert weight gradients into fp32 main grads lying in reverse order, in one Triton kernel.

megatron's DDP places a layer's expert main grads back to back in reverse order (expert ``e`` at
index ``n - 1 - e`` of the stack), and on Hopper torch 2.11's grouped GEMM writes the weight
gradient only in bf16 (the inputs' dtype). torch has no single kernel for "add a bf16 tensor into
the reverse of an fp32 one": a reversed copy plus one add, or one add per expert, reads and writes
more than the 10 bytes per parameter the sum needs (bf16 in, fp32 in, fp32 out). On the reference
config (3.02 B expert parameters) the add per expert takes 14.2 ms per step on one H200, the
reversed copy plus one add 17.5 ms, this kernel 7.1 ms (``tools/bench/kernel_timings.py``).

:func:`add_reversed` does it in one kernel, each program adding a block of one expert's gradient
into its row of the reversed stack. The sum is ``float(main) + float(bf16)``, rounded once, as
torch's own promoted add: the result is the same to the bit. The kernel is built on first use
(Triton ships with torch's CUDA builds); without Triton, or on a CPU tensor outside Triton's
interpreter (``TRITON_INTERPRET=1``), :func:`available` is False and the caller keeps torch's
kernels.
"""

from __future__ import annotations

import functools

from megatron.patchset.core.triton_kernels import triton_runs_on

BLOCK = 2048


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_reversed_kernel(
        dst, src, n_experts, numel, BLOCK: tl.constexpr, OVERWRITE: tl.constexpr
    ):
        expert = tl.program_id(1).to(tl.int64)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        value = tl.load(src + expert * numel + offsets, mask=mask).to(tl.float32)
        row = dst + (n_experts - 1 - expert) * numel + offsets
        if not OVERWRITE:
            value = tl.load(row, mask=mask) + value
        tl.store(row, value, mask=mask)

    return add_reversed_kernel


def available(device) -> bool:
    """Whether :func:`add_reversed` runs on ``device``: a CUDA device with Triton installed, or any
    device under Triton's interpreter."""
    return triton_runs_on(device)


def add_reversed(stack, dw, overwrite: bool = False) -> None:
    """``stack[n - 1 - e] += dw[e]`` (``=`` with ``overwrite``) for every expert ``e``, in one
    kernel. ``stack``: contiguous fp32 ``(n, *shape)``; ``dw``: bf16 (or fp32) of the same shape."""
    import triton

    if stack.shape != dw.shape or not stack.is_contiguous():
        raise ValueError(
            f"add_reversed: a contiguous stack of dw's shape is needed, got {tuple(stack.shape)} "
            f"(contiguous: {stack.is_contiguous()}) and {tuple(dw.shape)}"
        )
    dw = dw.contiguous()
    n = stack.shape[0]
    numel = stack[0].numel() if n else 0
    if numel == 0:
        return
    grid = (triton.cdiv(numel, BLOCK), n)
    _kernel()[grid](stack, dw, n, numel, BLOCK=BLOCK, OVERWRITE=overwrite, num_warps=8)
