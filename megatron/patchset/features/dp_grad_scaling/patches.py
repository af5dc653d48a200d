"""The two halves of the fold: megatron's DDP keeps its gradient buffers unscaled, and the loss
gradient that starts each backward pass carries the factor instead.

megatron's ``DistributedDataParallel`` gives each gradient bucket a ``gradient_scaling_factor``
(``1 / data-parallel size`` without ``--ddp-average-in-collective`` and per-token loss, for the
dense and the expert buffers alike) and multiplies the bucket by it before the reduce-scatter or
all-reduce: a read and a write of every fp32 gradient, per step. The backward pass is linear in
the loss gradient, so the same factor applied to that gradient gives gradients already scaled;
megatron's training loop seeds each backward pass (and the MoE auxiliary and MTP losses) from
``config.grad_scale_func``, which is ``optimizer.scale_loss``. With a power-of-two factor (a
power-of-two data-parallel size) every product and sum of the backward pass, the accumulation
over micro-batches and the reduction round the same scaled as unscaled: the gradients are
identical to the bit, short of values that leave the floating-point range within that factor.
With another factor the two differ by roundings of the factor.
"""

from __future__ import annotations

import functools

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch
from megatron.patchset.features.dp_grad_scaling.flags import FLAG

# The factor taken out of the gradient buffers of the DDP module built last in this process (every
# model chunk of a run has the same data-parallel group, hence the same factor); None where that
# module scales nothing, or none has been built.
_moved: dict[str, float | None] = {"factor": None}


def _buckets(ddp):
    for buffer in (*ddp.buffers, *ddp.expert_parallel_buffers):
        yield buffer
        yield from buffer.buckets


def take_scaling_out(ddp) -> float | None:
    """Set every bucket's (and buffer's) scaling factor of ``ddp`` to 1 and return the factor they
    had; None where nothing is scaled. Raises where the buffers disagree."""
    factors = {float(b.gradient_scaling_factor) for b in _buckets(ddp)}
    if not factors or factors == {1.0}:
        return None
    if len(factors) != 1:
        raise PatchsetError(
            f"{FLAG}: megatron's DDP scales its gradient buffers by different factors "
            f"({sorted(factors)}); one loss gradient can carry only one. Drop the flag."
        )
    factor = factors.pop()
    for b in _buckets(ddp):
        b.gradient_scaling_factor = 1.0
    return factor


@patch(
    "dp_grad_scaling.unscaled_buffers",
    "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.__init__",
    reason="megatron's DDP multiplies the whole fp32 gradient buffer by 1/DP before each "
    "reduction, one read and write of every gradient per step; the loss gradient carries the "
    "factor instead (dp_grad_scaling.scaled_loss_gradient)",
)
def _unscaled_buffers(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _moved["factor"] = take_scaling_out(self)

    return __init__


@patch(
    "dp_grad_scaling.scaled_loss_gradient",
    "megatron.core.optimizer.optimizer.MegatronOptimizer.scale_loss",
    reason="megatron's training loop seeds every backward pass (and the MoE auxiliary and MTP "
    "losses) from optimizer.scale_loss; it multiplies in the 1/DP taken out of DDP's gradient "
    "buffers (dp_grad_scaling.unscaled_buffers)",
)
def _scaled_loss_gradient(original):
    @functools.wraps(original)
    def scale_loss(self, loss):
        scaled = original(self, loss)
        factor = _moved["factor"]
        return scaled if factor is None else scaled * factor

    return scale_loss
