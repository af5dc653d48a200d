"""The flag of the Triton weighted SwiGLU and the predicate of the parsed arguments that switches it
on."""

from __future__ import annotations

import argparse
from typing import Any

FLAG = "--moe-swiglu-triton"


def requested(args: Any) -> bool:
    return args is not None and bool(getattr(args, "moe_swiglu_triton", False))


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        FLAG,
        action="store_true",
        help="The grouped experts' SwiGLU weighted by the routing probabilities (megatron's "
        "weighted_bias_swiglu_impl under --swiglu and the bias-SwiGLU fusion) as two Triton "
        "kernels instead of megatron-core's torch.compile'd functions. Each row's probability "
        "gradient is summed in the same order whatever the number of rows, so a step gives the "
        "same bits with capacity-padded and exact expert inputs (--moe-static-dispatch and "
        "megatron's all-to-all). Needs --moe-grouped-gemm and --disable-bias-linear.",
    )
