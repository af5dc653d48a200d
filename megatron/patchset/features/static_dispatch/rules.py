"""Rules for ``--moe-static-dispatch``: what the static all-to-all builds on, and what it does
not implement."""

from __future__ import annotations

import math

from megatron.patchset.core.predicates import (
    capacity_limited,
    etp,
    graph_scope_names,
    stash_or_budget,
)
from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.grouped_mm.flags import FLAG as GEMM_FLAG
from megatron.patchset.features.grouped_mm.flags import SPLITS_FLAG, splits_on_device
from megatron.patchset.features.grouped_mm.flags import requested as grouped_mm_torch
from megatron.patchset.features.static_dispatch.flags import (
    CHUNKS_FLAG,
    FACTOR_FLAG,
    FLAG,
    FLAGS,
    chunks,
    factor,
    flags_given,
    requested,
)


@rule(
    "moe-static-dispatch-requirements",
    phase="layout",
    flags=(
        FLAG,
        "--num-experts",
        "--moe-token-dispatcher-type",
        GEMM_FLAG,
        SPLITS_FLAG,
        "--moe-permute-fusion",
        "--expert-tensor-parallel-size",
        "--moe-expert-capacity-factor",
        "--moe-router-padding-for-quantization",
        "--moe-shared-expert-overlap",
        "--overlap-moe-expert-parallel-comm",
        "--moe-paged-stash",
        "--moe-expert-rank-capacity-factor",
    ),
)
def _static_dispatch_requirements(args):
    """The static path replaces the all-to-all dispatcher's host-side steps; the experts must take
    device-side, padded counts (the torch grouped GEMMs), and nothing may need exact buffer
    sizes on the host."""
    if not requested(args):
        return None
    problems = []
    if not args.num_experts:
        problems.append("an MoE model (--num-experts)")
    if args.moe_token_dispatcher_type != "alltoall":
        problems.append(
            f"--moe-token-dispatcher-type alltoall (got {args.moe_token_dispatcher_type})"
        )
    if not grouped_mm_torch(args) or not splits_on_device(args):
        problems.append(
            f"{GEMM_FLAG} torch {SPLITS_FLAG} (the experts read the device-side counts and "
            "padded row buffers)"
        )
    if not getattr(args, "moe_permute_fusion", False):
        problems.append(
            "--moe-permute-fusion (the unfused permutation sizes its output on the host)"
        )
    if etp(args) != 1:
        problems.append(
            f"expert tensor parallel size 1 (got {etp(args)}: the expert-TP all-gather takes host "
            "split sizes); set --expert-tensor-parallel-size 1"
        )
    if capacity_limited(args) or getattr(args, "moe_pad_expert_input_to_capacity", False):
        problems.append(
            "dropless MoE (no --moe-expert-capacity-factor / --moe-pad-expert-input-to-capacity)"
        )
    if getattr(args, "moe_router_padding_for_quantization", False) or getattr(
        args, "moe_router_padding_for_fp8", False
    ):
        problems.append(
            "no --moe-router-padding-for-quantization (the padded row count is dynamic)"
        )
    if getattr(args, "moe_shared_expert_overlap", False):
        problems.append(
            "no --moe-shared-expert-overlap (its hooks sit in the dynamic all-to-all's stages)"
        )
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        problems.append(
            "no --overlap-moe-expert-parallel-comm (its 1F1B schedule splits the dispatcher's "
            "stages across micro-batches)"
        )
    if stash_or_budget(args):
        problems.append(
            "no --moe-paged-stash / --moe-expert-rank-capacity-factor (megatron's static budget of "
            "the flex dispatcher; this path has its own capacity, "
            f"{FACTOR_FLAG})"
        )
    return listed(f"{FLAG} needs: ", problems)


@rule("moe-static-dispatch-options", phase="layout", flags=FLAGS)
def _options(args):
    """The capacity factor, the overflow policy, the chunks and the one-row-per-token exchange act
    only with the flag."""
    given = flags_given(args)
    if given and not requested(args):
        if len(given) == 1:
            return f"{given[0]} acts only with {FLAG}: add it or drop it."
        return f"{', '.join(given)} act only with {FLAG}: add it or drop them."
    return None


@rule(
    "moe-static-dispatch-capacity-factor",
    phase="layout",
    flags=(FACTOR_FLAG, "--micro-batch-size", "--seq-length", "--moe-router-topk"),
)
def _capacity_factor(args):
    """Below 1.0 even perfectly balanced routing overflows every step; the capacity must be a
    number of rows (the factor times a rank's tokens x top-k is finite)."""
    if not requested(args):
        return None
    value = factor(args)
    if not math.isfinite(value):
        return f"{FACTOR_FLAG} {value} is not a finite number"
    if not value >= 1.0:
        return (
            f"{FACTOR_FLAG} {value}: must be at least 1.0 (the per-peer capacity is this factor "
            "times the balanced share; below 1.0 every step overflows and is re-run)"
        )
    rows = args.micro_batch_size * args.seq_length * (args.moe_router_topk or 1)
    if not math.isfinite(value * rows):
        ep = args.expert_model_parallel_size
        return (
            f"{FACTOR_FLAG} {value} is too large to compute a capacity with: the capacity is "
            f"capped at a rank's tokens x top-k rows, which a factor of {ep} (the expert-parallel "
            f"size) already gives; use at most {ep}."
        )
    return None


@rule(
    "moe-static-dispatch-chunks",
    phase="layout",
    flags=(
        CHUNKS_FLAG,
        "--seq-length",
        "--tensor-model-parallel-size",
        "--sequence-parallel",
        "--context-parallel-size",
        "--use-megatron-fsdp",
        "--use-torch-fsdp2",
        "--recompute-modules",
        "--delay-wgrad-compute",
        "--overlap-dispatch-backward-with-experts-wgrad",
        "--cuda-graph-modules",
    ),
)
def _chunks(args):
    """Each MoE layer's sequence splits into equal chunks after the router, and every chunk's
    experts run a backward pass of their own: what accumulates or stashes weight gradients once
    per layer and micro-batch, or captures the layer's stages one by one, cannot take that."""
    if not requested(args) or chunks(args) == 1:
        return None
    n = chunks(args)
    if n < 1:
        return f"{CHUNKS_FLAG} {n}: must be at least 1 (1: no chunks)"
    seq = args.seq_length // max(1, getattr(args, "context_parallel_size", 1) or 1)
    if getattr(args, "sequence_parallel", False):
        seq //= max(1, args.tensor_model_parallel_size)
    problems = []
    if seq % n:
        problems.append(
            f"a chunk count that divides the {seq} tokens of a sequence each MoE layer gets "
            "(--seq-length over the context- and sequence-parallel split)"
        )
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        problems.append(
            "no Megatron-FSDP / FSDP2 (they overwrite the main gradient at every weight-gradient "
            "GEMM, so the second chunk's would replace the first's)"
        )
    if "moe" in (getattr(args, "recompute_modules", None) or []) and (
        getattr(args, "recompute_granularity", None) == "selective"
    ):
        problems.append(
            "no --recompute-modules moe (recomputing the whole layer would run its all-to-alls "
            "again inside the backward pass); moe_act recomputes inside each chunk"
        )
    if getattr(args, "delay_wgrad_compute", False) or getattr(
        args, "overlap_dispatch_backward_with_experts_wgrad", False
    ):
        problems.append(
            "no --delay-wgrad-compute / --overlap-dispatch-backward-with-experts-wgrad (they keep "
            "one deferred weight gradient per layer and micro-batch)"
        )
    scopes = {name for name in graph_scope_names(args) if name.startswith("moe")}
    if scopes and getattr(args, "cuda_graph_impl", "none") in ("local", "transformer_engine"):
        named = " ".join(sorted(scopes))
        problems.append(
            f"no per-layer graphs of the MoE stages (--cuda-graph-modules {named}: they capture "
            "the layer's stages one by one); --cuda-graph-impl full_iteration captures the chunks"
        )
    return listed(f"{CHUNKS_FLAG} {n} needs: ", problems)
