"""pretrain_gpt.py --dry-run: the whole pre-launch check on a machine without a GPU."""

import os
import subprocess
import sys

from megatron.patchset.core import argsfile
from tests.unit.conftest import REFERENCE, ROOT, TINY


def dry_run(config, *extra, world_size=None, env_extra=None):
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    if world_size is not None:
        env["WORLD_SIZE"] = str(world_size)
    env.update(env_extra or {})

    cmd = [
        sys.executable,
        os.path.join(ROOT, "pretrain_gpt.py"),
        "--dry-run",
        *argsfile.read(config),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_tiny_config_on_two_gpus_prints_the_layout():
    code, out, err = dry_run(TINY, world_size=2)
    assert code == 0, out + err
    assert "world size ........................ 2" in out
    assert "data parallel (DP) ................ 2" in out
    assert "expert model parallel (EP) ........ 1" in out
    assert "parameters: 15,345,920 in total" in out
    assert "Theoretical memory footprints" in out
    assert "compat.compile_helpers" in out
    assert "transformer-engine[pytorch]==2.20.2" in out
    assert out.rstrip().endswith("dry-run: OK")
    assert "Traceback" not in err


def test_expert_parallel_three_on_two_gpus_names_the_flag():
    code, out, err = dry_run(TINY, "--expert-model-parallel-size", "3", world_size=2)
    assert code != 0
    assert "--expert-model-parallel-size" in out
    assert "dry-run: INVALID" in out
    assert "Traceback" not in err


def test_dry_run_world_size_flag_overrides_environment():
    code, out, _ = dry_run(
        TINY, "--expert-model-parallel-size", "2", "--dry-run-world-size", "4", world_size=1
    )
    assert code == 0, out
    assert "world size ........................ 4" in out
    assert "expert data parallel .............. 2" in out


def test_megatron_validation_failure_is_reported_not_raised():
    # A check only megatron does: the config's sequence length against its position embeddings.
    code, out, err = dry_run(TINY, "--max-position-embeddings", "512", world_size=1)
    assert code == 2
    assert "megatron-core refused the flags" in out and "--max-position-embeddings" in out
    assert "Traceback" not in err


def test_transformer_config_post_init_checks_run():
    # Caught by TransformerConfig.__post_init__ (not by validate_args): overlap of EP
    # all-to-all needs expert parallelism.
    code, out, _ = dry_run(TINY, "--overlap-moe-expert-parallel-comm", world_size=1)
    assert code != 0
    assert "expert model parallelism" in out or "expert_model_parallel" in out


def test_reference_config_fits_its_stated_budget():
    code, out, err = dry_run(REFERENCE, world_size=1)
    assert code == 0, out + err
    assert "128 experts (top-8)" in out
    assert "parameters: " in out


def test_gradient_accumulation_fusion_lists_apex():

    argv = argsfile.remove(argsfile.read(TINY), "--no-gradient-accumulation-fusion")
    env = dict(os.environ, WORLD_SIZE="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--dry-run", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0
    assert "apex (fused_weight_gradient_mlp_cuda extension)" in proc.stdout
    code, out, _ = dry_run(TINY, world_size=1)
    assert "apex" not in out


def test_expert_overlap_flags_still_get_a_parameter_count():
    code, out, _ = dry_run(
        TINY,
        "--expert-model-parallel-size",
        "2",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
        world_size=2,
    )
    assert code == 0, out
    assert "parameters: 15,345,920 in total" in out
