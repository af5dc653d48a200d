"""The example launchers: the Slurm script passes --dry-run at its stated world size, and the
quick start checks the config (and says training needs a GPU) on a machine without one (no
nvidia-smi on PATH)."""

from tests.unit.conftest import run_example as run_script


def test_slurm_script_passes_dry_run_for_its_world_size():
    proc = run_script("examples/slurm/pretrain_moe.sbatch", {"DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size ........................ 32" in proc.stdout  # 4 nodes x 8 GPUs (#SBATCH)
    assert "pipeline model parallel (PP) ...... 2" in proc.stdout
    assert "expert model parallel (EP) ........ 8" in proc.stdout
    assert "48 layers" in proc.stdout
    assert proc.stdout.rstrip().endswith("dry-run: OK")


def test_slurm_script_knobs_reach_the_layout():
    proc = run_script(
        "examples/slurm/pretrain_moe.sbatch",
        {"DRY_RUN": "1", "NODES": "2", "PP": "2", "VPP": "2", "EP": "4", "GLOBAL_BATCH": "256"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size ........................ 16" in proc.stdout
    assert "virtual pipeline stages (VPP) ..... 2" in proc.stdout
    assert "expert model parallel (EP) ........ 4" in proc.stdout


def test_slurm_script_rejects_a_bad_layout():
    proc = run_script("examples/slurm/pretrain_moe.sbatch", {"DRY_RUN": "1", "EP": "12"})
    assert proc.returncode != 0
    assert "--expert-model-parallel-size" in proc.stdout


def test_quick_start_without_gpu_runs_the_dry_run(path_without_nvidia_smi):
    proc = run_script(
        "examples/train_tiny_moe.sh",
        {"PATH": path_without_nvidia_smi},
        drop=("NGPUS", "DRY_RUN", "CUDA_VISIBLE_DEVICES"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Training needs an NVIDIA GPU" in proc.stdout
    assert "DRY_RUN: " in proc.stdout
    assert "dry-run: OK" in proc.stdout
    assert "Traceback" not in proc.stderr
