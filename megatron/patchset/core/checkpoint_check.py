"""The checkpoint a launch loads (``--load``), checked before megatron reads it.

megatron-core 0.19.2 starts from random weights when ``--load`` names a missing directory, exits
with status 0 on a tracker file it cannot parse, and reports a truncated shard or metadata file
as a traceback that names no file. :func:`check` runs in ``--dry-run`` and at the start of every
launch with ``--load``, before megatron's argument validation, and finds what megatron would load:

* ``--load`` exists and holds a checkpoint, unless a fresh start is intended
  (``--load-allow-missing``, or ``--load`` is also ``--save``: the run resumes where it saves,
  and the first launch has nothing to resume);
* ``latest_checkpointed_iteration.txt`` holds an iteration number or ``release``, and that
  iteration's directory (or ``--ckpt-step``'s) exists;
* its files: for ``torch_dist`` (megatron's ``metadata.json``), ``torch_dcp`` and
  ``fsdp_dtensor``, the ``.metadata`` file reads with torch.distributed.checkpoint's
  ``FileSystemReader``, and every file its storage table names is there with at least the bytes
  the table places in it; for the legacy ``torch`` format, each ``mp_rank_*/*.pt`` file's zip
  directory reads.

Only metadata and file sizes are read, never a shard's contents; the ``.metadata`` file is read on
global rank 0 (and in the dry-run), the tracker and directories on every rank. A problem is one
:class:`~megatron.patchset.core.preflight.PreflightError` naming the file and the last complete
iteration in ``--load`` to load instead.
"""

from __future__ import annotations

import json
import os
import re
import zipfile

from megatron.patchset.core.preflight import PreflightError

TRACKER = "latest_checkpointed_iteration.txt"
ALLOW_MISSING_FLAG = "--load-allow-missing"
REMOTE_PREFIXES = ("msc://", "s3://", "gs://", "az://", "http://", "https://")
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")


def _refused(message: str) -> PreflightError:
    return PreflightError(f"megatron-patchset: {message}")


def iteration_dir(load: str, iteration: int | None) -> str:
    """megatron's directory of ``iteration`` in ``load`` (None: the ``release`` checkpoint)."""
    return os.path.join(load, "release" if iteration is None else f"iter_{iteration:07d}")


def saved_iterations(load: str) -> list[int]:
    """The iterations with an ``iter_*`` directory in ``load``, newest first."""
    try:
        names = os.listdir(load)
    except OSError:
        return []
    found = [int(m.group(1)) for m in map(_ITERATION_DIR.match, names) if m]
    return sorted((i for i in found if os.path.isdir(iteration_dir(load, i))), reverse=True)


def _shard_needs(path: str) -> dict[str, int]:
    """{file: least size in bytes} of the shard files named by the ``.metadata`` in ``path``;
    raises what torch's reader raises for an unreadable file."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not storage:
        raise ValueError("it names no shard files")
    needs: dict[str, int] = {}
    for info in storage.values():
        end = int(info.offset) + int(info.length)
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), end)
    return needs


def _zip_problem(path: str) -> str | None:
    """Why the torch.save file ``path`` is not whole (its zip directory does not read), or None."""
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError) as exc:
        return f"{path} is truncated or not a torch.save file ({exc})"


def _dcp_problem(path: str) -> str | None:
    metadata = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata):
        return f"{metadata} is missing (the save did not finish)"
    try:
        needs = _shard_needs(path)
    except Exception as exc:  # noqa: BLE001 - any reader failure means the file is not whole
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return f"{metadata} does not read ({detail}): truncated or corrupt"
    for name, least in sorted(needs.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            return f"{shard} is missing ({metadata} names it)"
        size = os.path.getsize(shard)
        if size < least:
            return (
                f"{shard} is {size:,} bytes, but {metadata} places {least:,} bytes in it "
                "(truncated)"
            )
    return None


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint directory ``path`` (an ``iter_*`` or ``release`` directory) cannot be
    loaded, or None. Reads metadata and file sizes only."""
    if not os.path.isdir(path):
        return f"{path} does not exist"
    names = set(os.listdir(path))
    if "metadata.json" in names:  # megatron's torch_dist
        config = os.path.join(path, "metadata.json")
        try:
            with open(config) as handle:
                backend = json.load(handle).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as exc:
            return f"{config} does not read as megatron's checkpoint metadata ({exc})"
        if not backend:
            return f"{config} names no sharded_backend"
        if "common.pt" in names:
            problem = _zip_problem(os.path.join(path, "common.pt"))
            if problem:
                return problem
        return _dcp_problem(path)
    legacy = sorted(n for n in names if n.startswith("mp_rank_"))
    if legacy:
        files = [
            os.path.join(path, folder, name)
            for folder in legacy
            if os.path.isdir(os.path.join(path, folder))
            for name in sorted(os.listdir(os.path.join(path, folder)))
            if name.endswith(".pt")
        ]
        if not files:
            return f"{os.path.join(path, legacy[0])} holds no .pt file"
        for file in files:
            problem = _zip_problem(file)
            if problem:
                return problem
        return None
    if ".metadata" in names:  # torch_dcp, fsdp_dtensor
        return _dcp_problem(path)
    return (
        f"{path} holds no checkpoint (no metadata.json, .metadata or mp_rank_* files; the save "
        "did not finish)"
    )


def last_complete(load: str, below: int | None = None) -> int | None:
    """The newest iteration in ``load`` (below ``below``, when given) whose checkpoint is
    complete, or None."""
    for iteration in saved_iterations(load):
        if below is not None and iteration >= below:
            continue
        if checkpoint_problem(iteration_dir(load, iteration)) is None:
            return iteration
    return None


def _instead(load: str, below: int | None = None) -> str:
    """What to load instead: the last complete iteration, or that there is none."""
    good = last_complete(load, below)
    if good is None:
        return f"no other iteration in {load} is complete"
    return (
        f"the last complete checkpoint is iteration {good}: pass --ckpt-step {good}, or write "
        f"{good} into {os.path.join(load, TRACKER)}"
    )


def _read_tracker(load: str) -> tuple[int | None, str | None]:
    """(iteration, None) from the tracker file (None: ``release``), or (None, problem)."""
    tracker = os.path.join(load, TRACKER)
    try:
        with open(tracker) as handle:
            text = handle.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{tracker} does not read ({exc})"
    if text == "release":
        return None, None
    if re.fullmatch(r"\d+", text):
        return int(text), None
    shown = text if len(text) <= 40 else text[:40] + "..."
    return None, f"{tracker} holds {shown!r}, not an iteration number or 'release'"


def _same_dir(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _shown(iteration: int | None) -> str:
    return "release" if iteration is None else f"iteration {iteration}"


def check(args, *, read_metadata: bool | None = None) -> str | None:
    """Check what ``--load`` would load; returns one line saying what (None without ``--load``),
    raises :class:`PreflightError` with one line (``megatron-patchset: --load ...``) naming the
    file when megatron would fail or start from random weights unasked.

    ``read_metadata``: read the ``.metadata`` files and shard sizes (default: on global rank 0).
    """
    load = getattr(args, "load", None)
    if not load:
        return None
    if read_metadata is None:
        read_metadata = os.environ.get("RANK", "0") in ("", "0")
    return _check_dir("--load", load, args, read_metadata)


def _check_dir(flag: str, load: str, args, read_metadata: bool) -> str:
    if load.startswith(REMOTE_PREFIXES):
        return f"{flag} {load}: object storage, not checked here"
    load = os.path.expanduser(load)
    if os.path.exists(load) and not os.path.isdir(load):
        raise _refused(f"{flag} {load} is a file, not a checkpoint directory.")
    step = getattr(args, "ckpt_step", None) or None
    tracker = os.path.join(load, TRACKER)
    if step is None and not os.path.isfile(tracker):
        return _no_tracker(flag, load, args, read_metadata)
    if step is not None:
        iteration = step
    else:
        iteration, problem = _read_tracker(load)
        if problem:
            raise _refused(f"{flag} {load}: {problem}; {_instead(load)}.")
    path = iteration_dir(load, iteration)
    which = f"--ckpt-step {step}" if step is not None else f"{tracker} names {_shown(iteration)}"
    if not os.path.isdir(path):
        raise _refused(f"{flag} {load}: {which}, but {path} does not exist; {_instead(load)}.")
    if not read_metadata:
        return f"{flag} {load}: {_shown(iteration)} ({path})"
    problem = checkpoint_problem(path)
    if problem:
        raise _refused(
            f"{flag} {load}: {_shown(iteration)} cannot be loaded: {problem}; "
            f"{_instead(load, iteration)}."
        )
    newer = [i for i in saved_iterations(load) if iteration is not None and i > iteration]
    ignored = (
        f"; megatron does not load the newer {iteration_dir(load, newer[0])} ({TRACKER} names "
        f"{iteration}: a save that did not finish leaves its folder there)"
        if newer and step is None
        else ""
    )
    return f"{flag} {load}: {_shown(iteration)}, files complete ({path}){ignored}"


def _no_tracker(flag: str, load: str, args, read_metadata: bool) -> str:
    """A checkpoint folder without a tracker file: a fresh start, if intended; refused
    otherwise."""
    what = "does not exist" if not os.path.exists(load) else f"holds no {TRACKER}"
    good = last_complete(load) if read_metadata else None
    if good is not None:
        raise _refused(
            f"{flag} {load} {what}, so megatron would start from random weights, but "
            f"{iteration_dir(load, good)} is a complete checkpoint: pass --ckpt-step {good}, or "
            f"write {good} into {os.path.join(load, TRACKER)}."
        )
    if getattr(args, "exit_on_missing_checkpoint", False):
        raise _refused(
            f"{flag} {load} {what} and --exit-on-missing-checkpoint is set: there is no "
            "checkpoint to load."
        )
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if flag == "--load" and pretrained:
        found = _check_dir("--pretrained-checkpoint", pretrained, args, read_metadata)
        return f"{flag} {load} {what}: megatron loads {found}"
    if getattr(args, "non_persistent_ckpt_type", None):
        return f"{flag} {load} {what}: only a non-persistent checkpoint can be loaded (not checked)"
    fresh = bool(getattr(args, "load_allow_missing", False)) or _same_dir(
        load, getattr(args, "save", None)
    )
    if flag != "--load" or not fresh:
        raise _refused(
            f"{flag} {load} {what}: there is no checkpoint to load. Check the path"
            + (
                f"; to start from random weights on purpose, pass {ALLOW_MISSING_FLAG}."
                if flag == "--load"
                else "."
            )
        )
    return f"{flag} {load} {what}: no checkpoint yet, the run starts from random weights"
