"""The small_batch recipe with ``DP_OVERLAP=1`` (megatron's ``--overlap-grad-reduce
--overlap-param-gather`` under the distributed optimizer) against the same recipe without it: the
same losses and gradient norms to the last bit (``--deterministic-mode``), through pretrain_gpt.py
with the full-iteration and optimizer graphs captured. On one GPU (a data-parallel group of one
rank, whose bucket reductions and gathers NCCL still runs inside the graph) and at DP 2. At DP 2 a
run of the overlapped recipe stopped after iteration 6 with ``--save`` and launched again with
``--load`` continues bit for bit (with ``--overlap-param-gather`` megatron completes the pending
parameter all-gather before it saves, and the resumed run's first forward gathers again)."""

import re

import pytest

from megatron.patchset import recipes
from tests.gpu.conftest import (
    DETERMINISTIC,
    assert_resumed_exactly,
    assert_same_bits,
    gpu_count,
    launch_many,
    tiny_argv,
)
from tests.gpu.test_resume import deterministic

pytestmark = pytest.mark.gpu

ITERS, EXIT = 12, 6
PLAIN = deterministic(recipes.flags("small_batch", DIST_OPT=1))
OVERLAPPED = deterministic(recipes.flags("small_batch", DIST_OPT=1, DP_OVERLAP=1))
CAPTURED = "CUDA graph capture done for training"
GPUS = (1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_overlap")
    jobs = []
    resumed = []
    for nproc in GPUS:
        if gpu_count() < nproc:
            continue
        argvs = {
            name: tiny_argv(*DETERMINISTIC, "--train-iters", str(ITERS), *flags)
            for name, flags in (("plain", PLAIN), ("overlapped", OVERLAPPED))
        }
        for name, argv in argvs.items():
            jobs.append(dict(tmp_path=tmp, name=f"{name}_{nproc}", nproc=nproc, argv=argv))
        if nproc == 2:  # the overlapped recipe stopped at EXIT with a checkpoint, then resumed
            ckpt = str(tmp / "ckpt")
            save = ["--save", ckpt, "--save-interval", str(EXIT), "--exit-interval", str(EXIT)]
            overlapped = argvs["overlapped"]
            jobs.append(dict(tmp_path=tmp, name="first_2", nproc=2, argv=overlapped + save))
            resumed.append(
                dict(tmp_path=tmp, name="resumed_2", nproc=2, argv=overlapped + ["--load", ckpt])
            )
    done = launch_many(jobs)
    if resumed:
        done.update(launch_many(resumed))
    return done


def compare(runs, nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    assert {"--overlap-grad-reduce", "--overlap-param-gather"} <= set(OVERLAPPED)
    overlapped, plain = runs[f"overlapped_{nproc}"], runs[f"plain_{nproc}"]
    for run, on in ((overlapped, "True"), (plain, "False")):
        text = run.log_text()
        assert CAPTURED in text
        # megatron's printout of its arguments: the flags took effect in one run only
        assert re.search(rf"overlap_grad_reduce \.+ {on}\b", text)
        assert re.search(rf"overlap_param_gather \.+ {on}\b", text)
    assert_same_bits(overlapped, plain, f"DP_OVERLAP=1 vs without, {nproc} GPU(s)", ITERS)


@pytest.mark.gpus(1)
def test_dp_overlap_on_one_gpu_gives_the_same_bits(runs):
    compare(runs, 1)


@pytest.mark.gpus(2)
def test_dp_overlap_at_dp2_gives_the_same_bits(runs):
    compare(runs, 2)


@pytest.mark.gpus(2)
def test_a_resume_at_dp2_with_the_overlap_continues_bit_identically(runs):
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    full, first, again = runs["overlapped_2"], runs["first_2"], runs["resumed_2"]
    assert_resumed_exactly(full, first, again, EXIT)
    print(
        f"\nDP_OVERLAP=1, DP=2: iterations {EXIT + 1}-{ITERS} resumed bit-identically; loss at "
        f"{ITERS} {again.losses[-1]!r}, grad norm {again.grad_norms[-1]!r}"
    )
