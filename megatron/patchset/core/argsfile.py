"""Flag files: the configs under ``examples/configs/*.args``.

A flag file holds megatron command-line flags, any number per line, with ``#`` comments. Bash
launchers read it with ``$(grep -v '^ *#' FILE)``; Python (``tools/bench.py``, tests) with
:func:`read`. Values must not contain spaces.
"""

from __future__ import annotations

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
