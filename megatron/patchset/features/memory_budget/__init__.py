"""A memory budget for the small-batch recipe (docs/features/memory_budget.md).

``--memory-budget 80G`` names the GPU's memory. After megatron's argument validation, when the
parallel layout, micro-batch and model are known, the fork estimates each rank's peak memory
(:mod:`.estimate`) and takes the fastest combination of memory levers that fits the budget less
its headroom (:mod:`.choice`): bf16 Adam moments, megatron's selective recomputation of the
experts' activation, then of the layer norms. It sets them on megatron's arguments before the
model's config and the optimizer are built, logs one line naming them, and refuses the launch
when even the leanest combination does not fit. The recipe's ``MEMORY=<N>G`` passes the flag.
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.memory_budget import choice, flags

FEATURE = Feature(
    name="memory_budget",
    title="A memory budget: the fastest memory levers whose estimated peak fits the GPU",
    switches=(flags.FLAG,),
    enabled=flags.requested,
    upstream_pr="fork-only (chooses the small-batch recipe's levers from an estimate calibrated "
    "on its benchmark records)",
    status="experimental",
    modules=(f"{__name__}.rules",),
    flags=(flags.FLAG,),
    add_arguments=flags.add_arguments,
    resolve_args=choice.resolve,
    report=choice.report,
    in_use=lambda args: [f"{flags.FLAG} {args.memory_budget}"],
)
