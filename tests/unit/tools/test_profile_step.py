"""tools/bench/profile_step.py: its torchrun command line and its Markdown report."""

import os

import profile_step
import pytest

from megatron.patchset.core.observe import labels, profile, trace_summary
from tests.unit.conftest import ROOT
from tests.unit.core.observe.traces import synthetic_trace


def test_profile_request_and_tool_argv(monkeypatch):
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    assert profile.profile_request() is None
    monkeypatch.setenv(profile.PROFILE_ENV, "/tmp/a:b/out:6")
    assert profile.profile_request() == ("/tmp/a:b/out", 6)
    monkeypatch.setenv(profile.PROFILE_ENV, "out")
    with pytest.raises(ValueError, match="<dir>:<iteration>"):
        profile.profile_request()
    argv = profile_step.build_argv(
        os.path.join(ROOT, "examples", "configs", "tiny_moe.args"),
        [("--micro-batch-size", ["2"])],
        "--moe-permute-fusion --num-layers 2",
        6,
    )
    assert argv[argv.index("--micro-batch-size") + 1] == "2"
    assert argv[argv.index("--num-layers") + 1] == "2" and argv.count("--num-layers") == 1
    assert "--moe-permute-fusion" in argv and argv[argv.index("--train-iters") + 1] == "6"


def test_markdown_report_lists_every_category_and_the_step_facts():
    s = trace_summary.summarize_trace(
        synthetic_trace(), meta={"iteration": 6, "micro_batch_size": 1}
    )
    text = profile_step.report(s, {"warm_step_ms": 12.5, "profiled_step_ms": 14.0})
    assert "micro_batch_size=1" in text and "12.50 ms" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| router"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert (
        cells[1:5] == ["0.10", "10.0%", "0.05", "0.05"] and cells[5] == "1" and cells[8] == "0.03"
    )
    for title in labels.CATEGORIES.values():
        assert any(line.startswith("| " + title) for line in lines), title
    assert "GPU busy: 0.29 ms, idle: 0.81 ms" in text
    assert "kernel launches: 4" in text and "device-to-host syncs: 1" in text
    assert any(line.startswith("| 1 ") for line in lines)  # per-layer table


def test_recipe_and_emulation_reach_the_profiled_run(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake_run(name, argv, env, nproc, out, timeout, emulate=None):
        seen.update(argv=argv, env=env, emulate=emulate)
        return 1, str(tmp_path / "metrics.jsonl"), str(tmp_path / "log.txt")

    (tmp_path / "log.txt").write_text("RuntimeError: no GPU\n")
    monkeypatch.setattr(profile_step.bench, "run_variant", fake_run)
    config = os.path.join(ROOT, "examples", "configs", "tiny_moe.args")
    code = profile_step.main(
        ["--config", config, "--recipe", "upstream_best EP=2", "--emulate", "8"]
        + ["--emulate-rank", "3", "--flags", "--num-layers 2", "--out", str(tmp_path)]
    )
    assert code == 1 and seen["emulate"] == (8, 3)
    argv = seen["argv"]
    assert argv[argv.index("--expert-model-parallel-size") + 1] == "2"
    assert "--fake-process-group" in argv and argv[argv.index("--num-layers") + 1] == "2"
    # upstream_best is upstream's flags: profiled unpatched
    assert seen["env"]["MEGATRON_PATCHSET"] == "off"
    with pytest.raises(SystemExit):
        profile_step.main(["--config", config, "--emulate", "8", "--emulate-rank", "8"])
    assert "--emulate" in capsys.readouterr().err
