"""tools/bench/comm_model.py: the rank's parameters from megatron's flags, the bytes of each
skipped collective, which link carries it, and the step it predicts."""

import contextlib
import io
import math
import os

import comm_model
import pytest

from megatron.patchset.core import argsfile
from tests.unit.conftest import ROOT

QWEN3 = os.path.join(ROOT, "examples", "configs", "qwen3_30b_a3b.args")
LINKS = comm_model.Links(nvlink=360.0, a2a_nvlink=300.0, nic=50.0, source="test")


def qwen3(*extra):
    return argsfile.read(QWEN3) + ["--expert-model-parallel-size", "8", *extra]


def test_the_ranks_parameters_are_megatrons():
    import shape
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron.patchset.core.dry_run import count_parameters, target_device

    args = shape.megatron_args(argsfile.read(QWEN3))
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        total, active = count_parameters(args, core_transformer_config_from_args(args))
    whole = comm_model.shape_of(argsfile.read(QWEN3), world=1)
    assert whole.dense_params + whole.expert_params == total
    assert whole.dense_params + whole.expert_params * 8 // 128 == active
    rank = comm_model.shape_of(qwen3(), world=32)
    assert rank.dense_params == whole.dense_params
    assert rank.expert_params == whole.expert_params // 8
    assert (rank.dp, rank.expert_dp, rank.moe_layers, rank.grad_bytes) == (32, 4, 48, 4)


def test_the_layouts_links_and_bytes():
    # 32 ranks, EP=8 inside a node: the all-to-all on NVLink, both data-parallel groups across
    # nodes; one micro-batch of 4096 tokens a step.
    shape = comm_model.shape_of(
        qwen3("--use-distributed-optimizer", "--global-batch-size", "32"), 32
    )
    got = comm_model.predict(shape, LINKS)
    assert (got["a2a_link"], got["dp_link"], got["expert_dp_link"]) == ("NVLink", "IB", "IB")
    each = 4096 * 8 * 2048 * 2
    assert got["a2a_count"] == 4 * 48 and got["a2a_mb_each"] == each / 1e6
    assert got["a2a_ms"] == pytest.approx(4 * 48 * each * 7 / 8 / 300e9 * 1e3)
    # the dense group has 8 GPUs in each node, whose 8 NICs (400 GB/s) NVLink caps at 360; the
    # expert group one GPU a node: one NIC
    grads = shape.dense_params * 4 * 31 / 32 / 360e9 + shape.expert_params * 4 * 3 / 4 / 50e9
    params = shape.dense_params * 2 * 31 / 32 / 360e9 + shape.expert_params * 2 * 3 / 4 / 50e9
    assert got["grad_ms"] == pytest.approx(grads * 1e3)
    assert got["param_ms"] == pytest.approx(params * 1e3)
    # 8 ranks on one node: everything on NVLink, no expert data parallelism, and 4 micro-batches
    # a step at the same global batch.
    small = comm_model.shape_of(
        qwen3("--use-distributed-optimizer", "--global-batch-size", "32"), 8
    )
    got8 = comm_model.predict(small, LINKS)
    assert (got8["dp_link"], small.expert_dp, small.micro_batches) == ("NVLink", 1, 4)
    assert got8["a2a_ms"] == pytest.approx(4 * got["a2a_ms"])
    # Without the distributed optimizer the gradients are all-reduced: twice the reduce-scatter.
    plain = comm_model.predict(comm_model.shape_of(qwen3("--global-batch-size", "32"), 32), LINKS)
    assert plain["grad_ms"] == pytest.approx(2 * got["grad_ms"]) and plain["param_ms"] == 0


def test_a_group_leaves_the_node_when_its_ranks_do_and_uses_its_cards_there():
    assert not comm_model.spans_nodes(8, 1, 8)
    assert comm_model.spans_nodes(16, 1, 8)
    assert comm_model.spans_nodes(4, 8, 8)  # expert data parallel over 4 nodes
    assert not comm_model.spans_nodes(1, 8, 8)
    assert comm_model.group_bandwidth(8, 1, 8, LINKS) == 360.0  # one node: NVLink
    assert comm_model.group_bandwidth(4, 8, 8, LINKS) == 50.0  # a GPU a node: its card
    assert comm_model.group_bandwidth(8, 4, 8, LINKS) == 100.0  # two GPUs a node
    assert comm_model.group_bandwidth(32, 1, 8, LINKS) == 360.0  # 8 cards, NVLink-bound


def test_the_predicted_step_adds_the_exposed_communication():
    prediction = {"a2a_ms": 10.0, "dp_ms": 50.0}
    got = comm_model.with_compute(prediction, step_ms=100.0, fwd_bwd_ms=40.0, tflops=300.0)
    assert got["step_exposed_ms"] == 160.0
    assert got["step_overlapped_ms"] == 120.0  # 40 ms of the 50 hidden behind fwd+bwd
    assert got["tflops_exposed"] == pytest.approx(300.0 * 100 / 160)
    assert got["tflops_overlapped"] == pytest.approx(300.0 * 100 / 120)


def test_the_static_dispatch_sends_its_capacity_padded_slots():
    flags = ("--use-distributed-optimizer", "--global-batch-size", "32")
    dynamic = comm_model.predict(comm_model.shape_of(qwen3(*flags), 32), LINKS)
    static = comm_model.shape_of(qwen3(*flags, "--moe-static-dispatch"), 32)
    assert static.a2a_rows_factor == 2.0  # the flag's default
    assert comm_model.predict(static, LINKS)["a2a_ms"] == pytest.approx(2 * dynamic["a2a_ms"])
    lower = comm_model.shape_of(
        qwen3(*flags, "--moe-static-dispatch", "--moe-static-dispatch-capacity-factor", "1.25"), 32
    )
    got = comm_model.predict(lower, LINKS)
    assert got["a2a_ms"] == pytest.approx(1.25 * dynamic["a2a_ms"])
    assert got["grad_ms"] == pytest.approx(dynamic["grad_ms"])  # data-parallel traffic unchanged


def test_one_row_per_token_and_peer_sends_two_thirds_of_the_slots():
    """Qwen3-30B-A3B at EP 8 (128 experts, top-8, 16 a rank): a token reaches 5.34 ranks on
    average, so the slots are 1.25 x 5.34 / 8 of megatron's rows, plus the routing beside them
    (16 fp32 probabilities and 16 map bytes forward, 16 fp32 gradients backward, per slot)."""
    flags = ("--use-distributed-optimizer", "--global-batch-size", "256")
    flags += ("--expert-model-parallel-size", "8", "--moe-static-dispatch")
    flags += ("--moe-static-dispatch-capacity-factor", "1.25")
    rows = comm_model.shape_of(qwen3(*flags), 32)
    tokens = comm_model.shape_of(qwen3(*flags, "--moe-static-dispatch-dedup"), 32)
    share = 1 - math.comb(112, 8) / math.comb(128, 8)
    routing = 1 + (16 * 5 + 16 * 4) / 4 / (2 * 2048)
    assert tokens.a2a_rows_factor == pytest.approx(1.25 * 8 * share / 8 * routing)
    assert 0.84 < tokens.a2a_rows_factor < 0.85 and rows.a2a_rows_factor == 1.25
    assert comm_model.predict(tokens, LINKS)["a2a_ms"] == pytest.approx(
        comm_model.predict(rows, LINKS)["a2a_ms"] * tokens.a2a_rows_factor / 1.25
    )
    # at EP 2 a token reaches both ranks in 99.7% of cases: the slots are capped at every token
    ep2 = ("--expert-model-parallel-size", "2", "--moe-static-dispatch-dedup")
    pair = comm_model.shape_of(qwen3(*flags[:3], *flags[5:], *ep2), 2)
    assert pair.ep == 2
    assert pair.a2a_rows_factor == pytest.approx(2 / 8 * (1 + 9 * 64 / (4 * 2 * 2048)))


def test_a_chunked_layer_exposes_what_its_experts_cannot_cover():
    # one chunk: dispatch, experts and combine one after the other
    assert comm_model.pipeline_ms(1.0, 1.0, 3.0, 1) == 5.0
    # experts longer than a chunk's all-to-all: only the first dispatch and the last combine wait
    assert comm_model.pipeline_ms(1.0, 1.0, 10.0, 2) == pytest.approx(0.5 + 10.0 + 0.5)
    assert comm_model.pipeline_ms(1.0, 1.0, 10.0, 4) == pytest.approx(0.25 + 10.0 + 0.25)
    # no compute to hide behind: the all-to-alls in full
    assert comm_model.pipeline_ms(1.0, 1.0, 0.0, 4) == pytest.approx(2.0)
    # short experts (forward of 1 ms, 2 chunks): dispatch 0 | dispatch 1 + experts 0 |
    # combine 0 + experts 1 | combine 1 -> 0.5 + 0.5 + 0.5 + 0.5
    assert comm_model.pipeline_ms(1.0, 1.0, 1.0, 2) == pytest.approx(2.0)
    # 4 chunks, experts 2 ms: the dispatches end at 1.0, the experts at 0.25 + 2.0, the combines
    # follow the experts of their chunk (0.75, 1.25, 1.75, 2.25 + 0.25 each) -> 2.5
    assert comm_model.pipeline_ms(1.0, 1.0, 2.0, 4) == pytest.approx(2.5)


def test_chunks_leave_part_of_the_all_to_all_on_the_step():
    flags = ("--use-distributed-optimizer", "--global-batch-size", "32", "--moe-static-dispatch")
    whole = comm_model.predict(comm_model.shape_of(qwen3(*flags), 32), LINKS)
    shape = comm_model.shape_of(qwen3(*flags, "--moe-static-dispatch-chunks", "2"), 32)
    assert shape.a2a_chunks == 2
    # 4096 tokens x top-8 x (2048 x 1536 + 768 x 2048) multiply-adds, two FLOPs each
    assert shape.expert_flops == 4096 * 8 * 2 * 2048 * 768 * 3
    chunked = comm_model.predict(shape, LINKS)
    assert chunked["a2a_ms"] == pytest.approx(whole["a2a_ms"])  # the same bytes
    fast = comm_model.with_compute(chunked, step_ms=300.0, fwd_bwd_ms=280.0, tflops=300.0)
    slow = comm_model.with_compute(chunked, step_ms=300.0, fwd_bwd_ms=280.0, tflops=1e-3)
    assert comm_model.with_compute(whole, 300.0, 280.0, 300.0)["a2a_exposed_ms"] == whole["a2a_ms"]
    assert 0 < fast["a2a_exposed_ms"] < chunked["a2a_ms"]
    # experts that take long enough hide all but the first dispatch and the last combine
    assert slow["a2a_exposed_ms"] == pytest.approx(chunked["a2a_ms"] / 2)
    # without the static dispatch the flag does nothing
    plain = comm_model.shape_of(qwen3(flags[0], "--moe-static-dispatch-chunks", "2"), 32)
    assert plain.a2a_chunks == 1
