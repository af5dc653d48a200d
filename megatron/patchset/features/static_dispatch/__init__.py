"""Dropless all-to-all dispatch with static shapes for any expert-parallel size, so that
megatron's full-iteration CUDA graphs capture MoE layers at EP >= 2 (docs/features/
static_dispatch.md).

``--moe-static-dispatch`` replaces the host side of megatron's all-to-all dispatcher
(:mod:`.dispatcher`, index maps in :mod:`.plan`, gathers in :mod:`.gather`); a step whose rows do
not fit the per-peer capacity is re-run with megatron's dynamic path or stops (:mod:`.runner`).
``--moe-static-dispatch-dedup`` sends each token once to every peer that hosts one of its experts
and sums that peer's expert outputs there (the ``token_*`` plans, ``gather_expand`` and
``gather_sum``). ``--moe-static-dispatch-chunks N`` runs each MoE layer in N token chunks whose
all-to-alls overlap the experts of another chunk (:mod:`.chunks`).
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.static_dispatch import flags


def _in_use(args) -> list[str]:
    policy = {
        "rerun": "a step that overflows is re-run with the dynamic all-to-all",
        "fail": "a step that overflows stops the run",
    }[flags.on_overflow(args)]
    return (
        [
            flags.FLAG,
            f"{flags.FACTOR_FLAG} {flags.factor(args)}",
            f"{flags.OVERFLOW_FLAG} {flags.on_overflow(args)}: {policy}",
        ]
        + (
            [
                f"{flags.CHUNKS_FLAG} {flags.chunks(args)}: each MoE layer in {flags.chunks(args)} "
                "token chunks, their all-to-alls on a side stream beside the experts"
            ]
            if flags.chunks(args) > 1
            else []
        )
        + (
            [
                f"{flags.DEDUP_FLAG}: each token crosses to a peer once, its expert outputs summed "
                "there"
            ]
            if flags.dedup(args)
            else []
        )
    )


FEATURE = Feature(
    name="static_dispatch",
    title="Static-shape all-to-all dispatch: full-iteration CUDA graphs at EP >= 2",
    switches=(flags.FLAG,),
    enabled=flags.requested,
    upstream_pr="fork-only (megatron-core 0.19.2's static-shape dispatch is the flex "
    "dispatcher's HybridEP / NCCL EP budget, tested on Blackwell)",
    status="experimental",
    modules=(
        f"{__name__}.rules",
        f"{__name__}.dispatcher",
        f"{__name__}.runner",
        f"{__name__}.chunks",
    ),
    flags=flags.FLAGS,
    add_arguments=flags.add_arguments,
    configure_config=flags.configure_config,
    in_use=_in_use,
)
