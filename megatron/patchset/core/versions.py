"""The version guard: the megatron-core and TransformerEngine releases the patches are written for.

Nothing is applied against a megatron-core other than :data:`SUPPORTED_MCORE_VERSION`, or a
TransformerEngine outside :data:`SUPPORTED_TE_RANGE` (when TE is installed at all); the error names
the installed and the expected version, and for megatron-core the folder it was imported from (a
Megatron-LM checkout on ``PYTHONPATH`` shadows the installed package).
"""

from __future__ import annotations

from megatron.patchset.core.errors import PatchsetVersionError

SUPPORTED_MCORE_VERSION = "0.19.2"
# TransformerEngine versions the patches were written and tested against: [low, high).
SUPPORTED_TE_RANGE = ("2.20.2", "2.21.0")


def version_tuple(text: str) -> tuple[int, ...]:
    """``"2.20.2+cu13"`` -> ``(2, 20, 2)``; stops at a pre-release marker (``0rc1`` -> ``(0,)``)."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def installed_mcore_version() -> str:
    """megatron-core's release version. (``package_info.__version__`` gets ``+<git hash>``
    appended when the installed package sits inside any git work tree, e.g. a .venv in a
    checkout, so the release is read from ``VERSION`` instead.)"""
    from megatron.core import package_info

    major, minor, patch, pre = package_info.VERSION[:4]
    return f"{major}.{minor}.{patch}{pre}"


def installed_te_version() -> str | None:
    """TransformerEngine's version, or None when it is not installed."""
    from importlib import metadata

    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def mcore_folder() -> str:
    """The folder ``megatron.core`` is imported from."""
    import os

    import megatron.core

    return os.path.dirname(os.path.abspath(megatron.core.__file__))


def check_versions(mcore_version: str | None = None, te_version: str | None = "__detect__") -> None:
    """Refuse to patch an upstream the patches were not written for."""
    mcore = installed_mcore_version() if mcore_version is None else mcore_version
    if mcore != SUPPORTED_MCORE_VERSION:
        where = f" (megatron.core from {mcore_folder()})" if mcore_version is None else ""
        raise PatchsetVersionError(
            f"megatron-patchset targets megatron-core=={SUPPORTED_MCORE_VERSION}, but "
            f"megatron-core {mcore} is installed{where}. Install the pinned version (pip install "
            f"megatron-core=={SUPPORTED_MCORE_VERSION}); patches are not applied to other versions "
            "because the upstream symbols they replace may have changed."
        )
    te = installed_te_version() if te_version == "__detect__" else te_version
    if te is not None:
        low, high = SUPPORTED_TE_RANGE
        if not (version_tuple(low) <= version_tuple(te) < version_tuple(high)):
            raise PatchsetVersionError(
                f"megatron-patchset is tested with transformer-engine >={low},<{high}, but "
                f"transformer-engine {te} is installed (megatron-core {mcore}). Install "
                f"transformer-engine[pytorch]=={low}."
            )
