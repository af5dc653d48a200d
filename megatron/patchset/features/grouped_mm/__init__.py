"""The experts' GEMMs as torch grouped_mm, token counts on the GPU, and full-iteration CUDA graphs
of a dropless MoE step (docs/features/grouped_mm.md).

``--moe-grouped-gemm-impl torch`` runs each expert linear's forward, data and weight gradient as
one grouped GEMM with device-side offsets (:mod:`.linears`); ``--moe-expert-splits-on-device``
keeps the per-expert token counts on the GPU (:mod:`.device_splits`), so megatron's
``--cuda-graph-impl full_iteration`` can capture the whole step.
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.grouped_mm import flags


def _in_use(args) -> list[str]:
    carveout = flags.wgrad_sm_carveout(args)
    return (
        [f"{flags.FLAG} torch"]
        + ([flags.SPLITS_FLAG] if flags.splits_on_device(args) else [])
        + ([f"{flags.CARVEOUT_FLAG} {carveout}"] if carveout else [])
    )


FEATURE = Feature(
    name="grouped_mm",
    title="Experts as torch grouped GEMMs; full-iteration graphs of a dropless MoE step",
    switches=(f"{flags.FLAG} torch",),
    enabled=flags.requested,
    upstream_pr="proposed (megatron-core 0.19.2 uses torch grouped_mm for inference only: "
    "InferenceGroupedMLP)",
    status="experimental",
    modules=(f"{__name__}.rules", f"{__name__}.linears", f"{__name__}.device_splits"),
    flags=(flags.FLAG, flags.SPLITS_FLAG, flags.CARVEOUT_FLAG),
    add_arguments=flags.add_arguments,
    configure_config=flags.configure_config,
    in_use=_in_use,
)
