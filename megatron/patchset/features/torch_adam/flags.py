"""The Adam implementation flag and the predicate of the parsed arguments that switches it on."""

from __future__ import annotations

import argparse
from typing import Any

FLAG = "--adam-impl"
IMPLS = ("te", "torch", "triton")
DEFAULT_IMPL = "te"


def impl(args: Any) -> str:
    return DEFAULT_IMPL if args is None else getattr(args, "adam_impl", DEFAULT_IMPL)


def requested(args: Any) -> bool:
    """torch's AdamW state in place of TE's FusedAdam: ``--adam-impl torch`` or ``triton``."""
    return impl(args) in ("torch", "triton")


def wants_torch_kernel(args: Any) -> bool:
    return impl(args) == "torch"


def wants_triton_kernel(args: Any) -> bool:
    return impl(args) == "triton"


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
        "step). triton: the same optimizer and state, stepped by one Triton kernel that also "
        "applies the clip and writes the bf16 model parameters (megatron's copy is skipped). "
        "torch and triton take fp32 main parameters, with or without "
        "--use-distributed-optimizer (each data-parallel rank then steps its shard).",
    )
