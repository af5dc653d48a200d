"""megatron-patchset: fast Mixture-of-Experts training patches over megatron-core 0.19.2.

This package is a namespace-package portion (``megatron.patchset``) installed next to the
pinned ``megatron-core`` wheel, which provides ``megatron.core`` and ``megatron.training``.
Every change to upstream behaviour is a registered patch (:mod:`megatron.patchset.core.registry`)
that belongs to a feature (:mod:`megatron.patchset.features`, one folder each);
``python -m megatron.patchset --list`` prints them.
"""

__version__ = "0.1.0"

from megatron.patchset.core.registry import apply, revert  # noqa: E402
from megatron.patchset.core.versions import SUPPORTED_MCORE_VERSION, SUPPORTED_TE_RANGE  # noqa: E402

__all__ = ["__version__", "SUPPORTED_MCORE_VERSION", "SUPPORTED_TE_RANGE", "apply", "revert"]
