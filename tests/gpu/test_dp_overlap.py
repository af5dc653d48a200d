"""The small_batch recipe with ``DP_OVERLAP=1`` (megatron's ``--overlap-grad-reduce
--overlap-param-gather`` under the distributed optimizer) against the same recipe without it: the
same losses and gradient norms to the last bit (``--deterministic-mode``), through pretrain_gpt.py
with the full-iteration and optimizer graphs captured. On one GPU (a data-parallel group of one
rank, whose bucket reductions and gathers NCCL still runs inside the graph) and at DP 2."""

import re

import pytest

from megatron.patchset import recipes
from tests.gpu.conftest import DETERMINISTIC, assert_same_bits, gpu_count, launch_many, tiny_argv
from tests.gpu.test_resume import deterministic

pytestmark = pytest.mark.gpu

ITERS = 12
PLAIN = deterministic(recipes.flags("small_batch", DIST_OPT=1))
OVERLAPPED = deterministic(recipes.flags("small_batch", DIST_OPT=1, DP_OVERLAP=1))
CAPTURED = "CUDA graph capture done for training"
GPUS = (1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_overlap")
    jobs = []
    for nproc in GPUS:
        if gpu_count() < nproc:
            continue
        for name, flags in (("plain", PLAIN), ("overlapped", OVERLAPPED)):
            argv = tiny_argv(*DETERMINISTIC, "--train-iters", str(ITERS), *flags)
            jobs.append(dict(tmp_path=tmp, name=f"{name}_{nproc}", nproc=nproc, argv=argv))
    return launch_many(jobs)


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
