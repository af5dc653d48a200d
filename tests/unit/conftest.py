"""Shared helpers for the CPU tests: megatron's real parser, the example configs and launchers."""

import os
import subprocess
import sys

import pytest

from megatron.patchset.core import argsfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "configs", "tiny_moe.args")
REFERENCE = os.path.join(ROOT, "examples", "configs", "reference_moe.args")


def parse(argv, world_size=1):
    """megatron's parse_args with the fork's flags, as pretrain_gpt.py parses them."""
    from megatron.training.arguments import parse_args

    from megatron.patchset.core.flags import add_patchset_args

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


def triton_interpreter(monkeypatch, kernel_cache):
    """Body of a fixture that runs a feature's Triton kernels under Triton's interpreter on the
    CPU: ``TRITON_INTERPRET=1`` and ``kernel_cache`` (the feature's cached kernel builder) cleared
    before and after, so the kernels are made in the mode the test runs in."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel_cache.cache_clear()
    yield
    kernel_cache.cache_clear()


def tiny_argv(*extra):

    return argsfile.read(TINY) + list(extra)


def pytest_collection_modifyitems(config, items):
    """The tests marked ``slow`` first, then the others, each in collection order. pytest-xdist
    (``--dist loadgroup``) hands out the ``xdist_group`` units first, then the other tests in this
    order: the long tests start early, and the short ones fill both workers at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _attention_backend_env():
    """megatron's model constructor sets NVTE_{FLASH,FUSED,UNFUSED}_ATTN for its attention backend
    and refuses to build a model with another backend while they are set: a model built in one
    test must not decide the backend of the next test's model."""
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def tiny():
    return tiny_argv


def validated(argv, world_size=1):
    """Parsed and validated by megatron's validate_args (derived values filled in), checked as
    on the target GPU machine (the dry-run's emulation), with megatron's printout silenced."""
    import contextlib
    import io

    from megatron.training.arguments import validate_args

    from megatron.patchset.core.dry_run import target_device

    args = parse(argv, world_size)
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
    return args


def run_example(path, env=None, *, drop=()):
    """Run an example launcher (``bash <path>`` from the repository root) with this interpreter
    as its PYTHON. The calling shell's Slurm and torchrun variables (``SLURM_*``, ``WORLD_SIZE``)
    and the names in ``drop`` are left out of its environment; ``env`` is added."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k != "WORLD_SIZE" and k not in drop
    }
    environ["PYTHON"] = sys.executable
    environ.update(env or {})
    return subprocess.run(
        ["bash", os.path.join(ROOT, path)],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=300,
    )


def dry_run_example(path, *, drop=(), **knobs):
    """``run_example`` in the launcher's ``DRY_RUN=1`` mode, with knobs as environment variables."""
    return run_example(path, {"DRY_RUN": "1", **knobs}, drop=drop)


def failures(argv, world_size=1, phase="layout", config=None):
    """{rule name: message} of the rules of ``phase`` that fail for ``argv``."""
    from megatron.patchset.core import rules

    args = parse(argv, world_size)
    try:
        rules.validate(args, phase, config=config)
    except rules.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures}
    return {}


def combination_failures(argv, world_size):
    """Combination-phase failures after megatron's validate_args and TransformerConfig, as
    pretrain_gpt.py runs them (device queries answered as on the target GPU)."""
    import contextlib
    import io

    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import validate_args

    from megatron.patchset.core import rules
    from megatron.patchset.core.dry_run import target_device

    args = parse(argv, world_size)
    args.rank = 0
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
        config = core_transformer_config_from_args(args)
    try:
        rules.validate(args, "combination", config=config)
    except rules.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures}
    return {}
