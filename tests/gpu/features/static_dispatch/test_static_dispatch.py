"""--moe-static-dispatch on GPUs.

Every run takes the experts' weighted SwiGLU as the Triton kernels of ``--moe-swiglu-triton``,
which give a row the same bits whatever the number of rows: megatron-core's compiled activation
sums the routing probabilities' gradient in an order that depends on the row count it was compiled
for, and the static path's capacity-padded expert inputs then give other bits than the dynamic
path's exact ones (with megatron's activation and ``TORCHDYNAMO_DISABLE=1`` the EP = 2 runs below
agree to the bit too).

One GPU (EP = 1):
* under ``--deterministic-mode`` the static path equals the device-side-counts path bit for bit
  (at EP = 1 every row fits), and its full-iteration graph replays the eager step bit for bit;
* with the optimizer in a graph too (``--optimizer-cuda-graph``) the run trains within bf16
  tolerance of eager.

Two GPUs (EP = 2): the static path trains like megatron's dynamic all-to-all, and under
``--deterministic-mode`` equals it bit for bit; its full-iteration graph replays the eager step bit
for bit; a capacity factor that overflows re-runs those steps dynamically (and the run still
matches), or stops with the error that names the flag.
"""

import pytest

from tests.gpu.conftest import (
    assert_same_bits,
    assert_trains_alike,
    gpu_count,
    launch_many,
    tiny_argv,
)

pytestmark = pytest.mark.gpu

ITERS = 20
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")
BASE = (
    "--moe-grouped-gemm-impl",
    "torch",
    "--moe-permute-fusion",
    "--no-check-for-nan-in-loss-and-grad",
    "--moe-swiglu-triton",
)
SPLITS = ("--moe-expert-splits-on-device",)
STATIC = SPLITS + ("--moe-static-dispatch",)
FULL_GRAPH = (
    "--cuda-graph-impl",
    "full_iteration",
    "--cuda-graph-warmup-steps",
    "2",
    "--logging-level",
    "20",
)
OPTIMIZER_GRAPH = ("--optimizer-cuda-graph",)
DETERMINISTIC = ("--deterministic-mode", "--te-rng-tracker")
EP2 = ("--expert-model-parallel-size", "2")
CAPTURED = "CUDA graph capture done for training"
RERUN = "re-running it with megatron's dynamic all-to-all"
LOSS_ATOL = 2e-2
GRAD_NORM_RTOL = 5e-2

# name: (GPUs, flags); every run adds tiny_argv, ITERS iterations, no dropout and BASE.
RUNS = {
    "det_splits_1gpu": (1, DETERMINISTIC + SPLITS),
    "det_static_1gpu": (1, DETERMINISTIC + STATIC),
    "det_static_graph_1gpu": (1, DETERMINISTIC + STATIC + FULL_GRAPH),
    "static_1gpu": (1, STATIC),
    "static_graph_optimizer_1gpu": (1, STATIC + FULL_GRAPH + OPTIMIZER_GRAPH),
    "dynamic_ep2": (2, EP2),
    "static_ep2": (2, STATIC + EP2),
    "det_dynamic_ep2": (2, DETERMINISTIC + EP2),
    "det_static_ep2": (2, DETERMINISTIC + STATIC + EP2),
    "det_static_graph_ep2": (2, DETERMINISTIC + STATIC + EP2 + FULL_GRAPH),
    "det_overflow_rerun_ep2": (
        2,
        DETERMINISTIC
        + STATIC
        + EP2
        + FULL_GRAPH
        + ("--moe-static-dispatch-capacity-factor", "1.0"),
    ),
}


def launch_runs(tmp, runs, iters):
    """Every run of ``runs`` (name: (GPUs, flags)) that this machine has the GPUs for, on the tiny
    config for ``iters`` iterations without dropout, with BASE."""
    jobs = [
        dict(
            tmp_path=tmp,
            name=name,
            nproc=nproc,
            argv=tiny_argv("--train-iters", str(iters), *NO_DROPOUT, *BASE, *flags),
        )
        for name, (nproc, flags) in runs.items()
        if gpu_count() >= nproc
    ]
    return launch_many(jobs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_runs(tmp_path_factory.mktemp("static_dispatch"), RUNS, ITERS)


def needs(n):
    if gpu_count() < n:
        pytest.skip(f"needs {n} GPUs")


def close(ours, reference, label, iters=ITERS):
    assert_trains_alike(
        ours, reference, label, iters=iters, loss_atol=LOSS_ATOL, grad_norm_rtol=GRAD_NORM_RTOL
    )


@pytest.mark.gpus(1)
def test_static_path_at_ep1_equals_the_device_counts_path_bitwise(runs):
    assert_same_bits(
        runs["det_static_1gpu"], runs["det_splits_1gpu"], "static vs device counts, EP=1", ITERS
    )


@pytest.mark.gpus(1)
def test_static_path_full_iteration_graph_replays_the_eager_step_bitwise(runs):
    graphed, eager = runs["det_static_graph_1gpu"], runs["det_static_1gpu"]
    assert CAPTURED in graphed.log_text() and CAPTURED not in eager.log_text()
    assert_same_bits(graphed, eager, "static, full-iteration graph vs eager, EP=1", ITERS)


@pytest.mark.gpus(1)
def test_optimizer_graph_trains_like_eager(runs):
    ours = runs["static_graph_optimizer_1gpu"]
    log = ours.log_text()
    assert CAPTURED in log
    assert "optimizer" in log.lower() and "captur" in log.lower()
    close(ours, runs["static_1gpu"], "full-iteration + optimizer graphs vs eager, EP=1")


@pytest.mark.gpus(2)
def test_static_ep2_trains_like_the_dynamic_all_to_all(runs):
    needs(2)
    close(runs["static_ep2"], runs["dynamic_ep2"], "static vs dynamic all-to-all, EP=2")


@pytest.mark.gpus(2)
def test_static_ep2_equals_the_dynamic_all_to_all_bitwise(runs):
    needs(2)
    assert_same_bits(
        runs["det_static_ep2"], runs["det_dynamic_ep2"], "static vs dynamic, EP=2, bitwise", ITERS
    )


@pytest.mark.gpus(2)
def test_static_ep2_full_iteration_graph_replays_the_eager_step_bitwise(runs):
    needs(2)
    graphed = runs["det_static_graph_ep2"]
    assert CAPTURED in graphed.log_text() and RERUN not in graphed.log_text()
    assert_same_bits(
        graphed, runs["det_static_ep2"], "static, full-iteration graph vs eager, EP=2", ITERS
    )


@pytest.mark.gpus(2)
def test_overflow_reruns_the_step_and_the_run_still_matches(runs, tmp_path):
    needs(2)
    rerun = runs["det_overflow_rerun_ep2"]
    reruns = rerun.log_text().count(RERUN)
    print(f"\ncapacity factor 1.0 at EP=2: {reruns} step(s) re-run of {ITERS}")
    assert reruns >= 1
    label = f"overflow re-runs vs dynamic, EP=2 ({reruns} re-run lines of {ITERS} steps x 2 ranks)"
    assert_same_bits(rerun, runs["det_dynamic_ep2"], label, ITERS)
    argv = tiny_argv(
        "--train-iters",
        "6",
        *NO_DROPOUT,
        *BASE,
        *STATIC,
        *EP2,
        "--moe-static-dispatch-capacity-factor",
        "1.0",
        "--moe-static-dispatch-on-overflow",
        "fail",
    )
    failed = launch_many(
        [dict(tmp_path=tmp_path, name="overflow_fail", nproc=2, argv=argv, check=False)],
        timeout=300,
    )["overflow_fail"]
    assert failed.returncode != 0
    assert "Raise --moe-static-dispatch-capacity-factor" in failed.log_text()
