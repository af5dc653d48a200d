"""The fork's command-line flags, added to megatron's own parser.

:func:`add_patchset_args` is the ``extra_args_provider`` for megatron's ``parse_args``: one
argument group, ``megatron-patchset``, with the dry-run flags, ``--load-allow-missing`` and every
feature's flags (each feature adds its own, in megatron's style: kebab-case, help text, defaults
shown).
"""

from __future__ import annotations

import argparse
import difflib
import math
import re

from megatron.patchset.core import features
from megatron.patchset.core.provided import provided

GROUP_TITLE = "megatron-patchset"


def suggestions(parser: argparse.ArgumentParser, message: str) -> str:
    """ " (did you mean ...?)" for the unrecognized flags of an argparse error message."""
    options = [o for action in parser._actions for o in action.option_strings]
    hints = []
    for flag in re.findall(r"(--[A-Za-z0-9_-]+)", message.partition("unrecognized arguments:")[2]):
        close = difflib.get_close_matches(flag.replace("_", "-"), options, n=2, cutoff=0.6)
        if close:
            hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    return (" (" + "; ".join(hints) + ")") if hints else ""


def short_error(parser: argparse.ArgumentParser, message: str) -> None:
    """argparse's error without the usage text (megatron's runs to hundreds of lines): the error,
    the closest flags for an unknown one, where to find the rest; exit code 2 as argparse's."""
    parser.exit(
        2,
        f"{parser.prog}: error: {message}{suggestions(parser, message)}\n"
        f"{parser.prog} --help lists every flag.\n",
    )


def finite_float(text: str) -> float:
    """argparse type of the fork's flags that take a number: a float, not nan or inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def add_patchset_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for megatron's ``parse_args``: the fork's own flags, and errors
    that fit on a screen."""
    parser.error = lambda message: short_error(parser, message)
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Validate the flag combination for the given world size without a GPU: run "
        "megatron's argument validation, build the model's TransformerConfig, run the fork's "
        "rules, print the parallel layout, fork features, patches, parameter count and "
        "theoretical memory, then exit (0 when the combination is valid).",
    )
    group.add_argument(
        "--dry-run-world-size",
        type=int,
        default=None,
        help="World size (number of GPUs) that --dry-run validates for. "
        "Default: the WORLD_SIZE environment variable, else 1.",
    )
    group.add_argument(
        "--load-allow-missing",
        action="store_true",
        help="With --load, start from random weights when --load holds no checkpoint (megatron's "
        "behaviour). Without it the launch refuses a --load directory that does not exist or "
        "holds no latest_checkpointed_iteration.txt, unless --load is also --save.",
    )
    for feature in features.load():
        # An exported megatron (python -m megatron.patchset export) already has them.
        if feature.add_arguments is not None and not provided(feature.name):
            feature.add_arguments(group)
    for action in group._group_actions:
        if action.type is float:  # float() reads nan and inf
            action.type = finite_float
    return parser
