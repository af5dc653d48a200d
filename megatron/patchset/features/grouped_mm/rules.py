"""Rules for the torch grouped-GEMM experts, device-side token counts, and megatron's full-iteration
CUDA graphs over a MoE model (which the two make possible)."""

from __future__ import annotations

from megatron.patchset.core.predicates import (
    capacity_limited,
    etp,
    layer_graphs_capture,
    stash_or_budget,
)
from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.grouped_mm.flags import (
    ALIGNMENT,
    CARVEOUT_FLAG,
    FLAG,
    SPLITS_FLAG,
    requested,
    splits_on_device,
    wgrad_sm_carveout,
)


@rule(
    "moe-grouped-gemm-impl-torch-requirements",
    phase="layout",
    flags=(
        FLAG,
        "--num-experts",
        "--moe-grouped-gemm",
        "--transformer-impl",
        "--bf16",
        "--fp8-format",
        "--fp4-format",
        "--disable-bias-linear",
        "--delay-wgrad-compute",
        "--overlap-dispatch-backward-with-experts-wgrad",
        "--overlap-grad-reduce",
        "--use-transformer-engine-op-fuser",
        "--moe-single-grouped-weight",
        "--use-megatron-fsdp",
        "--use-torch-fsdp2",
        "--cuda-graph-impl",
        "--cuda-graph-modules",
        "--cuda-graph-warmup-steps",
        SPLITS_FLAG,
    ),
)
def _grouped_gemm_impl_torch(args):
    """What the torch grouped GEMM replaces (TE's per-linear forward) and what it does not
    implement."""
    if not requested(args):
        return None
    problems = []
    if not args.num_experts:
        problems.append("an MoE model (--num-experts)")
    if not args.moe_grouped_gemm:
        problems.append(
            "--moe-grouped-gemm (without it the experts are a SequentialMLP, not grouped linears)"
        )
    if args.transformer_impl != "transformer_engine":
        problems.append(
            "--transformer-impl transformer_engine (it replaces TE's grouped linears; got "
            f"{args.transformer_impl})"
        )
    if not args.bf16:
        problems.append("--bf16 (the grouped GEMM kernels take bf16)")
    if args.fp8 or getattr(args, "fp4", None):
        problems.append("no --fp8-format/--fp4-format (quantized expert GEMMs stay TE's)")
    if args.add_bias_linear:
        problems.append("--disable-bias-linear (expert biases are not implemented)")
    if args.delay_wgrad_compute:
        problems.append(
            "no --delay-wgrad-compute (its deferred weight gradients of the attention and the "
            "1F1B all-to-all overlap are TE's); --overlap-dispatch-backward-with-experts-wgrad "
            "defers the experts' weight gradients of these GEMMs"
        )
    if args.overlap_dispatch_backward_with_experts_wgrad and args.overlap_grad_reduce:
        problems.append(
            "no --overlap-grad-reduce with --overlap-dispatch-backward-with-experts-wgrad (DDP's "
            "hook marks the expert weights ready before their deferred weight gradients are "
            "added, and their bucket could start reducing first)"
        )
    if args.use_transformer_engine_op_fuser:
        problems.append(
            "no --use-transformer-engine-op-fuser (its fused grouped MLP bypasses these linears)"
        )
    if getattr(args, "moe_single_grouped_weight", False):
        problems.append(
            "no --moe-single-grouped-weight (the GEMMs read the per-expert weight0..weightN)"
        )
    if args.use_megatron_fsdp or getattr(args, "use_torch_fsdp2", False):
        problems.append(
            "no --use-megatron-fsdp / --use-torch-fsdp2 (sharded expert weights are not tested "
            "with it)"
        )
    if args.cuda_graph_impl == "full_iteration" and not splits_on_device(args):
        problems.append(
            f"{SPLITS_FLAG} for --cuda-graph-impl full_iteration (without it the per-expert token "
            "counts reach these GEMMs from the host, which a graph cannot capture)"
        )
    if args.cuda_graph_impl == "full_iteration" and (args.cuda_graph_warmup_steps or 0) < 1:
        problems.append(
            "--cuda-graph-warmup-steps 1 or more with --cuda-graph-impl full_iteration (got "
            f"{args.cuda_graph_warmup_steps}: the first backward probes the grouped GEMM, which a "
            "capture cannot run)"
        )
    if layer_graphs_capture(args, {"moe"}):
        problems.append(
            "per-layer CUDA graphs that leave the experts out (--cuda-graph-modules attn "
            "moe_router moe_preprocess): megatron captures the MoE layer per layer only with "
            f"drop-and-pad; to capture the experts too use {SPLITS_FLAG} with --cuda-graph-impl "
            "full_iteration"
        )
    return listed(f"{FLAG} torch needs: ", problems)


@rule(
    "moe-grouped-gemm-impl-torch-alignment",
    phase="layout",
    flags=(
        FLAG,
        "--hidden-size",
        "--moe-latent-size",
        "--moe-ffn-hidden-size",
        "--expert-tensor-parallel-size",
    ),
)
def _grouped_gemm_impl_torch_alignment(args):
    """Rows of every GEMM operand must start on 16-byte boundaries: bf16 widths a multiple of 8."""
    if not requested(args) or not args.num_experts:
        return None
    etp_size = etp(args)
    widths = {
        "--moe-latent-size" if args.moe_latent_size else "--hidden-size": args.moe_latent_size
        or args.hidden_size,
        f"--moe-ffn-hidden-size / expert tensor parallel size {etp_size}": (
            args.moe_ffn_hidden_size or args.ffn_hidden_size
        )
        // etp_size,
    }
    bad = [f"{name} = {value}" for name, value in widths.items() if value % ALIGNMENT]
    if bad:
        return (
            f"{FLAG} torch: the expert GEMM widths must be multiples of {ALIGNMENT} (16-byte rows "
            f"in bf16): {', '.join(bad)}. Use {FLAG} te."
        )
    return None


@rule(
    "moe-wgrad-sm-carveout-requirements",
    phase="layout",
    flags=(CARVEOUT_FLAG, FLAG, "--overlap-dispatch-backward-with-experts-wgrad"),
)
def _wgrad_sm_carveout(args):
    """The carve-out applies to the deferred weight-gradient GEMMs of the torch grouped experts
    only; elsewhere it would be silently ignored."""
    if not wgrad_sm_carveout(args):
        return None
    problems = []
    if not requested(args):
        problems.append(f"{FLAG} torch (the carve-out sizes torch's grouped GEMM grid)")
    if not args.overlap_dispatch_backward_with_experts_wgrad:
        problems.append(
            "--overlap-dispatch-backward-with-experts-wgrad (without it no weight-gradient GEMM "
            "runs beside the all-to-all)"
        )
    return listed(f"{CARVEOUT_FLAG} {wgrad_sm_carveout(args)} needs: ", problems)


@rule(
    "moe-expert-splits-on-device-requirements",
    phase="layout",
    flags=(
        SPLITS_FLAG,
        FLAG,
        "--num-experts",
        "--moe-token-dispatcher-type",
        "--expert-model-parallel-size",
        "--expert-tensor-parallel-size",
        "--tensor-model-parallel-size",
        "--moe-expert-capacity-factor",
        "--moe-router-padding-for-quantization",
        "--moe-router-padding-for-fp8",
        "--moe-permute-fusion",
        "--cuda-graph-impl",
        "--cuda-graph-modules",
    ),
)
def _expert_splits_on_device(args):
    """The token counts can stay on the device only where nothing on the host needs them: no
    all-to-all or all-gather with host split sizes, a static permuted token count, and the fused
    chunk sort
    (the same conditions the dispatcher patch checks when a layer runs)."""
    if not splits_on_device(args):
        return None
    problems = []
    if not requested(args):
        problems.append(f"{FLAG} torch (TE's grouped linear splits its input on the host)")
    if not args.num_experts:
        problems.append("an MoE model (--num-experts)")
    if args.moe_token_dispatcher_type != "alltoall":
        problems.append(
            f"--moe-token-dispatcher-type alltoall (got {args.moe_token_dispatcher_type})"
        )
    if args.expert_model_parallel_size != 1 and not getattr(args, "moe_static_dispatch", False):
        problems.append(
            f"--expert-model-parallel-size 1 (got {args.expert_model_parallel_size}: the "
            "all-to-all takes its split sizes from the host), or --moe-static-dispatch"
        )
    if etp(args) != 1:
        problems.append(
            f"expert tensor parallel size 1 (got {etp(args)}: the all-gather takes host split "
            "sizes)"
        )
    if capacity_limited(args):
        problems.append(
            "no --moe-expert-capacity-factor (dropped tokens make the permuted token count dynamic)"
        )
    if getattr(args, "moe_router_padding_for_quantization", False) or getattr(
        args, "moe_router_padding_for_fp8", False
    ):
        problems.append(
            "no --moe-router-padding-for-quantization (the padded token count is dynamic)"
        )
    if not getattr(args, "moe_permute_fusion", False):
        problems.append(
            "--moe-permute-fusion (the unfused chunk sort splits its input on the host)"
        )
    if layer_graphs_capture(args, {"moe_router", "moe_preprocess", "moe", "mlp"}):
        problems.append(
            "no per-layer CUDA graphs over the MoE router or preprocessing (megatron copies the "
            "graph's token counts to the host after each replay anyway); use --cuda-graph-impl "
            "full_iteration or no graphs"
        )
    return listed(f"{SPLITS_FLAG} needs: ", problems)


@rule(
    "full-iteration-graphs-timers",
    phase="layout",
    flags=("--cuda-graph-impl", "--timing-log-level"),
)
def _full_iteration_graphs_timers(args):
    """Megatron's level-1 and level-2 timers run inside forward_backward_func and synchronise the
    device at start and stop (and barrier with --barrier-with-L1-time): inside the capture of a
    full-iteration graph that fails."""
    if args.cuda_graph_impl != "full_iteration" or (args.timing_log_level or 0) < 1:
        return None
    return (
        f"--cuda-graph-impl full_iteration with --timing-log-level {args.timing_log_level}: "
        "megatron's "
        "forward-backward timer (and the level-2 timers) synchronise the device inside the "
        "captured step, and "
        'the capture fails ("operation not permitted when stream is capturing"). Use '
        "--timing-log-level 0; "
        "tools/bench/bench.py --time-fwd-bwd times forward-backward around the graph."
    )


@rule(
    "full-iteration-graphs-dropless-moe",
    phase="layout",
    flags=(
        "--cuda-graph-impl",
        "--num-experts",
        "--moe-expert-capacity-factor",
        "--moe-pad-expert-input-to-capacity",
        "--moe-token-dispatcher-type",
        SPLITS_FLAG,
    ),
)
def _full_iteration_graphs_dropless_moe(args):
    """Dropless MoE reads the per-expert token counts on the host inside the step (the all-to-all
    dispatcher's device-to-host copy and wait, TEGroupedMLP's .tolist()), which a capture refuses;
    the fork's device-side counts remove both. Drop-and-pad is static only in the all-to-all
    dispatcher. Paged stashing has its own rule."""
    if args.cuda_graph_impl != "full_iteration" or not args.num_experts or stash_or_budget(args):
        return None
    if splits_on_device(args):
        return None
    padded = capacity_limited(args) and args.moe_pad_expert_input_to_capacity
    if padded and args.moe_token_dispatcher_type == "alltoall":  # static counts, built on the host
        return None
    if padded:
        return (
            f"--cuda-graph-impl full_iteration with the {args.moe_token_dispatcher_type} "
            "dispatcher: it reads the token counts on the host inside the step even with "
            "drop-and-pad (the allgather dispatcher's .cpu()/.item()), which the capture refuses. "
            "Use --moe-token-dispatcher-type alltoall."
        )
    return (
        "--cuda-graph-impl full_iteration with a dropless MoE: the dispatcher copies the "
        "per-expert token counts to the host and waits for them inside the step (the experts "
        "split their input on the host), which the capture refuses. With one expert-parallel rank "
        f"use --moe-grouped-gemm-impl torch {SPLITS_FLAG} (the counts stay on the GPU); else use "
        "per-layer graphs (--cuda-graph-impl transformer_engine --cuda-graph-modules attn "
        "moe_router moe_preprocess)."
    )
