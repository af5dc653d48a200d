"""tools/bench/bench.py's reduction of metrics to its table, flag files, and the metrics patch."""

import json
import os

import bench
import pytest

from tests.unit.conftest import TINY


def records(times, losses, flops=2.0e15, tokens=16384, world=2):
    out = []
    for i, (t, loss) in enumerate(zip(times, losses), start=1):
        out.append(
            {
                "iteration": i,
                "time_s": t,
                "losses": {"lm loss": loss},
                "grad_norm": 1.0,
                "flops": flops,
                "tokens": tokens,
                "world_size": world,
            }
        )
    out.append({"summary": {"max_allocated_gib": 10.5, "max_reserved_gib": 12.0}})
    return out


def test_summarize_uses_median_after_warmup_and_megatron_flops():
    times = [None, 9.0, 9.0, 0.5, 0.4, 0.6]  # the first iterations are slow and excluded
    res = bench.summarize(records(times, [9, 8, 7, 6, 5, 4]), warmup=3, peak_tflops=800.0)
    assert res["timed_iterations"] == 3
    assert res["step_ms"] == pytest.approx(500.0)
    assert res["tokens_per_s"] == pytest.approx(16384 / 0.5)
    assert res["tflops_per_gpu"] == pytest.approx(2.0e15 / 0.5 / 2 / 1e12)
    assert res["mfu"] == pytest.approx(res["tflops_per_gpu"] / 800.0)
    assert res["final_loss"] == 4 and res["peak_reserved_gib"] == 12.0


def test_summarize_refuses_when_nothing_is_timed():
    with pytest.raises(ValueError, match="no timed iterations"):
        bench.summarize(records([None, 1.0], [1, 1]), warmup=5, peak_tflops=None)


def test_table_has_speedup_against_first_variant():
    rows = [
        {
            "variant": "upstream",
            "step_ms": 200.0,
            "tokens_per_s": 1.0,
            "tflops_per_gpu": 1.0,
            "mfu": 0.1,
            "peak_allocated_gib": 1.0,
            "peak_reserved_gib": 2.0,
            "final_loss": 3.0,
        },
        {
            "variant": "fast",
            "step_ms": 100.0,
            "tokens_per_s": 2.0,
            "tflops_per_gpu": 2.0,
            "mfu": 0.2,
            "peak_allocated_gib": 1.0,
            "peak_reserved_gib": 2.0,
            "final_loss": 3.0,
        },
        {"variant": "broken", "error": "exit code 1"},
    ]
    table = bench.format_table(rows, 790.0)
    assert "MFU@790" in table and "2.00x" in table and "1.00x" in table and "FAILED" in table


def test_summarize_leaves_the_profiled_iteration_out_of_the_timing():
    times = [None, 0.5, 0.5, 0.5, 3.0]  # iteration 5 ran under the profiler
    res = bench.summarize(records(times, [5, 4, 3, 2, 1]), warmup=1, peak_tflops=None, exclude=(5,))
    assert res["timed_iterations"] == 3 and res["step_ms"] == pytest.approx(500.0)
    assert res["final_loss"] == 1  # the loss curve keeps every iteration


def test_profile_columns_average_the_ranks_and_the_table_compares_to_the_first_variant(tmp_path):
    def write(folder, backward_exposed, idle):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "summary.json"), "w") as handle:
            json.dump(
                {
                    "step_host_ms": 100.0,
                    "gpu_idle_ms": idle,
                    "p2p": {
                        "backward": {
                            "kernels": 4,
                            "kernel_ms": 10.0,
                            "exposed_ms": backward_exposed,
                        },
                        "forward": {"kernels": 4, "kernel_ms": 8.0, "exposed_ms": 1.0},
                    },
                },
                handle,
            )

    write(tmp_path / "base", 6.0, 20.0)
    write(tmp_path / "base" / "rank1", 2.0, 10.0)
    write(tmp_path / "fast", 0.5, 5.0)
    write(tmp_path / "fast" / "rank1", 0.3, 5.0)
    assert len(bench.read_profiles(str(tmp_path / "base"))) == 2
    base = {"variant": "base", **bench.profile_columns(bench.read_profiles(str(tmp_path / "base")))}
    fast = {"variant": "fast", **bench.profile_columns(bench.read_profiles(str(tmp_path / "fast")))}
    assert base["p2p_backward_exposed_ms_mean"] == pytest.approx(4.0)
    assert base["p2p_backward_exposed_ms_max"] == pytest.approx(6.0)
    assert base["gpu_idle_ms_mean"] == pytest.approx(15.0) and base["profiled_ranks"] == 2
    table = bench.format_profile_table([base, fast, {"variant": "broken", "error": "exit code 1"}])
    assert "| fast " in table and "0.40" in table and "-90%" in table
    assert bench.profile_columns([]) == {}


def test_pipeline_pairs_split_each_rank_against_its_pipeline_peer():
    def summary(rank, group, starts):
        return {
            "rank": rank,
            "pp_group_ranks": group,
            "step_host_ms": 1.0,
            "p2p": {},
            "p2p_kernels": [
                {"dir": "backward", "ts": t, "end": 100.0, "compute": []} for t in starts
            ],
        }

    ranks = [summary(0, [0, 2], [0.0]), summary(2, [0, 2], [60.0]), summary(1, [1, 3], [0.0])]
    pairs = bench.pipeline_pairs(ranks)  # rank 1's peer 3 is missing
    assert len(pairs) == 2
    assert pairs[0]["backward"]["peer_wait_ms"] == pytest.approx(0.060)
    assert pairs[1]["backward"]["peer_wait_ms"] == 0 and pairs[1]["backward"][
        "transfer_ms"
    ] == pytest.approx(0.040)
    columns = bench.profile_columns(ranks)
    assert columns["p2p_paired_ranks"] == 2
    assert columns["p2p_backward_transfer_exposed_ms_mean"] == pytest.approx(0.040)
    assert columns["p2p_backward_peer_wait_ms_mean"] == pytest.approx(0.030)
    assert bench.pipeline_pairs([summary(0, [0, 1, 2, 3], [0.0])]) == []  # PP=4: not paired


def test_profile_iteration_must_follow_the_warm_up():
    for bad in (["--profile-iteration", "3"], ["--profile-iteration", "11"]):
        with pytest.raises(SystemExit):
            bench.main(["--config", TINY, "--iters", "10", "--warmup", "3", *bad])


def write_metrics(folder, name, times):
    """A variant's metrics file in an --out folder, as a finished run leaves it."""
    with open(folder / f"{name}.jsonl", "w") as handle:
        for rec in records(times, [3.0] * len(times), world=1):
            handle.write(json.dumps(rec) + "\n")


def test_report_only_rebuilds_the_table_from_an_earlier_out_folder(tmp_path, capsys, monkeypatch):
    write_metrics(tmp_path, "eager", [None, 1.0, 1.0, 1.0])
    write_metrics(tmp_path, "fast+scope", [None, 0.5, 0.5, 0.5])  # '+' kept, as in run names
    monkeypatch.setattr(
        bench, "run_variant", lambda *a, **k: pytest.fail("--report-only must run nothing")
    )
    code = bench.main(
        [
            "--config",
            TINY,
            "--iters",
            "4",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
            "--report-only",
            "--peak-tflops",
            "790",
            "--variant",
            "eager=",
            "--variant",
            "fast+scope=--foo",
            "--variant",
            "missing=",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1  # the variant without metrics is reported as failed
    assert "no metrics file" in out and "2.00x" in out
    saved = json.load(open(tmp_path / "bench.json"))
    assert saved["facts"] == {"report_only": True}
    assert [v.get("step_ms") for v in saved["variants"]] == [1000.0, 500.0, None]


def test_variant_and_assignment_parsing():
    assert bench.parse_variant("upstream") == ("upstream", [])
    assert bench.parse_variant("g=--cuda-graph-impl transformer_engine") == (
        "g",
        ["--cuda-graph-impl", "transformer_engine"],
    )
    assert bench.parse_assignment("micro-batch-size=1,2,4") == (
        "--micro-batch-size",
        ["1", "2", "4"],
    )


def test_default_peak_by_device():
    assert bench.default_peak("NVIDIA H200") == 790.0
    assert bench.default_peak("NVIDIA H100 80GB HBM3") == 790.0
    assert bench.default_peak("Some CPU") is None


def test_forward_backward_columns_and_speedup_per_sweep_value():
    """megatron's forward-backward timer gives its own time, MFU and speed-up; with a sweep, each
    value's rows are compared to that value's first variant, not to the first row of the run."""

    def variant(times, fwd_bwd, tokens):
        recs = records(times, [3.0] * len(times), tokens=tokens, world=1)
        for rec, fb in zip(recs, fwd_bwd):
            rec["fwd_bwd_s"] = fb
        return recs

    rows = []
    for value, name, times, fb in (
        ("1", "upstream", [None, 0.4, 0.4], [None, 0.3, 0.3]),
        ("1", "fork", [None, 0.2, 0.2], [None, 0.1, 0.1]),
        ("4", "upstream", [None, 1.0, 1.0], [None, 0.8, 0.8]),
        ("4", "fork", [None, 0.5, 0.5], [None, 0.4, 0.4]),
    ):
        row = bench.summarize(variant(times, fb, 4096), warmup=1, peak_tflops=800.0)
        row.update(variant=f"{name} micro-batch-size={value}", sweep_value=value)
        rows.append(row)
    assert rows[1]["fwd_bwd_ms"] == pytest.approx(100.0)
    assert rows[1]["fwd_bwd_mfu"] == pytest.approx(2.0e15 / 0.1 / 1e12 / 800.0)
    table = bench.format_table(rows, 800.0).splitlines()
    assert "fwd+bwd ms" in table[0] and "fwd+bwd MFU" in table[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    speed, fb_speed = head.index("speed-up"), head.index("fwd+bwd speed-up")
    assert [c[speed] for c in cells] == ["1.00x", "2.00x", "1.00x", "2.00x"]
    assert [c[fb_speed] for c in cells] == ["1.00x", "3.00x", "1.00x", "2.00x"]


def test_table_without_the_timer_keeps_its_columns():
    row = bench.summarize(records([None, 0.5, 0.5], [2, 1, 1]), warmup=1, peak_tflops=None)
    assert "fwd_bwd_ms" not in row
    assert "fwd+bwd" not in bench.format_table([dict(row, variant="a")], None)


def test_upstream_variants_run_unpatched():
    assert bench.is_upstream("upstream", [])
    assert bench.is_upstream("upstream-graphs", ["--cuda-graph-impl", "transformer_engine"])
    assert not bench.is_upstream(
        "upstream", ["--compile-transformer-layers"]
    )  # historic meaning: fork run
    assert not bench.is_upstream("fork", [])


def test_bench_time_fwd_bwd_sets_the_timer_for_every_variant(tmp_path, monkeypatch):
    envs = {}

    def fake_run(
        name, entry_argv, env_extra, nproc, out_dir, timeout, numa_binding=None, emulate=None
    ):
        envs[name] = dict(env_extra)
        log = tmp_path / f"{name}.log"
        log.write_text("not run\n")
        return 1, str(tmp_path / f"{name}.jsonl"), str(log)

    monkeypatch.setattr(bench, "run_variant", fake_run)
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    args = [
        "--config",
        TINY,
        "--out",
        str(tmp_path),
        "--iters",
        "3",
        "--warmup",
        "1",
        "--peak-tflops",
        "790",
        "--variant",
        "upstream=",
        "--variant",
        "fork=--moe-grouped-gemm-impl torch",
    ]
    bench.main(args + ["--time-fwd-bwd"])
    assert set(envs) == {"upstream", "fork"}
    assert all(env.get("MEGATRON_PATCHSET_TIME_FWD_BWD") == "1" for env in envs.values())
    assert envs["upstream"]["MEGATRON_PATCHSET"] == "off"
    envs.clear()
    bench.main(args)
    assert not any("MEGATRON_PATCHSET_TIME_FWD_BWD" in env for env in envs.values())


def test_numa_binding_reaches_torchrun(tmp_path, monkeypatch):
    commands = []

    def fake_subprocess_run(cmd, **kwargs):
        commands.append(cmd)
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(bench.subprocess, "run", fake_subprocess_run)
    bench.run_variant("a", ["pretrain_gpt.py", "--bf16"], {}, 2, str(tmp_path), 10, "node")
    bench.run_variant("b", ["pretrain_gpt.py", "--bf16"], {}, 2, str(tmp_path), 10)
    bound, unbound = commands
    launcher = bound.index("torch.distributed.run")
    assert bound[launcher + 1 : launcher + 4] == [
        "--standalone",
        "--nproc-per-node=2",
        "--numa-binding=node",
    ]
    assert bound[launcher + 4 :] == ["pretrain_gpt.py", "--bf16"]
    assert not any(c.startswith("--numa-binding") for c in unbound)
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--numa-binding", "everywhere"])


def test_variant_env_tokens():
    name, flags = bench.parse_variant(
        "no-norm=MEGATRON_PATCHSET_SKIP_PATCHES=a,b X_Y=1 --flag --num-layers 2"
    )
    env, rest = bench.split_env(flags)
    assert name == "no-norm"
    assert env == {"MEGATRON_PATCHSET_SKIP_PATCHES": "a,b", "X_Y": "1"}
    assert rest == ["--flag", "--num-layers", "2"]
    # Only leading upper-case tokens: a flag value with "=" stays a flag value.
    assert bench.split_env(["--set", "A=1"]) == ({}, ["--set", "A=1"])


def test_repeat_runs_in_mirrored_order_and_pools_the_repeats():
    variants = [("eager", []), ("compiled", ["--compile-transformer-layers"])]
    assert bench.run_order(variants, 1) == [
        ("eager", "eager", []),
        ("compiled", "compiled", ["--compile-transformer-layers"]),
    ]
    assert [label for label, *_ in bench.run_order(variants, 3)] == [
        "eager#1",
        "compiled#1",
        "compiled#2",
        "eager#2",
        "eager#3",
        "compiled#3",
    ]

    def row(label, times, fwd=None, error=None):
        if error:
            return {"variant": label, "sweep_value": None, "error": error}
        r = {
            "variant": label,
            "sweep_value": None,
            "step_ms": sorted(times)[len(times) // 2],
            "timed_step_ms": times,
        }
        if fwd:
            r.update(fwd_bwd_ms=sorted(fwd)[len(fwd) // 2], timed_fwd_bwd_ms=fwd)
        return r

    rows = [
        row("eager#1", [100, 110, 120], [80, 90, 100]),
        row("compiled#1", [90, 95, 100], [70, 75, 80]),
        row("compiled#2", [130, 140, 150], [110, 115, 120]),
        row("eager#2", [150, 160, 170], [130, 140, 150]),
        row("other#1", [], error="exit code 1"),
    ]
    pooled = {r["variant"]: r for r in bench.pooled_rows(rows)}
    assert pooled["eager"]["runs"] == 2 and pooled["eager"]["step_ms"] == 135.0  # median of all six
    assert pooled["eager"]["step_ms_per_run"] == [110, 160]
    assert pooled["compiled"]["step_ms"] == 115.0 and pooled["compiled"]["fwd_bwd_ms"] == 95.0
    assert pooled["other"]["runs"] == 0 and pooled["other"]["failed"] == 1
    text = bench.format_pooled_table(bench.pooled_rows(rows))
    line = next(row for row in text.splitlines() if row.startswith("| compiled"))
    assert "1.17x" in line and "95.0 / 140.0" in line  # 135 / 115; each repeat's own median
    assert "0 (1 failed)" in text


def test_summarize_keeps_the_timed_series():
    recs = records([1.0, 2.0, 3.0, 4.0], [5, 4, 3, 2])
    for r, t in zip(recs, [0.5, 0.6, 0.7, 0.8]):
        r["fwd_bwd_s"] = t
    out = bench.summarize(recs, warmup=1, peak_tflops=None)
    assert out["timed_step_ms"] == [2000.0, 3000.0, 4000.0]
    assert out["timed_fwd_bwd_ms"] == pytest.approx([600.0, 700.0, 800.0])


def test_repeat_end_to_end_with_report_only(tmp_path, capsys, monkeypatch):
    # A drift: every later run is slower. Single-order rows would favour whoever ran first.
    write_metrics(tmp_path, "a#1", [None, 1.0, 1.0, 1.0])
    write_metrics(tmp_path, "b#1", [None, 1.1, 1.1, 1.1])
    write_metrics(tmp_path, "b#2", [None, 1.2, 1.2, 1.2])
    write_metrics(tmp_path, "a#2", [None, 1.3, 1.3, 1.3])
    monkeypatch.setattr(
        bench, "run_variant", lambda *a, **k: pytest.fail("--report-only must run nothing")
    )
    code = bench.main(
        [
            "--config",
            TINY,
            "--iters",
            "4",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
            "--repeat",
            "2",
            "--report-only",
            "--peak-tflops",
            "790",
            "--variant",
            "a=",
            "--variant",
            "b=--foo",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "pooled over 2 repeats" in out
    saved = json.load(open(tmp_path / "bench.json"))
    assert [v["variant"] for v in saved["variants"]] == ["a#1", "b#1", "b#2", "a#2"]
    pooled = {p["variant"]: p for p in saved["pooled"]}
    assert pooled["a"]["step_ms"] == pytest.approx(1150.0) and pooled["b"][
        "step_ms"
    ] == pytest.approx(1150.0)
    with pytest.raises(SystemExit):
        bench.main(
            ["--config", TINY, "--iters", "4", "--warmup", "1", "--repeat", "0", "--variant", "a="]
        )


def test_plan_runs_gives_each_variant_its_entry_environment_and_flags(tmp_path):
    opts = bench.parse_options(
        [
            "--config",
            TINY,
            "--out",
            str(tmp_path),
            "--iters",
            "4",
            "--warmup",
            "1",
            "--time-fwd-bwd",
            "--upstream-script",
            "/mlm/pretrain_gpt.py",
            "--sweep",
            "micro-batch-size=1,2",
            "--variant",
            "upstream=",
            "--variant",
            "fork=X_Y=1 --moe-grouped-gemm-impl torch",
            "--variant",
            "torchtitan=--tt-compile",
        ]
    )
    planned = bench.plan_runs(opts)
    assert [p.label for p in planned] == [
        f"{name} micro-batch-size={value}"
        for value in ("1", "2")
        for name in ("upstream", "fork", "torchtitan")
    ]
    upstream, fork, peer = planned[3:]
    assert upstream.name == "upstream_micro-batch-size-2"
    assert upstream.entry == [os.path.join(bench.HERE, "run_upstream.py"), "/mlm/pretrain_gpt.py"]
    assert upstream.env["PYTHONPATH"] == "/mlm" and "MEGATRON_PATCHSET" not in upstream.env
    assert fork.entry == [os.path.join(bench.ROOT, "pretrain_gpt.py")] and fork.env["X_Y"] == "1"
    assert fork.flags == ["--moe-grouped-gemm-impl", "torch"]
    assert (
        fork.argv[-2:] == fork.flags and fork.argv[fork.argv.index("--micro-batch-size") + 1] == "2"
    )
    assert fork.argv[fork.argv.index("--train-iters") + 1] == "4"
    assert peer.entry == [bench.peer_runner("torchtitan")] and peer.flags == ["--tt-compile"]
    assert all(p.env["MEGATRON_PATCHSET_TIME_FWD_BWD"] == "1" for p in planned)
    assert all(p.profile_dir is None for p in planned)
    # Without --upstream-script the baseline is this repository's script, unpatched.
    entry, env = bench.variant_entry("upstream", [], None)
    assert entry == [os.path.join(bench.ROOT, "pretrain_gpt.py")] and env == {
        "MEGATRON_PATCHSET": "off"
    }


def test_a_variants_pythonpath_comes_before_the_checkout_and_the_callers(tmp_path, monkeypatch):
    seen = {}

    def fake_subprocess_run(cmd, env, **kwargs):
        seen.update(env)
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(bench.subprocess, "run", fake_subprocess_run)
    monkeypatch.setenv("PYTHONPATH", "/caller")
    bench.run_variant("a", ["x.py"], {"PYTHONPATH": "/mlm"}, 1, str(tmp_path), 10)
    assert seen["PYTHONPATH"].split(os.pathsep) == ["/mlm", bench.ROOT, "/caller"]
    bench.run_variant("b", ["x.py"], {}, 1, str(tmp_path), 10)
    assert seen["PYTHONPATH"].split(os.pathsep) == [bench.ROOT, "/caller"]


def test_report_sections_follow_the_options_of_the_run():
    row = dict(
        bench.summarize(records([None, 0.5, 0.5], [2, 1, 1]), warmup=1, peak_tflops=None),
        variant="a",
    )
    result = {"iters": 3, "warmup": 1, "peak_tflops": None, "variants": [row], "repeat": 1}
    (caption, table), *more = bench.report_sections(result)
    assert caption == "3 iterations, median of the last 2" and "| a " in table and more == []
    result.update(repeat=2, pooled=bench.pooled_rows([row]), profile_iteration=3)
    captions = [c for c, _ in bench.report_sections(result)]
    assert captions[1].startswith("pooled over 2 repeats")
    assert captions[2].startswith("torch.profiler, iteration 3")


def test_a_recipe_variant_carries_the_recipes_flags_and_runs_upstream_when_it_is_the_baseline():
    from megatron.patchset import recipes

    name, flags = bench.parse_recipe("small_batch EP=8")
    queues = ["CUDA_DEVICE_MAX_CONNECTIONS=1"]
    env = ["NVTE_NORM_FWD_USE_CUDNN=1", "NVTE_NORM_BWD_USE_CUDNN=1", *queues]  # environment first
    assert name == "small-batch:EP=8" and flags == env + recipes.flags("small_batch", EP=8)
    name, flags = bench.parse_recipe("small_batch EP=8 CUDNN_NORMS=0")
    assert flags == queues + recipes.flags("small_batch", EP=8)
    label, flags = bench.parse_recipe("upstream_best")
    assert label == "upstream-best" and bench.is_upstream(label, flags)
    label, flags = bench.parse_recipe("fsdp=fsdp_cuda_graphs GRAPHS=0")
    assert label == "fsdp" and flags[0] == "CUDA_DEVICE_MAX_CONNECTIONS=8"
    for bad, why in (
        ("small_batch GRAPHS=foo", "GRAPHS must be full, layer or none"),
        ("nope", "no recipe named 'nope'"),
        ("base=upstream_best", "its label must start with 'upstream-'"),
    ):
        with pytest.raises(Exception, match=why):
            bench.parse_recipe(bad)


def test_recipes_and_variants_run_in_command_line_order(tmp_path):
    opts = bench.parse_options(
        [
            "--config",
            TINY,
            "--out",
            str(tmp_path),
            "--recipe",
            "upstream_best",
            "--variant",
            "x=",
            "--recipe",
            "small_batch KERNELS=0",
        ]
    )
    assert [name for name, _ in opts.variant] == ["upstream-best", "x", "small-batch:KERNELS=0"]


def test_emulate_runs_one_process_as_a_rank_of_the_layout(tmp_path, monkeypatch):
    commands = []

    def fake_subprocess_run(cmd, env=None, **kwargs):
        commands.append((cmd, env))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(bench.subprocess, "run", fake_subprocess_run)
    bench.run_variant("a", ["pretrain_gpt.py", "--bf16"], {}, 1, str(tmp_path), 10, emulate=(32, 5))
    cmd, env = commands[0]
    assert cmd[1:] == ["pretrain_gpt.py", "--bf16"] and "torch.distributed.run" not in cmd
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"]) == ("32", "5", "0")
    plan = bench.plan_runs(
        bench.parse_options(
            [
                "--config",
                TINY,
                "--out",
                str(tmp_path),
                "--emulate",
                "32",
                "--recipe",
                "upstream_best",
            ]
        )
    )
    assert plan[0].argv[-1] == "--fake-process-group"
    with pytest.raises(SystemExit):
        bench.parse_options(["--config", TINY, "--emulate", "8", "--nproc", "2"])
    with pytest.raises(SystemExit):
        bench.parse_options(["--config", TINY, "--emulate", "8", "--emulate-rank", "8"])


def test_an_emulated_run_reports_tokens_per_gpu_and_the_skipped_communication(tmp_path):
    argv = bench.argsfile.read(os.path.join(os.path.dirname(TINY), "qwen3_30b_a3b.args"))
    argv += ["--expert-model-parallel-size", "8", "--use-distributed-optimizer"]
    row = {"variant": "fork", "argv": argv, "emulated_world": 32}
    row.update(
        bench.summarize(
            records([0.5, 0.5, 0.5], [3.0, 2.0, 1.0], tokens=32 * 4096, world=32), 1, 790.0
        )
    )
    opts = bench.parse_options(
        ["--config", TINY, "--out", str(tmp_path), "--emulate", "32", "--system", "h100"]
    )
    result = {"iters": 3, "warmup": 1, "peak_tflops": 790.0, "variants": [row]}
    result["emulate"] = bench.emulation_result(opts, {"device": "NVIDIA H200"}, [row])
    assert result["emulate"]["system"] == "h100"
    assert row["tokens_per_s_per_gpu"] == pytest.approx(4096 / 0.5)
    captions = [caption for caption, _ in bench.report_sections(result)]
    table = dict(bench.report_sections(result))
    assert "tokens/s/GPU" in table[captions[0]]
    assert "rank 0 of 32" in captions[1] and "h100" in captions[1]
    # predicted for h100 nodes from an H200's step: the caption says whose step it is
    assert "The emulated steps are this NVIDIA H200's: only the links are h100's." in captions[1]
    assert row["comm"]["step_exposed_ms"] > row["step_ms"]
    # the stand-in says what it is, beside the measured table
    assert "expert-parallel exchanges are stand-ins" in captions[0]
    assert "route as rank 0" in captions[0]
    # the published figures the prediction is read against, with their layouts and sources
    assert "Megatron-LM 234.1 TFLOP/s per GPU (32x H100, TP1 PP1 EP8" in captions[1]
    assert "NeMo AutoModel 277 TFLOP/s per GPU (8x H100, EP8 FSDP8" in captions[1]


def test_an_emulated_run_of_another_model_names_no_published_figure(tmp_path):
    argv = bench.argsfile.read(TINY) + ["--expert-model-parallel-size", "2"]
    row = {"variant": "fork", "argv": argv, "emulated_world": 4}
    row.update(bench.summarize(records([0.5, 0.5, 0.5], [3.0, 2.0, 1.0], world=4), 1, 790.0))
    opts = bench.parse_options(["--config", TINY, "--out", str(tmp_path), "--emulate", "4"])
    result = {"iters": 3, "warmup": 1, "peak_tflops": 790.0, "variants": [row]}
    result["emulate"] = bench.emulation_result(opts, {"device": "NVIDIA H200"}, [row])
    assert result["emulate"]["anchors"] == []
    captions = [caption for caption, _ in bench.report_sections(result)]
    assert "stand-ins" in captions[0] and "Published" not in captions[1]
    assert "only the links" not in captions[1]  # h200 links for an H200's step


def test_check_real_needs_an_emulated_layout_that_fits_one_host():
    with pytest.raises(SystemExit):
        bench.parse_options(["--config", TINY, "--check-real"])
    with pytest.raises(SystemExit):
        bench.parse_options(["--config", TINY, "--emulate", "16", "--check-real"])
    opts = bench.parse_options(["--config", TINY, "--emulate", "4", "--check-real"])
    assert opts.check_real and opts.emulate == 4


def test_check_real_trains_each_emulated_variant_again_on_the_hosts_gpus(
    tmp_path, capsys, monkeypatch
):
    argv = bench.argsfile.read(os.path.join(os.path.dirname(TINY), "qwen3_30b_a3b.args"))
    config = tmp_path / "layout.args"
    config.write_text(" ".join(argv + ["--expert-model-parallel-size", "4"]) + "\n")
    calls = []

    def fake_run_variant(name, entry_argv, env_extra, nproc, out_dir, timeout, numa, emulate):
        calls.append((name, nproc, emulate, list(entry_argv)))
        real = emulate is None
        metrics, log = bench.variant_files(out_dir, name)
        with open(metrics, "w") as handle:  # the real step is slower: it communicates
            for rec in records([None, 0.5, 0.6, 0.6] if real else [None, 0.5, 0.5, 0.5], [3.0] * 4):
                handle.write(json.dumps(rec) + "\n")
        open(log, "w").close()
        return 0, metrics, log

    monkeypatch.setattr(bench, "run_variant", fake_run_variant)
    monkeypatch.setattr(bench, "device_facts", lambda: {"device": "NVIDIA H100", "device_count": 4})
    common = ["--config", str(config), "--out", str(tmp_path / "out"), "--iters", "4"]
    common += ["--warmup", "1", "--emulate", "4", "--check-real", "--recipe", "upstream_best"]
    assert bench.main(common) == 0
    real = calls[1]
    assert len(calls) == 2 and calls[0][1:3] == (1, (4, 0))
    assert "--fake-process-group" in calls[0][3]
    assert real[0].endswith("-real") and real[1:3] == (4, None)
    assert "--fake-process-group" not in real[3]
    assert [a for a in calls[0][3] if a != "--fake-process-group"] == real[3]
    saved = json.load(open(tmp_path / "out" / "bench.json"))
    row = saved["variants"][0]
    assert row["real"]["step_ms"] == pytest.approx(600.0) and row["step_ms"] == 500.0
    out = capsys.readouterr().out
    assert "trained again for real on 4 GPUs" in out and "600.0" in out
    # too few GPUs here: refused before anything runs
    calls.clear()
    monkeypatch.setattr(bench, "device_facts", lambda: {"device": "NVIDIA H100", "device_count": 2})
    assert bench.main(common) == 2 and calls == []
    assert "needs 4 GPUs on this host; it has 2" in capsys.readouterr().err
