"""What a launch checks before megatron's own set-up, shared by ``pretrain_gpt.py`` and
``--dry-run``: the launcher's environment variables, megatron's argument validation with its
failures turned into one line that names the flags, and the GPU.

Every failure is a :class:`PreflightError` (or the rule engine's ``PatchsetArgumentError``): one
message, no traceback, a non-zero exit.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import traceback
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.errors import PatchsetError

# (variable, least value) that torchrun, Slurm launchers and megatron read as integers.
INTEGER_ENV = (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1))


class PreflightError(PatchsetError):
    """The launch cannot start; the message says why and how to fix it."""


def environment_problems(environ: dict | None = None) -> list[str]:
    """Launcher variables that megatron reads with int() and that would fail there."""
    environ = os.environ if environ is None else environ
    problems = []
    for name, least in INTEGER_ENV:
        value = environ.get(name)
        if value is None:
            continue
        try:
            number = int(value)
        except ValueError:
            problems.append(f"{name}={value!r} is not an integer")
            continue
        if number < least:
            problems.append(f"{name}={number} must be {least} or more")
    return problems


def check_environment(environ: dict | None = None) -> None:
    """The launcher's variables (:func:`environment_problems`) and ``MEGATRON_PATCHSET``."""
    problems = environment_problems(environ)
    if problems:
        raise PreflightError(
            "megatron-patchset: launcher environment: "
            + "; ".join(problems)
            + " (torchrun and srun set these; unset or correct them)."
        )
    from megatron.patchset.core import registry

    registry.upstream_mode(environ)  # raises for a value it does not know


def _as_flags(text: str) -> str:
    """``args.hidden_size`` in megatron's source -> ``--hidden-size``."""
    return re.sub(r"\bargs\.([a-z][a-z0-9_]*)", lambda m: "--" + m.group(1).replace("_", "-"), text)


@functools.cache
def _flag_of_dest() -> dict[str, str]:
    """megatron's (and the fork's) argument names -> their flags, e.g. ``hidden_size`` ->
    ``--hidden-size``."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron.patchset.core.flags import add_patchset_args

    parser = add_patchset_args(add_megatron_arguments(argparse.ArgumentParser(add_help=False)))
    return {
        action.dest: max(action.option_strings, key=len)
        for action in parser._actions
        if action.option_strings and "_" in action.dest
    }


def _name_flags(message: str) -> str:
    """megatron's messages name config fields (``overlap_moe_expert_parallel_comm``): add the
    flag each comes from."""
    flags = _flag_of_dest()
    seen: set[str] = set()

    def add(match):
        word = match.group(0)
        flag = flags.get(word)
        if flag is None or word in seen:
            return word
        seen.add(word)
        return f"{word} ({flag})"

    return re.sub(r"(?<![-\w])[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", add, message)


def _megatron_frame(exc: BaseException) -> tuple[str, int, str, str] | None:
    """(file relative to its package root, line, source line, the statement with the three lines
    before it) of the innermost megatron frame."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/" in f.filename]
    if not frames:
        return None
    frame = frames[-1]
    source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    last = frame.end_lineno or frame.lineno
    context = "".join(
        linecache.getline(frame.filename, n) for n in range(max(1, frame.lineno - 3), last + 1)
    )
    short = "megatron/" + frame.filename.rsplit("/megatron/", 1)[1]
    return short, frame.lineno, source, context


def describe_megatron_failure(exc: BaseException) -> str:
    """One line for an exception raised by megatron's argument validation or config: its own
    message, or, for a bare ``assert``, the failing condition with megatron's ``args.x`` shown as
    the flag ``--x``."""
    message = str(exc).strip()
    where = _megatron_frame(exc)
    if message and not isinstance(exc, (ZeroDivisionError, TypeError, KeyError, IndexError)):
        named = _name_flags(message)
        if "--" not in named and where is not None:
            flags = _flag_of_dest()
            checked = sorted(
                {
                    flags.get(d, "--" + d.replace("_", "-"))
                    for d in re.findall(r"\bargs\.([a-z][a-z0-9_]*)", where[3])
                }
            )
            if checked:
                named += f" (megatron checks {', '.join(checked)} at {where[0]}:{where[1]})"
        return f"megatron-core refused the flags: {named}"
    if where is None:
        return f"megatron-core refused the flags: {type(exc).__name__}: {message or '(no message)'}"
    path, line, source, _ = where
    detail = f" ({type(exc).__name__}: {message})" if message else ""
    return (
        f"megatron-core refused the flags at {path}:{line}: `{_as_flags(source)}`{detail}. "
        "Check the flags named there."
    )


def megatron_validated(validate: Callable[[], Any]) -> Any:
    """Run megatron's argument validation (or config construction); a failure becomes a
    :class:`PreflightError` with :func:`describe_megatron_failure`'s message."""
    try:
        return validate()
    except (
        AssertionError,
        ValueError,
        RuntimeError,
        NotImplementedError,
        ZeroDivisionError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
    ) as exc:
        raise PreflightError(describe_megatron_failure(exc)) from exc


def require_gpu() -> None:
    """Training needs a CUDA GPU; say so before megatron asks the driver."""
    import torch

    if not torch.cuda.is_available():
        raise PreflightError(
            "megatron-patchset: training needs an NVIDIA GPU and none is visible (CUDA_VISIBLE_"
            "DEVICES, the driver). Run with --dry-run to check the flags on this machine."
        )
