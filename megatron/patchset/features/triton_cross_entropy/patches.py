"""The patch that puts the Triton cross entropy in the place of megatron-core's fused one."""

from __future__ import annotations

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch
from megatron.patchset.features.triton_cross_entropy import kernels
from megatron.patchset.features.triton_cross_entropy.flags import FLAG


def triton_for_fused(original):
    """The replacement of ``fused_vocab_parallel_cross_entropy(logits, target, tp_group)``: the
    Triton kernels where they run, megatron's function elsewhere (a CPU tensor, no Triton)."""

    def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
        if tp_group is not None and tp_group.size() != 1:
            raise PatchsetError(
                f"{FLAG}: the loss is split over {tp_group.size()} tensor-parallel ranks; the "
                "kernels cover one. Use --tensor-model-parallel-size 1 or drop the flag."
            )
        if not kernels.available(vocab_parallel_logits.device):
            return original(vocab_parallel_logits, target, tp_group)
        return kernels.triton_cross_entropy(vocab_parallel_logits, target)

    return fused_vocab_parallel_cross_entropy


@patch(
    "triton_cross_entropy.fused_loss",
    "megatron.core.models.common.language_module.language_module."
    "fused_vocab_parallel_cross_entropy",
    reason="megatron-core's fused cross entropy keeps the softmax in fp32 and passes over a "
    "tokens x vocabulary fp32 tensor several times; two Triton kernels read the bf16 logits once "
    "in forward and once in backward",
)
def triton_cross_entropy(original):
    return triton_for_fused(original)
