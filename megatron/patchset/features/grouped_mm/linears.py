"""The experts' grouped GEMMs as one ``torch.nn.functional.grouped_mm`` each
(``--moe-grouped-gemm-impl torch``).

Why: on Hopper, TransformerEngine 2.20's ``GroupedLinear`` runs a grouped linear as one cuBLAS GEMM
per expert (its grouped-tensor kernel is Blackwell-only). With 128 experts that is 128 launches for
each of forward, data gradient and weight gradient, per linear, per layer: the profile of the
reference config at 1x4096 tokens (``docs/benchmarks.md``) spends 185-240 ms of host time on about
2,500 such launches for 17 ms of GEMM kernels. PyTorch's grouped GEMM (CUTLASS, SM90) takes the
per-expert row offsets as a device tensor and does each of the three in one launch.

What changes, and what does not: :class:`GroupedMMForward` replaces only ``forward`` of megatron's
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (as subclasses, see
:func:`grouped_mm_linear`). Parameters (``weight0`` ... ``weight{N-1}``), their initialisation, the
state dict and the sharded checkpoint format, the expert-parallel attributes that DDP and the
distributed optimizer read, and ``TEGroupedMLP`` around them (activation, probabilities, offload)
stay upstream's; only the three GEMMs run elsewhere. The two registry patches rebind the names that
``TESpecProvider.grouped_mlp_modules`` looks up when the layer spec is built.

The GEMMs (per linear, ``W_e`` of shape ``(out, in)``, rows of ``x`` grouped by expert):

* forward ``y = grouped_mm(x, stack(W).mT, offs)``. ``stack(W)`` is a view, no copy: at its first
  forward the linear moves its expert weights into one ``(experts, out, in)`` tensor in expert
  order (:func:`share_one_storage`; each ``weight{i}.data`` becomes a row of it), which the
  optimizer's copy back to bf16 and checkpoint loads then write in place. Where the weights are
  views already (DDP's parameter buffer under ``--use-distributed-optimizer`` holds them in reverse
  order) they stay, and each GEMM stacks a copy (one layer's at a time);
* data gradient ``dx = grouped_mm(dy, stack(W), offs)``;
* weight gradient ``dW = grouped_mm(dy.T, x, offs)``, shape ``(experts, out, in)``: fp32 from the
  GEMM where the device writes it (torch 2.11's grouped GEMM does not on Hopper: there it is bf16).

For weights that megatron's DDP manages (they carry ``main_grad`` and ``grad_added_to_main_grad``)
the weight gradient goes straight into the main grads, in as few passes as their layout allows:

* back to back in expert order (one stacked view): one add;
* back to back in reverse order, as DDP places them: in the main grads' dtype one
  ``_foreach_add_``; bf16 into fp32 the one Triton kernel of :mod:`.accumulate` (without Triton:
  one add per expert while a CUDA graph is captured, else a reversed copy and one add);
* scattered: one ``_foreach_add_``, after one cast when the dtypes differ.

This follows the contract TE uses for its fused accumulation: ``overwrite_main_grad`` copies
instead of adding, ``grad_added_to_main_grad`` is set and a dummy gradient is returned so that
DDP's per-parameter hook still fires (and skips its own add). It needs no apex kernel, so it holds
with ``--no-gradient-accumulation-fusion`` too; without DDP the gradients are returned.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch
from megatron.patchset.features.grouped_mm import accumulate
from megatron.patchset.features.grouped_mm.flags import ALIGNMENT, FLAG
from megatron.patchset.features.grouped_mm.tail import zero_tail

_SPEC_PROVIDER = "megatron.core.extensions.transformer_engine_spec_provider"
_REASON = (
    "TE 2.20 runs a grouped linear as one cuBLAS GEMM per expert on Hopper (host-bound at small "
    "micro-batches); run forward, dgrad and wgrad as one torch grouped_mm each, with the offsets "
    "on the device"
)


class DeviceSplits:
    """Per-expert token counts that stay on the device (``--moe-expert-splits-on-device``).

    ``TEGroupedMLP.forward`` turns its token counts into a host list with ``.tolist()`` before
    handing them to the linears; for a ``DeviceSplits`` that returns the object itself, and
    :func:`group_offsets` reads the counts tensor without a device-to-host copy.

    ``padded``: the input has rows after the last expert's (the static dispatch's fixed-size
    buffers, ``--moe-static-dispatch``); they are zeros, and the GEMMs keep their outputs there
    zero (grouped_mm leaves rows past the last offset unwritten)."""

    __slots__ = ("counts", "padded")

    def __init__(self, counts, padded: bool = False):
        self.counts = counts
        self.padded = padded

    def tolist(self) -> DeviceSplits:
        return self

    def __len__(self) -> int:
        return self.counts.numel()

    def __iter__(self):
        # Only megatron's --save-tokens-per-expert-interval hook iterates them (list(...)): that
        # logging step reads the counts on the host, the training step does not.
        return iter(self.counts.tolist())

    def __repr__(self) -> str:
        padded = ", padded" if self.padded else ""
        return f"DeviceSplits({self.counts.numel()} experts on {self.counts.device}{padded})"


# ---------------------------------------------------------------------------------------
# Offsets, gradients, the autograd function
# ---------------------------------------------------------------------------------------

_offsets_cache: dict = {}  # device -> (split sizes, offsets): fc1 and fc2 of a layer share them


def group_offsets(m_splits: Any, device: Any):
    """End offsets of each expert's rows as an int32 tensor on ``device``.

    ``m_splits`` is a list of per-expert row counts (what ``TEGroupedMLP`` passes), a tensor of
    them or a :class:`DeviceSplits`; a tensor on the device stays there (no device-to-host copy).
    """
    import torch

    if isinstance(m_splits, DeviceSplits):
        m_splits = m_splits.counts
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


def capturing(device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph now."""
    import torch

    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_fp32_wgrad_supported: dict = {}  # device type -> whether grouped_mm writes fp32 from bf16


def _wgrad_out_dtype(main_grad_dtype, device):
    """fp32 weight gradients straight from the GEMM when the main grads are fp32 and the device's
    grouped_mm accepts ``out_dtype=float32`` (probed once; PyTorch's CPU fallback does not)."""
    import torch
    import torch.nn.functional as F

    if main_grad_dtype != torch.float32:
        return None
    supported = _fp32_wgrad_supported.get(device.type)
    if supported is None:
        if capturing(device):
            raise RuntimeError(
                f"{FLAG} torch: the first backward runs inside a CUDA graph capture, where the "
                "grouped GEMM's fp32-output probe cannot run; capture after at least one eager "
                "step (--cuda-graph-warmup-steps 1 or more)"
            )
        a = torch.zeros(2 * ALIGNMENT, 2 * ALIGNMENT, dtype=torch.bfloat16, device=device)
        offs = torch.tensor([ALIGNMENT, 2 * ALIGNMENT], dtype=torch.int32, device=device)
        try:  # the weight-gradient form: (out, rows) x (rows, in), rows split into two groups
            F.grouped_mm(a.t(), a, offs=offs, out_dtype=torch.float32)
            supported = True
        except RuntimeError:
            supported = False
        _fp32_wgrad_supported[device.type] = supported
    return torch.float32 if supported else None


_dummy_grads: dict = {}


def _dummy_grad(weight, zero: bool):
    """A gradient that AccumulateGrad can hand to DDP's hook, which then discards it (TE's scheme).

    One buffer per shape, handed out as a fresh ``detach()`` each time: AccumulateGrad keeps a
    gradient whose tensor nobody else references, and deep-copies any other one (a copy kernel
    per expert weight)."""
    import torch

    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _dummy_grads:
        _dummy_grads[key] = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    if zero:
        _dummy_grads[key].zero_()
    return _dummy_grads[key].detach()


def _main_grad(weight):
    getter = getattr(weight, "get_main_grad", None)
    main_grad = getter() if getter is not None else getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{FLAG} torch: an expert weight of shape {tuple(weight.shape)} carries "
            "grad_added_to_main_grad but no main_grad (megatron's DDP sets both)"
        )
    return main_grad


def stacked_view(tensors: Sequence):
    """``(view, descending)``: the equally shaped, contiguous ``tensors`` as one ``(n, *shape)``
    view when they lie back to back in one storage -- megatron's DDP places a layer's expert weights
    and their main grads so, in reverse order -- with whether they lie in descending order (then
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


def weight_gradients(dy, x, offs, weights: Sequence, fuse_accumulation: bool) -> list:
    """Per-expert weight gradients, or -- with accumulation fusion -- their sum into ``main_grad``
    and what autograd then hands to each weight (a dummy for megatron's DDP, else None)."""
    import torch
    import torch.nn.functional as F

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
            # fp32 from the GEMM: the multi-tensor kernel takes the experts in any order, so the
            # main grads lying in reverse need neither a reversed copy nor a launch per expert.
            parts = list(dw.unbind(0))
            torch._foreach_copy_(main_grads, parts) if overwrite else torch._foreach_add_(
                main_grads, parts
            )
        elif stacked is not None:
            view, descending = stacked
            if descending and accumulate.available(dw.device):
                accumulate.add_reversed(view, dw, overwrite=overwrite)
            elif descending and capturing(dw.device):
                # Inside a CUDA graph the host cost of a launch is gone at replay (a kernel node
                # costs about a microsecond): an add per expert (bf16 promoted to fp32 on the fly)
                # saves the reversed copy of dw that the one add needs.
                for main_grad, part in zip(main_grads, dw.unbind(0)):
                    main_grad.copy_(part) if overwrite else main_grad.add_(part)
            else:  # one kernel; the add promotes bf16 to the buffer's fp32 on the fly
                source = dw.flip(0) if descending else dw
                view.copy_(source) if overwrite else view.add_(source)
        else:
            # The foreach kernels take one dtype: with a bf16 dw and fp32 main grads they fall back
            # to a launch per expert. One cast keeps them on the multi-tensor path.
            parts = list(dw.to(main_grads[0].dtype).unbind(0))
            torch._foreach_copy_(main_grads, parts) if overwrite else torch._foreach_add_(
                main_grads, parts
            )
    grads = []
    for weight in weights:
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            grads.append(_dummy_grad(weight, zero=getattr(weight, "zero_out_wgrad", False)))
        else:
            grads.append(None)
    return grads


def expert_stack(weights: Sequence):
    """The experts' weights as one ``(experts, out, in)`` tensor: a view when they lie back to back
    in expert order (:func:`share_one_storage`), else a stacked copy."""
    import torch

    found = stacked_view(weights)  # called in the autograd function, where grad mode is off
    if found is not None and not found[1]:
        return found[0]
    return torch.stack(weights)


def share_one_storage(weights: Sequence) -> bool:
    """Move equally shaped expert weights that each fill a storage of their own into one
    ``(experts, out, in)`` tensor in expert order (each ``weight.data`` becomes a row of it, values
    unchanged), so that :func:`expert_stack` needs no copy. Weights that share a larger storage --
    DDP's parameter buffer under ``--use-distributed-optimizer``, which holds them in reverse order
    and keeps writing there -- or that differ in shape, dtype or device are left as they are;
    returns whether they were moved."""
    import torch

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


@functools.cache
def _grouped_mm_function():
    import torch
    import torch.nn.functional as F

    class GroupedMM(torch.autograd.Function):
        """``y[rows of e] = x[rows of e] @ W_e.T`` for every expert ``e``; see the module
        docstring."""

        @staticmethod
        def forward(ctx, x, offs, fuse_accumulation, padded, *weights):
            ctx.save_for_backward(x, offs)
            ctx.weights = weights
            ctx.fuse_accumulation = fuse_accumulation
            ctx.padded = padded
            if x.shape[0] == 0:
                return x.new_empty(0, weights[0].shape[0])
            y = F.grouped_mm(x, expert_stack(weights).transpose(1, 2), offs=offs)
            return zero_tail(y, offs) if padded else y

        @staticmethod
        def backward(ctx, dy):
            x, offs = ctx.saved_tensors
            weights = ctx.weights
            dy = dy.contiguous()
            dx = None
            if ctx.needs_input_grad[0]:
                dx = (
                    F.grouped_mm(dy, expert_stack(weights), offs=offs)
                    if x.shape[0]
                    else torch.zeros_like(x)
                )
                if ctx.padded:
                    zero_tail(dx, offs)
            wgrads = [None] * len(weights)
            if any(ctx.needs_input_grad[3:]):
                wgrads = weight_gradients(dy, x, offs, weights, ctx.fuse_accumulation)
            ctx.weights = None
            return (dx, None, None, None, *wgrads)

    return GroupedMM


def grouped_mm(x, m_splits, weights: Sequence, fuse_accumulation: bool = False):
    """The grouped linear ``x -> [x_e @ W_e.T]_e`` with rows grouped by ``m_splits``."""
    if not x.is_contiguous():
        x = x.contiguous()
    padded = isinstance(m_splits, DeviceSplits) and m_splits.padded
    return _grouped_mm_function().apply(
        x, group_offsets(m_splits, x.device), fuse_accumulation, padded, *weights
    )


# ---------------------------------------------------------------------------------------
# The linear modules and their patches
# ---------------------------------------------------------------------------------------


class GroupedMMForward:
    """Mixin placed before megatron's TE grouped linear: its ``forward(x, m_splits)`` runs the three
    GEMMs through :func:`grouped_mm` on the module's own ``weight{i}`` parameters and returns
    ``(output, None)`` like megatron's wrapper without a bias (the validation rule refuses
    biases)."""

    def __init__(self, num_gemms, input_size, output_size, *args, **kwargs):
        super().__init__(num_gemms, input_size, output_size, *args, **kwargs)
        _announce(type(self).__name__, num_gemms, input_size, output_size)
        self._weights_placed = False

    def forward(self, x, m_splits):
        import torch

        if x.dtype != torch.bfloat16:
            raise RuntimeError(
                f"{FLAG} torch runs bf16 GEMMs; the experts got {x.dtype} inputs (train with "
                "--bf16)"
            )
        weights = [self._parameters[f"weight{i}"] for i in range(self.num_gemms)]
        if not self._weights_placed and not torch.compiler.is_compiling():
            # At the first forward: after DDP and the optimizer took the parameters and a
            # checkpoint was loaded into them, before any CUDA graph captures their addresses.
            self._weights_placed = True
            share_one_storage(weights)
        out = grouped_mm(
            x, m_splits, weights, fuse_accumulation=hasattr(weights[0], "grad_added_to_main_grad")
        )
        self.is_first_microbatch = False
        return out, None


_announced: set = set()


def _announce(name: str, num_gemms: int, input_size: int, output_size: int) -> None:
    """One line on rank 0 per linear class, when megatron builds the first layer's experts."""
    import torch

    if name in _announced:
        return
    _announced.add(name)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(
            f"megatron-patchset: experts' {name} runs forward, dgrad and wgrad as one torch "
            f"grouped_mm each ({num_gemms} local experts, {input_size} -> {output_size} before "
            "tensor parallelism)",
            flush=True,
        )


def grouped_mm_linear(original: type | None, role: str) -> type:
    """``original`` (megatron's TE column/row grouped linear) with :class:`GroupedMMForward`."""
    if original is None:
        raise PatchsetError(
            f"{FLAG} torch replaces megatron's TE{role}ParallelGroupedLinear, which is None here: "
            "TransformerEngine is not installed (the experts need --transformer-impl "
            "transformer_engine)"
        )
    return type(
        f"GroupedMM{role}ParallelGroupedLinear",
        (GroupedMMForward, original),
        {
            "__module__": __name__,
            "__doc__": f"megatron's TE{role}ParallelGroupedLinear with its GEMMs as torch "
            "grouped_mm calls.",
        },
    )


# The names TESpecProvider.grouped_mlp_modules looks up when it builds the experts' spec.
@patch(
    "grouped_mm.fc1",
    f"{_SPEC_PROVIDER}.TEColumnParallelGroupedLinear",
    reason=f"{_REASON} (fc1)",
)
def column_parallel_grouped_mm(original):
    return grouped_mm_linear(original, "Column")


@patch(
    "grouped_mm.fc2",
    f"{_SPEC_PROVIDER}.TERowParallelGroupedLinear",
    reason=f"{_REASON} (fc2)",
)
def row_parallel_grouped_mm(original):
    return grouped_mm_linear(original, "Row")
