"""The Adam implementation flag and the predicate of the parsed arguments that switches it on."""

from __future__ import annotations

import argparse
from typing import Any

FLAG = "--adam-impl"
IMPLS = ("te", "torch", "triton")
DEFAULT_IMPL = "te"
MOMENTS_FLAG = "--adam-moments-dtype"
MOMENTS_DTYPES = ("fp32", "bf16")


def moments_dtype(args: Any) -> str:
    """``--adam-moments-dtype``: fp32 (torch's, the default) or bf16."""
    return "fp32" if args is None else getattr(args, "adam_moments_dtype", "fp32")


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
    group.add_argument(
        MOMENTS_FLAG,
        choices=MOMENTS_DTYPES,
        default="fp32",
        help="With --adam-impl triton: the dtype Adam's two moments (exp_avg, exp_avg_sq) are "
        "kept in. bf16 keeps 4 bytes per parameter less and the kernel moves 22 bytes per "
        "parameter instead of 30; the update is computed in fp32 and the moments are rounded "
        "to nearest even as they are stored. megatron's distributed checkpoint holds them in "
        "bf16 (dp_reshardable) or in fp32 (fully_reshardable, gathered in fp32: the same "
        "values); they load in bf16, fp32 moments of a checkpoint rounded to nearest even as "
        "they load. Default: fp32.",
    )
