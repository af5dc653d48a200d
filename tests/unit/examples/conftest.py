"""Fixtures for the launcher tests: small indexed datasets, a PATH without nvidia-smi, and the
command a launcher's DRY_RUN=1 mode prints."""

import os
import shlex

import pytest

LOCAL = (
    "examples/train_tiny_moe.sh",
    "examples/pretrain_moe_compile.sh",
    "examples/pretrain_moe_deepep.sh",
    "examples/pretrain_moe_fsdp_cuda_graphs.sh",
    "examples/pretrain_moe_p2p_overlap.sh",
    "examples/pretrain_moe_paged_stash.sh",
    "examples/pretrain_moe_small_batch.sh",
)
SLURM = (
    "examples/slurm/pretrain_moe.sbatch",
    "examples/slurm/pretrain_moe_fsdp_cuda_graphs.sbatch",
    "examples/slurm/pretrain_moe_p2p_overlap.sbatch",
    "examples/slurm/pretrain_moe_small_batch.sbatch",
)
LAUNCHERS = LOCAL + SLURM


def dry_run_command(stdout):
    """The argv of the one ``DRY_RUN: `` line a launcher prints in its DRY_RUN=1 mode."""
    lines = [line for line in stdout.splitlines() if line.startswith("DRY_RUN: ")]
    assert len(lines) == 1, stdout
    return shlex.split(lines[0][len("DRY_RUN: ") :])


@pytest.fixture
def indexed_dataset(tmp_path):
    """Builds a small megatron indexed dataset (PREFIX.bin, PREFIX.idx) of token ids below
    ``vocab`` with megatron's own builder; returns PREFIX."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    def build(name="text_document", vocab=4096, documents=8, length=300):
        prefix = str(tmp_path / name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        generator = torch.Generator().manual_seed(len(name))
        for _ in range(documents):
            tokens = torch.randint(0, vocab, (length,), generator=generator, dtype=torch.int32)
            builder.add_document(tokens, [len(tokens)])
        builder.finalize(prefix + ".idx")
        return prefix

    return build


@pytest.fixture
def path_without_nvidia_smi(tmp_path):
    """A PATH with every command of this one except nvidia-smi (links in one folder)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            link = folder / entry.name
            if entry.name == "nvidia-smi" or os.path.lexists(link):
                continue
            if entry.is_file() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return str(folder)


# What the launchers' environment could carry in from the calling shell and so hide a default
# the launcher or its recipe sets.
LAUNCH_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_NVLS_ENABLE")


def _dry_run(tmp_path):
    """``(run, environ)``: ``run(script, **knobs)`` runs a launcher's DRY_RUN=1 mode with an
    interpreter that answers the launcher's own questions (packages, recipe flags) and, for the
    dry-run itself, writes the environment it was started with to ``environ`` and exits (fast: the
    flags and environment, not their check); it returns the launched argv."""
    import sys

    from tests.unit.conftest import dry_run_example

    environ = tmp_path / "dry_run_environ"
    stub = tmp_path / "python"
    stub.write_text(
        f'#!/bin/bash\nif [ "$1" = pretrain_gpt.py ]; then env > "{environ}"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)

    def run(script, **knobs):
        proc = dry_run_example(script, drop=LAUNCH_ENV, PYTHON=str(stub), **knobs)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return dry_run_command(proc.stdout)[1:]

    return run, environ


@pytest.fixture
def launched_flags(tmp_path):
    """``launched_flags(script, **knobs)``: the argv a launcher's DRY_RUN=1 mode prints."""
    return _dry_run(tmp_path)[0]


@pytest.fixture
def launched_env(tmp_path):
    """``launched_env(script, **knobs)``: the environment a launcher's DRY_RUN=1 mode starts
    pretrain_gpt.py with (the calling shell's values of :data:`LAUNCH_ENV` left out)."""
    run, environ = _dry_run(tmp_path)

    def launched(script, **knobs):
        run(script, **knobs)
        lines = environ.read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    return launched
