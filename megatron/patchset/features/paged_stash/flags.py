"""megatron-core's flags that switch paged stashing and the static receive budget on (the feature
adds none of its own), and predicates of the parsed arguments."""

from __future__ import annotations

from typing import Any

from megatron.patchset.core.predicates import graph_scope_names

# megatron's fused-impl gate for SwiGLU/quick-GEGLU experts reads this (TE ignores it on sm_90).
CUTEDSL_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"

FLAGS = (
    "--moe-paged-stash",
    "--moe-paged-stash-page-size",
    "--moe-paged-stash-buffer-size-factor-cuda",
    "--moe-paged-stash-buffer-size-factor-cpu",
)


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


def preprocess_graphed(args: Any) -> bool:
    """Whether per-layer CUDA graphs capture the MoE preprocessing step."""
    return getattr(args, "cuda_graph_impl", "none") in ("transformer_engine", "local") and (
        "moe_preprocess" in graph_scope_names(args)
    )
