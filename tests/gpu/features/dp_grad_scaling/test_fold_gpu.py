"""--ddp-scale-grads-in-loss on one GPU, as rank 0 of a 4-GPU job at EP = 2 (megatron's
``--fake-process-group``: data-parallel size 4, expert data-parallel size 2), and on two GPUs at
EP = 2 (data-parallel size 2, NCCL): the small_batch recipe's step (static all-to-all,
full-iteration and optimizer CUDA graphs, the one-kernel Adam under the distributed optimizer;
megatron's unfused cross entropy, which its --deterministic-mode needs) with the fold and with its
two patches left out, bit for bit."""

import pytest

from megatron.patchset import recipes
from tests.gpu.conftest import DETERMINISTIC, assert_same_bits, launch_many, tiny_argv

pytestmark = pytest.mark.gpu

ITERS = 12
FOLD_PATCHES = "dp_grad_scaling.unscaled_buffers,dp_grad_scaling.scaled_loss_gradient"


def recipe_argv():
    flags = list(recipes.get("small_batch")({"EP": "2"}).flags)
    assert "--ddp-scale-grads-in-loss" in flags and "--use-distributed-optimizer" in flags
    # megatron's --deterministic-mode refuses the fused cross entropy (and with it the Triton one)
    flags = [f for f in flags if f not in ("--cross-entropy-loss-fusion", "--cross-entropy-triton")]
    return tiny_argv("--train-iters", str(ITERS), *DETERMINISTIC) + flags


def fold_and_reference(tmp_path, nproc, emulate=None):
    argv = recipe_argv()
    jobs = [
        dict(tmp_path=tmp_path, name="fold", nproc=nproc, argv=argv, emulate=emulate),
        dict(
            tmp_path=tmp_path,
            name="megatron_scaling",
            nproc=nproc,
            argv=argv,
            emulate=emulate,
            env={"MEGATRON_PATCHSET_SKIP_PATCHES": FOLD_PATCHES},
        ),
    ]
    runs = launch_many(jobs)
    return runs["fold"], runs["megatron_scaling"]


def assert_folded_and_same_bits(fold, reference, label):
    """Only ``fold`` applied the feature's patches, and both trained to the same bits."""
    applied = "megatron-patchset patches applied: "
    for run, folded in ((fold, True), (reference, False)):
        line = next(x for x in run.log_text().splitlines() if applied in x)
        assert ("dp_grad_scaling.scaled_loss_gradient" in line) is folded
        assert ("dp_grad_scaling.unscaled_buffers" in line) is folded
    assert_same_bits(fold, reference, f"fold vs megatron's scaling, {label}", ITERS)


@pytest.mark.gpus(1)
def test_fold_under_the_recipe_graphs_equals_megatrons_scaling_bitwise(tmp_path):
    fold, reference = fold_and_reference(tmp_path, 1, emulate=4)
    assert_folded_and_same_bits(fold, reference, "rank 0 of 4 at EP=2")


@pytest.mark.gpus(2)
def test_fold_on_two_gpus_equals_megatrons_scaling_bitwise(tmp_path):
    fold, reference = fold_and_reference(tmp_path, 2)
    assert_folded_and_same_bits(fold, reference, "2 GPUs, DP=2, EP=2")
