"""The Adam implementation flag and the predicate of the parsed arguments that switches it on."""

from __future__ import annotations

import argparse
from typing import Any

FLAG = "--adam-impl"
IMPLS = ("te", "torch")
DEFAULT_IMPL = "te"


def requested(args: Any) -> bool:
    return args is not None and getattr(args, "adam_impl", DEFAULT_IMPL) == "torch"


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        FLAG,
        choices=IMPLS,
        default=DEFAULT_IMPL,
        help="Kernel of --optimizer adam. te: megatron-core's choice, TransformerEngine's "
        "FusedAdam (apex's without TE). torch: torch.optim.AdamW (Adam without "
        "--decoupled-weight-decay) with fused=True, one kernel over all parameters; with "
        "--optimizer-cuda-graph it is capturable and the learning rate is a device tensor "
        "that megatron's scheduler updates in place. The state keeps megatron-core's "
        "checkpoint format for torch optimizers (exp_avg, exp_avg_sq and a per-parameter "
        "step). Needs the non-distributed optimizer in fp32 main parameters.",
    )
