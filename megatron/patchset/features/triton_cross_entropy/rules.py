"""Rules for ``--cross-entropy-triton``: what it replaces and the layout it covers."""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.triton_cross_entropy.flags import FLAG, requested


@rule(
    "cross-entropy-triton-requirements",
    phase="layout",
    flags=(
        FLAG,
        "--cross-entropy-loss-fusion",
        "--cross-entropy-fusion-impl",
        "--tensor-model-parallel-size",
    ),
)
def _cross_entropy_triton(args):
    """The kernels replace megatron-core's native fused cross entropy on one tensor-parallel
    rank."""
    if not requested(args):
        return None
    problems = []
    if not getattr(args, "cross_entropy_loss_fusion", False):
        problems.append("--cross-entropy-loss-fusion (the kernels replace the fused loss)")
    if getattr(args, "cross_entropy_fusion_impl", "native") != "native":
        problems.append(
            f"--cross-entropy-fusion-impl native (got {args.cross_entropy_fusion_impl})"
        )
    if getattr(args, "tensor_model_parallel_size", 1) != 1:
        problems.append(
            "--tensor-model-parallel-size 1 (the vocabulary-parallel reduction is not "
            f"implemented; got {args.tensor_model_parallel_size})"
        )
    return listed(f"{FLAG} needs: ", problems)
