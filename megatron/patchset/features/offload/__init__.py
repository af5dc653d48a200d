"""Parameter, gradient and optimizer-state offload to host memory (docs/features/offload.md).

A library API, not a flag: :func:`offload` releases the GPU memory behind megatron's DDP or
Megatron-FSDP buffers (and optionally the optimizer's state) by resizing their storages, and
:func:`reload` brings the same tensors back with the same values (:mod:`.api`).
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.offload.api import (
    OffloadError,
    OffloadState,
    is_offloaded,
    offload,
    offloaded,
    reload,
    storages,
)

FEATURE = Feature(
    name="offload",
    title="Parameter, gradient and optimizer-state offload API",
    switches=(),
    enabled=lambda args: False,
    upstream_pr="fork-only (library API)",
    status="stable",
)

__all__ = [
    "FEATURE",
    "OffloadError",
    "OffloadState",
    "is_offloaded",
    "offload",
    "offloaded",
    "reload",
    "storages",
]
