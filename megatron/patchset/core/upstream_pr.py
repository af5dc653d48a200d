"""Where a feature or patch stands upstream: a structured ``upstream_pr``.

Three kinds, written as text in a feature's descriptor or a patch's declaration:

* ``PR <number>`` (optionally ``PR <number> (<note>)``): an NVIDIA/Megatron-LM pull request the
  change corresponds to; ``NVIDIA/Megatron-LM#<number>`` and ``#<number>`` are read the same;
* ``proposed`` (optionally with a note): meant for upstream, no pull request opened yet;
* ``fork-only (<reason>)``: stays in the fork; the reason is required.

``python -m megatron.patchset export`` exports features of the first two kinds only.
"""

from __future__ import annotations

import dataclasses
import re

from megatron.patchset.core.errors import PatchsetError

KINDS = ("pr", "proposed", "fork-only")
UPSTREAM_REPO = "NVIDIA/Megatron-LM"

_PR = re.compile(r"^(?:PR\s+|#|NVIDIA/Megatron-LM#)(\d+)(?:\s*\((.+)\))?$", re.DOTALL)
_PROPOSED = re.compile(r"^proposed(?:\s*\((.+)\))?$", re.DOTALL)
_FORK_ONLY = re.compile(r"^fork-only\s*\((.+)\)$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class UpstreamPR:
    """``kind`` is one of :data:`KINDS`; ``number`` is set for ``pr`` only; ``note`` is the
    reason of a ``fork-only`` change (required) or a remark on a PR or proposal."""

    kind: str
    number: int | None = None
    note: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise PatchsetError(f"upstream_pr kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == "pr") != (self.number is not None):
            raise PatchsetError("upstream_pr: a PR number goes with kind 'pr' only")
        if self.kind == "fork-only" and not self.note.strip():
            raise PatchsetError("upstream_pr: 'fork-only' needs a reason")

    @classmethod
    def parse(cls, value: UpstreamPR | str) -> UpstreamPR:
        """Read ``PR 1234 (note)``, ``proposed (note)`` or ``fork-only (reason)``."""
        if isinstance(value, UpstreamPR):
            return value
        text = " ".join(str(value).split())
        match = _PR.match(text)
        if match:
            return cls("pr", int(match.group(1)), match.group(2) or "")
        match = _PROPOSED.match(text)
        if match:
            return cls("proposed", None, match.group(1) or "")
        match = _FORK_ONLY.match(text)
        if match:
            return cls("fork-only", None, match.group(1))
        raise PatchsetError(
            f"upstream_pr {value!r} is not 'PR <number> (note)', 'proposed (note)' or "
            "'fork-only (reason)'"
        )

    @property
    def exportable(self) -> bool:
        """Whether the change is meant for upstream (a PR or a proposal)."""
        return self.kind != "fork-only"

    @property
    def reference(self) -> str:
        """``NVIDIA/Megatron-LM#1234``, ``proposed`` or ``fork-only``."""
        return f"{UPSTREAM_REPO}#{self.number}" if self.kind == "pr" else self.kind

    def __str__(self) -> str:
        head = f"PR {self.number}" if self.kind == "pr" else self.kind
        return f"{head} ({self.note})" if self.note else head
