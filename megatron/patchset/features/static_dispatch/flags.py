"""The static-dispatch flags, and how their values reach the dispatcher (attributes of the model's
``TransformerConfig``) and the step runner (:mod:`.state`)."""

from __future__ import annotations

import argparse
from typing import Any

FLAG = "--moe-static-dispatch"
FACTOR_FLAG = "--moe-static-dispatch-capacity-factor"
OVERFLOW_FLAG = "--moe-static-dispatch-on-overflow"
DEFAULT_FACTOR = 2.0
ON_OVERFLOW = ("rerun", "fail")
DEFAULT_ON_OVERFLOW = "rerun"
CHUNKS_FLAG = "--moe-static-dispatch-chunks"
DEFAULT_CHUNKS = 1
DEDUP_FLAG = "--moe-static-dispatch-dedup"
FLAGS = (FLAG, FACTOR_FLAG, OVERFLOW_FLAG, CHUNKS_FLAG, DEDUP_FLAG)

# TransformerConfig attributes (absent: upstream's dispatcher).
CONFIG_ON = "moe_static_dispatch"
CONFIG_FACTOR = "moe_static_dispatch_capacity_factor"
CONFIG_CHUNKS = "moe_static_dispatch_chunks"
CONFIG_DEDUP = "moe_static_dispatch_dedup"


def requested(args: Any) -> bool:
    return args is not None and bool(getattr(args, "moe_static_dispatch", False))


def factor(args: Any) -> float:
    return getattr(args, "moe_static_dispatch_capacity_factor", DEFAULT_FACTOR)


def on_overflow(args: Any) -> str:
    return getattr(args, "moe_static_dispatch_on_overflow", DEFAULT_ON_OVERFLOW)


def chunks(args: Any) -> int:
    return getattr(args, "moe_static_dispatch_chunks", DEFAULT_CHUNKS)


def dedup(args: Any) -> bool:
    return bool(getattr(args, "moe_static_dispatch_dedup", False))


def flags_given(args: Any) -> list[str]:
    """The capacity factor, the overflow policy, the chunk count and the one-row-per-token
    exchange where set away from their defaults, as they were typed."""
    given = [DEDUP_FLAG] if dedup(args) else []
    for flag, value, default in (
        (FACTOR_FLAG, factor(args), DEFAULT_FACTOR),
        (OVERFLOW_FLAG, on_overflow(args), DEFAULT_ON_OVERFLOW),
        (CHUNKS_FLAG, chunks(args), DEFAULT_CHUNKS),
    ):
        if value != default:
            given.append(f"{flag} {value}")
    return given


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        FLAG,
        action="store_true",
        default=False,
        help="Dropless all-to-all token dispatch with static shapes and no host synchronisation, "
        "for any expert-parallel size: the per-expert token counts are exchanged on the GPU and "
        "token rows move in fixed-size slots (a per-peer capacity), so --cuda-graph-impl "
        "full_iteration captures the MoE layers at EP >= 2. Needs --moe-grouped-gemm-impl torch "
        "--moe-expert-splits-on-device, the alltoall dispatcher with --moe-permute-fusion, and "
        "expert tensor parallel size 1.",
    )
    group.add_argument(
        FACTOR_FLAG,
        type=float,
        default=DEFAULT_FACTOR,
        help="Rows one rank may send to one expert-parallel peer, as a multiple of the balanced "
        "share: ceil(factor x tokens x top-k / EP), at most tokens x top-k (then nothing can "
        f"overflow). Default: {DEFAULT_FACTOR}.",
    )
    group.add_argument(
        OVERFLOW_FLAG,
        choices=ON_OVERFLOW,
        default=DEFAULT_ON_OVERFLOW,
        help="What a step does when some rank routes more rows to a peer than the capacity "
        "(detected on the GPU, all-reduced after forward-backward; no token is silently dropped). "
        "rerun: discard the step's gradients and run it again with megatron's dynamic all-to-all "
        "(eager, with host split sizes). fail: stop with an error that names the capacity. "
        f"Default: {DEFAULT_ON_OVERFLOW}.",
    )
    group.add_argument(
        CHUNKS_FLAG,
        type=int,
        default=DEFAULT_CHUNKS,
        help="Split each MoE layer's tokens (along the sequence) into this many chunks after the "
        "router, and run each chunk's dispatch and combine all-to-alls on a side stream while "
        "the experts compute another chunk, so that only the first chunk's dispatch and the last "
        "chunk's combine wait for the network. 1: one all-to-all each way, no overlap. "
        f"Default: {DEFAULT_CHUNKS}.",
    )
    group.add_argument(
        DEDUP_FLAG,
        action="store_true",
        default=False,
        help="Send each token once to every expert-parallel peer that hosts one or more of its "
        "top-k experts, with the routing of those experts beside it, instead of once per "
        "routed expert; the peer feeds it to its experts and sums their outputs before the "
        "combine. With 128 experts, top-8 and EP 8 a token reaches 5.3 of the 8 ranks on "
        "average: about two thirds of the all-to-all bytes. The per-peer capacity is then in "
        "tokens: ceil(factor x tokens x share), share being the fraction of tokens a peer gets "
        "under uniform routing.",
    )


def configure_config(args: Any, config: Any) -> None:
    """Copy the options onto megatron's TransformerConfig and the step runner's state."""
    from megatron.patchset.features.static_dispatch import state

    if not requested(args):
        return
    setattr(config, CONFIG_ON, True)
    setattr(config, CONFIG_FACTOR, float(factor(args)))
    setattr(config, CONFIG_CHUNKS, int(chunks(args)))
    setattr(config, CONFIG_DEDUP, dedup(args))
    state.ON_OVERFLOW = on_overflow(args)
