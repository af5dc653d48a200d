"""megatron DDP's data-parallel gradient scaling folded into the loss gradient
(docs/features/dp_grad_scaling.md).

``--ddp-scale-grads-in-loss`` moves the ``1 / data-parallel size`` that megatron's DDP multiplies
into the whole gradient buffer before each reduction (:mod:`.patches`) to the loss gradient that
starts the backward pass: one pass over the fp32 gradient buffer less per step, the same
gradients to the bit when the data-parallel size is a power of two.
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.dp_grad_scaling import flags

FEATURE = Feature(
    name="dp_grad_scaling",
    title="Data-parallel gradient scaling in the loss gradient (no pass over the gradient buffer)",
    switches=(flags.FLAG,),
    enabled=flags.requested,
    upstream_pr="proposed (megatron-core 0.19.2 scales the gradient buffer before the reduction)",
    status="experimental",
    modules=(f"{__name__}.rules", f"{__name__}.patches"),
    flags=(flags.FLAG,),
    add_arguments=flags.add_arguments,
)
