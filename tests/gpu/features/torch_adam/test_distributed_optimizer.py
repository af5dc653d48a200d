"""--adam-impl triton under megatron's distributed optimizer on two GPUs (data-parallel size 2,
each rank steps half of every parameter's fp32 main shard and writes its bf16 shard; NCCL
gathers the parameters):

* the small_batch recipe with ``DIST_OPT=1`` (full-iteration and optimizer CUDA graphs, the
  one-kernel step with the clip and the bf16 copy) trains like the same recipe with megatron's own
  Adam (TransformerEngine's FusedAdam, ``KERNELS=0``), within the tolerance of the other
  torch_adam GPU tests;
* a run stopped at iteration 10 with ``--save`` (megatron's ``torch_dist`` format) and launched
  again with ``--load`` continues bit for bit (``--deterministic-mode``).
"""

import pytest

from megatron.patchset import recipes
from tests.gpu.conftest import (
    assert_resumed_exactly,
    assert_trains_alike,
    launch_many,
    tiny_argv,
)
from tests.gpu.test_resume import EXIT, ITERS, NUMERICS, deterministic

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

OURS = deterministic(recipes.flags("small_batch", DIST_OPT=1))
MEGATRONS = deterministic(recipes.flags("small_batch", DIST_OPT=1, KERNELS=0, OPTIMIZER_GRAPH=0))
ANNOUNCED = "megatron-patchset: Adam is torch.optim.AdamW (one Triton kernel"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist_opt")
    ours = tiny_argv(*NUMERICS, *OURS)
    ckpt = str(tmp / "ckpt")
    first = [
        dict(tmp_path=tmp, name="ours_full", nproc=2, argv=ours),
        dict(tmp_path=tmp, name="megatron_full", nproc=2, argv=tiny_argv(*NUMERICS, *MEGATRONS)),
        dict(
            tmp_path=tmp,
            name="ours_first",
            nproc=2,
            argv=ours
            + ["--save", ckpt, "--save-interval", str(EXIT), "--exit-interval", str(EXIT)],
        ),
    ]
    done = launch_many(first)
    done.update(
        launch_many(
            [dict(tmp_path=tmp, name="ours_resumed", nproc=2, argv=ours + ["--load", ckpt])]
        )
    )
    return done


def test_the_one_kernel_step_trains_like_megatrons_adam_at_dp2(runs):
    assert "--use-distributed-optimizer" in OURS and "--use-distributed-optimizer" in MEGATRONS
    assert ANNOUNCED in runs["ours_full"].log_text()
    assert ANNOUNCED not in runs["megatron_full"].log_text()
    assert_trains_alike(
        runs["ours_full"],
        runs["megatron_full"],
        "one-kernel AdamW vs megatron's Adam, distributed optimizer, DP=2",
        iters=ITERS,
        loss_atol=2e-2,
        grad_norm_rtol=5e-2,
    )


def test_a_resume_at_dp2_continues_bit_identically(runs):
    full, first, again = runs["ours_full"], runs["ours_first"], runs["ours_resumed"]
    assert len(full.iterations) == ITERS
    assert_resumed_exactly(full, first, again, EXIT)
    print(
        f"\nDP=2: iterations {EXIT + 1}-{ITERS} resumed bit-identically; loss at {ITERS} "
        f"{again.losses[-1]!r}, grad norm {again.grad_norms[-1]!r}"
    )
