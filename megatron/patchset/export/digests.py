"""The recorded fingerprints of the upstream symbols the patches target (:mod:`.recorded`).

The export refuses a feature whose target's definition in the given checkout differs from the
one its patch was written against. Only sha256 digests are stored, never upstream's text;
:func:`record` recomputes them from a source tree (``python -m megatron.patchset export
--record-digests --megatron-lm PATH`` after a patch was updated for a new upstream version).
"""

from __future__ import annotations

import os

from megatron.patchset.core import registry
from megatron.patchset.core.versions import SUPPORTED_MCORE_VERSION
from megatron.patchset.export.source import SourceTree, digest, find_symbol


def compute(tree: SourceTree) -> dict[str, str]:
    """``{target: digest}`` of every feature patch's target in ``tree``."""
    targets = sorted({p.target for p in registry.registered() if p.kind == "feature"})
    return {target: digest(find_symbol(tree, target)) for target in targets}


RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded.py")


def record(tree: SourceTree) -> dict[str, str]:
    """Rewrite :mod:`.recorded` from ``tree``; returns the digests."""
    digests = compute(tree)
    lines = [
        "# ruff: noqa: E501",
        '"""sha256 digests of the upstream symbols the feature patches target (written by',
        '``python -m megatron.patchset export --record-digests``; never edit by hand)."""',
        "",
        f'MEGATRON_CORE = "{SUPPORTED_MCORE_VERSION}"',
        "TARGETS = {",
        *(f'    "{target}": "{value}",' for target, value in digests.items()),
        "}",
    ]
    with open(RECORDED, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    return digests
