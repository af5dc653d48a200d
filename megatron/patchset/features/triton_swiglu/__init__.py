"""The grouped experts' probability-weighted SwiGLU as two Triton kernels
(docs/features/triton_swiglu.md).

``--moe-swiglu-triton`` replaces the name megatron's grouped experts call for their weighted
SwiGLU (:mod:`.patches`) with the kernels of :mod:`.kernels`, whose probability gradient has the
same bits for a row whatever the number of rows around it.
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.triton_swiglu import flags

FEATURE = Feature(
    name="triton_swiglu",
    title="The experts' weighted SwiGLU as two Triton kernels, the same bits for any row count",
    switches=(flags.FLAG,),
    enabled=flags.requested,
    upstream_pr="proposed (megatron-core 0.19.2 compiles weighted_swiglu_back with "
    "torch.compile, whose row sum depends on the row count it is compiled for)",
    status="experimental",
    modules=(f"{__name__}.rules", f"{__name__}.patches"),
    flags=(flags.FLAG,),
    add_arguments=flags.add_arguments,
)
