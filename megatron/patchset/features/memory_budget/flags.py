"""The flag of the memory budget and the predicate of the parsed arguments that switches it on."""

from __future__ import annotations

import argparse
import re
from typing import Any

FLAG = "--memory-budget"
# A card's memory as its maker names it: 80G for an 80 GB H100, 141G for an H200.
PATTERN = r"[0-9]+(\.[0-9]+)?G"
GIB = 1024**3


def budget_gib(text: str) -> float:
    """``80G`` -> 80.0 (GiB). Raises ValueError for other text."""
    if not re.fullmatch(PATTERN, text or ""):
        raise ValueError(f"{FLAG} takes the card's memory as <N>G, e.g. 80G (got {text!r})")
    value = float(text[:-1])
    if value <= 0:
        raise ValueError(f"{FLAG} must be more than 0G (got {text!r})")
    return value


def _budget_type(text: str) -> str:
    try:
        budget_gib(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def requested(args: Any) -> bool:
    return args is not None and bool(getattr(args, "memory_budget", None))


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        FLAG,
        type=_budget_type,
        default=None,
        metavar="<N>G",
        help="The GPU's memory, as its maker names it (80G for an 80 GB H100, 141G for an "
        "H200): after megatron's argument validation the fork estimates each rank's peak memory "
        "for the parallel layout, micro-batch and model, and takes the fastest combination of "
        "memory levers (bf16 Adam moments; selective recomputation of the experts' activation, "
        "then of the layer norms) whose estimate fits 90%% of it; none when the run fits as it "
        "is. Refused before training when even the leanest combination does not fit. Sets "
        "--adam-moments-dtype bf16 (with --adam-impl triton) or megatron's precision-aware "
        "optimizer with bf16 moments (with the distributed optimizer), --recompute-granularity "
        "selective and --recompute-modules; do not pass those with it.",
    )
