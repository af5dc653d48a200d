"""Flex token dispatch through DeepEP, HybridEP or NCCL EP (docs/features/flex_dispatch.md).

Each backend is probed before any GPU work and again where megatron builds its manager, so that a
broken or missing library is reported with its cause instead of megatron's "not installed"
(:mod:`.probes`, :mod:`.manager_checks`); megatron's NCCL EP bootstrap is fixed for
TransformerEngine 2.20 and torch 2.11 (:mod:`.manager_checks`, :mod:`.op_repair`).
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.flex_dispatch.probes import requested_backend


def packages(args) -> list[tuple[str, str]]:
    """The backend's library: DeepEP built from source, or TE's NCCL EP with a recent NCCL."""
    from megatron.patchset.core.versions import SUPPORTED_TE_RANGE
    from megatron.patchset.features.flex_dispatch import probes

    backend = requested_backend(args)
    why = f"--moe-flex-dispatcher-backend {backend}"
    if backend in ("deepep", "hybridep"):
        revision = (
            probes.HYBRIDEP_REVISION[:7] + " hybrid-ep"
            if backend == "hybridep"
            else probes.DEEPEP_REVISION[:7]
        )
        return [(f"deep_ep (DeepEP {revision}, built from source: docs/deepep.md)", why)]
    if backend == "ncclep":
        nccl = ".".join(map(str, probes.NCCL_EP_MIN_NCCL))
        return [
            (
                f"transformer-engine[pytorch]=={SUPPORTED_TE_RANGE[0]}",
                f"{why}: its libnccl_ep.so, run with NCCL >= {nccl} (docs/deepep.md)",
            )
        ]
    return []


FEATURE = Feature(
    name="flex_dispatch",
    title="Flex token dispatch: DeepEP, HybridEP, NCCL EP",
    switches=("--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend"),
    enabled=lambda args: requested_backend(args) is not None,
    upstream_pr="fork-only (diagnostics)",
    status="stable",
    modules=(f"{__name__}.rules", f"{__name__}.manager_checks"),
    packages=packages,
    in_use=lambda args: [f"--moe-flex-dispatcher-backend {requested_backend(args)}"],
)
