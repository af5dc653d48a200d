"""Rules for ``--adam-impl torch`` and ``triton``: what torch's AdamW replaces and what it does not
cover; ``--adam-moments-dtype bf16`` only with the one-kernel step."""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.torch_adam.flags import (
    FLAG,
    MOMENTS_FLAG,
    impl,
    moments_dtype,
    requested,
)


@rule(
    "adam-impl-torch-requirements",
    phase="layout",
    flags=(
        FLAG,
        "--optimizer",
        "--use-megatron-fsdp",
        "--use-torch-fsdp2",
        "--use-precision-aware-optimizer",
        "--optimizer-cpu-offload",
        "--optimizer-cuda-graph",
        "--weight-decay-incr-style",
    ),
)
def _adam_impl_torch(args):
    """The optimizers whose state megatron-core stores for torch's Adam, and a weight decay that a
    captured step can keep."""
    if not requested(args):
        return None
    problems = []
    if getattr(args, "optimizer", "adam") != "adam":
        problems.append(f"--optimizer adam (got {args.optimizer})")
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        problems.append("no --use-megatron-fsdp / --use-torch-fsdp2 (sharded optimizers)")
    if getattr(args, "use_precision_aware_optimizer", False):
        problems.append(
            "no --use-precision-aware-optimizer (its low-precision states and master weights are "
            "TE FusedAdam's)"
        )
    if getattr(args, "optimizer_cpu_offload", False):
        problems.append("no --optimizer-cpu-offload (its GPU part is megatron's hybrid optimizer)")
    if getattr(args, "optimizer_cuda_graph", False) and (
        getattr(args, "weight_decay_incr_style", "constant") != "constant"
    ):
        problems.append(
            "--weight-decay-incr-style constant with --optimizer-cuda-graph (the captured step "
            f"keeps the weight decay of the capture; got {args.weight_decay_incr_style})"
        )
    return listed(f"{FLAG} {args.adam_impl} needs: ", problems)


@rule("adam-moments-dtype-needs-triton", phase="layout", flags=(MOMENTS_FLAG, FLAG))
def _moments_dtype(args):
    """bf16 moments are kept and rounded by the one-kernel step only."""
    if moments_dtype(args) == "bf16" and impl(args) != "triton":
        return (
            f"{MOMENTS_FLAG} bf16 acts only with {FLAG} triton (got {FLAG} {impl(args)}): add "
            f"{FLAG} triton or drop {MOMENTS_FLAG}."
        )
    return None
