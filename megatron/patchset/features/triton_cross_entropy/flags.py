"""The flag of the Triton cross-entropy and the predicate of the parsed arguments that switches it
on."""

from __future__ import annotations

import argparse
from typing import Any

FLAG = "--cross-entropy-triton"


def requested(args: Any) -> bool:
    return args is not None and bool(getattr(args, "cross_entropy_triton", False))


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        FLAG,
        action="store_true",
        help="With --cross-entropy-loss-fusion (--cross-entropy-fusion-impl native): the fused "
        "cross entropy as two Triton kernels, one pass over the logits in forward (online "
        "softmax) and one in backward, instead of megatron-core's compiled functions, which "
        "keep the softmax in fp32. Same loss and gradient within fp32 rounding. Needs "
        "--tensor-model-parallel-size 1.",
    )
