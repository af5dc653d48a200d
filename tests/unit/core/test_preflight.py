"""What a launch checks before megatron's own set-up: the launcher's environment, megatron's
validation failures as one line naming the flags, --help, unknown flags, the GPU; every bad input
ends in one message and a non-zero exit, never a traceback."""

import io
import os
import subprocess
import sys

import pytest

from megatron.patchset.core import dry_run, preflight
from tests.unit.conftest import ROOT, tiny_argv


def launch(*argv, env=None):
    environ = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=300,
    )


def test_environment_problems_name_the_variable():
    assert preflight.environment_problems({"WORLD_SIZE": "8", "RANK": "3"}) == []
    problems = preflight.environment_problems(
        {"WORLD_SIZE": "abc", "RANK": "-1", "LOCAL_RANK": "x"}
    )
    assert problems == [
        "WORLD_SIZE='abc' is not an integer",
        "RANK=-1 must be 0 or more",
        "LOCAL_RANK='x' is not an integer",
    ]
    with pytest.raises(preflight.PreflightError, match="WORLD_SIZE='abc'"):
        preflight.check_environment({"WORLD_SIZE": "abc"})


def test_a_bare_megatron_assert_is_shown_with_flags(tmp_path):
    import importlib.util

    source = tmp_path / "site" / "megatron" / "training" / "checks.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "def validate(args):\n    assert args.hidden_size % args.num_attention_heads == 0\n"
    )
    spec = importlib.util.spec_from_file_location("checks_under_test", source)
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    args = type("Args", (), {"hidden_size": 250, "num_attention_heads": 8})()
    with pytest.raises(preflight.PreflightError) as err:
        preflight.megatron_validated(lambda: checks.validate(args))
    text = str(err.value)
    assert text.startswith("megatron-core refused the flags at megatron/training/checks.py:2")
    assert "--hidden-size % --num-attention-heads == 0" in text
    with pytest.raises(preflight.PreflightError, match="refused the flags: needs --foo"):
        preflight.megatron_validated(lambda: (_ for _ in ()).throw(AssertionError("needs --foo")))


def test_help_works_and_lists_the_fork_group():
    proc = launch("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\nmegatron-patchset:\n  --dry-run" in proc.stdout
    assert "--moe-paged-stash-buffer-size-factor-cuda" in proc.stdout  # the help that had '10%'


def test_unknown_flag_is_one_line_with_the_closest_flags():
    proc = launch("--dry-run", *tiny_argv("--moe-grouped-gem"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-2:] == [
        "pretrain_gpt.py: error: unrecognized arguments: --moe-grouped-gem (--moe-grouped-gem: "
        "did you mean --moe-grouped-gemm or --moe-grouped-gemm-impl?)",
        "pretrain_gpt.py --help lists every flag.",
    ]
    assert "usage:" not in proc.stderr


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "abc"}, {"RANK": "one"}])
def test_a_bad_launcher_variable_is_named_in_launch_and_dry_run(env):
    for argv in (tiny_argv(), ["--dry-run", *tiny_argv()]):
        proc = launch(*argv, env=env)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        name = next(iter(env))
        assert f"{name}=" in proc.stdout + proc.stderr


def test_launch_without_a_gpu_says_so_before_megatron_asks_the_driver():
    proc = launch(*tiny_argv(), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1
    assert "training needs an NVIDIA GPU and none is visible" in proc.stderr
    assert "Traceback" not in proc.stderr and "NVIDIA driver" not in proc.stderr


def test_launch_runs_the_fork_rules_before_the_gpu_check():
    proc = launch(*tiny_argv("--pipeline-model-parallel-size", "0"))
    assert proc.returncode == 1 and "[sizes-positive]" in proc.stderr
    assert "Traceback" not in proc.stderr


def in_process(argv, monkeypatch=None):
    out = io.StringIO()
    code = dry_run.run(argv, out=out)
    return code, out.getvalue()


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"MEGATRON_PATCHSET": "off"}, "MEGATRON_PATCHSET=off runs unpatched upstream"),
        ({"MEGATRON_PATCHSET_SKIP_PATCHES": "no.such"}, "no patch named no.such"),
    ],
)
def test_the_dry_run_refuses_what_the_launch_refuses(monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out = in_process(tiny_argv("--compile-transformer-layers"))
    assert code == 2 and expected in out and out.rstrip().endswith("dry-run: INVALID")


def test_a_model_that_does_not_build_makes_the_dry_run_invalid(monkeypatch):
    def no_build(args, config):
        raise ValueError("the layer spec does not fit")

    monkeypatch.setattr(dry_run, "count_parameters", no_build)
    code, out = in_process(tiny_argv())
    assert code == 2
    assert "the model cannot be built with these flags: the layer spec does not fit" in out


def test_the_dry_run_names_its_data(tmp_path):
    from megatron.patchset.core import argsfile
    from tests.unit.support.indexed_data import write_dataset

    prefix = write_dataset(tmp_path / "text")
    code, out = in_process(argsfile.remove(tiny_argv(), "--mock-data") + ["--data-path", prefix])
    assert code == 0, out
    assert f"data: 1 indexed dataset(s): {prefix} (--tokenizer-type NullTokenizer)" in out
    code, out = in_process(tiny_argv())
    assert "data: mock data (--mock-data)" in out


@pytest.mark.parametrize(
    "tool, argv, expected",
    [
        (
            "bench.py",
            ["--config", "/no/such.args"],
            "argument --config: /no/such.args: no such file",
        ),
        ("bench.py", ["--config", "examples"], "examples is a directory, not a flag file"),
        (
            "bench.py",
            ["--config", "examples/configs/tiny_moe.args", "--nproc", "0"],
            "argument --nproc: 0 is less than 1",
        ),
        ("profile_step.py", ["--config", "/no/such.args"], "/no/such.args: no such file"),
        (
            "profile_step.py",
            ["--config", "examples/configs/tiny_moe.args", "--nproc", "0"],
            "argument --nproc: 0 is less than 1",
        ),
        ("profile_step.py", ["--summary", "/no/summary.json"], "--summary /no/summary.json"),
    ],
)
def test_tools_refuse_bad_arguments_in_one_line(tool, argv, expected):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench", tool), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and expected in proc.stderr
    assert "Traceback" not in proc.stderr
