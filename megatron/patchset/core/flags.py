"""The fork's command-line flags, added to megatron's own parser.

:func:`add_patchset_args` is the ``extra_args_provider`` for megatron's ``parse_args``: one
argument group, ``megatron-patchset``, with the dry-run flags and every feature's flags (each
feature adds its own, in megatron's style: kebab-case, help text, defaults shown).
"""

from __future__ import annotations

import argparse

from megatron.patchset.core import features

GROUP_TITLE = "megatron-patchset"


def add_patchset_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for megatron's ``parse_args``: the fork's own flags."""
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
    for feature in features.load():
        if feature.add_arguments is not None:
            feature.add_arguments(group)
    return parser
