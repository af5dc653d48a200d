"""The tiny MoE config trains through pretrain_gpt.py: one GPU, two GPUs with EP=2, and the
same loss as unpatched upstream when no fork flag is set."""

import math
import os

import pytest

from tests.gpu.conftest import (
    UPSTREAM_ENTRY,
    UPSTREAM_SCRIPT,
    first_difference,
    launch,
    tiny_argv,
)

pytestmark = pytest.mark.gpu


def check_learning(run):
    losses = run.losses
    assert len(losses) == 50, f"{len(losses)} iterations recorded"
    assert all(math.isfinite(x) for x in losses)
    # From ~ln(4096) = 8.3 at the start, the mock data (shifted ranges) is learnt quickly.
    assert losses[0] > 7.5
    assert losses[49] < losses[0] - 3.0
    assert losses[49] < losses[9]
    print(
        f"\n{run.name}: loss it1 {losses[0]:.4f} it10 {losses[9]:.4f} it50 {losses[49]:.4f}; "
        f"median step {run.step_ms():.1f} ms; peak {run.summary.get('max_allocated_gib', 0):.2f} "
        "GiB"
    )


@pytest.mark.gpus(1)
def test_tiny_moe_one_gpu(tmp_path):
    check_learning(launch(tmp_path, "tiny_1gpu", 1, tiny_argv()))


@pytest.mark.gpus(2)
def test_tiny_moe_two_gpus_expert_parallel(tmp_path):
    run = launch(tmp_path, "tiny_2gpu_ep2", 2, tiny_argv("--expert-model-parallel-size", "2"))
    check_learning(run)


@pytest.mark.gpus(1)
def test_fork_matches_unpatched_upstream(tmp_path):
    """No fork flag: pretrain_gpt.py (with its patches) and Megatron-LM's own pretrain_gpt.py
    (release branch core_r0.19.0, run unmodified through tools/bench/run_upstream.py) give
    bit-identical losses and gradient norms."""
    if not os.path.exists(UPSTREAM_SCRIPT):
        pytest.skip(
            f"Megatron-LM's pretrain_gpt.py not found at {UPSTREAM_SCRIPT} (set "
            "MEGATRON_LM_PRETRAIN_GPT)"
        )
    argv = tiny_argv("--train-iters", "20", "--deterministic-mode")
    fork = launch(tmp_path, "tiny_fork", 1, argv)
    upstream = launch(
        tmp_path,
        "tiny_upstream",
        1,
        argv,
        entry=[UPSTREAM_ENTRY, UPSTREAM_SCRIPT],
    )
    assert len(fork.losses) == len(upstream.losses) == 20
    assert first_difference(fork.losses, upstream.losses) is None
    assert first_difference(fork.grad_norms, upstream.grad_norms) is None
    print(
        f"\nfork == upstream for 20 iterations: last loss {fork.losses[-1]!r}, grad norm "
        f"{fork.grad_norms[-1]!r}"
    )


@pytest.mark.gpus(1)
def test_tiny_moe_trains_on_an_indexed_dataset(tmp_path):
    """pretrain_gpt.py on a megatron indexed dataset (--data-path, no --mock-data): the dry-run
    accepts it and names it, and the model learns the file's tokens."""
    import subprocess
    import sys

    from megatron.patchset.core import argsfile
    from tests.gpu.conftest import ROOT
    from tests.unit.support.indexed_data import write_dataset

    prefix = write_dataset(tmp_path / "text", documents=400, length=1100, vocab=4096, counting=True)
    argv = argsfile.remove(tiny_argv("--train-iters", "50"), "--mock-data") + [
        "--data-path",
        prefix,
    ]
    check = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--dry-run", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout[-2000:]
    assert f"data: 1 indexed dataset(s): {prefix}" in check.stdout
    run = launch(tmp_path, "tiny_indexed_data", 1, argv)
    losses = run.losses
    assert len(losses) == 50 and all(math.isfinite(x) for x in losses)
    assert losses[0] > 7.5 and losses[-1] < losses[0] - 3.0  # counting runs: learnt quickly
    assert "(GPTDataset)" in run.log_text()
    print(f"\nindexed data: loss it1 {losses[0]:.4f} it50 {losses[-1]:.4f}")
