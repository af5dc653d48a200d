"""TransformerEngine per-layer CUDA graphs with Megatron-FSDP (docs/features/fsdp_cuda_graphs.md).

Megatron-FSDP's layer hooks are marked where they are registered (:mod:`.fsdp_hooks`), taken off
for TE's capture and handed to TE as ``capture_time_hooks``, and fire around every graphed call
(:mod:`.te_graphs`); the graphs are bit-identical to eager FSDP.
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.fsdp_cuda_graphs.fsdp_hooks import wanted

FEATURE = Feature(
    name="fsdp_cuda_graphs",
    title="TransformerEngine per-layer CUDA graphs with Megatron-FSDP",
    switches=("--use-megatron-fsdp", "--cuda-graph-impl transformer_engine"),
    enabled=wanted,
    upstream_pr="PR 4232 (with #4231, both open; the fork's own implementation for TE 2.20.2)",
    status="stable",
    modules=(f"{__name__}.rules", f"{__name__}.fsdp_hooks", f"{__name__}.te_graphs"),
)
