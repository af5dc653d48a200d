"""Rules for ``--memory-budget``: it chooses the levers itself, on the layouts its estimate
covers."""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.memory_budget.flags import FLAG, requested


@rule(
    "memory-budget-chooses-the-levers",
    phase="layout",
    flags=(
        FLAG,
        "--recompute-granularity",
        "--recompute-modules",
        "--recompute-activations",
        "--adam-moments-dtype",
        "--use-precision-aware-optimizer",
        "--exp-avg-dtype",
        "--exp-avg-sq-dtype",
    ),
)
def _chooses_the_levers(args):
    """The budget sets the recomputation and the moments' dtype; a value given as well would be
    overwritten or contradict the estimate."""
    if not requested(args):
        return None
    given = []
    if getattr(args, "recompute_granularity", None) is not None:
        given.append(f"--recompute-granularity {args.recompute_granularity}")
    if getattr(args, "recompute_modules", None):
        given.append("--recompute-modules " + " ".join(args.recompute_modules))
    if getattr(args, "recompute_activations", False):
        given.append("--recompute-activations")
    if getattr(args, "adam_moments_dtype", "fp32") != "fp32":
        given.append(f"--adam-moments-dtype {args.adam_moments_dtype}")
    if getattr(args, "use_precision_aware_optimizer", False):
        given.append("--use-precision-aware-optimizer")
    for flag, dest in (
        ("--exp-avg-dtype", "exp_avg_dtype"),
        ("--exp-avg-sq-dtype", "exp_avg_sq_dtype"),
    ):
        if str(getattr(args, dest, "fp32")) not in ("fp32", "torch.float32"):
            given.append(f"{flag} {getattr(args, dest)}")
    return listed(
        f"{FLAG} {args.memory_budget} chooses the recomputation and the Adam moments' dtype "
        "itself; drop ",
        given,
    )


@rule(
    "memory-budget-layout",
    phase="layout",
    flags=(
        FLAG,
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
        "--use-megatron-fsdp",
    ),
)
def _layout(args):
    """The estimate counts one micro-batch of whole layers on every rank, with megatron's DDP."""
    if not requested(args):
        return None
    problems = []
    for flag, dest in (
        ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
        ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
        ("--context-parallel-size", "context_parallel_size"),
    ):
        if getattr(args, dest, 1) != 1:
            problems.append(f"{flag} 1 (got {getattr(args, dest)})")
    if getattr(args, "use_megatron_fsdp", False):
        problems.append("megatron's DDP, not --use-megatron-fsdp")
    return listed(
        f"{FLAG} {args.memory_budget} estimates layouts of expert and data parallelism only; "
        "it needs: ",
        problems,
    )
