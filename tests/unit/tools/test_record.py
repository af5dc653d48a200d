"""tools/bench/bench.py --record: the dated record of a run, written from a synthetic bench.json
(--record-from) or after a --report-only run; no GPU."""

import json
import os

import bench
import pytest
import record

from tests.unit.conftest import TINY

FACTS = {
    "host_cpus": 16,
    "host_cpu": "Some CPU",
    "python": "3.12.3",
    "torch": "2.11.0+cu130",
    "device": "NVIDIA H200",
    "device_count": 1,
    "device_memory_gib": 139.8,
    "megatron_core": "0.19.2",
    "transformer_engine": "2.20.2",
    "torchtitan": None,
}
ARGV = ["--config", "examples/configs/reference_moe.args", "--variant", "fast=--flag a b"]


def row(name, step_ms, value=None):
    return {
        "variant": name,
        "sweep_value": value,
        "step_ms": step_ms,
        "tokens_per_s": 4096 / step_ms * 1e3,
        "tflops_per_gpu": 100.0,
        "mfu": 0.125,
        "peak_allocated_gib": 40.0,
        "peak_reserved_gib": 50.0,
        "final_loss": 6.5,
        "losses": [9.0, 6.5],
    }


def bench_json(folder, **extra):
    """A bench.json as a run on one H200 writes it, and a stand-in chart beside it."""
    result = {
        "title": "reference_moe.args on 1x NVIDIA H200",
        "date": "2026-11-20",
        "argv": ARGV,
        "launch_env": {"CUDA_DEVICE_MAX_CONNECTIONS": "8", "PYTHONPATH": "/opt/site:/home/me/x"},
        "config": "examples/configs/reference_moe.args",
        "nproc": 1,
        "iters": 14,
        "warmup": 6,
        "peak_tflops": 790.0,
        "facts": FACTS,
        "repeat": 1,
        "profile_iteration": None,
        "variants": [row("upstream", 200.0), row("fast", 160.0)],
        **extra,
    }
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "bench.json"), "w") as handle:
        json.dump(result, handle)
    with open(os.path.join(folder, "bench.png"), "wb") as handle:
        handle.write(b"\x89PNG chart")
    return result


def test_record_from_a_bench_json_holds_everything_to_repeat_the_run(tmp_path, capsys):
    result = bench_json(tmp_path / "out")
    docs = tmp_path / "docs"
    code = bench.main(
        [
            "--record-from",
            str(tmp_path / "out" / "bench.json"),
            "--record",
            "moe-1x4096",
            "--record-dir",
            str(docs),
        ]
    )
    assert code == 0
    page = (docs / "2026-11-20-moe-1x4096.md").read_text()
    assert f"wrote {docs / '2026-11-20-moe-1x4096.md'}" in capsys.readouterr().out
    lines = page.splitlines()
    assert lines[0] == "# reference_moe.args on 1x NVIDIA H200"
    assert "- Date: 2026-11-20" in lines
    assert "- Device: 1x NVIDIA H200 (139.8 GiB each); host: Some CPU, 16 CPUs" in lines
    assert (
        "- Software: torch 2.11.0+cu130, megatron-core 0.19.2, TransformerEngine 2.20.2, "
        "Python 3.12.3"
    ) in lines
    command = lines[lines.index("```bash") + 1]
    # the machine's paths stay out of the record
    assert command == (
        "CUDA_DEVICE_MAX_CONNECTIONS=8 python tools/bench/bench.py --config "
        "examples/configs/reference_moe.args --variant 'fast=--flag a b'"
    )
    # The table is the one bench.py prints for this bench.json, speed-up included.
    table = bench.format_table(result["variants"], 790.0)
    assert table in page and "1.25x" in table
    assert "14 iterations, median of the last 8:" in lines
    assert "![reference_moe.args on 1x NVIDIA H200](2026-11-20-moe-1x4096.png)" in lines
    assert (docs / "2026-11-20-moe-1x4096.png").read_bytes() == b"\x89PNG chart"


def test_records_are_never_edited_unless_asked(tmp_path, capsys):
    bench_json(tmp_path / "out")
    argv = [
        "--record-from",
        str(tmp_path / "out" / "bench.json"),
        "--record",
        "moe",
        "--record-dir",
        str(tmp_path / "docs"),
    ]
    assert bench.main(argv) == 0
    page = tmp_path / "docs" / "2026-11-20-moe.md"
    page.write_text("kept\n")
    assert bench.main(argv) == 2
    assert "records are never edited" in capsys.readouterr().err
    assert page.read_text() == "kept\n"
    assert bench.main(argv + ["--record-overwrite"]) == 0
    assert page.read_text().startswith("# reference_moe.args")


def test_a_run_whose_record_exists_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / f"{bench.today()}-tiny.md").write_text("kept\n")
    monkeypatch.setattr(bench, "run_variant", lambda *a, **k: pytest.fail("nothing may run"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--config", TINY, "--record", "tiny", "--record-dir", str(docs)])
    assert exit_info.value.code == 2
    assert "records are never edited" in capsys.readouterr().err


def test_report_only_run_writes_its_record_with_the_command_line(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name in bench.LAUNCH_ENV or name.startswith(bench.LAUNCH_ENV_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("HOME_OF_SOMETHING", "/x")
    with open(tmp_path / "eager.jsonl", "w") as handle:
        for i, t in enumerate([None, 1.0, 1.0], start=1):
            metrics = {"iteration": i, "time_s": t, "losses": {"lm loss": 3.0}, "grad_norm": 1.0}
            metrics.update(flops=2.0e15, tokens=4096, world_size=1)
            handle.write(json.dumps(metrics) + "\n")
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    argv = ["--config", TINY, "--iters", "3", "--warmup", "1", "--out", str(tmp_path)]
    argv += ["--report-only", "--peak-tflops", "790", "--variant", "eager="]
    argv += ["--record", "tiny-eager", "--record-dir", str(tmp_path / "docs")]
    assert bench.main(argv) == 0
    saved = json.load(open(tmp_path / "bench.json"))
    assert saved["argv"] == argv and saved["date"] == bench.today()
    assert saved["launch_env"] == {"NCCL_DEBUG": "WARN"}
    page = (tmp_path / "docs" / f"{bench.today()}-tiny-eager.md").read_text()
    assert "- Device: not recorded (the tables were rebuilt with --report-only)" in page
    assert "| eager " in page and "1000.0" in page
    assert "NCCL_DEBUG=WARN python tools/bench/bench.py --config" in page
    assert "![" not in page  # no chart was drawn: none is linked


def test_an_older_bench_json_takes_its_files_date_and_the_default_title(tmp_path):
    result = bench_json(tmp_path / "out")
    for key in ("title", "date", "argv"):
        del result[key]
    path = tmp_path / "out" / "bench.json"
    path.write_text(json.dumps(result))
    os.utime(path, (1_700_000_000, 1_700_000_000))
    argv = ["--record-from", str(path), "--record", "old", "--record-dir", str(tmp_path / "d")]
    assert bench.main(argv) == 0
    date = bench.today(1_700_000_000)
    page = (tmp_path / "d" / f"{date}-old.md").read_text()
    assert page.startswith("# reference_moe.args on 1x NVIDIA H200\n")
    assert "not recorded (bench.json without argv)" in page


def test_slugs_and_the_options_record_from_needs(capsys):
    assert record.check_slug("moe-1x4096") == "moe-1x4096"
    for bad in ("Moe", "a b", "-a", "a--b", "a/b", ""):
        with pytest.raises(ValueError, match="not a record slug"):
            record.check_slug(bad)
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--record", "a/b"])
    assert "not a record slug" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--record-from", "bench.json"])
    assert "--record-from needs --record SLUG" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([])
    assert "the following arguments are required: --config" in capsys.readouterr().err


def test_an_emulated_runs_record_can_predict_for_other_machines(tmp_path):
    argv = bench.argsfile.read(os.path.join(os.path.dirname(TINY), "qwen3_30b_a3b.args"))
    argv += ["--expert-model-parallel-size", "8", "--use-distributed-optimizer"]
    fast = {**row("fast", 160.0), "argv": argv, "emulated_world": 32, "tokens_per_s_per_gpu": 800.0}
    emulate = {"world_size": 32, "rank": 0, "system": "h200", "gpus_per_node": 8, "links": {}}
    bench_json(tmp_path / "out", variants=[fast], emulate=emulate)
    docs = tmp_path / "docs"
    args = ["--record-from", str(tmp_path / "out" / "bench.json"), "--record", "l1"]
    assert bench.main(args + ["--record-dir", str(docs), "--system", "h100", "--title", "L1"]) == 0
    page = (docs / "2026-11-20-l1.md").read_text()
    assert page.startswith("# L1\n")
    assert "rank 0 of 32), predicted for h100 nodes of 8 GPUs" in page
    assert "| fast " in page.split("predicted for h100")[1]
