"""``export --series``: upstream changes as a patch series that ``git am -3`` applies in order.

The series is made by git itself. The checkout is cloned into a scratch folder; each change's
edits (:mod:`.edits`) are applied to the files there and committed with the author and date
given (or the user's git configuration), and ``git format-patch`` writes the commits. The patches
therefore carry full ``index`` lines (``git am -3`` falls back to a three-way merge with them), a
real author and date, and the change's commit message. A change whose edits the checkout already
holds is reported and skipped, so exporting onto a branch that has the first changes produces
the next ones; an edit that no longer fits refuses its change by name, and the changes after it.
A change that builds on an earlier one (:attr:`~.changes.UpstreamChange.needs`) is refused by the
name of that one unless it is applied before it in the same run or the checkout holds it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.export import changes as changes_mod
from megatron.patchset.export import edits

# git's own defaults that would make the patches differ between machines or git versions
_FORMAT_PATCH = ("format-patch", "--full-index", "--no-signature", "--zero-commit", "--no-stat")


@dataclasses.dataclass
class SeriesResult:
    patches: list[str]  # paths of the patch files, in order
    skipped: dict[str, str]  # change name -> why (already in the checkout)
    refused: dict[str, str]  # change name -> why (an edit does not fit)


def _git(folder: str, *args: str, env: dict | None = None) -> str:
    run = subprocess.run(
        ["git", "-C", folder, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C", **(env or {})},
    )
    if run.returncode:
        raise PatchsetError(f"git {' '.join(args[:2])} in {folder}: {run.stderr.strip()}")
    return run.stdout


def identity(checkout: str, author: str | None) -> tuple[str, str]:
    """(name, email) from ``author`` ("Name <email>") or the checkout's git configuration."""
    if author:
        name, _, rest = author.partition("<")
        if not rest.endswith(">") or not name.strip():
            raise PatchsetError(f"--author {author!r}: expected 'Name <email>'")
        return name.strip(), rest[:-1].strip()
    found = []
    for key in ("user.name", "user.email"):
        run = subprocess.run(["git", "-C", checkout, "config", key], capture_output=True, text=True)
        found.append(run.stdout.strip())
    if not all(found):
        raise PatchsetError(
            "no author: set git's user.name and user.email, or pass --author 'Name <email>'"
        )
    return found[0], found[1]


def check_checkout(checkout: str) -> None:
    if not os.path.isdir(os.path.join(checkout, "megatron")):
        raise PatchsetError(f"--megatron-lm {checkout}: no megatron/ folder there")
    run = subprocess.run(
        ["git", "-C", checkout, "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    if run.returncode or os.path.realpath(run.stdout.strip()) != os.path.realpath(checkout):
        raise PatchsetError(
            f"--megatron-lm {checkout}: --series needs the top of a Megatron-LM git checkout"
        )
    if _git(checkout, "status", "--porcelain", "--untracked-files=no").strip():
        raise PatchsetError(f"--megatron-lm {checkout}: commit or stash its changes first")


def _read(folder: str, path: str) -> str | None:
    full = os.path.join(folder, path)
    if not os.path.exists(full):
        return None
    with open(full) as handle:
        return handle.read()


def _holds(folder: str, name: str) -> bool:
    """Whether ``folder`` holds every edit of the series' change ``name``."""
    change = next((c for c in changes_mod.series() if c.name == name), None)
    if change is None:
        raise PatchsetError(f"a change needs {name}, which the series does not hold")
    sources = {path: _read(folder, path) for path in change.paths()}
    return all(edits.status(sources[edit.path], edit) == edits.APPLIED for edit in change.edits)


def _apply(folder: str, change: changes_mod.UpstreamChange) -> str | None:
    """Apply ``change`` in ``folder``: None, or why it was not applied (``applied``: all its
    edits are already there; otherwise the edit that does not fit)."""
    sources = {path: _read(folder, path) for path in change.paths()}
    states = []
    for edit in change.edits:
        state = edits.status(sources[edit.path], edit)
        if state == edits.DRIFTED:
            where = edit.definition or "the module's top level"
            if sources[edit.path] is None:
                return f"{edit.path}: not in this checkout"
            if isinstance(edit, edits.NewFile):
                return f"{edit.path}: a different file of that name exists"
            return f"{edit.path}: {where} changed upstream; the edit does not fit"
        states.append(state)
    if all(state == edits.APPLIED for state in states):
        return edits.APPLIED
    if edits.APPLIED in states:
        return "the checkout holds part of this change; revert it or apply the rest by hand"
    for edit in change.edits:
        sources[edit.path] = edits.apply_to_source(sources[edit.path], edit)
    for path, text in sources.items():
        os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
        with open(os.path.join(folder, path), "w") as handle:
            handle.write(text)
    return None


def write_series(
    checkout: str,
    out: str,
    selected: list[changes_mod.UpstreamChange],
    author: str | None = None,
    date: str | None = None,
) -> SeriesResult:
    """Write the patches of ``selected`` onto ``checkout``'s HEAD into ``out``."""
    check_checkout(checkout)
    name, email = identity(checkout, author)
    env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email}
    env |= {"GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email}
    if date:
        env |= {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    result = SeriesResult([], {}, {})
    scratch = tempfile.mkdtemp(prefix="series-")
    try:
        work = os.path.join(scratch, "tree")
        run = subprocess.run(
            ["git", "clone", "-q", "--shared", "--no-checkout", checkout, work],
            capture_output=True,
            text=True,
        )
        if run.returncode:
            raise PatchsetError(f"git clone of {checkout}: {run.stderr.strip()}")
        base = _git(checkout, "rev-parse", "HEAD").strip()
        _git(work, "checkout", "-q", "--detach", base)
        present: set[str] = set()  # changes applied in this run or found in the checkout
        for change in selected:
            if result.refused:
                result.refused[change.name] = "an earlier change of the series was refused"
                continue
            missing = [n for n in change.needs if n not in present and not _holds(work, n)]
            if missing:
                result.refused[change.name] = (
                    f"needs {', '.join(missing)} first (export it with this change, or apply its "
                    "patch to the checkout)"
                )
                continue
            try:
                why = _apply(work, change)
            except edits.EditError as exc:
                why = str(exc)
            if why == edits.APPLIED:
                result.skipped[change.name] = "already in the checkout"
                present.add(change.name)
                continue
            if why:
                result.refused[change.name] = why
                continue
            _git(work, "add", "--", *change.paths())
            _git(work, "commit", "-q", "--no-verify", "-m", change.message(), env=env)
            present.add(change.name)
        os.makedirs(out, exist_ok=True)
        if _git(work, "rev-parse", "HEAD").strip() != base:
            listing = _git(work, *_FORMAT_PATCH, "-o", os.path.abspath(out), f"{base}..HEAD")
            result.patches = [line for line in listing.splitlines() if line]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result
