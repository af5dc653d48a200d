"""Facts about the parsed arguments that several features' rules and patches ask for."""

from __future__ import annotations

import argparse
import os
from typing import Any


def world_size(args: argparse.Namespace) -> int:
    size = getattr(args, "world_size", None)
    if size is None:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    return size


def etp(args: argparse.Namespace) -> int:
    """The expert tensor-parallel size (megatron's default: the tensor-parallel size)."""
    return args.expert_tensor_parallel_size or args.tensor_model_parallel_size


def model_parallel(args: argparse.Namespace) -> int:
    """TP x PP x CP."""
    return (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )


def layout_is_uneven(args: argparse.Namespace) -> bool:
    """The pipeline split is given explicitly rather than as num_layers / PP."""
    return (
        getattr(args, "pipeline_model_parallel_layout", None) is not None
        or getattr(args, "decoder_first_pipeline_num_layers", None) is not None
        or getattr(args, "decoder_last_pipeline_num_layers", None) is not None
        or getattr(args, "account_for_embedding_in_pipeline_split", False)
        or getattr(args, "account_for_loss_in_pipeline_split", False)
    )


def graph_scope_names(args: Any) -> set[str]:
    """The ``--cuda-graph-modules`` scopes by name (empty: whole layers)."""
    return {getattr(m, "name", str(m)) for m in (getattr(args, "cuda_graph_modules", None) or [])}


def layer_graphs_capture(args: argparse.Namespace, scopes: set[str]) -> bool:
    """Per-layer CUDA graphs (local or TE) that capture any of ``scopes``: no
    --cuda-graph-modules means whole layers."""
    if args.cuda_graph_impl not in ("local", "transformer_engine"):
        return False
    names = graph_scope_names(args)
    return not names or bool(names & scopes)


def capacity_limited(args: argparse.Namespace) -> bool:
    """An expert capacity is set (megatron treats a negative --moe-expert-capacity-factor as
    none)."""
    factor = getattr(args, "moe_expert_capacity_factor", None)
    return factor is not None and factor >= 0


def stash_or_budget(args: Any) -> bool:
    """MoE paged stashing (``--moe-paged-stash``) or a static per-rank receive budget
    (``--moe-expert-rank-capacity-factor``) is asked for."""
    return bool(getattr(args, "moe_paged_stash", False)) or (
        getattr(args, "moe_expert_rank_capacity_factor", None) is not None
    )
