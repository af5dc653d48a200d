"""--moe-static-dispatch-chunks on GPUs: each MoE layer in token chunks whose all-to-alls run on a
side stream beside the experts of another chunk.

* the chunked layers train like the whole ones (within bf16 tolerance: the expert weight
  gradients are summed chunk by chunk), at EP = 1 and at EP = 2;
* under ``--deterministic-mode`` the full-iteration graph, which captures the two streams as
  parallel branches, replays the eager chunked step bit for bit (EP = 1 and EP = 2).
"""

import pytest

from tests.gpu.conftest import assert_same_bits
from tests.gpu.features.static_dispatch.test_static_dispatch import (
    CAPTURED,
    DETERMINISTIC,
    EP2,
    FULL_GRAPH,
    RERUN,
    STATIC,
    close,
    launch_runs,
    needs,
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
    return launch_runs(tmp_path_factory.mktemp("static_dispatch_chunks"), RUNS, ITERS)


@pytest.mark.gpus(1)
def test_chunks_train_like_the_whole_layer(runs):
    needs(1)
    assert ANNOUNCED in runs["chunks_1gpu"].log_text()
    close(runs["chunks_1gpu"], runs["static_1gpu"], "2 chunks vs whole layers, EP=1", ITERS)


@pytest.mark.gpus(1)
def test_chunked_full_iteration_graph_replays_the_eager_step_bitwise(runs):
    needs(1)
    graphed = runs["det_chunks_graph_1gpu"]
    assert CAPTURED in graphed.log_text()
    assert_same_bits(graphed, runs["det_chunks_1gpu"], "2 chunks, graph vs eager, EP=1", ITERS)


@pytest.mark.gpus(2)
def test_chunks_train_like_the_whole_layer_at_ep2(runs):
    needs(2)
    close(runs["chunks_ep2"], runs["static_ep2"], "2 chunks vs whole layers, EP=2", ITERS)


@pytest.mark.gpus(2)
def test_chunked_full_iteration_graph_replays_the_eager_step_bitwise_at_ep2(runs):
    needs(2)
    graphed = runs["det_chunks_graph_ep2"]
    assert CAPTURED in graphed.log_text() and RERUN not in graphed.log_text()
    assert_same_bits(graphed, runs["det_chunks_ep2"], "2 chunks, graph vs eager, EP=2", ITERS)
