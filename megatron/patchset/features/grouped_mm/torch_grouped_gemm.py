"""MoE expert linears as torch grouped GEMMs (``moe_grouped_gemm_impl='torch'``).

On Hopper, Transformer Engine's ``GroupedLinear`` runs a grouped linear as one cuBLAS GEMM per
expert: with 128 local experts that is 128 launches for each of forward, data gradient and weight
gradient, per linear, per layer, and the per-expert token counts must be on the host to split the
input. ``torch.nn.functional.grouped_mm`` (CUTLASS on sm90) takes the per-expert row offsets as a
device tensor and does each of the three GEMMs in one launch.

:func:`grouped_linear_forward` replaces only the GEMMs of a TE grouped linear: its parameters
(``weight0`` ... ``weight{N-1}``), their initialisation, the state dict and the checkpoint format,
and the expert-parallel attributes that DDP and the distributed optimizer read are unchanged.
Per linear, with ``W_e`` of shape ``(out, in)`` and the rows of ``x`` grouped by expert:

* forward ``y = grouped_mm(x, stack(W).mT, offs)``. ``stack(W)`` is a view, not a copy: at its
  first forward the linear moves its expert weights into one ``(experts, out, in)`` tensor in
  expert order (:func:`share_one_storage`; each ``weight{i}.data`` becomes a row of it), which the
  optimizer's copy back to bf16 and checkpoint loads then write in place. Weights that are views
  of a larger buffer already (DDP's parameter buffer with the distributed optimizer holds them in
  reverse order) stay where they are: rows grouped from the last expert to the first (the static
  dispatch lays them out so, ``descending``) read them as one view, other layouts stack a copy
  per GEMM;
* data gradient ``dx = grouped_mm(dy, stack(W), offs)``;
* weight gradient ``dW = grouped_mm(dy.T, x, offs)``, shape ``(experts, out, in)``: fp32 from the
  GEMM where the device writes it (torch 2.11's grouped GEMM writes only bf16 on Hopper).

For weights that megatron's DDP manages (they carry ``main_grad`` and ``grad_added_to_main_grad``)
the weight gradient goes straight into the main grads, in as few passes as their layout allows:

* back to back in expert order (one stacked view: the rows grouped from the last expert to the
  first over DDP's buffer, ``descending``): one add, bf16 into fp32 in one Triton kernel
  (:func:`add_reversed` in expert order; torch's promoted add without Triton);
* back to back in reverse order, as DDP places them: in the main grads' dtype one
  ``_foreach_add_``; bf16 into fp32 one Triton kernel (:func:`add_reversed`; without Triton, one
  add per expert while a CUDA graph is captured, else a reversed copy and one add);
* scattered: one ``_foreach_add_``, after one cast when the dtypes differ.

This follows the contract TE uses for its fused weight-gradient accumulation:
``overwrite_main_grad`` copies instead of adding, ``grad_added_to_main_grad`` is set and a dummy
gradient is returned so that DDP's per-parameter hook still fires (and skips its own add). It
needs no apex kernel, so it also holds without gradient accumulation fusion; without DDP the
gradients are returned.

The token counts may be a host list or a tensor on the device; a device tensor stays there, so
the layer runs without a device-to-host synchronization (``moe_expert_splits_on_device``).
"""

import functools
import importlib.util
import itertools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

# bf16 rows and columns must start on 16-byte boundaries for the grouped GEMM kernels.
_ALIGNMENT = 8
ADD_REVERSED_BLOCK = 2048


# ---------------------------------------------------------------------------------------
# bf16 weight gradients into fp32 main grads back to back (in either order), in one Triton kernel
# ---------------------------------------------------------------------------------------


@functools.cache
def _add_reversed_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_reversed_kernel(
        dst,
        src,
        n_experts,
        numel,
        BLOCK: tl.constexpr,
        OVERWRITE: tl.constexpr,
        DESCENDING: tl.constexpr,
    ):
        """Program (block, expert): the block of ``src[expert]`` into ``dst[n - 1 - expert]``
        (``dst[expert]`` unless ``DESCENDING``)."""
        expert = tl.program_id(1).to(tl.int64)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        value = tl.load(src + expert * numel + offsets, mask=mask).to(tl.float32)
        target = n_experts - 1 - expert if DESCENDING else expert
        row = dst + target * numel + offsets
        if not OVERWRITE:
            value = tl.load(row, mask=mask) + value
        tl.store(row, value, mask=mask)

    return add_reversed_kernel


def add_reversed_available(device: torch.device) -> bool:
    """Whether :func:`add_reversed` runs on ``device``: a CUDA device with Triton installed, or any
    device under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return importlib.util.find_spec("triton") is not None


def add_reversed(
    stack: torch.Tensor, dw: torch.Tensor, overwrite: bool = False, descending: bool = True
) -> None:
    """``stack[n - 1 - e] += dw[e]`` (``=`` with ``overwrite``; ``stack[e]`` with ``descending``
    False) for every expert ``e``, in one kernel. ``stack``: contiguous fp32 ``(n, *shape)``;
    ``dw``: bf16 (or fp32) of the same shape.

    DDP places a layer's expert main grads back to back in reverse order, and torch has no single
    kernel that adds a bf16 tensor into the reverse of an fp32 one: a reversed copy plus one add,
    or one add per expert, reads and writes more than the 10 bytes per parameter the sum needs.
    In expert order torch's promoted add is one kernel, but not a vectorized one (13.5 ms against
    this kernel's 8.3 ms for the 96 adds of a Qwen3-30B-A3B rank at EP 8 on an H200). The sum is
    ``float(main) + float(dw)``, rounded once, as torch's own promoted add."""
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
    grid = (triton.cdiv(numel, ADD_REVERSED_BLOCK), n)
    _add_reversed_kernel()[grid](
        stack,
        dw,
        n,
        numel,
        BLOCK=ADD_REVERSED_BLOCK,
        OVERWRITE=overwrite,
        DESCENDING=descending,
        num_warps=8,
    )


# ---------------------------------------------------------------------------------------
# Offsets, weight gradients, the autograd function
# ---------------------------------------------------------------------------------------

_offsets_cache: dict = {}  # device -> (split sizes, offsets): fc1 and fc2 of a layer share them


def group_offsets(m_splits: Any, device: torch.device) -> torch.Tensor:
    """End offsets of each expert's rows as an int32 tensor on ``device``.

    ``m_splits`` is a list of per-expert row counts or a tensor of them; a tensor on the device
    stays there (no device-to-host copy)."""
    # non_blocking: a blocking host-to-device copy would also wait for the whole stream.
    if isinstance(m_splits, torch.Tensor):
        return torch.cumsum(m_splits.to(device=device, non_blocking=True), 0, dtype=torch.int32)
    key = tuple(int(n) for n in m_splits)
    cached = _offsets_cache.get(device)
    if cached is not None and cached[0] == key:
        return cached[1]
    offs = torch.tensor(list(itertools.accumulate(key)), dtype=torch.int32).to(
        device, non_blocking=True
    )
    _offsets_cache[device] = (key, offs)
    return offs


def capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_fp32_wgrad_supported: dict = {}  # device type -> whether grouped_mm writes fp32 from bf16


def _wgrad_out_dtype(main_grad_dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """fp32 weight gradients straight from the GEMM when the main grads are fp32 and the device's
    grouped_mm accepts ``out_dtype=float32`` (probed once; PyTorch's CPU fallback does not)."""
    if main_grad_dtype != torch.float32:
        return None
    supported = _fp32_wgrad_supported.get(device.type)
    if supported is None:
        if capturing(device):
            raise RuntimeError(
                "moe_grouped_gemm_impl='torch': the first backward runs inside a CUDA graph "
                "capture, where the grouped GEMM's fp32-output probe cannot run; capture after "
                "at least one eager step (--cuda-graph-warmup-steps 1 or more)"
            )
        a = torch.zeros(2 * _ALIGNMENT, 2 * _ALIGNMENT, dtype=torch.bfloat16, device=device)
        offs = torch.tensor([_ALIGNMENT, 2 * _ALIGNMENT], dtype=torch.int32, device=device)
        try:  # the weight-gradient form: (out, rows) x (rows, in), rows split into two groups
            F.grouped_mm(a.t(), a, offs=offs, out_dtype=torch.float32)
            supported = True
        except RuntimeError:
            supported = False
        _fp32_wgrad_supported[device.type] = supported
    return torch.float32 if supported else None


_dummy_grads: dict = {}


def _dummy_grad(weight: torch.Tensor, zero: bool) -> torch.Tensor:
    """A gradient that AccumulateGrad can hand to DDP's hook, which then discards it (TE's scheme).

    One buffer per shape, handed out as a fresh ``detach()`` each time: AccumulateGrad keeps a
    gradient whose tensor nobody else references, and deep-copies any other one (a copy kernel
    per expert weight)."""
    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _dummy_grads:
        _dummy_grads[key] = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    if zero:
        _dummy_grads[key].zero_()
    return _dummy_grads[key].detach()


def _main_grad(weight: torch.Tensor) -> torch.Tensor:
    getter = getattr(weight, "get_main_grad", None)
    main_grad = getter() if getter is not None else getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"moe_grouped_gemm_impl='torch': an expert weight of shape {tuple(weight.shape)} "
            "carries grad_added_to_main_grad but no main_grad (megatron's DDP sets both)"
        )
    return main_grad


def stacked_view(tensors: Sequence[torch.Tensor]) -> tuple | None:
    """``(view, descending)``: the equally shaped, contiguous ``tensors`` as one ``(n, *shape)``
    view when they lie back to back in one storage (megatron's DDP places a layer's expert weights
    and their main grads so, in reverse order), with whether they lie in descending order (then
    ``view[i]`` is ``tensors[n - 1 - i]``); None when they do not."""
    first, n = tensors[0], len(tensors)
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (
            t.shape != first.shape
            or t.dtype != first.dtype
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
    step = first.numel()
    offsets = [t.storage_offset() for t in tensors]
    descending = n > 1 and offsets[0] - offsets[1] == step
    sign = -1 if descending else 1
    if any(offset - offsets[0] != sign * i * step for i, offset in enumerate(offsets)):
        return None
    base = tensors[-1] if descending else first
    return base.as_strided((n, *first.shape), (step, *first.stride())), descending


def _copy_or_add(overwrite: bool, dst: torch.Tensor, src: torch.Tensor) -> None:
    if overwrite:
        dst.copy_(src)
    else:
        dst.add_(src)


def _foreach_copy_or_add(overwrite: bool, dst: list, src: list) -> None:
    if overwrite:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_add_(dst, src)


def weight_gradients(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    weights: Sequence[torch.Tensor],
    fuse_accumulation: bool,
) -> list:
    """Per-expert weight gradients, or (with accumulation fusion) their sum into ``main_grad``
    and what autograd then hands to each weight (a dummy for megatron's DDP, else None)."""
    if not fuse_accumulation:
        if x.shape[0] == 0:
            return [torch.zeros_like(w) for w in weights]
        return list(F.grouped_mm(dy.t(), x, offs=offs).unbind(0))

    main_grads = [_main_grad(w) for w in weights]
    overwrite = getattr(weights[0], "overwrite_main_grad", False)
    if x.shape[0] == 0:
        if overwrite:
            torch._foreach_zero_(main_grads)
    else:
        dw = F.grouped_mm(
            dy.t(), x, offs=offs, out_dtype=_wgrad_out_dtype(main_grads[0].dtype, dy.device)
        )
        stacked = stacked_view(main_grads)
        same_dtype = dw.dtype == main_grads[0].dtype
        if same_dtype and (stacked is None or stacked[1]):
            # The multi-tensor kernel takes the experts in any order, so main grads lying in
            # reverse need neither a reversed copy nor a launch per expert.
            _foreach_copy_or_add(overwrite, main_grads, list(dw.unbind(0)))
        elif stacked is not None:
            view, descending = stacked
            if not same_dtype and add_reversed_available(dw.device):
                add_reversed(view, dw, overwrite=overwrite, descending=descending)
            elif descending and capturing(dw.device):
                # Inside a CUDA graph the host cost of a launch is gone at replay: an add per
                # expert (bf16 promoted to fp32 on the fly) saves the reversed copy of dw that the
                # one add needs.
                for main_grad, part in zip(main_grads, dw.unbind(0)):
                    _copy_or_add(overwrite, main_grad, part)
            else:  # one kernel; the add promotes bf16 to the buffer's fp32 on the fly
                _copy_or_add(overwrite, view, dw.flip(0) if descending else dw)
        else:
            # The foreach kernels take one dtype: with a bf16 dw and fp32 main grads they fall
            # back to a launch per expert. One cast keeps them on the multi-tensor path.
            parts = list(dw.to(main_grads[0].dtype).unbind(0))
            _foreach_copy_or_add(overwrite, main_grads, parts)
    return main_grad_placeholders(weights)


def main_grad_placeholders(weights: Sequence[torch.Tensor]) -> list:
    """What autograd hands each weight whose gradient goes into ``main_grad``: the flag DDP's hook
    reads (``grad_added_to_main_grad``) is set and a dummy gradient makes the hook fire; None for
    weights without the flag."""
    grads = []
    for weight in weights:
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            grads.append(_dummy_grad(weight, zero=getattr(weight, "zero_out_wgrad", False)))
        else:
            grads.append(None)
    return grads


def expert_stack(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The experts' weights as one ``(experts, out, in)`` tensor: a view when they lie back to
    back in expert order (:func:`share_one_storage`), else a stacked copy."""
    found = stacked_view(weights)  # called in the autograd function, where grad mode is off
    if found is not None and not found[1]:
        return found[0]
    return torch.stack(weights)


def share_one_storage(weights: Sequence[torch.Tensor]) -> bool:
    """Move equally shaped expert weights that each fill a storage of their own into one
    ``(experts, out, in)`` tensor in expert order (each ``weight.data`` becomes a row of it,
    values unchanged), so that :func:`expert_stack` needs no copy. Weights that share a larger
    storage (DDP's parameter buffer with the distributed optimizer, which holds them in reverse
    order and keeps writing there) or that differ in shape, dtype or device are left as they are;
    returns whether they were moved."""
    first = weights[0]
    if any(
        w.storage_offset() != 0
        or w.untyped_storage().nbytes() != w.numel() * w.element_size()
        or w.shape != first.shape
        or w.dtype != first.dtype
        or w.device != first.device
        for w in weights
    ):
        return False
    stack = torch.empty((len(weights), *first.shape), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for row, weight in zip(stack.unbind(0), weights):
            row.copy_(weight)
            weight.data = row
    return True


class GroupedMMFunction(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ W_e.T`` for every expert ``e``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, offs, fuse_accumulation, *weights):  # pylint: disable=arguments-differ
        """Forward: one grouped GEMM."""
        ctx.save_for_backward(x, offs)
        ctx.weights = weights
        ctx.fuse_accumulation = fuse_accumulation
        if x.shape[0] == 0:
            return x.new_empty(0, weights[0].shape[0])
        return F.grouped_mm(x, expert_stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy):  # pylint: disable=arguments-differ
        """Backward: one grouped GEMM for the data gradient, one for the weight gradients."""
        x, offs = ctx.saved_tensors
        weights = ctx.weights
        dy = dy.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            if x.shape[0]:
                dx = F.grouped_mm(dy, expert_stack(weights), offs=offs)
            else:
                dx = torch.zeros_like(x)
        wgrads = [None] * len(weights)
        if any(ctx.needs_input_grad[3:]):
            wgrads = weight_gradients(dy, x, offs, weights, ctx.fuse_accumulation)
        ctx.weights = None
        return (dx, None, None, *wgrads)


def grouped_mm_with_offsets(
    x: torch.Tensor,
    offs: torch.Tensor,
    weights: Sequence[torch.Tensor],
    fuse_accumulation: bool = False,
) -> torch.Tensor:
    """The grouped linear ``x -> [x_e @ W_e.T]_e`` with the rows of expert ``e`` ending at
    ``offs[e]`` (an int32 tensor on ``x``'s device)."""
    if not x.is_contiguous():
        x = x.contiguous()
    return GroupedMMFunction.apply(x, offs, fuse_accumulation, *weights)


def grouped_mm(
    x: torch.Tensor, m_splits: Any, weights: Sequence[torch.Tensor], fuse_accumulation: bool = False
) -> torch.Tensor:
    """The grouped linear ``x -> [x_e @ W_e.T]_e`` with rows grouped by ``m_splits`` (a host list
    of per-expert row counts, or a tensor of them)."""
    offs = group_offsets(m_splits, x.device)
    return grouped_mm_with_offsets(x, offs, weights, fuse_accumulation)


def expert_weights(module: torch.nn.Module) -> list:
    """A TE grouped linear's ``weight0`` ... ``weight{N-1}``, moved into one tensor at the first
    call: after DDP and the optimizer took the parameters and a checkpoint was loaded into them,
    before any CUDA graph captures their addresses."""
    weights = [module._parameters[f"weight{i}"] for i in range(module.num_gemms)]
    if not getattr(module, "_grouped_mm_weights_placed", False):
        if not torch.compiler.is_compiling():
            module._grouped_mm_weights_placed = True
            share_one_storage(weights)
    return weights


def grouped_linear_forward(
    module: torch.nn.Module,
    x: torch.Tensor,
    m_splits: Any,
    offs: torch.Tensor | None = None,
    descending: bool = False,
) -> tuple:
    """Forward of a TE grouped linear (``TEGroupedLinear``) without a bias, its GEMMs as torch
    grouped GEMMs on its own ``weight{i}`` parameters: ``(output, None)``. ``offs``: the row
    offsets of ``m_splits`` where the caller has them already. ``descending``: the row groups
    run from the last expert to the first (then weights that DDP's buffer holds in that order
    are one view, not a stacked copy, and their main grads take one add)."""
    if x.dtype != torch.bfloat16:
        raise RuntimeError(
            f"moe_grouped_gemm_impl='torch' runs bf16 GEMMs; the experts got {x.dtype} inputs "
            "(train with --bf16)"
        )
    weights = expert_weights(module)
    if descending:
        weights = weights[::-1]
    if offs is None:
        offs = group_offsets(m_splits, x.device)
    fuse_accumulation = hasattr(weights[0], "grad_added_to_main_grad")
    out = grouped_mm_with_offsets(x, offs, weights, fuse_accumulation=fuse_accumulation)
    module.is_first_microbatch = False
    return out, None
