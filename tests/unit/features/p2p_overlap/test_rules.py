"""The P2P-overlap rules, with megatron's real parser (PP=2 x VPP=2 x EP=2 on 4 GPUs)."""

import pytest

from megatron.patchset.core import argsfile
from tests.unit.conftest import combination_failures, failures, tiny_argv

# PP=2 x VPP=2 x EP=2 on 4 GPUs, 2 layers per model chunk: where the P2P-overlap flags act.
P2P_LAYOUT = (
    "--num-layers",
    "8",
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "2",
    "--expert-model-parallel-size",
    "2",
    "--overlap-moe-expert-parallel-comm",
    "--delay-wgrad-compute",
    "--global-batch-size",
    "64",
)


P2P_FLAGS = (
    "--overlap-p2p-backward-on-comm-stream",
    "--overlap-p2p-wgrad-delayed-layer-number",
    "2",
    "--overlap-p2p-with-transformer-layer-wgrad",
)


def p2p_argv(*extra, flags=P2P_FLAGS):
    return tiny_argv(*P2P_LAYOUT, *flags, *extra)


def test_p2p_overlap_layout_is_valid():
    assert failures(p2p_argv(), 4) == {}
    assert combination_failures(p2p_argv(), 4) == {}


def test_p2p_overlap_needs_ep_overlap_and_delayed_wgrad():

    argv = argsfile.remove(p2p_argv(), "--delay-wgrad-compute")
    msg = failures(argv, 4)["p2p-overlap-needs-ep-overlap-and-delayed-wgrad"]
    assert "need --delay-wgrad-compute" in msg and "--overlap-p2p-backward-on-comm-stream" in msg
    argv = argsfile.remove(argv, "--overlap-moe-expert-parallel-comm")
    msg = failures(argv, 4)["p2p-overlap-needs-ep-overlap-and-delayed-wgrad"]
    assert "--overlap-moe-expert-parallel-comm and --delay-wgrad-compute" in msg
    # Only the fork's flags are checked: default values ask for nothing.
    assert "p2p-overlap-needs-ep-overlap-and-delayed-wgrad" not in failures(tiny_argv(), 1)


def test_p2p_overlap_needs_interleaved_pipeline():
    two_gpus = tiny_argv(
        "--expert-model-parallel-size",
        "2",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
        "--overlap-p2p-wgrad-delayed-layer-number",
        "2",
    )
    msg = failures(two_gpus, 2)["p2p-overlap-needs-interleaved-pipeline"]
    assert "--overlap-p2p-wgrad-delayed-layer-number 2" in msg
    assert "--pipeline-model-parallel-size 1" in msg and "no virtual pipeline" in msg

    no_vpp = argsfile.remove(p2p_argv(), "--num-layers-per-virtual-pipeline-stage")
    msg = failures(no_vpp, 4)["p2p-overlap-needs-interleaved-pipeline"]
    assert (
        "--num-layers-per-virtual-pipeline-stage" in msg
        and "--pipeline-model-parallel-size" not in msg
    )
    one_chunk = p2p_argv(
        "--num-layers-per-virtual-pipeline-stage", "4"
    )  # 4 layers per rank: 1 chunk
    assert "no virtual pipeline" in failures(one_chunk, 4)["p2p-overlap-needs-interleaved-pipeline"]
    msg = failures(p2p_argv("--no-overlap-p2p-communication"), 4)[
        "p2p-overlap-needs-interleaved-pipeline"
    ]
    assert "--no-overlap-p2p-communication" in msg
    stages = p2p_argv("--num-virtual-stages-per-pipeline-rank", "2")
    stages = argsfile.remove(stages, "--num-layers-per-virtual-pipeline-stage")
    assert "p2p-overlap-needs-interleaved-pipeline" not in failures(stages, 4)


P2P_UNSUPPORTED = [
    (("--expert-model-parallel-size", "1"), "--expert-model-parallel-size 1"),
    (("--moe-token-dispatcher-type", "allgather"), "--moe-token-dispatcher-type allgather"),
    (("--recompute-granularity", "full"), "--recompute-granularity full"),
    (("--recompute-method", "uniform"), "--recompute-method uniform"),
    (("--recompute-num-layers", "1"), "--recompute-num-layers 1"),
    (("--recompute-modules", "moe"), "--recompute-modules with moe"),
    (("--moe-shared-expert-overlap",), "--moe-shared-expert-overlap"),
    (("--mtp-num-layers", "2"), "--mtp-num-layers 2"),
    (("--cuda-graph-impl", "transformer_engine"), "whole layers"),
    (
        ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe"),
        "--cuda-graph-modules moe",
    ),
    (("--transformer-impl", "local"), "--transformer-impl local"),
    (
        ("--overlap-dispatch-backward-with-experts-wgrad",),
        "--overlap-dispatch-backward-with-experts-wgrad",
    ),
    (("--use-megatron-fsdp",), "--use-megatron-fsdp"),
]


@pytest.mark.parametrize("extra, named", P2P_UNSUPPORTED, ids=[n for _, n in P2P_UNSUPPORTED])
def test_p2p_overlap_fine_grained_schedule_limits(extra, named):
    msg = failures(p2p_argv(*extra), 4)["p2p-overlap-fine-grained-schedule-limits"]
    assert named in msg and "fine-grained 1F1B schedule" in msg
    # megatron checks these itself (late, or without naming a flag) when the fork's flags are off.
    assert "p2p-overlap-fine-grained-schedule-limits" not in failures(p2p_argv(*extra, flags=()), 4)


def test_p2p_overlap_fine_grained_schedule_limits_precision_and_torch(monkeypatch):
    from megatron.core import utils as mcore_utils

    msg = failures(argsfile.remove(p2p_argv(), "--bf16"), 4)[
        "p2p-overlap-fine-grained-schedule-limits"
    ]
    assert "add --bf16 or --fp16" in msg
    monkeypatch.setattr(
        mcore_utils, "is_torch_min_version", lambda version, *a, **k: version != "2.6.0"
    )
    assert (
        "before torch 2.6.0" in failures(p2p_argv(), 4)["p2p-overlap-fine-grained-schedule-limits"]
    )


def test_p2p_overlap_delayed_layer_number_range():
    got = combination_failures(p2p_argv(flags=("--overlap-p2p-wgrad-delayed-layer-number", "0")), 4)
    assert "at least 1" in got["p2p-overlap-delayed-layer-number-range"]
    got = combination_failures(p2p_argv(flags=("--overlap-p2p-wgrad-delayed-layer-number", "3")), 4)
    msg = got["p2p-overlap-delayed-layer-number-range"]
    assert "2 layers per model chunk" in msg and "Use 1 to 2" in msg
    assert (
        combination_failures(p2p_argv(flags=("--overlap-p2p-wgrad-delayed-layer-number", "2")), 4)
        == {}
    )


def test_p2p_overlap_delayed_layer_number_with_an_uneven_layout():

    argv = argsfile.remove(p2p_argv(), "--num-layers-per-virtual-pipeline-stage")
    argv = argsfile.override(argv, "--num-layers", "6") + [
        "--pipeline-model-parallel-layout",
        "Et|tt|tt|tL",
    ]
    assert failures(argv + ["--overlap-p2p-wgrad-delayed-layer-number", "3"], 4) == {}
    got = combination_failures(argv + ["--overlap-p2p-wgrad-delayed-layer-number", "3"], 4)
    assert "model chunks of 1, 2 layers" in got["p2p-overlap-delayed-layer-number-range"]
    assert combination_failures(argv + ["--overlap-p2p-wgrad-delayed-layer-number", "2"], 4) == {}
