"""The fork's schedule plan (--overlap-p2p-*) trains bit-identically to megatron's own
fine-grained schedule.

Two GPUs, EP=2, no pipeline: megatron's combined 1F1B schedule for one model chunk, with
``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``. There is no backward P2P here, so
deferring the weight gradients of N layers only changes when their GEMMs are enqueued; every
parameter gets the same gradients in the same order and the losses and gradient norms must
equal upstream's to the last bit. One torchrun process runs all modes on identical seeds and
batches (tests/gpu/harness/p2p_overlap.py); upstream runs twice to show that the reference
itself is deterministic.

Four GPUs, PP=2 with VPP=2 and EP=2 (the layout of examples/pretrain_moe_p2p_overlap.sh), where
the backward P2P exists: each option alone and all together, same bit-identity requirement
(moving ``post_backward`` to the communication stream and deferring weight-gradient GEMMs past
it changes when work is enqueued, not what is computed).
"""

import math
import os

import pytest

from tests.gpu.conftest import ROOT, first_difference, launch, tiny_argv

pytestmark = pytest.mark.gpu

HARNESS = os.path.join(ROOT, "tests", "gpu", "harness", "p2p_overlap.py")
ITERATIONS = 20
FORK_MODES = ("fork:1", "fork:2", "fork:all:tl:comm")


def by_mode(records):
    modes = {}
    for record in records:
        if "mode" in record:
            modes.setdefault(record["mode"], []).append(record)
    return modes


def check_against_upstream(run, fork_modes, iterations):
    """Every fork mode's losses and grad norms equal upstream's, bit for bit; upstream run twice
    agrees with itself. Returns the upstream series (loss, grad norm)."""
    modes = by_mode(run.records)
    assert set(modes) == {"upstream", "upstream#2", *fork_modes}, sorted(modes)

    def series(mode, key):
        return [r["losses"]["lm loss"] if key == "loss" else r["grad_norm"] for r in modes[mode]]

    reference = modes["upstream"]
    assert len(reference) == iterations
    assert all(math.isfinite(x) for x in series("upstream", "loss"))
    assert series("upstream", "loss")[-1] < series("upstream", "loss")[0]
    assert reference[-1]["plan_runs"].get("TransformerModelChunkSchedulePlan", 0) > 0, (
        "the upstream runs did not go through megatron's fine-grained schedule plan"
    )
    for key in ("loss", "grad"):
        diff = first_difference(series("upstream#2", key), series("upstream", key))
        assert diff is None, (
            f"upstream's own {key} differs between two identical runs at iteration "
            f"{diff[0] + 1 if diff else '?'} ({diff}): the reference is not deterministic on this "
            "machine, so bit-identity cannot be checked (see P2P_OVERLAP_DETERMINISTIC)"
        )

    for mode in fork_modes:
        records = modes[mode]
        assert len(records) == iterations, mode
        assert records[0]["model_class"] == "P2POverlapGPTModel", records[0]
        assert records[-1]["plan_runs"].get("P2POverlapChunkSchedulePlan", 0) > 0, (
            f"{mode}: megatron's schedule did not run the fork's plan"
        )
        for key in ("loss", "grad"):
            diff = first_difference(series(mode, key), series("upstream", key))
            assert diff is None, (
                f"{mode} (options {records[0]['options']}): {key} differs from upstream at "
                f"iteration {diff[0] + 1}: {diff[1]!r} vs {diff[2]!r}"
            )
    return series("upstream", "loss"), series("upstream", "grad")


def deterministic():
    # torch deterministic algorithms, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, NCCL_ALGO=Ring
    return (
        ["--deterministic-mode"] if os.environ.get("P2P_OVERLAP_DETERMINISTIC", "1") != "0" else []
    )


@pytest.mark.gpus(2)
def test_delayed_wgrad_layers_match_upstream_fine_grained_schedule(tmp_path):
    argv = tiny_argv(
        "--expert-model-parallel-size",
        "2",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
        "--train-iters",
        str(ITERATIONS),
        "--global-batch-size",
        "32",  # 4 micro-batches per step: 3 overlapped f/b steps
        *deterministic(),
    )
    env = {
        "P2P_OVERLAP_MODES": ",".join(("upstream", "upstream") + FORK_MODES),
        # The all-to-all overlap runs kernels on two streams at once.
        "CUDA_DEVICE_MAX_CONNECTIONS": "32",
    }
    run = launch(tmp_path, "p2p_overlap_ep2", 2, argv, env=env, entry=[HARNESS])
    losses, grads = check_against_upstream(run, FORK_MODES, ITERATIONS)
    print(
        f"\nfork == upstream for {ITERATIONS} iterations in modes {', '.join(FORK_MODES)}: last "
        f"loss {losses[-1]!r}, grad norm {grads[-1]!r}; {run.seconds:.0f} s"
    )


# Four GPUs: PP=2 with two model chunks per rank (VPP=2), EP=2 across the two DP replicas of each
# stage. 12 layers = 3 per chunk, so 1, 2 and "all" delayed layers are three different plans.
# Each option on its own (the other two at upstream's values: delayed layers 1 is upstream's
# own deferral of the last backward layer's attention weight gradient), then all together.
PP_FORK_MODES = (
    "fork:1:comm",  # --overlap-p2p-backward-on-comm-stream
    "fork:1",  # --overlap-p2p-wgrad-delayed-layer-number 1
    "fork:2",  # ... 2
    "fork:all",  # ... all (3, the chunk's layers)
    "fork:1:tl",  # --overlap-p2p-with-transformer-layer-wgrad
    "fork:all:tl:comm",  # all three
)


@pytest.mark.gpus(4)
def test_p2p_overlap_options_match_upstream_with_interleaved_pipeline(tmp_path):
    argv = tiny_argv(
        "--num-layers",
        "12",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "3",
        "--expert-model-parallel-size",
        "2",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
        "--train-iters",
        str(ITERATIONS),
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "32",  # DP=2: 8 micro-batches per step and replica
        *deterministic(),
    )
    env = {
        "P2P_OVERLAP_MODES": ",".join(("upstream", "upstream") + PP_FORK_MODES),
        "CUDA_DEVICE_MAX_CONNECTIONS": "32",
    }
    run = launch(tmp_path, "p2p_overlap_pp2_vpp2_ep2", 4, argv, env=env, entry=[HARNESS])
    modes = by_mode(run.records)
    # The "all" modes defer the three layers of a chunk.
    assert modes["fork:all"][0]["options"]["overlap_p2p_wgrad_delayed_layer_number"] == 3
    losses, grads = check_against_upstream(run, PP_FORK_MODES, ITERATIONS)
    print(
        f"\nPP=2 VPP=2 EP=2: fork == upstream for {ITERATIONS} iterations in modes "
        f"{', '.join(PP_FORK_MODES)}: last loss {losses[-1]!r}, grad norm {grads[-1]!r}; "
        f"{run.seconds:.0f} s"
    )
