"""Rules for the P2P-overlap flags.

The three flags only act inside megatron's fine-grained (EP all-to-all overlapped) schedule plan,
on the backward pipeline send/receive of the interleaved schedule. The rules refuse combinations
where they would do nothing, and the combinations that the fine-grained schedule itself rejects
(megatron asserts those late or without naming a flag).
"""

from __future__ import annotations

import argparse

from megatron.patchset.core.predicates import graph_scope_names, layer_graphs_capture
from megatron.patchset.core.rules import rule
from megatron.patchset.features.p2p_overlap.flags import (
    DEFAULTS,
    FLAGS,
    WGRAD_DELAYED_LAYERS,
    chunk_layer_counts,
    flags_given,
    requested,
)


def _requested_virtual_stages(args: argparse.Namespace) -> int | None:
    """Virtual stages per pipeline rank that the raw flags ask for (None: no virtual pipeline).

    Mirrors megatron's derivation of ``virtual_pipeline_model_parallel_size`` closely enough
    to tell whether there is one; megatron's own checks still validate the numbers.
    """
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout:
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(
            args.pipeline_model_parallel_layout
        )
        vpp = stages // pp if stages % pp == 0 else None
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        vpp = args.num_virtual_stages_per_pipeline_rank
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        layers = (
            (args.num_layers or 0)
            + int(bool(args.account_for_embedding_in_pipeline_split))
            + int(bool(args.account_for_loss_in_pipeline_split))
        )
        per_rank = layers // pp if pp else 0
        vpp = (
            per_rank // args.num_layers_per_virtual_pipeline_stage
            if args.num_layers_per_virtual_pipeline_stage > 0
            else None
        )
    else:
        vpp = None
    return vpp if vpp is not None and vpp > 1 else None


@rule(
    "p2p-overlap-needs-ep-overlap-and-delayed-wgrad",
    phase="layout",
    flags=FLAGS + ("--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"),
)
def _p2p_needs_fine_grained_schedule(args):
    """The P2P-overlap flags act in the fine-grained schedule plan, on delayed weight gradients."""
    if not requested(args):
        return None
    missing = [
        flag
        for flag, on in (
            ("--overlap-moe-expert-parallel-comm", args.overlap_moe_expert_parallel_comm),
            ("--delay-wgrad-compute", args.delay_wgrad_compute),
        )
        if not on
    ]
    if missing:
        return (
            f"the P2P-overlap flags ({flags_given(args)}) need {' and '.join(missing)}: they "
            "change megatron's fine-grained 1F1B schedule (--overlap-moe-expert-parallel-comm) "
            "and defer weight gradients, which TransformerEngine computes separately only with "
            f"--delay-wgrad-compute. Add {' '.join(missing)}, or drop the P2P-overlap flags."
        )
    return None


@rule(
    "p2p-overlap-needs-interleaved-pipeline",
    phase="layout",
    flags=FLAGS
    + (
        "--pipeline-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
        "--no-overlap-p2p-communication",
    ),
)
def _p2p_needs_interleaved_pipeline(args):
    """The backward send/receive the flags overlap exists in the interleaved schedule with P2P
    overlap."""
    if not requested(args):
        return None
    problems = []
    pp = args.pipeline_model_parallel_size
    if pp <= 1:
        problems.append(f"--pipeline-model-parallel-size {pp} (needs 2 or more)")
    if _requested_virtual_stages(args) is None:
        problems.append(
            "no virtual pipeline (set --num-layers-per-virtual-pipeline-stage or "
            "--num-virtual-stages-per-pipeline-rank for 2 or more model chunks per rank)"
        )
    if not args.overlap_p2p_comm:
        problems.append("--no-overlap-p2p-communication (the schedule then sends outside the plan)")
    if problems:
        return (
            f"the P2P-overlap flags ({flags_given(args)}) act on the backward pipeline "
            "send/receive of the interleaved 1F1B schedule, which this layout does not have: "
            f"{'; '.join(problems)}."
        )
    return None


@rule(
    "p2p-overlap-fine-grained-schedule-limits",
    phase="layout",
    flags=FLAGS
    + (
        "--expert-model-parallel-size",
        "--moe-token-dispatcher-type",
        "--recompute-granularity",
        "--recompute-method",
        "--recompute-num-layers",
        "--recompute-modules",
        "--bf16",
        "--fp16",
        "--moe-shared-expert-overlap",
        "--mtp-num-layers",
        "--cuda-graph-impl",
        "--cuda-graph-modules",
        "--transformer-impl",
        "--overlap-dispatch-backward-with-experts-wgrad",
        "--use-megatron-fsdp",
    ),
)
def _p2p_fine_grained_limits(args):
    """What megatron's fine-grained schedule and delayed weight gradients do not support."""
    if not requested(args):
        return None
    from megatron.core import utils as mcore_utils

    problems = []
    if not mcore_utils.is_torch_min_version("2.6.0"):
        import torch

        problems.append(
            f"torch {torch.__version__} (the EP all-to-all overlap hangs before torch 2.6.0; "
            "upgrade torch)"
        )
    if args.expert_model_parallel_size <= 1:
        problems.append(
            f"--expert-model-parallel-size {args.expert_model_parallel_size} (needs 2 or more)"
        )
    if args.moe_token_dispatcher_type not in ("alltoall", "flex"):
        problems.append(
            f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} (use alltoall or flex)"
        )
    if args.recompute_granularity == "full":
        problems.append("--recompute-granularity full (use selective recomputation or none)")
    if args.recompute_method is not None:
        problems.append(f"--recompute-method {args.recompute_method} (drop it)")
    if args.recompute_num_layers is not None:
        problems.append(f"--recompute-num-layers {args.recompute_num_layers} (drop it)")
    if "moe" in (args.recompute_modules or []):
        problems.append("--recompute-modules with moe (recompute other modules only)")
    if not (args.bf16 or args.fp16):
        problems.append("fp32 parameters (add --bf16 or --fp16)")
    if args.moe_shared_expert_overlap:
        problems.append("--moe-shared-expert-overlap (drop it)")
    if (args.mtp_num_layers or 0) > 1:
        problems.append(f"--mtp-num-layers {args.mtp_num_layers} (at most 1)")
    if layer_graphs_capture(args, {"moe", "mlp"}):
        problems.append(
            f"--cuda-graph-impl {args.cuda_graph_impl} capturing the MLP/MoE part "
            "(--cuda-graph-modules "
            f"{' '.join(sorted(graph_scope_names(args))) or 'empty, i.e. whole layers'}; capture "
            "attn and/or moe_router only)"
        )
    if args.transformer_impl != "transformer_engine":
        problems.append(
            f"--transformer-impl {args.transformer_impl} (weight-gradient deferral is a "
            "TransformerEngine feature: use transformer_engine)"
        )
    if args.overlap_dispatch_backward_with_experts_wgrad:
        problems.append("--overlap-dispatch-backward-with-experts-wgrad (excludes both; drop it)")
    if args.use_megatron_fsdp:
        problems.append(
            "--use-megatron-fsdp (the fine-grained schedule has no Megatron-FSDP with a virtual "
            "pipeline)"
        )
    if problems:
        return (
            f"the P2P-overlap flags ({flags_given(args)}) act in megatron's fine-grained 1F1B "
            f"schedule, which does not support: {'; '.join(problems)}."
        )
    return None


@rule(
    "p2p-overlap-delayed-layer-number-range",
    phase="combination",
    flags=(
        "--overlap-p2p-wgrad-delayed-layer-number",
        "--num-layers",
        "--pipeline-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
    ),
)
def _p2p_delayed_layer_number(args, config):
    """N counts backward layers of one model chunk: 1 up to the layers a chunk holds."""
    number = getattr(args, WGRAD_DELAYED_LAYERS, DEFAULTS[WGRAD_DELAYED_LAYERS])
    if number < 1:
        return (
            f"--overlap-p2p-wgrad-delayed-layer-number {number}: give the number of backward "
            "layers per model chunk whose weight gradients wait for the backward P2P, at least 1 "
            "(1 is megatron's behaviour)."
        )
    if config is None or number == 1:
        return None
    counts = chunk_layer_counts(config)
    largest = max(counts, default=0)
    if number > largest:
        vpp = args.virtual_pipeline_model_parallel_size
        sizes = sorted(set(counts))
        shape = (
            f"{largest} layers per model chunk (--num-layers {args.num_layers} over "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} x {vpp or 1} "
            "virtual stages)"
            if len(sizes) == 1
            else f"model chunks of {', '.join(map(str, sizes))} layers"
        )
        return (
            f"--overlap-p2p-wgrad-delayed-layer-number {number} is more than the layers of any "
            f"model chunk: this layout has {shape}. Use 1 to {largest} ({largest} defers every "
            "layer of a chunk)."
        )
    return None
