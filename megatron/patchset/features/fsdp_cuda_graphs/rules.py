"""Rules for TransformerEngine per-layer CUDA graphs (--cuda-graph-impl transformer_engine, any
--cuda-graph-modules scope) with Megatron-FSDP.

The graphs replay reading and writing the parameter buffers
at the addresses they had at capture: FSDP must gather every layer into the same fixed
buffers each iteration. These rules run after megatron's validate_args, which may already
have turned --fsdp-double-buffer on (--use-nccl-ub, --megatron-fsdp-max-pool-double-buffer).
"""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.fsdp_cuda_graphs.fsdp_hooks import wanted


@rule(
    "fsdp-cuda-graphs-double-buffer",
    phase="combination",
    flags=(
        "--use-megatron-fsdp",
        "--cuda-graph-impl",
        "--fsdp-double-buffer",
        "--fsdp-db-use-persist-buf-on-alloc-fail",
        "--data-parallel-sharding-strategy",
    ),
)
def _fsdp_cuda_graphs_double_buffer(args, config):
    """Per-layer graphs under Megatron-FSDP need fixed parameter-buffer addresses."""
    if not wanted(args):
        return None
    problems = []
    if args.data_parallel_sharding_strategy != "optim_grads_params":
        problems.append(
            "--data-parallel-sharding-strategy optim_grads_params (got "
            f"{args.data_parallel_sharding_strategy}: only with it are layers FSDP units, gathered "
            "into fixed double buffers; the other strategies put hooks on submodules inside the "
            "graphed region)"
        )
    if not args.fsdp_double_buffer:
        problems.append(
            "--fsdp-double-buffer (without it each all-gather allocates a new parameter buffer, "
            "whose address changes between iterations while the graph keeps reading the old one: "
            "wrong results or an illegal memory access)"
        )
    if not getattr(args, "fsdp_db_use_persist_buf_on_alloc_fail", False):
        problems.append(
            "--fsdp-db-use-persist-buf-on-alloc-fail (without it a layer whose buffers do not fit "
            "the double buffer, e.g. a dense or MTP layer next to MoE layers, falls back to a "
            "dynamic buffer during replay: an illegal memory access)"
        )
    return listed(
        "TransformerEngine per-layer CUDA graphs (--cuda-graph-impl transformer_engine) with "
        "--use-megatron-fsdp replay at the parameter-buffer addresses seen at capture, so they "
        "need: ",
        problems,
    )


@rule(
    "fsdp-cuda-graphs-supported",
    phase="combination",
    flags=(
        "--use-megatron-fsdp",
        "--cuda-graph-impl",
        "--gradient-accumulation-fusion",
        "--megatron-fsdp-enable-fine-grained-param-gather",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
        "--pipeline-model-parallel-size",
        "--num-distributed-optimizer-instances",
        "--fp8-param-gather",
        "--fine-grained-activation-offloading",
        "--cuda-graph-warmup-steps",
    ),
)
def _fsdp_cuda_graphs_supported(args, config):
    """What the fork's FSDP + per-layer graph capture does not handle (rejected, not guessed)."""
    if not getattr(args, "use_megatron_fsdp", False) or args.cuda_graph_impl == "none":
        return None
    if args.cuda_graph_impl == "local":
        return (
            "--cuda-graph-impl local does not work with --use-megatron-fsdp (megatron's local "
            "graphs only know DDP's hooks and fail at the first graphed layer); use "
            "--cuda-graph-impl transformer_engine (per-layer, this fork) or full_iteration."
        )
    if args.cuda_graph_impl != "transformer_engine":
        return None
    problems = []
    if args.gradient_accumulation_fusion:
        problems.append(
            "gradient-accumulation fusion (add --no-gradient-accumulation-fusion: TE's fused "
            "weight-gradient kernel asks FSDP for its main-grad bucket inside the capture, baking "
            "an address FSDP does not keep)"
        )
    if getattr(args, "megatron_fsdp_enable_fine_grained_param_gather", False):
        problems.append(
            "--megatron-fsdp-enable-fine-grained-param-gather (hooks on submodules inside the "
            "graph)"
        )
    if getattr(args, "fp8_param_gather", False):
        problems.append(
            "--fp8-param-gather (its transpose-buffer gathers are not handled by the capture)"
        )
    if args.overlap_moe_expert_parallel_comm:
        problems.append(
            "--overlap-moe-expert-parallel-comm (Megatron-FSDP refuses it with double buffering)"
        )
    if args.delay_wgrad_compute:
        problems.append(
            "--delay-wgrad-compute (its weight-gradient graphs bypass FSDP's gradient hooks)"
        )
    if args.pipeline_model_parallel_size > 1:
        problems.append(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} (FSDP's root "
            "pre-backward hook lands inside the last layer of non-last stages, where a graph "
            "cannot run it)"
        )
    if (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
        problems.append(
            "--num-distributed-optimizer-instances > 1 (hybrid FSDP's outer gathers are not "
            "handled)"
        )
    if getattr(args, "fine_grained_activation_offloading", False):
        problems.append("--fine-grained-activation-offloading (untested with FSDP graphs)")
    if args.cuda_graph_warmup_steps < 1:
        problems.append(
            "--cuda-graph-warmup-steps 0 (capture must follow at least one eager step, so that "
            "FSDP's buffers exist before TE records their addresses)"
        )
    return listed(
        "TransformerEngine per-layer CUDA graphs with --use-megatron-fsdp do not support: ",
        problems,
    )
