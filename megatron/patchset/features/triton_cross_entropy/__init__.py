"""megatron-core's fused cross entropy as two Triton kernels
(docs/features/triton_cross_entropy.md).

``--cross-entropy-triton`` replaces the name megatron's language models call under
``--cross-entropy-loss-fusion`` (:mod:`.patches`) with the kernels of :mod:`.kernels`: one pass
over the logits in forward, one in backward, nothing of the vocabulary's size kept in fp32.
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.triton_cross_entropy import flags

FEATURE = Feature(
    name="triton_cross_entropy",
    title="Fused cross entropy as two Triton kernels (one pass over the logits each way)",
    switches=(flags.FLAG,),
    enabled=flags.requested,
    upstream_pr="proposed (megatron-core 0.19.2's fused loss is its compiled native one; TE's "
    "is disabled by its argument checks)",
    status="not yet verified on 2 GPUs",
    modules=(f"{__name__}.rules", f"{__name__}.patches"),
    flags=(flags.FLAG,),
    add_arguments=flags.add_arguments,
)
