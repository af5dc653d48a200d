"""The experts' grouped GEMMs as one ``torch.nn.functional.grouped_mm`` each
(``--moe-grouped-gemm-impl torch``): the overlay's side.

Why: on Hopper, TransformerEngine 2.20's ``GroupedLinear`` runs a grouped linear as one cuBLAS GEMM
per expert (its grouped-tensor kernel is Blackwell-only). With 128 experts that is 128 launches for
each of forward, data gradient and weight gradient, per linear, per layer: the profile of the
reference config at 1x4096 tokens (``docs/benchmarks.md``) spends 185-240 ms of host time on about
2,500 such launches for 17 ms of GEMM kernels. PyTorch's grouped GEMM (CUTLASS, SM90) takes the
per-expert row offsets as a device tensor and does each of the three in one launch.

The GEMMs, the weight-gradient accumulation into DDP's main grads and the stacking of the expert
weights are :mod:`.torch_grouped_gemm`, the module the upstream change adds as
``megatron/core/transformer/moe/torch_grouped_gemm.py`` (upstream routes to it from
``TEGroupedLinear.forward``). Here :class:`GroupedMMForward` replaces only ``forward`` (and
``backward_dw``, for megatron's ``--overlap-dispatch-backward-with-experts-wgrad``:
:mod:`.delayed_wgrad`) of megatron's
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (as subclasses, see
:func:`grouped_mm_linear`), and the two registry patches rebind the names that
``TESpecProvider.grouped_mlp_modules`` looks up when the layer spec is built. Parameters, their
initialisation, the state dict and the sharded checkpoint format, the expert-parallel attributes
and ``TEGroupedMLP`` around them stay upstream's.

What only the overlay has: :class:`DeviceSplits`, the token counts on the device as
``TEGroupedMLP.forward`` of megatron-core 0.19.2 takes them (it calls ``.tolist()``), and their
``padded`` form for the static dispatch's fixed-size buffers, whose rows after the last expert's
the linears keep zero (:mod:`.tail`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch
from megatron.patchset.features.grouped_mm.flags import FLAG
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
    zero (grouped_mm leaves rows past the last offset unwritten).

    ``descending``: the rows (and ``counts``) run from the last local expert to the first, the
    order in which megatron's DDP buffers hold a layer's expert weights under the distributed
    optimizer; the GEMMs then read the weights in place instead of stacking a copy."""

    __slots__ = ("counts", "padded", "descending")

    def __init__(self, counts, padded: bool = False, descending: bool = False):
        self.counts = counts
        self.padded = padded
        self.descending = descending

    def tolist(self) -> DeviceSplits:
        return self

    def __len__(self) -> int:
        return self.counts.numel()

    def __iter__(self):
        # Only megatron's --save-tokens-per-expert-interval hook iterates them (list(...)): that
        # logging step reads the counts on the host, the training step does not. In expert order.
        counts = self.counts.flip(0) if self.descending else self.counts
        return iter(counts.tolist())

    def __repr__(self) -> str:
        padded = ", padded" if self.padded else ""
        descending = ", descending" if self.descending else ""
        return (
            f"DeviceSplits({self.counts.numel()} experts on {self.counts.device}"
            f"{padded}{descending})"
        )


# ---------------------------------------------------------------------------------------
# The GEMMs (torch_grouped_gemm), with the overlay's device-side and padded token counts
# ---------------------------------------------------------------------------------------


def group_offsets(m_splits: Any, device: Any):
    """End offsets of each expert's rows as an int32 tensor on ``device``: a list, a tensor of
    counts or a :class:`DeviceSplits` (read on the device, no device-to-host copy)."""
    from megatron.patchset.features.grouped_mm import torch_grouped_gemm

    if isinstance(m_splits, DeviceSplits):
        m_splits = m_splits.counts
    return torch_grouped_gemm.group_offsets(m_splits, device)


@functools.cache
def _zero_tail_function():
    import torch

    class ZeroTail(torch.autograd.Function):
        """Identity forward; backward zeroes the gradient's rows from ``offs[-1]`` on (grouped_mm
        leaves a data gradient's rows after the last expert's unwritten)."""

        @staticmethod
        def forward(ctx, x, offs):
            ctx.save_for_backward(offs)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, dx):
            (offs,) = ctx.saved_tensors
            return zero_tail(dx.contiguous(), offs), None

    return ZeroTail


def _padded_grouped_mm(x, offs, weights: Sequence, fuse_accumulation: bool):
    """The grouped linear over a buffer with rows after the last expert's: those rows of the
    output and of the data gradient are zero."""
    from megatron.patchset.features.grouped_mm import torch_grouped_gemm

    x = _zero_tail_function().apply(x.contiguous(), offs)
    out = torch_grouped_gemm.grouped_mm_with_offsets(x, offs, weights, fuse_accumulation)
    zero_tail(out.detach(), offs)  # not saved for backward: no version conflict
    return out


def grouped_mm(x, m_splits, weights: Sequence, fuse_accumulation: bool = False):
    """The grouped linear ``x -> [x_e @ W_e.T]_e`` with rows grouped by ``m_splits``."""
    from megatron.patchset.features.grouped_mm import torch_grouped_gemm

    offs = group_offsets(m_splits, x.device)
    if isinstance(m_splits, DeviceSplits) and m_splits.descending:
        weights = list(weights)[::-1]
    if isinstance(m_splits, DeviceSplits) and m_splits.padded:
        return _padded_grouped_mm(x, offs, weights, fuse_accumulation)
    return torch_grouped_gemm.grouped_mm_with_offsets(x, offs, weights, fuse_accumulation)


# ---------------------------------------------------------------------------------------
# The linear modules and their patches
# ---------------------------------------------------------------------------------------


class GroupedMMForward:
    """Mixin placed before megatron's TE grouped linear: its ``forward(x, m_splits)`` runs the three
    GEMMs through :func:`.torch_grouped_gemm.grouped_linear_forward` on the module's own
    ``weight{i}`` parameters and returns ``(output, None)`` like megatron's wrapper without a bias
    (the validation rule refuses biases)."""

    def __init__(self, num_gemms, input_size, output_size, *args, **kwargs):
        super().__init__(num_gemms, input_size, output_size, *args, **kwargs)
        _announce(type(self).__name__, num_gemms, input_size, output_size)

    def forward(self, x, m_splits):
        from megatron.patchset.features.grouped_mm import delayed_wgrad, torch_grouped_gemm

        offs = group_offsets(m_splits, x.device)
        device_splits = isinstance(m_splits, DeviceSplits)
        descending = device_splits and m_splits.descending
        padded = device_splits and m_splits.padded
        if padded:
            x = _zero_tail_function().apply(x.contiguous(), offs)
        if getattr(self, "delay_wgrad_compute", False):
            # megatron sets it with --overlap-dispatch-backward-with-experts-wgrad: the weight
            # gradient waits for backward_dw
            return delayed_wgrad.grouped_linear_forward(self, x, offs, descending, padded), None
        out, bias = torch_grouped_gemm.grouped_linear_forward(
            self, x, None, offs=offs, descending=descending
        )
        if padded:
            zero_tail(out.detach(), offs)  # not saved for backward: no version conflict
        return out, bias

    def backward_dw(self):
        """The weight gradients kept by the backward passes since the last call (megatron's MoE
        layer calls this after the dispatch's backward all-to-all); nothing without
        ``delay_wgrad_compute``."""
        from megatron.patchset.features.grouped_mm import delayed_wgrad

        delayed_wgrad.backward_dw(self)


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
