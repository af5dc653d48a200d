"""Features that the running megatron already contains, as edited in by
``python -m megatron.patchset export``.

An exported tree carries each feature's flags in ``megatron/training/arguments.py``, its rules in
``validate_args`` and its patches in the modules they target, each region between marker comments
(:data:`BEGIN`). When such a tree comes first on ``PYTHONPATH``, the overlay leaves those features
to it: their flags are not added a second time, their rules, config hooks and patches are not run
twice. The overlay reads the markers from the source of ``megatron.training.arguments`` without
importing it.
"""

from __future__ import annotations

import functools
import importlib.util
import re

BEGIN = "# >>> megatron-patchset export: "
END = "# <<< megatron-patchset export: "
_MARKER = re.compile(r"^[ \t]*" + re.escape(BEGIN) + r"([A-Za-z0-9_]+)\b", re.MULTILINE)


def features_in(text: str) -> frozenset[str]:
    """The feature names of the export markers in a module's source text."""
    return frozenset(_MARKER.findall(text))


@functools.cache
def provided_features() -> frozenset[str]:
    """The features exported into the importable ``megatron.training.arguments``."""
    try:
        spec = importlib.util.find_spec("megatron.training.arguments")
    except (ImportError, ValueError):
        return frozenset()
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return frozenset()
    try:
        with open(spec.origin, encoding="utf-8") as handle:
            return features_in(handle.read())
    except OSError:
        return frozenset()


def provided(feature: str | None) -> bool:
    """Whether the running megatron contains ``feature`` (None: a core patch or rule, never)."""
    return feature is not None and feature in provided_features()
