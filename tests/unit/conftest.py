"""Shared helpers for the CPU tests: megatron's real parser, the example configs and launchers."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "configs", "tiny_moe.args")
REFERENCE = os.path.join(ROOT, "examples", "configs", "reference_moe.args")


def parse(argv, world_size=1):
    """megatron's parse_args with the fork's flags, as pretrain_gpt.py parses them."""
    from megatron.patchset.arguments import add_patchset_args
    from megatron.training.arguments import parse_args

    saved_argv, saved_ws = sys.argv, os.environ.get("WORLD_SIZE")
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        return parse_args(add_patchset_args)
    finally:
        sys.argv = saved_argv
        if saved_ws is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved_ws


def tiny_argv(*extra):
    from megatron.patchset import argsfile

    return argsfile.read(TINY) + list(extra)


@pytest.fixture
def tiny():
    return tiny_argv


def validated(argv, world_size=1):
    """Parsed and validated by megatron's validate_args (derived values filled in), checked as
    on the target GPU machine (the dry-run's emulation), with megatron's printout silenced."""
    import contextlib
    import io

    from megatron.patchset.dry_run import target_device
    from megatron.training.arguments import validate_args

    args = parse(argv, world_size)
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
    return args


def run_example(path, env=None, *, drop=()):
    """Run an example launcher (``bash <path>`` from the repository root) with this interpreter
    as its PYTHON. The calling shell's Slurm and torchrun variables (``SLURM_*``, ``WORLD_SIZE``)
    and the names in ``drop`` are left out of its environment; ``env`` is added."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM_") and k != "WORLD_SIZE" and k not in drop}
    environ["PYTHON"] = sys.executable
    environ.update(env or {})
    return subprocess.run(["bash", os.path.join(ROOT, path)], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=300)


def dry_run_example(path, *, drop=(), **knobs):
    """``run_example`` in the launcher's ``DRY_RUN=1`` mode, with knobs as environment variables."""
    return run_example(path, {"DRY_RUN": "1", **knobs}, drop=drop)
