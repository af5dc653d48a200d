"""The grouped-GEMM flags and the predicates of the parsed arguments that switch the patches on."""

from __future__ import annotations

import argparse
from typing import Any

FLAG = "--moe-grouped-gemm-impl"
IMPLS = ("te", "torch")
DEFAULT_IMPL = "te"
SPLITS_FLAG = "--moe-expert-splits-on-device"
CARVEOUT_FLAG = "--moe-wgrad-sm-carveout"
# The TransformerConfig attribute configure_config sets and the experts' linears read.
CONFIG_CARVEOUT = "moe_wgrad_sm_carveout"
# bf16 rows and columns must start on 16-byte boundaries for the grouped GEMM kernels.
ALIGNMENT = 8


def requested(args: Any) -> bool:
    return args is not None and getattr(args, "moe_grouped_gemm_impl", DEFAULT_IMPL) == "torch"


def splits_on_device(args: Any) -> bool:
    return args is not None and bool(getattr(args, "moe_expert_splits_on_device", False))


def wgrad_sm_carveout(args: Any) -> int:
    """``--moe-wgrad-sm-carveout`` of the parsed arguments, or of a TransformerConfig that
    :func:`configure_config` set (0 without it)."""
    return int(getattr(args, CONFIG_CARVEOUT, 0) or 0) if args is not None else 0


def configure_config(args: Any, config: Any) -> None:
    """Copy ``--moe-wgrad-sm-carveout`` onto megatron's TransformerConfig, where the experts'
    linears read it."""
    if wgrad_sm_carveout(args):
        setattr(config, CONFIG_CARVEOUT, wgrad_sm_carveout(args))


def add_arguments(group: argparse._ArgumentGroup) -> None:
    from megatron.patchset.core import argsfile

    group.add_argument(
        FLAG,
        choices=IMPLS,
        default=DEFAULT_IMPL,
        help="GEMMs of the grouped MoE experts (--moe-grouped-gemm with the TransformerEngine "
        "spec). te: TransformerEngine's GroupedLinear (on Hopper one cuBLAS GEMM per expert). "
        "torch: forward, data and weight gradient as one torch grouped_mm call each (CUTLASS, "
        "SM90, bf16), with the per-expert offsets on the device; TE's parameters and checkpoint "
        "format are kept.",
    )
    group.add_argument(
        SPLITS_FLAG,
        action="store_true",
        default=False,
        help="Keep the per-expert token counts on the GPU: the all-to-all dispatcher neither "
        "copies them to the host nor waits for them, and the experts' grouped GEMMs read them "
        "there, so a dropless MoE layer runs without a host synchronisation and --cuda-graph-impl "
        "full_iteration can capture the whole forward and backward. Needs --moe-grouped-gemm-impl "
        "torch, the alltoall dispatcher with --moe-permute-fusion, one expert-parallel and "
        "expert-tensor-parallel rank, and no token dropping.",
    )
    group.add_argument(
        CARVEOUT_FLAG,
        type=argsfile.at_least(0),
        default=0,
        help="With --overlap-dispatch-backward-with-experts-wgrad and --moe-grouped-gemm-impl "
        "torch: the experts' deferred weight-gradient GEMMs launch their persistent grid on N "
        "fewer SMs (torch's SM carve-out), so that the dispatch's backward all-to-all, whose "
        "NCCL thread blocks cannot share an SM with the GEMM's, runs beside them. N must be "
        "below the GPU's SM count; the GEMMs lose up to about N / SM count of their speed. "
        "Default: 0 (every SM).",
    )
