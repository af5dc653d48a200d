"""--overlap-dispatch-backward-with-experts-wgrad with the torch grouped GEMMs on GPUs.

megatron's MoE layer computes the experts' weight gradients on a side stream after it has issued
the dispatch's backward all-to-all. Under ``--deterministic-mode`` a run with the flag equals the
same run without it bit for bit (losses and gradient norms):

* one GPU: the static dispatch's full-iteration graph, which captures the side stream;
* two GPUs (EP = 2): megatron's dynamic all-to-all eagerly, and the static dispatch with one slot
  per token and peer in the full-iteration graph, as the small_batch recipe runs it.

With ``--moe-wgrad-sm-carveout 24`` as well (the weight-gradient GEMMs on 24 fewer SMs) each run
gives the same bits too, and its log holds torch's warning that the carve-out was set.
"""

import pytest

from tests.gpu.conftest import (
    DETERMINISTIC,
    GROUPED_MM_GRAPHED,
    assert_same_bits,
    gpu_count,
    launch_many,
    tiny_argv,
)

pytestmark = pytest.mark.gpu

ITERS = 12
FLAG = ("--overlap-dispatch-backward-with-experts-wgrad",)
BASE = DETERMINISTIC + ("--no-check-for-nan-in-loss-and-grad", "--moe-swiglu-triton")
TORCH_GEMMS = ("--moe-grouped-gemm-impl", "torch", "--moe-permute-fusion")
STATIC_GRAPH = GROUPED_MM_GRAPHED + ("--moe-static-dispatch", "--logging-level", "20")
EP2 = ("--expert-model-parallel-size", "2")
DEDUP = ("--moe-static-dispatch-dedup", "--moe-static-dispatch-capacity-factor", "1.25")
CARVEOUT = ("--moe-wgrad-sm-carveout", "24")
CAPTURED = "CUDA graph capture done for training"
CARVED = "Setting the SM carveout for matmuls"

# name: (GPUs, flags without the flag under test)
PAIRS = {
    "static_graph_1gpu": (1, STATIC_GRAPH),
    "dynamic_ep2": (2, TORCH_GEMMS + EP2),
    "static_dedup_graph_ep2": (2, STATIC_GRAPH + DEDUP + EP2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("delayed_wgrad")
    jobs = []
    for name, (nproc, flags) in PAIRS.items():
        if gpu_count() < nproc:
            continue
        for suffix, extra in (("", ()), ("_delayed", FLAG), ("_carved", FLAG + CARVEOUT)):
            argv = tiny_argv("--train-iters", str(ITERS), *BASE, *flags, *extra)
            jobs.append(dict(tmp_path=tmp, name=name + suffix, nproc=nproc, argv=argv))
    return launch_many(jobs)


def compare(runs, name):
    nproc = PAIRS[name][0]
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    immediate = runs[name]
    for variant in ("delayed", "carved"):
        run = runs[f"{name}_{variant}"]
        if "--cuda-graph-impl" in PAIRS[name][1]:
            assert CAPTURED in run.log_text()
        assert (CARVED in run.log_text()) == (variant == "carved")
        assert_same_bits(run, immediate, f"{name}: {variant} vs immediate expert wgrad", ITERS)


@pytest.mark.gpus(1)
def test_the_full_iteration_graph_with_the_side_stream_gives_the_same_bits(runs):
    compare(runs, "static_graph_1gpu")


@pytest.mark.gpus(2)
def test_ep2_with_megatrons_all_to_all_gives_the_same_bits(runs):
    compare(runs, "dynamic_ep2")


@pytest.mark.gpus(2)
def test_ep2_static_dispatch_graph_as_the_recipe_runs_it_gives_the_same_bits(runs):
    compare(runs, "static_dedup_graph_ep2")
