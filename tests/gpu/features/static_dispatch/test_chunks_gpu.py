"""--moe-static-dispatch-chunks on GPUs: each MoE layer in token chunks whose all-to-alls run on a
side stream beside the experts of another chunk.

* the chunked layers train like the whole ones (within bf16 tolerance: the expert weight
  gradients are summed chunk by chunk), at EP = 1 and at EP = 2;
* under ``--deterministic-mode`` the full-iteration graph, which captures the two streams as
  parallel branches, replays the eager chunked step bit for bit (EP = 1 and EP = 2).
"""

import pytest

from tests.gpu.conftest import (
    assert_same_bits,
    assert_trains_alike,
    gpu_count,
    launch_many,
    tiny_argv,
)
from tests.gpu.features.static_dispatch.test_static_dispatch import (
    BASE,
    CAPTURED,
    DETERMINISTIC,
    EP2,
    FULL_GRAPH,
    GRAD_NORM_RTOL,
    LOSS_ATOL,
    NO_DROPOUT,
    RERUN,
    STATIC,
)

pytestmark = pytest.mark.gpu

ITERS = 12
ANNOUNCED = "megatron-patchset: MoE layers run in 2 token chunks of 512 tokens per sequence, their "
CHUNKS = ("--moe-static-dispatch-chunks", "2")
RUNS = {
    "static_1gpu": (1, STATIC),
    "chunks_1gpu": (1, STATIC + CHUNKS),
    "det_chunks_1gpu": (1, DETERMINISTIC + STATIC + CHUNKS),
    "det_chunks_graph_1gpu": (1, DETERMINISTIC + STATIC + CHUNKS + FULL_GRAPH),
    "static_ep2": (2, STATIC + EP2),
    "chunks_ep2": (2, STATIC + EP2 + CHUNKS),
    "det_chunks_ep2": (2, DETERMINISTIC + STATIC + EP2 + CHUNKS),
    "det_chunks_graph_ep2": (2, DETERMINISTIC + STATIC + EP2 + CHUNKS + FULL_GRAPH),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("static_dispatch_chunks")
    jobs = [
        dict(
            tmp_path=tmp,
            name=name,
            nproc=nproc,
            argv=tiny_argv("--train-iters", str(ITERS), *NO_DROPOUT, *BASE, *flags),
        )
        for name, (nproc, flags) in RUNS.items()
        if gpu_count() >= nproc
    ]
    return launch_many(jobs)


def needs(n):
    if gpu_count() < n:
        pytest.skip(f"needs {n} GPUs")


def close(ours, reference, label):
    assert_trains_alike(
        ours, reference, label, iters=ITERS, loss_atol=LOSS_ATOL, grad_norm_rtol=GRAD_NORM_RTOL
    )


@pytest.mark.gpus(1)
def test_chunks_train_like_the_whole_layer(runs):
    needs(1)
    assert ANNOUNCED in runs["chunks_1gpu"].log_text()
    close(runs["chunks_1gpu"], runs["static_1gpu"], "2 chunks vs whole layers, EP=1")


@pytest.mark.gpus(1)
def test_chunked_full_iteration_graph_replays_the_eager_step_bitwise(runs):
    needs(1)
    graphed = runs["det_chunks_graph_1gpu"]
    assert CAPTURED in graphed.log_text()
    assert_same_bits(graphed, runs["det_chunks_1gpu"], "2 chunks, graph vs eager, EP=1", ITERS)


@pytest.mark.gpus(2)
def test_chunks_train_like_the_whole_layer_at_ep2(runs):
    needs(2)
    close(runs["chunks_ep2"], runs["static_ep2"], "2 chunks vs whole layers, EP=2")


@pytest.mark.gpus(2)
def test_chunked_full_iteration_graph_replays_the_eager_step_bitwise_at_ep2(runs):
    needs(2)
    graphed = runs["det_chunks_graph_ep2"]
    assert CAPTURED in graphed.log_text() and RERUN not in graphed.log_text()
    assert_same_bits(graphed, runs["det_chunks_ep2"], "2 chunks, graph vs eager, EP=2", ITERS)
