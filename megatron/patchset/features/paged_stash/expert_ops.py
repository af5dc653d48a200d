"""The experts' TE op-fuser ops on Hopper: GEMMs on the real rows of the static buffer (zero output
and input gradient for the slack rows), and saved activations that megatron's paged stash can mark.

Patch ``paged_stash.te_expert_ops`` gives the experts' op-fuser ops (``ops.GroupedLinear``,
``ops.ScaledSwiGLU``) subclasses built from the installed TE classes; see the feature's overview
(:mod:`megatron.patchset.features.paged_stash`) for why.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from megatron.patchset.core.registry import patch
from megatron.patchset.features.paged_stash.flags import static_budget

# The attribute megatron-core 0.19.2's paged-stash hook looks for on a saved tensor
# (PagedStashManager.on_save_for_backward); False = an activation, True = an MXFP8 scale.
STASH_MARK = "grouped_tensor_scale_inv"
# Set on a basic op's context when the split path saved its whole input instead of views.
PACKED_INPUT_ATTR = "megatron_patchset_packed_input"


class SlackRowError(ValueError):
    """The per-expert token counts exceed the rows of the expert input buffer."""


# ---------------------------------------------------------------------------------------
# Tensor helpers (pure torch; unit-tested on the CPU)
# ---------------------------------------------------------------------------------------


def host_split_sizes(split_sizes: Any) -> list[int]:
    """Per-expert token counts as Python ints (one device-to-host copy for a CUDA tensor)."""
    if hasattr(split_sizes, "tolist"):
        return [int(s) for s in split_sizes.tolist()]
    return [int(s) for s in split_sizes]


def slack_rows(sizes: Sequence[int], rows: int) -> int:
    """Rows of a ``rows``-row expert buffer beyond the real tokens ``sum(sizes)``."""
    total = sum(sizes)
    if any(s < 0 for s in sizes) or total > rows:
        raise SlackRowError(
            f"the experts were given {total} tokens ({list(sizes)}) but their input has only "
            f"{rows} rows; the dispatcher's tokens_per_expert does not match its output buffer"
        )
    return rows - total


def pad_rows(tensor: Any, rows: int) -> Any:
    """``tensor`` extended with zero rows to ``rows`` rows (dim 0); unchanged when it has them."""
    import torch

    if tensor is None or tensor.shape[0] == rows:
        return tensor
    full = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    full[: tensor.shape[0]].copy_(tensor)
    return full


def mark_for_stash(tensor: Any) -> bool:
    """Mark an activation so that megatron's paged-stash hook pages it; returns whether marked.

    A plain tensor gets the attribute itself. A TE grouped-tensor storage (an object with
    ``rowwise_data``/``columnwise_data``) is decomposed into its data tensors when saved, so its
    unquantized row-wise data is marked; quantized storages are left alone (this fork pages bf16
    and fp16 activations only).
    """
    if tensor is None:
        return False
    if hasattr(tensor, "columnwise_data"):
        if getattr(tensor, "columnwise_data", None) is not None:
            return False
        data = getattr(tensor, "rowwise_data", None)
        if data is None:
            return False
        setattr(data, STASH_MARK, False)
        return True
    setattr(tensor, STASH_MARK, False)
    return True


def stash_manager() -> Any:
    """megatron's PagedStashManager singleton, or None when none was created yet."""
    try:
        from megatron.core.transformer.moe.paged_stash import PagedStashManager
    except ImportError:  # pragma: no cover - megatron-core without paged stashing
        return None
    return PagedStashManager.STASH_MGR


def stash_expects(tensor: Any, manager: Any = None) -> bool:
    """Whether megatron's hook, active now, would page ``tensor``: the stash is enabled and the
    tensor has the row count of the expert buffer being processed (``max_num_tokens``)."""
    manager = stash_manager() if manager is None else manager
    if manager is None or not getattr(manager, "enabled", False):
        return False
    rows = getattr(manager, "max_num_tokens", None)
    shape = getattr(tensor, "shape", None)
    return rows is not None and shape is not None and len(shape) >= 1 and shape[0] == rows


def input_offset(scale_bias: bool) -> int:
    """Index of the first saved input in TE 2.20.2's GroupedLinear saved-tensor layout
    ``[split_sizes, base_split_offsets, split_points, input_offsets, output_offsets,
    (scales), *inputs, *weights]``."""
    return 6 if scale_bias else 5


def pack_saved_input(saved: Sequence[Any], full_input: Any, num_groups: int, offset: int) -> tuple:
    """Replace the per-expert input views of a split-path saved layout by the whole input
    (first slot; the others None), which the paged-stash hook can page as one tensor."""
    saved = list(saved)
    saved[offset : offset + num_groups] = [full_input] + [None] * (num_groups - 1)
    return tuple(saved)


def unpack_saved_input(
    saved: Sequence[Any], num_groups: int, offset: int, sizes: Sequence[int]
) -> tuple:
    """Inverse of :func:`pack_saved_input`: per-expert views of the real rows of the input."""
    import torch

    saved = list(saved)
    full = saved[offset]
    total = sum(sizes)
    views = list(torch.split(full[:total], list(sizes)))
    saved[offset : offset + num_groups] = views
    return tuple(saved)


def packable_inputs(
    saved: Sequence[Any], input_: Any, num_groups: int, offset: int, dtype: Any
) -> bool:
    """Whether a split-path layout saved plain per-expert views of ``input_`` (bf16/fp16, no
    quantized copies), so that saving ``input_`` itself is equivalent."""
    import torch

    if type(input_) is not torch.Tensor or input_.dim() != 2 or input_.dtype != dtype:
        return False
    views = saved[offset : offset + num_groups]
    if len(views) != num_groups:
        return False
    return all(type(v) is torch.Tensor for v in views)


# ---------------------------------------------------------------------------------------
# TransformerEngine op-fuser basic ops (subclasses built from the installed TE classes)
# ---------------------------------------------------------------------------------------


def make_grouped_linear(base: type) -> type:
    """A subclass of TE's ``ops.GroupedLinear`` (``base``) that runs the split GEMM path on the
    real rows of a static expert buffer and lets megatron's paged stash page its saved input."""

    class PagedStashGroupedLinear(base):
        __doc__ = (
            "TE op-fuser GroupedLinear with slack-row handling on the split GEMM path and "
            "paged-stash marking of its saved input (megatron-patchset)."
        )

        def _fuser_forward_split_quantize(
            self, *, input_, split_sizes, scales, out_buffer=None, **kwargs
        ):
            rows = input_.shape[0]
            sizes = host_split_sizes(split_sizes)
            extra = slack_rows(sizes, rows)
            if extra == 0 or input_.dim() != 2:
                return super()._fuser_forward_split_quantize(
                    input_=input_,
                    split_sizes=split_sizes,
                    scales=scales,
                    out_buffer=out_buffer,
                    **kwargs,
                )
            import torch

            total = rows - extra
            full_out = out_buffer
            if full_out is None:
                full_out = torch.empty(
                    (rows, self.out_features), dtype=kwargs["dtype"], device=kwargs["device"]
                )
            full_out[total:].zero_()
            _, saved = super()._fuser_forward_split_quantize(
                input_=input_[:total],
                split_sizes=split_sizes,
                scales=None if scales is None else scales[:total],
                out_buffer=full_out[:total],
                **kwargs,
            )
            return full_out, saved

        def fuser_forward_save_ctx(
            self,
            basic_op_ctxs,
            input_,
            tensors_to_save,
            *,
            requires_grad,
            use_grouped_tensor_path,
            **kwargs,
        ):
            packed = False
            if requires_grad[0] and tensors_to_save and tensors_to_save[0] is not None:
                saved = tensors_to_save[0]
                offset = input_offset(bool(getattr(self, "_scale_bias", False)))
                if use_grouped_tensor_path:
                    if len(saved) > offset and stash_expects(input_):
                        mark_for_stash(saved[offset])
                elif stash_expects(input_):
                    weight = (
                        self.weight
                        if getattr(self, "single_grouped_weight", False)
                        else self.weight0
                    )
                    if packable_inputs(saved, input_, self.num_groups, offset, weight.dtype):
                        tensors_to_save = [pack_saved_input(saved, input_, self.num_groups, offset)]
                        mark_for_stash(input_)
                        packed = True
            super().fuser_forward_save_ctx(
                basic_op_ctxs,
                input_,
                tensors_to_save,
                requires_grad=requires_grad,
                use_grouped_tensor_path=use_grouped_tensor_path,
                **kwargs,
            )
            if requires_grad[0]:
                setattr(basic_op_ctxs[0], PACKED_INPUT_ATTR, packed)

        def _fuser_backward_split_quantize(self, *, ctx, grad_output):
            saved = ctx.saved_tensors
            sizes = host_split_sizes(saved[0])
            offset = input_offset(bool(getattr(self, "_scale_bias", False)))
            if getattr(ctx, PACKED_INPUT_ATTR, False):
                ctx.saved_tensors = unpack_saved_input(saved, self.num_groups, offset, sizes)
                setattr(ctx, PACKED_INPUT_ATTR, False)
            rows = grad_output.shape[0]
            extra = slack_rows(sizes, rows)
            if extra == 0 or grad_output.dim() != 2:
                return super()._fuser_backward_split_quantize(ctx=ctx, grad_output=grad_output)
            import torch

            total = rows - extra
            full_dgrad = None
            previous = getattr(ctx, "dgrad_out", None)
            if getattr(ctx, "input_requires_grad", True):
                full_dgrad = previous
                if full_dgrad is None:
                    full_dgrad = torch.empty(
                        (rows, self.in_features), dtype=ctx.dtype, device=grad_output.device
                    )
                full_dgrad[total:].zero_()
                ctx.dgrad_out = full_dgrad[:total]
            try:
                grad_input, grad_params, grad_extra = super()._fuser_backward_split_quantize(
                    ctx=ctx, grad_output=grad_output[:total]
                )
            finally:
                # The op context lives as long as the autograd graph: a view left on it would keep
                # this budget-sized gradient buffer (256 + 96 MiB per layer at the reference
                # shape) allocated after it has been handed back.
                ctx.dgrad_out = previous
            if full_dgrad is not None:
                grad_input = full_dgrad
            grad_extra = [
                tuple(
                    pad_rows(g, rows)
                    if g is not None and g.dim() >= 1 and g.shape[0] == total
                    else g
                    for g in group
                )
                for group in grad_extra
            ]
            return grad_input, grad_params, grad_extra

    PagedStashGroupedLinear.__name__ = PagedStashGroupedLinear.__qualname__ = (
        "PagedStashGroupedLinear"
    )
    PagedStashGroupedLinear.__module__ = __name__
    return PagedStashGroupedLinear


def make_scaled_glu(base: type) -> type:
    """A subclass of TE's ``ops.ScaledSwiGLU`` (``base``) whose saved input (the FC1 output) is
    marked for megatron's paged stash."""

    class PagedStashScaledSwiGLU(base):
        __doc__ = "TE op-fuser ScaledSwiGLU whose saved input is paged by megatron's paged stash."

        def fuser_forward(self, basic_op_ctxs, input_, **kwargs):
            if basic_op_ctxs[0].requires_grad and stash_expects(input_):
                mark_for_stash(input_)
            return super().fuser_forward(basic_op_ctxs, input_, **kwargs)

    PagedStashScaledSwiGLU.__name__ = PagedStashScaledSwiGLU.__qualname__ = "PagedStashScaledSwiGLU"
    PagedStashScaledSwiGLU.__module__ = __name__
    return PagedStashScaledSwiGLU


_SUBCLASSES: dict[type, type] = {}


def paged_stash_class(op_class: type, grouped_linear: type, scaled_glu: type) -> type | None:
    """The fork's subclass of a TE op class (built once per class), or None for other ops."""
    if op_class in _SUBCLASSES.values():
        return None  # already the fork's
    if op_class not in _SUBCLASSES:
        if issubclass(op_class, grouped_linear):
            _SUBCLASSES[op_class] = make_grouped_linear(op_class)
        elif issubclass(op_class, scaled_glu):
            _SUBCLASSES[op_class] = make_scaled_glu(op_class)
        else:
            return None
    return _SUBCLASSES[op_class]


def adopt_ops(ops: Any, grouped_linear: type, scaled_glu: type) -> int:
    """Re-class the expert ops of a TE ``ops.Sequential`` (FC1, activation, FC2) to the fork's
    subclasses, which only add methods; returns how many were re-classed."""
    changed = 0
    for op in ops:
        sub = paged_stash_class(type(op), grouped_linear, scaled_glu)
        if sub is not None:
            op.__class__ = sub
            changed += 1
    return changed


@patch(
    "paged_stash.te_expert_ops",
    "megatron.core.transformer.moe.experts.TEGroupedMLP._make_fused_ops",
    reason="on Hopper with cuBLASLt < 13.4 TE's bf16 op-fuser grouped GEMM takes the split path "
    "(split_sizes.tolist() + torch.split), which fails on the slack rows of the static expert "
    "buffer (HybridEP with a budget, NCCL EP with --moe-ncclep-static-shape), and TE's basic "
    "GroupedLinear/ScaledSwiGLU ops never mark their saved activations for megatron's paged "
    "stash: give the experts' ops subclasses that run the GEMMs on the real rows (zero "
    "output/grad for slack rows) and save markable activations",
    upstream_pr="fork-only (TE marks activations only in its Blackwell fused grouped MLP; its "
    "grouped-tensor GEMM path handles slack rows with cuBLASLt >= 13.4)",
    flags=("--moe-expert-rank-capacity-factor", "--use-transformer-engine-op-fuser"),
    enabled=static_budget,
)
def _wrap_make_fused_ops(original):
    @functools.wraps(original)
    def _make_fused_ops(self, *args, **kwargs):
        ops = original(self, *args, **kwargs)
        from transformer_engine.pytorch.ops import ScaledSwiGLU
        from transformer_engine.pytorch.ops.basic.grouped_linear import GroupedLinear

        adopt_ops(ops, GroupedLinear, ScaledSwiGLU)
        return ops

    return _make_fused_ops
