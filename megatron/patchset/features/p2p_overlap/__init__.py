"""Delayed weight gradients overlapping the pipeline's backward P2P (docs/features/p2p_overlap.md).

Three flags change megatron's fine-grained 1F1B schedule plan
(``--overlap-moe-expert-parallel-comm``
with ``--delay-wgrad-compute`` in an interleaved pipeline): the backward send/receive runs on the
communication stream, and the last N backward layers of each model chunk defer their weight
gradients past it.
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.p2p_overlap import flags

FEATURE = Feature(
    name="p2p_overlap",
    title="Delayed weight gradients overlapping the pipeline's backward P2P",
    switches=flags.FLAGS,
    enabled=flags.requested,
    upstream_pr="PR 4268 (closed unmerged; this is the fork's own implementation)",
    status="experimental",
    modules=(f"{__name__}.rules", f"{__name__}.schedule_plan"),
    flags=flags.FLAGS,
    add_arguments=flags.add_arguments,
    configure_config=flags.configure_config,
    in_use=lambda args: flags.flags_given(args).split(", "),
)
