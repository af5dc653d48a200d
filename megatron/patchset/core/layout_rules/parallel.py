"""Parallel sizes against the world size, and the divisibility megatron assumes."""

from __future__ import annotations

from megatron.patchset.core.predicates import etp, layout_is_uneven, model_parallel, world_size
from megatron.patchset.core.rules import rule


@rule(
    "model-parallel-divides-world-size",
    phase="layout",
    flags=(
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
    ),
)
def _model_parallel_divides_world(args):
    """TP x PP x CP must divide the number of GPUs."""
    mp, world = model_parallel(args), world_size(args)
    if world % mp:
        return (
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} x "
            f"--context-parallel-size {args.context_parallel_size} = {mp} does not divide the "
            f"world size {world}. Pick sizes whose product divides the number of GPUs."
        )
    return None


@rule(
    "expert-parallel-divides-world-size",
    phase="layout",
    flags=(
        "--expert-model-parallel-size",
        "--expert-tensor-parallel-size",
        "--pipeline-model-parallel-size",
    ),
)
def _expert_parallel_divides_world(args):
    """ETP x EP x PP must divide the number of GPUs (MoE layers' own process grid)."""
    ep, pp, world = (
        args.expert_model_parallel_size,
        args.pipeline_model_parallel_size,
        world_size(args),
    )
    etp_size = etp(args)
    if world % (ep * etp_size * pp):
        return (
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp_size} x "
            f"--pipeline-model-parallel-size {pp} = {ep * etp_size * pp} does not divide the world "
            f"size {world}. Use an --expert-model-parallel-size that divides "
            f"{world // max(1, etp_size * pp) if world % (etp_size * pp) == 0 else world} (the "
            "GPUs left per pipeline stage after expert tensor parallelism)."
        )
    return None


@rule(
    "experts-divisible-by-expert-parallel",
    phase="layout",
    flags=("--num-experts", "--expert-model-parallel-size"),
)
def _experts_divisible(args):
    """Every expert-parallel rank must own the same number of experts."""
    ep = args.expert_model_parallel_size
    if ep > 1 and args.num_experts is None:
        return f"--expert-model-parallel-size {ep} needs a MoE model: set --num-experts."
    if args.num_experts is not None and args.num_experts % ep:
        return (
            f"--num-experts {args.num_experts} is not a multiple of --expert-model-parallel-size "
            f"{ep}; every expert-parallel rank must hold the same number of experts."
        )
    return None


@rule(
    "heads-divisible-by-tensor-parallel",
    phase="layout",
    flags=("--num-attention-heads", "--num-query-groups", "--tensor-model-parallel-size"),
)
def _heads_divisible(args):
    """Attention heads and query groups are split across tensor-parallel ranks."""
    tp = args.tensor_model_parallel_size
    problems = []
    if args.num_attention_heads is not None and args.num_attention_heads % tp:
        problems.append(f"--num-attention-heads {args.num_attention_heads}")
    if (
        getattr(args, "group_query_attention", False)
        and args.num_query_groups
        and args.num_query_groups % tp
    ):
        problems.append(f"--num-query-groups {args.num_query_groups}")
    if problems:
        return f"{' and '.join(problems)} not divisible by --tensor-model-parallel-size {tp}."
    return None


@rule(
    "layers-divisible-by-pipeline",
    phase="layout",
    flags=("--num-layers", "--pipeline-model-parallel-size"),
)
def _layers_divisible(args):
    """An even pipeline split needs num_layers % PP == 0."""
    pp = args.pipeline_model_parallel_size
    if (
        pp > 1
        and args.num_layers is not None
        and not layout_is_uneven(args)
        and args.num_layers % pp
    ):
        return (
            f"--num-layers {args.num_layers} does not split evenly over "
            f"--pipeline-model-parallel-size {pp}; change either, or give an uneven split with "
            "--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers or "
            "--pipeline-model-parallel-layout."
        )
    return None


@rule("global-batch-divisible", phase="layout", flags=("--global-batch-size", "--micro-batch-size"))
def _global_batch_divisible(args):
    """The global batch must be a whole number of micro-batches on every data-parallel rank."""
    world, mp = world_size(args), model_parallel(args)
    if args.global_batch_size is None or world % mp:
        return None
    dp = world // mp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        return (
            f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}."
        )
    return None


@rule(
    "optimizer-graph-needs-one-norm-group",
    phase="layout",
    flags=(
        "--optimizer-cuda-graph",
        "--use-distributed-optimizer",
        "--expert-model-parallel-size",
        "--expert-tensor-parallel-size",
        "--tensor-model-parallel-size",
    ),
)
def _optimizer_graph_norm_group(args):
    """Without the distributed optimizer, megatron's dense and expert optimizers reduce their
    gradient norms over different model-parallel groups once ETP x EP differs from TP, and the
    chained optimizer then adds the two norms on the host (a device-to-host read that a CUDA graph
    cannot capture): --optimizer-cuda-graph fails at its capture."""
    if not getattr(args, "optimizer_cuda_graph", False):
        return None
    if getattr(args, "use_distributed_optimizer", False) or not getattr(args, "num_experts", None):
        return None
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        return None
    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    if ep * etp(args) == tp:
        return None
    return (
        f"--optimizer-cuda-graph with --expert-model-parallel-size {ep} x "
        f"--expert-tensor-parallel-size {etp(args)} != --tensor-model-parallel-size {tp} and "
        "without --use-distributed-optimizer: the dense and expert gradient norms are reduced "
        "over different groups and summed on the host, which the optimizer's CUDA graph cannot "
        "capture. Add --use-distributed-optimizer or drop --optimizer-cuda-graph."
    )


@rule(
    "optimizer-graph-host-reads",
    phase="layout",
    flags=("--optimizer-cuda-graph", "--log-num-zeros-in-grad", "--fp16"),
)
def _optimizer_graph_host_reads(args):
    """megatron's optimizer step reads a value back to the host with these flags, inside the step
    that --optimizer-cuda-graph captures, where a CUDA graph cannot: the count of zero gradients
    (``count_zeros_fp32``'s ``.item()``) and fp16's check of the loss scaler for inf/nan
    (``found_inf.item()``). The capture fails at the first graphed step."""
    if not getattr(args, "optimizer_cuda_graph", False):
        return None
    reads = [
        (flag, what)
        for flag, dest, what in (
            ("--log-num-zeros-in-grad", "log_num_zeros_in_grad", "the count of zero gradients"),
            ("--fp16", "fp16", "the loss scaler's inf/nan check"),
        )
        if getattr(args, dest, False)
    ]
    if not reads:
        return None
    named = " and ".join(f"{flag} ({what})" for flag, what in reads)
    return (
        f"--optimizer-cuda-graph with {named}: megatron's optimizer step reads that value back "
        "to the host, which the optimizer's CUDA graph cannot capture. Drop "
        f"{' and '.join(flag for flag, _ in reads)} or --optimizer-cuda-graph."
    )
