"""The Megatron-FSDP + CUDA-graph launch scripts pass pretrain_gpt.py --dry-run at their stated
world size, and an unsupported combination is refused before launch."""

import os

import pytest

from tests.unit.conftest import dry_run_example

SCRIPTS = {
    "local": os.path.join("examples", "pretrain_moe_fsdp_cuda_graphs.sh"),
    "slurm": os.path.join("examples", "slurm", "pretrain_moe_fsdp_cuda_graphs.sbatch"),
}


def dry_run(script, **knobs):
    # megatron refuses Megatron-FSDP with CUDA_DEVICE_MAX_CONNECTIONS=1
    proc = dry_run_example(SCRIPTS[script], drop=("CUDA_DEVICE_MAX_CONNECTIONS",), **knobs)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("script, world, ep", [("local", 2, 1), ("slurm", 8, 8)])
def test_script_layout_is_valid_with_fsdp_and_graphs(script, world, ep):
    code, out, err = dry_run(script)
    assert code == 0, out + err
    for line in (
        f"world size ........................ {world}",
        f"expert model parallel (EP) ........ {ep}",
        "fork features enabled: fsdp_cuda_graphs "
        "(--use-megatron-fsdp, --cuda-graph-impl transformer_engine)",
        "fsdp_cuda_graphs.capture_helper",
        "fsdp_cuda_graphs.hook_markers",
    ):
        assert line in out, line
    assert out.rstrip().endswith("dry-run: OK")


def test_script_knobs_reach_the_rules():
    code, out, err = dry_run("local", WARMUP_STEPS="0")
    assert code == 2
    assert (
        "[fsdp-cuda-graphs-supported]" in out + err and "--cuda-graph-warmup-steps 0" in out + err
    )
