"""The recorded fingerprints of the upstream symbols the patches target (``digests.json``).

The export refuses a feature whose target's definition in the given checkout differs from the
one its patch was written against. Only sha256 digests are stored, never upstream's text;
:func:`record` recomputes them from a source tree (``python -m megatron.patchset export
--record-digests --megatron-lm PATH`` after a patch was updated for a new upstream version).
"""

from __future__ import annotations

import json

from megatron.patchset.core import registry
from megatron.patchset.core.versions import SUPPORTED_MCORE_VERSION
from megatron.patchset.export import plan
from megatron.patchset.export.source import SourceTree, digest, find_symbol


def compute(tree: SourceTree) -> dict[str, str]:
    """``{target: digest}`` of every feature patch's target in ``tree``."""
    targets = sorted({p.target for p in registry.registered() if p.kind == "feature"})
    return {target: digest(find_symbol(tree, target)) for target in targets}


def record(tree: SourceTree) -> dict[str, str]:
    """Rewrite ``digests.json`` from ``tree``; returns the digests."""
    digests = compute(tree)
    with open(plan.DIGESTS, "w", encoding="utf-8") as handle:
        json.dump({"megatron_core": SUPPORTED_MCORE_VERSION, "targets": digests}, handle, indent=1)
        handle.write("\n")
    return digests
