"""The flag that folds DDP's gradient scaling into the loss gradient, and its predicate."""

from __future__ import annotations

import argparse
from typing import Any

FLAG = "--ddp-scale-grads-in-loss"


def requested(args: Any) -> bool:
    return args is not None and bool(getattr(args, "ddp_scale_grads_in_loss", False))


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        FLAG,
        action="store_true",
        help="Scale the loss gradient that starts each backward pass by 1/data-parallel size "
        "instead of multiplying megatron DDP's whole gradient buffer by it before the "
        "reduce-scatter (all-reduce): one pass less over the fp32 gradients per step. The "
        "gradients are identical to the bit when the data-parallel size is a power of two "
        "(else within roundings of the factor). "
        "Needs megatron's DDP (not --use-megatron-fsdp / --use-torch-fsdp2), without "
        "--ddp-average-in-collective and --calculate-per-token-loss. Default: off.",
    )
