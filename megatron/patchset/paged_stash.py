"""MoE paged stashing on Hopper in bf16 (megatron-core 0.19.2, TransformerEngine 2.20.2).

megatron-core's paged stashing (``--moe-paged-stash`` with ``--moe-expert-rank-capacity-factor``,
the ``hybridep`` or ``ncclep`` flex dispatcher and TE's op fuser,
``--use-transformer-engine-op-fuser``) keeps
the expert MLP's saved activations in a pool of fixed-size pages instead of one static
``[budget, hidden]`` tensor per layer, so that a static per-rank receive budget (what makes the
dispatch sync-free and graph-friendly) does not cost budget-sized activation memory. Upstream
only runs it on Blackwell with MXFP8. On Hopper in bf16 three things stand in the way; the
patches here fix them:

1. **Nothing is paged.** megatron's ``saved_tensors_hooks`` page only tensors that carry the
   attribute ``grouped_tensor_scale_inv``; TE sets it only in its Blackwell fused grouped MLP and
   in the ``GroupedLinear`` *module*, never in the op-fuser *basic* ops that run on Hopper
   (``ops.GroupedLinear``, ``ops.ScaledSwiGLU``). The capture step then records nothing and
   every step saves full-size activations. Patch ``paged_stash.te_expert_ops`` gives the
   experts' op-fuser ops subclasses that mark the three expert activations (FC1 input, SwiGLU input,
   FC2 input), each ``[rows of the static buffer, width]`` as megatron's hook expects.
2. **Slack rows break the bf16 grouped GEMM.** HybridEP with a receive budget returns a static
   ``[budget, hidden]`` buffer of which only ``sum(tokens_per_expert)`` rows are real. TE 2.20.2
   consumes such a buffer only on its "grouped-tensor" GEMM path, which on Hopper needs
   cuBLASLt >= 13.4 (torch 2.11's cu130 wheels ship 13.1); otherwise it takes the split path,
   ``torch.split(x, split_sizes.tolist())``, which raises when the sizes do not cover every
   row. The same patch runs the split path on the real rows only and gives
   the slack rows a zero output (forward) and a zero input gradient (backward). The split path
   saves per-expert views of its input, which megatron's hook cannot page (it assumes one
   ``[rows, width]`` tensor), so under paged stashing the whole input is saved instead and split
   again in backward.
3. **Partial CUDA graphs drop the static budget.** With ``--cuda-graph-modules ...
   moe_preprocess`` the dispatcher's preprocessing (``_HybridEPManager.setup_metadata``, which
   sets the budget as a Python int) runs only while the graph is captured; on replay only tensor
   attributes are restored, so from the second replay HybridEP silently falls back to dynamic,
   CPU-synchronised dispatch with no budget. ``paged_stash.hybridep_budget_on_graph_replay``
   recomputes the budget from the restored routing map's shape before each dispatch.

Two observe patches make the run legible: ``paged_stash.report_buffers`` prints what the stash
allocated (or that nothing was marked, i.e. nothing is paged) and ``paged_stash.report_overflow``
prints one clear line when a step overflowed the stash buffer or the HybridEP receive budget and
megatron re-runs it (dropless, stash off), and when the re-run finished.

The grouped-tensor GEMM path (cuBLASLt >= 13.4) keeps TE's own slack-row handling; on it the
patch only marks the saved input (not exercised on this stack).

**The ncclep backend** (TE 2.20's NCCL EP; facts from megatron-core 0.19.2's
``transformer/moe/token_dispatcher.py``, ``experts.py`` and ``paged_stash.py``):

- Expert input. ``_NCCLEPManager`` sizes its receive buffer once, at the first dispatch
  (``_ensure_bootstrap``, token_dispatcher.py:1593-1609): local tokens rounded up to 64, x top-k
  x ``--moe-expert-rank-capacity-factor``, rounded up to the alignment, which is 256 with the op
  fuser (moe_utils.py:1407). Each local expert's rows are padded to that alignment and
  ``tokens_per_expert`` counts the padding. Without ``--moe-ncclep-static-shape`` the experts get
  the buffer narrowed to ``sum(tokens_per_expert)`` rows (a host sync, token_dispatcher.py:1694-1701),
  so megatron's stash sizes its pages from that data-dependent count divided by the factor
  (experts.py:654-670, paged_stash.py:569) and overflows, and re-runs, nearly every step; the
  fork's rule ``paged-stash-ncclep-static-shape`` asks for the flag. With it the experts get the
  whole static ``[budget, hidden]`` buffer with slack rows and ``[budget]`` fp32 probabilities,
  as with HybridEP, and ``paged_stash.te_expert_ops`` applies unchanged (megatron allows the
  static shape in bf16 on sm_90 with the op fuser and grouped GEMM, token_dispatcher.py:1534-1545).
- Partial CUDA graphs. ``setup_metadata`` (token_dispatcher.py:1586-1591) sets
  ``token_probs``/``token_indices`` (restored on replay, ``cudagraph_attrs`` line 1796) and
  ``num_local_tokens``, a Python int that nothing resets; the budget is a bootstrap-time
  attribute. Nothing is lost on replay, so no counterpart of
  ``hybridep_budget_on_graph_replay`` is needed.
- Budget overflow. NCCL EP cannot drop tokens: exceeding the budget traps the kernel (the run
  dies; transformer_config.py:977-982). The manager has no ``over_budget`` flag, so
  ``check_over_budget`` returns None (token_dispatcher.py:1988-1993), and its factor attribute is
  ``rank_capacity_factor``, so ``prepare_for_rerun``'s ``hasattr(..,
  'moe_expert_rank_capacity_factor')`` (paged_stash.py:1097-1101) is False: the re-run after a
  stash overflow keeps the static budget and only turns paging off. ``report_overflow`` says so.
  Be generous with the factor (the example uses 2.0).
- ``--moe-ncclep-zero-copy`` (symmetric-memory FC2 output and FC1 dgrad buffers, passed to the
  op fuser as ``out_buffer``/``dgrad_out``, which the patched split path honours) is not
  exercised here.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Optional, Sequence

from megatron.patchset.patches import register

logger = logging.getLogger(__name__)

# The attribute megatron-core 0.19.2's paged-stash hook looks for on a saved tensor
# (PagedStashManager.on_save_for_backward); False = an activation, True = an MXFP8 scale.
STASH_MARK = "grouped_tensor_scale_inv"
# Set on a basic op's context when the split path saved its whole input instead of views.
PACKED_INPUT_ATTR = "megatron_patchset_packed_input"
# megatron's fused-impl gate for SwiGLU/quick-GEGLU experts reads this (TE ignores it on sm_90).
CUTEDSL_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"

FLAGS = (
    "--moe-paged-stash",
    "--moe-paged-stash-page-size",
    "--moe-paged-stash-buffer-size-factor-cuda",
    "--moe-paged-stash-buffer-size-factor-cpu",
)

# Lines printed by the observe patches (tests and tools grep for these prefixes).
LOG_PREFIX = "megatron-patchset: paged stash"


class SlackRowError(ValueError):
    """The per-expert token counts exceed the rows of the expert input buffer."""


# ---------------------------------------------------------------------------------------
# Predicates on the parsed arguments
# ---------------------------------------------------------------------------------------


def requested(args: Any) -> bool:
    """Whether the run pages the experts' activations (``--moe-paged-stash``)."""
    return bool(getattr(args, "moe_paged_stash", False))


def static_budget(args: Any) -> bool:
    """Whether experts receive a static buffer with slack rows: a per-rank receive budget
    (``--moe-expert-rank-capacity-factor``) with the TE op-fuser grouped MLP."""
    return getattr(args, "moe_expert_rank_capacity_factor", None) is not None and bool(
        getattr(args, "use_transformer_engine_op_fuser", False)
    )


def ncclep(args: Any) -> bool:
    """Whether the flex dispatcher runs TE's NCCL EP (``--moe-flex-dispatcher-backend ncclep``)."""
    return getattr(args, "moe_token_dispatcher_type", None) == "flex" and (
        getattr(args, "moe_flex_dispatcher_backend", None) == "ncclep"
    )


def graph_scope_names(args: Any) -> set[str]:
    return {getattr(m, "name", str(m)) for m in (getattr(args, "cuda_graph_modules", None) or [])}


def preprocess_graphed(args: Any) -> bool:
    """Whether per-layer CUDA graphs capture the MoE preprocessing step."""
    return getattr(args, "cuda_graph_impl", "none") in ("transformer_engine", "local") and (
        "moe_preprocess" in graph_scope_names(args)
    )


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


def unpack_saved_input(saved: Sequence[Any], num_groups: int, offset: int, sizes: Sequence[int]) -> tuple:
    """Inverse of :func:`pack_saved_input`: per-expert views of the real rows of the input."""
    import torch

    saved = list(saved)
    full = saved[offset]
    total = sum(sizes)
    views = list(torch.split(full[:total], list(sizes)))
    saved[offset : offset + num_groups] = views
    return tuple(saved)


def packable_inputs(saved: Sequence[Any], input_: Any, num_groups: int, offset: int, dtype: Any) -> bool:
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

        def _fuser_forward_split_quantize(self, *, input_, split_sizes, scales, out_buffer=None, **kwargs):
            rows = input_.shape[0]
            sizes = host_split_sizes(split_sizes)
            extra = slack_rows(sizes, rows)
            if extra == 0 or input_.dim() != 2:
                return super()._fuser_forward_split_quantize(
                    input_=input_, split_sizes=split_sizes, scales=scales, out_buffer=out_buffer, **kwargs
                )
            import torch

            total = rows - extra
            full_out = out_buffer
            if full_out is None:
                full_out = torch.empty((rows, self.out_features), dtype=kwargs["dtype"], device=kwargs["device"])
            full_out[total:].zero_()
            _, saved = super()._fuser_forward_split_quantize(
                input_=input_[:total],
                split_sizes=split_sizes,
                scales=None if scales is None else scales[:total],
                out_buffer=full_out[:total],
                **kwargs,
            )
            return full_out, saved

        def fuser_forward_save_ctx(self, basic_op_ctxs, input_, tensors_to_save, *, requires_grad,
                                   use_grouped_tensor_path, **kwargs):
            packed = False
            if requires_grad[0] and tensors_to_save and tensors_to_save[0] is not None:
                saved = tensors_to_save[0]
                offset = input_offset(bool(getattr(self, "_scale_bias", False)))
                if use_grouped_tensor_path:
                    if len(saved) > offset and stash_expects(input_):
                        mark_for_stash(saved[offset])
                elif stash_expects(input_):
                    weight = self.weight if getattr(self, "single_grouped_weight", False) else self.weight0
                    if packable_inputs(saved, input_, self.num_groups, offset, weight.dtype):
                        tensors_to_save = [pack_saved_input(saved, input_, self.num_groups, offset)]
                        mark_for_stash(input_)
                        packed = True
            super().fuser_forward_save_ctx(
                basic_op_ctxs, input_, tensors_to_save, requires_grad=requires_grad,
                use_grouped_tensor_path=use_grouped_tensor_path, **kwargs,
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
                    full_dgrad = torch.empty((rows, self.in_features), dtype=ctx.dtype, device=grad_output.device)
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
                tuple(pad_rows(g, rows) if g is not None and g.dim() >= 1 and g.shape[0] == total else g for g in group)
                for group in grad_extra
            ]
            return grad_input, grad_params, grad_extra

    PagedStashGroupedLinear.__name__ = PagedStashGroupedLinear.__qualname__ = "PagedStashGroupedLinear"
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


def paged_stash_class(op_class: type, grouped_linear: type, scaled_glu: type) -> Optional[type]:
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


@register(
    "paged_stash.te_expert_ops",
    "megatron.core.transformer.moe.experts.TEGroupedMLP._make_fused_ops",
    reason="on Hopper with cuBLASLt < 13.4 TE's bf16 op-fuser grouped GEMM takes the split path "
    "(split_sizes.tolist() + torch.split), which fails on the slack rows of the static expert "
    "buffer (HybridEP with a budget, NCCL EP with --moe-ncclep-static-shape), and TE's basic GroupedLinear/ScaledSwiGLU ops never mark their saved "
    "activations for megatron's paged stash: give the experts' ops subclasses that run the GEMMs "
    "on the real rows (zero output/grad for slack rows) and save markable activations",
    upstream_pr="fork-only (TE marks activations only in its Blackwell fused grouped MLP; its "
    "grouped-tensor GEMM path handles slack rows with cuBLASLt >= 13.4)",
    flags=("--moe-expert-rank-capacity-factor", "--use-transformer-engine-op-fuser"),
    enabled=static_budget,
    wraps=True,
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


# ---------------------------------------------------------------------------------------
# HybridEP receive budget under partial CUDA graphs
# ---------------------------------------------------------------------------------------


def rank_budget(num_tokens: int, topk: int, factor: float, align: Optional[int]) -> int:
    """Rows of HybridEP's static per-rank receive buffer: tokens x top-k x the rank capacity
    factor, rounded up to ``align`` (megatron's sizing rule for ``num_permuted_tokens``)."""
    budget = int(num_tokens * topk * factor)
    if align:
        budget += -budget % align
    return budget


def restore_static_budget(manager: Any, align_for: Callable[[Any], Optional[int]]) -> bool:
    """Set a HybridEP manager's static receive budget when a graph replay skipped the
    preprocessing that sets it; returns whether it was restored."""
    factor = getattr(manager, "moe_expert_rank_capacity_factor", None)
    routing_map = getattr(manager, "routing_map", None)
    if (
        factor is None
        or getattr(manager, "num_permuted_tokens", None) is not None
        or getattr(manager, "drop_and_pad", False)
        or routing_map is None
    ):
        return False
    rows = int(routing_map.shape[0])
    manager.num_permuted_tokens = rank_budget(rows, manager.config.moe_router_topk, factor, align_for(manager.config))
    if getattr(manager, "_padded_num_tokens", None) is None:
        manager._padded_num_tokens = rows
    if getattr(manager, "_original_num_tokens", None) is None:
        manager._original_num_tokens = rows
    return True


@register(
    "paged_stash.hybridep_budget_on_graph_replay",
    "megatron.core.transformer.moe.token_dispatcher._HybridEPManager.dispatch",
    reason="with CUDA graphs over moe_preprocess, HybridEP's setup_metadata (which sets the "
    "static receive budget as a Python int) only runs at capture; on replay the budget is lost "
    "and dispatch silently becomes dynamic and CPU-synchronised: recompute it from the "
    "restored routing map before dispatching",
    upstream_pr="fork-only (megatron-core 0.19.2 restores only tensor attributes on replay)",
    flags=("--moe-expert-rank-capacity-factor", "--cuda-graph-modules moe_preprocess"),
    enabled=lambda args: getattr(args, "moe_expert_rank_capacity_factor", None) is not None
    and getattr(args, "moe_flex_dispatcher_backend", None) == "hybridep"
    and preprocess_graphed(args),
    wraps=True,
)
def _wrap_hybridep_dispatch(original):
    @functools.wraps(original)
    def dispatch(self, hidden_states, *args, **kwargs):
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

        restore_static_budget(self, get_align_size_for_quantization)
        return original(self, hidden_states, *args, **kwargs)

    return dispatch


# ---------------------------------------------------------------------------------------
# Observe: what the stash allocated, overflow and re-run
# ---------------------------------------------------------------------------------------


def _rank0() -> bool:
    try:
        import torch

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0
    except Exception:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0")) == 0


def _iteration() -> Optional[int]:
    try:
        from megatron.training import get_args

        return getattr(get_args(), "curr_iteration", None)
    except Exception:
        return None


def say(message: str) -> None:
    """Print one fork line on rank 0 (independent of megatron's logging level)."""
    if _rank0():
        print(f"{LOG_PREFIX}: {message}", flush=True)


def describe_buffers(stash_buffers: Optional[dict]) -> list[str]:
    """One line per stash buffer: dtype, width, pages and bytes on the GPU and the host."""
    lines = []
    for dtype, by_width in (stash_buffers or {}).items():
        for width, buf in by_width.items():
            cuda = getattr(buf, "cuda_buffer", None)
            host = getattr(buf, "host_buffer", None)
            cuda_bytes = cuda.numel() * cuda.element_size() if cuda is not None else 0
            host_bytes = host.numel() * host.element_size() if host is not None else 0
            tokens = cuda.shape[0] if cuda is not None else 0
            lines.append(
                f"{str(dtype).replace('torch.', '')} width {width}: {tokens} token rows, "
                f"{cuda_bytes / 2**20:.1f} MiB GPU" + (f", {host_bytes / 2**20:.1f} MiB pinned host" if host_bytes else "")
            )
    return lines


@register(
    "paged_stash.report_buffers",
    "megatron.core.transformer.moe.paged_stash.PagedStashManager.allocate_stash_buffers",
    reason="say what paged stashing allocated, and say clearly when the capture step marked "
    "nothing (megatron only logs 'max_tokens_dict is None' at INFO)",
    upstream_pr="fork-only (instrumentation)",
    flags=("--moe-paged-stash",),
    enabled=requested,
    wraps=True,
    kind="observe",
)
def _wrap_allocate(original):
    @functools.wraps(original)
    def allocate_stash_buffers(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        lines = describe_buffers(getattr(self, "stash_buffers", None))
        if lines:
            say("allocated stash buffers (" + "; ".join(lines) + ")")
        else:
            say(
                "WARNING: no MoE activation was marked for stashing in the capture step, so nothing "
                "is paged and activations are saved at full size. The expert MLP must run TE's op "
                "fuser (--use-transformer-engine-op-fuser) with megatron-patchset's TE patches applied."
            )
        return result

    return allocate_stash_buffers


class OverflowReport:
    """Turns megatron's per-step overflow flags into one line per event."""

    def __init__(self, emit: Callable[[str], None] = say):
        self.emit = emit
        self.rerun_pending = False
        self.reruns = 0
        self.spills = 0

    def __call__(self, stash_overflow: int, over_budget: int, host_spill: int, config: Any = None) -> None:
        where = _iteration()
        step = f"iteration {where + 1}" if isinstance(where, int) else "this step"
        if stash_overflow or over_budget:
            causes = []
            if stash_overflow:
                causes.append(f"stash buffer full on {stash_overflow} rank(s)")
            if over_budget:
                causes.append(f"HybridEP receive budget exceeded (tokens dropped) on {over_budget} rank(s)")
            keeps_budget = getattr(config, "moe_flex_dispatcher_backend", None) == "ncclep"
            hints = []
            if stash_overflow:
                hints.append(
                    f"--moe-paged-stash-buffer-size-factor-cuda (now {getattr(config, 'moe_paged_stash_buffer_size_factor_cuda', '?')}) "
                    f"or --moe-paged-stash-buffer-size-factor-cpu (now {getattr(config, 'moe_paged_stash_buffer_size_factor_cpu', '?')})"
                )
            if over_budget:
                hints.append(f"--moe-expert-rank-capacity-factor (now {getattr(config, 'moe_expert_rank_capacity_factor', '?')})")
            self.reruns += 1
            self.rerun_pending = True
            how = (
                "with the same NCCL EP receive budget (NCCL EP cannot drop tokens) and without paged stashing"
                if keeps_budget
                else "without the receive budget and without paged stashing"
            )
            self.emit(
                f"OVERFLOW in {step} ({'; '.join(causes)}): megatron re-runs the step on the same data "
                f"{how} (gradients zeroed first). "
                f"Re-runs cost a step each; raise {' and '.join(hints)} to avoid them."
            )
            return
        if self.rerun_pending:
            self.rerun_pending = False
            self.emit(f"re-run of {step} finished without overflow ({self.reruns} re-run(s) so far); training continues")
        if host_spill:
            self.spills += 1
            self.emit(
                f"{step} spilled activations to pinned host memory on {host_spill} rank(s) (GPU stash full); "
                f"no re-run needed"
            )


_REPORT = OverflowReport()


@register(
    "paged_stash.report_overflow",
    "megatron.core.transformer.moe.paged_stash.PagedStashRunner.check_moe_overflow",
    reason="one clear line when a step overflows the paged stash or the HybridEP receive budget "
    "and megatron re-runs it (with ncclep: budget kept, paging off), and when the re-run finished "
    "(megatron logs at INFO only)",
    upstream_pr="fork-only (instrumentation)",
    flags=("--moe-expert-rank-capacity-factor",),
    enabled=lambda args: getattr(args, "moe_expert_rank_capacity_factor", None) is not None,
    wraps=True,
    kind="observe",
)
def _wrap_check_overflow(original):
    @functools.wraps(original)
    def check_moe_overflow(self, *args, **kwargs):
        # DeferredResultChecks already all-reduced this attempt's flags: use them, no second collective
        cached = self.__dict__.pop(FLAGS_ATTR, None)
        result = cached if cached is not None else original(self, *args, **kwargs)
        try:
            _REPORT(*result, config=getattr(self, "config", None))
        except Exception as exc:  # pragma: no cover - reporting must never break training
            logger.warning("paged stash overflow report failed: %s", exc)
        return result

    return check_moe_overflow


# ---------------------------------------------------------------------------------------
# Result checks of an attempt that overflowed
# ---------------------------------------------------------------------------------------

# The overflow flags of the attempt just run, kept on the runner for its own check_moe_overflow.
FLAGS_ATTR = "_megatron_patchset_overflow_flags"


class RngStates:
    """Every random stream a training step draws from, saved and put back: Python's, NumPy's,
    torch's CPU and CUDA default generators (what megatron's rerun state machine saves for its own
    re-runs) and the named states of megatron's CUDA RNG tracker (model-parallel dropout; with
    ``--te-rng-tracker`` / CUDA graphs these are graph-safe ``torch.Generator`` objects, saved by
    value and set in place so that captured graphs keep their generator)."""

    def __init__(self, tracker: Optional[Callable[[], Any]] = None, cuda: Optional[bool] = None):
        self._tracker = tracker
        self._cuda = cuda

    def cuda(self) -> bool:
        import torch

        return torch.cuda.is_available() if self._cuda is None else self._cuda

    def tracker(self) -> Any:
        if self._tracker is not None:
            return self._tracker()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker()

    def save(self) -> dict:
        import random

        import numpy as np
        import torch

        named = {}
        for name, state in self.tracker().get_states().items():
            named[name] = state.get_state() if isinstance(state, torch.Generator) else state.clone()
        return {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if self.cuda() else None, "tracker": named}

    def restore(self, saved: dict) -> None:
        import random

        import numpy as np
        import torch

        random.setstate(saved["python"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["cpu"])
        if saved["cuda"] is not None:
            torch.cuda.set_rng_state(saved["cuda"])
        tracker = self.tracker()
        current = tracker.get_states()
        tensors = {}
        for name, value in saved["tracker"].items():
            live = current.get(name)
            if isinstance(live, torch.Generator):
                live.set_state(value)  # in place: a captured graph holds this generator
                tensors[name] = live
            else:
                tensors[name] = value.clone()
        tracker.set_states(tensors)


def _snapshot(value: Any) -> Any:
    """A tensor's value at this point, without its autograd graph; anything else as it is."""
    import torch

    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class DeferredResultChecks:
    """The forward-backward function of megatron's ``PagedStashRunner``, with the rerun state
    machine's result checks (NaN loss, NaN gradient norm per DDP bucket, spiky loss) held back
    while paged stashing is on, until the attempt's overflow flags are known.

    An attempt that overflowed the stash restores garbage activations in backward, so its
    gradients can be NaN; megatron-core 0.19.2 checks them inside the attempt, before its runner
    looks at the overflow flags. The rerun state machine then takes the NaN for a fault, re-runs
    the whole iteration (which overflows again on the same data) and saves a checkpoint and
    exits (without ``--save``: a TypeError). Here the checks are recorded during a stashed
    attempt and, once the (one, all-reduced) flags are in: replayed in order if nothing
    overflowed, dropped if it did (the runner re-runs the step without stashing, and that
    attempt is checked as usual). An overflowed attempt's random draws are undone as well
    (``RngStates``): megatron's runner does not, so with dropout the re-run, and every step after
    it, would draw other masks than a run that never overflowed.
    """

    def __init__(self, runner: Any, forward_backward_func: Callable, state_machine: Callable[[], Any],
                 check_flags: Callable[[Any], tuple], rng: Optional["RngStates"] = None):
        self.rng = rng or RngStates()
        self.runner = runner
        self.forward_backward_func = forward_backward_func
        self.state_machine = state_machine
        self.check_flags = check_flags
        self.dropped = 0

    def stashing(self) -> bool:
        return bool(getattr(getattr(self.runner, "config", None), "moe_paged_stash", False))

    def __call__(self, *args, **kwargs):
        if not self.stashing():  # the re-run attempt, or paging off: checked as usual
            return self.forward_backward_func(*args, **kwargs)
        machine = self.state_machine()
        held: list[tuple[tuple, dict]] = []
        # shadows the method; keeps detached copies of tensor arguments: the loss megatron checks
        # is still attached to its autograd graph (which would stay allocated until the step ends,
        # where upstream frees each micro-batch's graph after its backward), and the schedule
        # scales it in place after the check
        machine.validate_result = lambda *a, **k: held.append(
            (tuple(_snapshot(v) for v in a), {key: _snapshot(v) for key, v in k.items()}))
        rng = self.rng.save()
        try:
            result = self.forward_backward_func(*args, **kwargs)
        finally:
            del machine.validate_result
        flags = tuple(self.check_flags(self.runner))
        setattr(self.runner, FLAGS_ATTR, flags)
        stash_overflow, over_budget = flags[0], flags[1]
        if stash_overflow or over_budget:
            self.dropped += len(held)
            if held:
                say(f"{len(held)} result check(s) of the overflowed attempt dropped (its gradients are not "
                    f"used; the re-run is checked)")
            # the re-run draws the attempt's dropout masks again, as a step that never paged would
            self.rng.restore(rng)
            return result
        for a, k in held:
            machine.validate_result(*a, **k)
        return result


def _upstream_check_flags(runner: Any) -> tuple:
    """megatron's own check_moe_overflow (one all-reduce), without the fork's report wrapper."""
    method = type(runner).check_moe_overflow
    return getattr(method, "__wrapped__", method)(runner)


@register(
    "paged_stash.defer_result_checks",
    "megatron.core.transformer.moe.paged_stash.PagedStashRunner.__init__",
    reason="an attempt that overflows the paged stash has NaN gradients, which megatron's rerun "
    "state machine checks inside the attempt, before the runner sees the overflow: it takes them "
    "for a fault, re-runs the iteration (overflowing again) and exits; hold the checks until the "
    "overflow flags are known and drop those of an overflowed attempt, and put back the RNG states "
    "the attempt advanced (dropout), so the re-run equals a step that never overflowed",
    upstream_pr="fork-only (megatron-core 0.19.2's overflow re-run stops at the NaN check)",
    flags=FLAGS[:1],
    enabled=requested,
    wraps=True,
)
def _wrap_runner_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        self.forward_backward_func = DeferredResultChecks(
            self, self.forward_backward_func, get_rerun_state_machine, _upstream_check_flags)

    return __init__
