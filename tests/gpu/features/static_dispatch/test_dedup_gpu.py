"""--moe-static-dispatch-dedup on GPUs: each token crosses to an expert-parallel peer once, and
the peer sums its experts' outputs before the combine.

* the one-row-per-token exchange trains like the row-per-expert one (within bf16 tolerance: the
  outputs are summed per peer, then over peers), at EP = 1 and at EP = 2 on two GPUs;
* under ``--deterministic-mode`` its full-iteration graph replays the eager step bit for bit
  (EP = 1, one GPU as rank 0 of an EP = 2 layout under ``--fake-process-group``, and EP = 2).

Under the fake process group the combine brings back this rank's own expert outputs in place of
the other ranks' (the emulation's stand-in), which the two exchanges place differently: the
emulated rank's losses are not compared across them, only graph against eager.
"""

import pytest

from tests.gpu.conftest import assert_same_bits, gpu_count, launch_many, tiny_argv
from tests.gpu.features.static_dispatch.test_static_dispatch import (
    BASE,
    CAPTURED,
    DETERMINISTIC,
    EP2,
    FULL_GRAPH,
    NO_DROPOUT,
    RERUN,
    STATIC,
    close,
    needs,
)

pytestmark = pytest.mark.gpu

ITERS = 12
DEDUP = ("--moe-static-dispatch-dedup",)
ANNOUNCED = "megatron-patchset: MoE all-to-all with one row per token and peer "
# name: (GPUs, ranks emulated on one GPU or None, flags)
RUNS = {
    "static_1gpu": (1, None, STATIC),
    "dedup_1gpu": (1, None, STATIC + DEDUP),
    "det_dedup_1gpu": (1, None, DETERMINISTIC + STATIC + DEDUP),
    "det_dedup_graph_1gpu": (1, None, DETERMINISTIC + STATIC + DEDUP + FULL_GRAPH),
    "det_dedup_emulated_ep2": (1, 4, DETERMINISTIC + STATIC + EP2 + DEDUP),
    "det_dedup_graph_emulated_ep2": (1, 4, DETERMINISTIC + STATIC + EP2 + DEDUP + FULL_GRAPH),
    "static_ep2": (2, None, STATIC + EP2),
    "dedup_ep2": (2, None, STATIC + EP2 + DEDUP),
    "det_dedup_ep2": (2, None, DETERMINISTIC + STATIC + EP2 + DEDUP),
    "det_dedup_graph_ep2": (2, None, DETERMINISTIC + STATIC + EP2 + DEDUP + FULL_GRAPH),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("static_dispatch_dedup")
    jobs = [
        dict(
            tmp_path=tmp,
            name=name,
            nproc=nproc,
            emulate=emulate,
            argv=tiny_argv("--train-iters", str(ITERS), *NO_DROPOUT, *BASE, *flags),
        )
        for name, (nproc, emulate, flags) in RUNS.items()
        if gpu_count() >= nproc
    ]
    return launch_many(jobs)


@pytest.mark.gpus(1)
def test_one_row_per_token_trains_like_one_row_per_expert(runs):
    needs(1)
    assert ANNOUNCED in runs["dedup_1gpu"].log_text()
    assert ANNOUNCED not in runs["static_1gpu"].log_text()
    close(runs["dedup_1gpu"], runs["static_1gpu"], "dedup vs rows, EP=1", ITERS)


@pytest.mark.gpus(1)
def test_full_iteration_graph_replays_the_eager_step_bitwise(runs):
    needs(1)
    for graphed, eager, label in (
        ("det_dedup_graph_1gpu", "det_dedup_1gpu", "EP=1"),
        ("det_dedup_graph_emulated_ep2", "det_dedup_emulated_ep2", "rank 0 of 4 at EP=2"),
    ):
        assert CAPTURED in runs[graphed].log_text()
        assert RERUN not in runs[graphed].log_text()
        assert_same_bits(runs[graphed], runs[eager], f"dedup, graph vs eager, {label}", ITERS)


@pytest.mark.gpus(2)
def test_one_row_per_token_trains_like_one_row_per_expert_at_ep2(runs):
    needs(2)
    assert ANNOUNCED in runs["dedup_ep2"].log_text()
    close(runs["dedup_ep2"], runs["static_ep2"], "dedup vs rows, EP=2", ITERS)


@pytest.mark.gpus(2)
def test_full_iteration_graph_replays_the_eager_step_bitwise_at_ep2(runs):
    needs(2)
    graphed = runs["det_dedup_graph_ep2"]
    assert CAPTURED in graphed.log_text() and RERUN not in graphed.log_text()
    assert_same_bits(graphed, runs["det_dedup_ep2"], "dedup, graph vs eager, EP=2", ITERS)
