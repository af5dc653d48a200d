"""Rules for ``--ddp-scale-grads-in-loss``: megatron's DDP and one pre-reduction scaling factor for
all of its buffers."""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.dp_grad_scaling.flags import FLAG, requested


@rule(
    "ddp-scale-grads-in-loss-requirements",
    phase="combination",
    flags=(
        FLAG,
        "--use-megatron-fsdp",
        "--use-torch-fsdp2",
        "--ddp-average-in-collective",
        "--calculate-per-token-loss",
    ),
)
def _scale_in_loss(args, config):
    """megatron's DDP multiplies every bucket by one factor, 1/DP, before the reduction only
    without averaging in the collective and without per-token loss."""
    if not requested(args):
        return None
    problems = []
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        problems.append("megatron's DDP (no --use-megatron-fsdp / --use-torch-fsdp2)")
    if getattr(args, "ddp_average_in_collective", False):
        problems.append(
            "no --ddp-average-in-collective (the collective averages the dense gradients and "
            "the expert buffers keep a different factor)"
        )
    if getattr(args, "calculate_per_token_loss", False):
        problems.append(
            "no --calculate-per-token-loss (DDP scales nothing before the reduction then)"
        )
    return listed(f"{FLAG} needs: ", problems)
