"""One ``git format-patch``-style file per exported feature, ready for ``git am``.

The commit message follows Megatron-LM's pull-request form: a subject, "What does this PR do ?",
the changelog (what each edited file gains) and the upstream PR the change corresponds to.
"""

from __future__ import annotations

import difflib

from megatron.patchset import __version__
from megatron.patchset.core.features import Feature

AUTHOR = "megatron-patchset <megatron-patchset@users.noreply.github.com>"
# A fixed date keeps a second export byte-identical to the first.
DATE = "Thu, 1 Jan 1970 00:00:00 +0000"


def unified_diff(relative: str, before: str, after: str) -> str:
    """A ``diff --git`` section for one file (empty when nothing changed)."""
    if before == after:
        return ""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"a/{relative}",
        tofile=f"b/{relative}",
    )
    body = "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )
    return f"diff --git a/{relative} b/{relative}\n{body}"


def _stat(changes: dict[str, tuple[str, str]]) -> str:
    rows, added, removed = [], 0, 0
    for relative, (before, after) in sorted(changes.items()):
        matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(), False)
        plus = minus = 0
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag in ("replace", "delete"):
                minus += i2 - i1
            if tag in ("replace", "insert"):
                plus += j2 - j1
        added, removed = added + plus, removed + minus
        rows.append(f" {relative} | {plus + minus} {'+' * min(plus, 40)}{'-' * min(minus, 40)}")
    rows.append(
        f" {len(changes)} file{'s' if len(changes) != 1 else ''} changed, {added} insertions(+), "
        f"{removed} deletions(-)"
    )
    return "\n".join(rows)


def message(feature: Feature, changes: dict[str, tuple[str, str]], source_version: str) -> str:
    pr = feature.upstream_pr
    if pr.kind == "pr":
        reference = f"Corresponds to {pr.reference}" + (f" ({pr.note})." if pr.note else ".")
    else:
        reference = "Proposed upstream; no pull request opened yet" + (
            f" ({pr.note})." if pr.note else "."
        )
    flags = ", ".join(feature.switches) or "its library API"
    changelog = "\n".join(f"- `{relative}`" for relative in sorted(changes))
    return (
        f"Subject: [PATCH] {feature.title}\n\n"
        "# What does this PR do ?\n\n"
        f"{feature.title}, switched on by {flags}.\n\n"
        f"{reference}\n\n"
        "## Changelog\n\n"
        f"{changelog}\n\n"
        f"Exported by megatron-patchset {__version__} from its feature {feature.name!r} onto "
        f"megatron-core {source_version}.\n"
    )


def format_patch(feature: Feature, changes: dict[str, tuple[str, str]], source_version: str) -> str:
    """The whole ``.patch`` file; ``changes`` is ``{file: (before, after)}``."""
    diffs = "".join(unified_diff(r, b, a) for r, (b, a) in sorted(changes.items()))
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        f"From: {AUTHOR}\n"
        f"Date: {DATE}\n"
        f"{message(feature, changes, source_version)}"
        "---\n"
        f"{_stat(changes)}\n\n"
        f"{diffs}"
        "-- \n"
        f"megatron-patchset {__version__}\n"
    )
