"""Compat patches: what running from the megatron-core wheel needs.

``compat.compile_helpers``: on rank 0, ``megatron.training.initialize`` calls
``megatron.core.datasets.utils.compile_helpers``, which runs ``make`` in the installed
``megatron/core/datasets`` folder. The megatron-core wheel ships the compiled extension
(``helpers_cpp``) but no Makefile, so upstream's call fails and exits the job. The replacement
uses the shipped extension when it imports, and otherwise builds ``helpers.cpp`` itself with the
C++ compiler and pybind11 into the same folder.

``compat.help_percent_signs``: argparse formats help strings with ``%``; one of megatron-core
0.19.2's help strings contains a bare ``%``, so ``--help`` fails. The replacement doubles such
signs after megatron adds its arguments.

``compat.checkpoint_exit_status``: megatron-core 0.19.2's checkpoint loader ends a failed load
(a tracker file it cannot parse, ``--exit-on-missing-checkpoint``, a checkpoint without its
iteration or RNG state) with a bare ``sys.exit()``, status 0, so a launcher or scheduler takes
the failure for a finished run. The replacement of the loader module's ``sys`` exits with status
1 and one line saying so; every other name is the real ``sys``.

All three are applied before the command line is parsed (``registry.apply(None)``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import subprocess
import sys
import sysconfig
import types

from megatron.patchset.core.registry import patch

logger = logging.getLogger(__name__)


def _helpers_importable() -> bool:
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def _build_command(folder: str) -> list[str]:
    """g++ command line that builds helpers.cpp into helpers_cpp<EXT_SUFFIX> in ``folder``."""
    import pybind11  # only needed when the wheel's extension is unusable

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return [
        os.environ.get("CXX", "g++"),
        "-O3",
        "-Wall",
        "-shared",
        "-std=c++11",
        "-fPIC",
        "-fdiagnostics-color",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{pybind11.get_include()}",
        os.path.join(folder, "helpers.cpp"),
        "-o",
        os.path.join(folder, f"helpers_cpp{suffix}"),
    ]


@patch(
    "compat.compile_helpers",
    "megatron.core.datasets.utils.compile_helpers",
    reason="the wheel ships the built dataset helpers but no Makefile, so upstream's `make` fails",
    upstream_pr="fork-only (wheel packaging)",
    kind="compat",
)
def _compile_helpers(_original):
    return compile_helpers


def compile_helpers() -> None:
    """Make sure the C++ dataset helpers are importable; build them only if they are not."""
    if _helpers_importable():
        logger.info("dataset helpers: using the compiled extension shipped with megatron-core")
        return
    folder = os.path.dirname(importlib.import_module("megatron.core.datasets").__file__)
    try:
        command = _build_command(folder)
    except ImportError:
        sys.exit(
            "megatron-patchset: megatron.core.datasets.helpers_cpp does not import and pybind11 "
            "is missing to build it: pip install pybind11"
        )
    print(f"> building dataset helpers: {' '.join(command)}", flush=True)
    if subprocess.run(command).returncode != 0 or not _helpers_importable():
        sys.exit("megatron-patchset: failed to build megatron/core/datasets/helpers.cpp")


_LONE_PERCENT = re.compile(r"%(%|\([^)]*\)[a-zA-Z])?")


def escape_help(text: str) -> str:
    """``text`` with every ``%`` that is not argparse's ``%%`` or ``%(name)s`` doubled."""
    return _LONE_PERCENT.sub(lambda m: m.group(0) if m.group(1) else "%%", text)


@patch(
    "compat.help_percent_signs",
    "megatron.training.arguments.add_megatron_arguments",
    reason="megatron-core 0.19.2's help of --moe-paged-stash-buffer-size-factor-cuda says '10%', "
    "which argparse reads as a format character: --help fails with ValueError",
    upstream_pr="fork-only (fixed on Megatron-LM main, not in 0.19.x)",
    kind="compat",
)
def _help_percent_signs(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser):
        parser = original(parser)
        for action in parser._actions:
            if isinstance(action.help, str):
                action.help = escape_help(action.help)
        return parser

    return add_megatron_arguments


CHECKPOINT_EXIT_MESSAGE = (
    "megatron-patchset: megatron-core stopped loading the checkpoint (its message is above); "
    "exit status 1"
)


class _NonZeroExit(types.ModuleType):
    """A stand-in for the ``sys`` module whose ``exit()`` without a status (or with 0) exits
    with status 1; every other attribute is the real module's."""

    def __init__(self, real):
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def exit(self, status=None):
        raise SystemExit(CHECKPOINT_EXIT_MESSAGE if status in (None, 0) else status)


@patch(
    "compat.checkpoint_exit_status",
    "megatron.training.checkpointing.sys",
    reason="megatron-core 0.19.2's checkpoint loader stops on a load error with sys.exit(), exit "
    "status 0, which a launcher or scheduler takes for success",
    upstream_pr="proposed",
    kind="compat",
)
def _checkpoint_exit_status(original):
    return _NonZeroExit(original)
