"""Flag files: the configs under ``examples/configs/*.args``.

A flag file holds megatron command-line flags, any number per line, with ``#`` comments. The
launchers read it with ``read_config`` (``examples/lib/launch.sh``); Python
(``tools/bench/bench.py``, tests) with :func:`read`. Values must not contain spaces.
"""

from __future__ import annotations

import os
import shlex


def read(path: str) -> list[str]:
    """The flags of a flag file, in order, as an argv list."""
    argv: list[str] = []
    with open(path) as handle:
        for line in handle:
            argv.extend(shlex.split(line, comments=True))
    return argv


def override(argv: list[str], flag: str, *values: str) -> list[str]:
    """``argv`` with ``flag`` set to ``values`` (replacing an earlier value, or appended).

    With no values the flag is a switch; ``remove`` drops a flag and its values instead.
    """
    out = remove(argv, flag)
    return out + [flag, *values]


def remove(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and the values that follow it."""
    out: list[str] = []
    skipping = False
    for item in argv:
        if item == flag:
            skipping = True
            continue
        if skipping and not item.startswith("--"):
            continue
        skipping = False
        out.append(item)
    return out


def existing_file(path: str) -> str:
    """argparse ``type`` for a flag file: it must be a readable file (a clear error otherwise)."""
    import argparse

    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory, not a flag file")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path}: no such file")
    try:
        read(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{path} cannot be read as a flag file: {exc}") from exc
    return path


def at_least(least: int):
    """argparse ``type``: an integer of at least ``least``."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse
