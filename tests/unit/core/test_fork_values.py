"""Values the fork reads that megatron's parser accepts as they are: numbers that are not finite,
the core's flags that act only with another, and ``MEGATRON_PATCHSET``. Each is refused in the
dry-run and at launch with one line naming the flag or the variable."""

import io
import os
import subprocess
import sys

import pytest

from megatron.patchset.core import dry_run, registry
from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.flags import finite_float
from tests.unit.conftest import ROOT, failures, tiny_argv


def in_process(argv):
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stderr
    sys.stderr = err
    try:
        code = dry_run.run(argv, out=out)
    except SystemExit as exc:  # argparse
        code = exc.code
    finally:
        sys.stderr = saved
    return code, out.getvalue() + err.getvalue()


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


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_finite_float_refuses_what_float_reads_as_not_a_number(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="is not a finite number"):
        finite_float(text)
    assert finite_float("1e305") == 1e305
    with pytest.raises(argparse.ArgumentTypeError, match="invalid float value: 'x'"):
        finite_float("x")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_fork_flag_given_nan_or_inf_is_refused_by_name(value):
    code, text = in_process(
        tiny_argv("--moe-static-dispatch", "--moe-static-dispatch-capacity-factor", value)
    )
    assert code == 2
    assert (
        f"error: argument --moe-static-dispatch-capacity-factor: {value} is not a finite number"
        in text
    )
    assert "Traceback" not in text


def test_dry_run_world_size_without_dry_run_is_refused_at_launch():
    got = failures(tiny_argv("--dry-run-world-size", "4"))
    assert got == {
        "fork-flags-need-their-switch": "--dry-run-world-size 4 only acts with --dry-run (a "
        "launch runs on the world size torchrun gives it): add --dry-run or drop the flag."
    }
    assert failures(tiny_argv("--dry-run", "--dry-run-world-size", "4")) == {}
    # the dry-run itself, also when called without --dry-run in its argv
    code, text = in_process(tiny_argv("--dry-run-world-size", "2"))
    assert code == 0, text


def test_load_allow_missing_without_load_is_refused(tmp_path):
    got = failures(tiny_argv("--load-allow-missing"))
    assert got["fork-flags-need-their-switch"] == (
        "--load-allow-missing only acts with --load: add --load or drop the flag."
    )
    assert failures(tiny_argv("--load-allow-missing", "--load", str(tmp_path))) == {}


@pytest.mark.parametrize("value", ["", "on", "1", "ON"])
def test_megatron_patchset_on_values_run_the_fork(monkeypatch, value):
    monkeypatch.setenv("MEGATRON_PATCHSET", value)
    assert registry.upstream_mode() is False


@pytest.mark.parametrize("value", ["off", "0", "upstream", "Off"])
def test_megatron_patchset_off_values_run_upstream(monkeypatch, value):
    monkeypatch.setenv("MEGATRON_PATCHSET", value)
    assert registry.upstream_mode() is True


@pytest.mark.parametrize("value", ["false", "no", "disabled", "2"])
def test_another_megatron_patchset_value_is_refused_with_the_accepted_ones(monkeypatch, value):
    monkeypatch.setenv("MEGATRON_PATCHSET", value)
    with pytest.raises(PatchsetError) as err:
        registry.upstream_mode()
    assert str(err.value) == (
        f"megatron-patchset: MEGATRON_PATCHSET={value!r} is not one of on, 1 (the fork, as when "
        "unset) or off, 0, upstream (unpatched upstream megatron-core)."
    )
    code, text = in_process(tiny_argv())
    assert code == 2 and f"MEGATRON_PATCHSET={value!r} is not one of" in text


@pytest.mark.slow
def test_the_launch_refuses_megatron_patchset_false_before_anything_runs():
    proc = launch(*tiny_argv(), env={"MEGATRON_PATCHSET": "false"})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-patchset: MEGATRON_PATCHSET='false' is not")
    assert "Traceback" not in proc.stderr
