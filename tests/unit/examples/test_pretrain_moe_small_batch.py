"""The small-micro-batch recipe: the launch and Slurm scripts pass pretrain_gpt.py --dry-run with
the flags they would launch with, their GRAPHS knob picks the graph mode, and a combination the
capture cannot take is refused before launch."""

import os

import pytest

from tests.unit.conftest import dry_run_example

SCRIPTS = {
    "local": os.path.join("examples", "pretrain_moe_small_batch.sh"),
    "slurm": os.path.join("examples", "slurm", "pretrain_moe_small_batch.sbatch"),
}
PATCHES = (
    "grouped_mm.fc1",
    "grouped_mm.splits_on_device_dispatcher",
    "grouped_mm.splits_on_device_grouped_mlp",
    "dp_grad_scaling.unscaled_buffers",
    "dp_grad_scaling.scaled_loss_gradient",
)


@pytest.mark.parametrize("script, world", [("local", 1), ("slurm", 8)])
def test_full_graph_recipe_passes_the_dry_run(script, world):
    proc = dry_run_example(SCRIPTS[script])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"world size ........................ {world}" in out
    assert "expert model parallel (EP) ........ 1" in out
    assert (
        "fork features enabled: grouped_mm "
        "(--moe-grouped-gemm-impl torch, --moe-expert-splits-on-device); torch_adam "
        "(--adam-impl triton); dp_grad_scaling (--ddp-scale-grads-in-loss)" in out
    )
    assert all(name in out for name in PATCHES)
    assert out.rstrip().endswith("dry-run: OK")


@pytest.mark.parametrize("graphs", ["layer", "none"])
def test_other_graph_modes_leave_the_counts_on_the_host(graphs):
    proc = dry_run_example(SCRIPTS["local"], GRAPHS=graphs, MICRO_BATCH="4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "fork features enabled: grouped_mm (--moe-grouped-gemm-impl torch); dp_grad_scaling "
        "(--ddp-scale-grads-in-loss); triton_swiglu (--moe-swiglu-triton)\n" in proc.stdout
    )
    assert "splits_on_device" not in proc.stdout
    assert "micro-batches per step ............ 1 (global 4, micro 4)" in proc.stdout


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_the_full_graph_recipe_takes_the_forks_triton_kernels_unless_told_not_to(kernels):
    proc = dry_run_example(SCRIPTS["local"], KERNELS=kernels)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for feature, patch in (
        ("torch_adam (--adam-impl triton)", "torch_adam.triton_step"),
        ("triton_cross_entropy (--cross-entropy-triton)", "triton_cross_entropy.fused_loss"),
    ):
        assert (feature in out) == (kernels == "1"), out
        assert (patch in out) == (kernels == "1")
    assert out.rstrip().endswith("dry-run: OK")


def test_a_timer_inside_the_captured_step_is_refused_before_launch():
    proc = dry_run_example(SCRIPTS["slurm"], EXTRA="--timing-log-level 1")
    assert proc.returncode != 0
    assert "[full-iteration-graphs-timers]" in proc.stdout + proc.stderr


def test_unknown_graph_mode_is_an_error():
    proc = dry_run_example(SCRIPTS["local"], GRAPHS="everything")
    assert proc.returncode == 2 and "GRAPHS must be full, layer or none" in proc.stderr


@pytest.mark.parametrize("script, knobs", [("local", {"NGPUS": "2"}), ("slurm", {})])
def test_expert_parallel_full_graphs_take_the_static_all_to_all(script, knobs):
    proc = dry_run_example(SCRIPTS[script], EP="2", CAPACITY_FACTOR="1.5", **knobs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "expert model parallel (EP) ........ 2" in out
    assert (
        "static_dispatch (--moe-static-dispatch, --moe-static-dispatch-capacity-factor 1.5" in out
    )
    assert "static_dispatch.graph_step" in out
    # one slot per token and peer unless DEDUP=0
    assert "--moe-static-dispatch-dedup: each token crosses to a peer once" in out
    assert "--optimizer-cuda-graph" in out  # the same recipe in both forms
    assert out.rstrip().endswith("dry-run: OK")


def test_dedup_0_sends_one_row_per_routed_expert():
    proc = dry_run_example(SCRIPTS["local"], NGPUS="2", EP="2", DEDUP="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "static_dispatch (--moe-static-dispatch" in proc.stdout
    assert "--moe-static-dispatch-dedup" not in proc.stdout


def test_expert_parallel_without_full_graphs_keeps_megatrons_dispatcher():
    proc = dry_run_example(SCRIPTS["local"], NGPUS="2", EP="2", GRAPHS="layer")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "static_dispatch" not in proc.stdout and "--optimizer-cuda-graph" not in proc.stdout


@pytest.mark.parametrize(
    "knob, value, message",
    [
        ("EP", "0", "EP must be a whole number >= 1"),
        ("CAPACITY_FACTOR", "lots", "CAPACITY_FACTOR must be a number"),
        ("OPTIMIZER_GRAPH", "yes", "OPTIMIZER_GRAPH must be 0 or 1"),
        ("KERNELS", "on", "KERNELS must be 0 or 1"),
    ],
)
def test_bad_expert_knobs_are_named(knob, value, message):
    proc = dry_run_example(SCRIPTS["local"], **{knob: value})
    assert proc.returncode == 2 and message in proc.stderr


def test_a_capacity_factor_below_one_is_refused_before_launch():
    proc = dry_run_example(SCRIPTS["local"], NGPUS="2", EP="2", CAPACITY_FACTOR="0.5")
    assert proc.returncode != 0
    assert "[moe-static-dispatch-capacity-factor]" in proc.stdout + proc.stderr


@pytest.mark.parametrize("script", ["local", "slurm"])
def test_a_memory_budget_chooses_the_levers_in_the_dry_run(script):
    """MEMORY=80G at 4x4096 tokens per rank of the reference config: no lever does not fit
    (the records: 81.58 GiB allocated), bf16 moments alone do and are taken."""
    knobs = (
        {"MICRO_BATCH": "4"} if script == "local" else {"MICRO_BATCH": "4", "GPUS_PER_NODE": "1"}
    )
    proc = dry_run_example(SCRIPTS[script], MEMORY="80G", **knobs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "memory_budget (--memory-budget 80G)" in out
    assert "--adam-moments-dtype bf16" in out
    chosen = [line for line in out.splitlines() if " chosen " in line]
    assert len(chosen) == 1 and chosen[0].rstrip().endswith("bf16 Adam moments"), out
    assert out.rstrip().endswith("dry-run: OK")


def test_a_budget_nothing_fits_is_refused_before_launch_in_one_line():
    proc = dry_run_example(SCRIPTS["local"], MEMORY="40G", MICRO_BATCH="4")
    assert proc.returncode == 2
    lines = [line for line in proc.stdout.splitlines() if "MEMORY=40G" in line]
    assert len(lines) == 1, proc.stdout
    assert "needs about" in lines[0] and "--micro-batch-size (now 4)" in lines[0]
