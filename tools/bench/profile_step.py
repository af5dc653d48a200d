#!/usr/bin/env python3
"""Where the host time of one training step goes: one iteration under torch.profiler.

    python tools/bench/profile_step.py --config examples/configs/reference_moe.args --nproc 1 \\
        [--set FLAG=VALUE ...] [--flags "..."] [--upstream] --warmup 5 --out prof-out
    python tools/bench/profile_step.py --config examples/configs/qwen3_30b_a3b.args \\
        --recipe "small_batch EP=8 DIST_OPT=1 GRAPHS=none" --emulate 32 --out prof-l1

Trains the config through ``pretrain_gpt.py`` under ``torchrun`` (as ``tools/bench/bench.py`` does,
with its helpers) for ``--warmup`` + 1 iterations, with ``MEGATRON_PATCHSET_PROFILE`` set so
that the observe patch ``observe.train_step`` (``megatron.patchset.core.observe.profile``) runs
the last iteration under ``torch.profiler`` with labels on megatron's attention, router,
dispatch, permutation, expert, combine and optimizer code. Rank 0 writes ``<out>/trace.json``
(open it in Perfetto or chrome://tracing) and ``<out>/summary.json``; this tool prints the
summary as Markdown: host time per category (forward and backward), kernel launches,
device-to-host syncs and GPU kernel time per category, the step's GPU busy and idle time, and a
per-layer table.

``--summary FILE`` only prints an existing summary; ``--trace FILE`` re-reduces a trace.
``--upstream`` profiles unpatched megatron-core (``MEGATRON_PATCHSET=off``; observe patches
still apply). ``--recipe`` adds a named recipe's flags (a baseline recipe such as
``upstream_best`` implies ``--upstream``), and ``--emulate WORLD_SIZE`` profiles one rank of a
larger job on this GPU, as bench.py's option of that name does. A failed run is reported with its
cause, as in bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

import bench  # a sibling: this script's folder is on sys.path

from megatron.patchset.core import argsfile
from megatron.patchset.core.observe import profile, trace_summary

ROOT = bench.ROOT


def build_argv(config: str, sets: list, flags: str, iters: int) -> list[str]:
    argv = argsfile.read(config)
    for flag, values in sets:
        argv = argsfile.override(argv, flag, *values)
    for flag, values in _pairs(shlex.split(flags or "")):
        argv = argsfile.override(argv, flag, *values)
    argv = argsfile.override(argv, "--train-iters", str(iters))
    argv = argsfile.override(argv, "--log-interval", "1")
    return argv


def _pairs(tokens: list[str]):
    """``--flag v1 v2 --switch`` -> [("--flag", ["v1", "v2"]), ("--switch", [])]."""
    out: list = []
    for token in tokens:
        if token.startswith("--"):
            out.append((token, []))
        elif out:
            out[-1][1].append(token)
        else:
            raise SystemExit(f"--flags: {token!r} does not follow a --flag")
    return out


def unprofiled_step_ms(metrics_path: str, profiled: int) -> dict:
    """Median step time of the warm-up iterations after the first (no profiler) and the
    profiled iteration's own time, from the metrics file."""
    try:
        records = [r for r in bench.read_metrics(metrics_path) if "iteration" in r]
    except OSError:
        return {}
    plain = [
        r["time_s"] * 1e3 for r in records if r.get("time_s") and 2 < r["iteration"] < profiled
    ]
    this = [r["time_s"] * 1e3 for r in records if r.get("time_s") and r["iteration"] == profiled]
    return {
        "warm_step_ms": statistics.median(plain) if plain else None,
        "profiled_step_ms": this[0] if this else None,
    }


def report(summary: dict, extra: dict | None = None) -> str:
    head = []
    facts = {
        k: summary.get(k)
        for k in (
            "iteration",
            "device",
            "world_size",
            "micro_batch_size",
            "seq_length",
            "num_layers",
            "num_experts",
            "moe_router_topk",
            "moe_token_dispatcher_type",
            "expert_model_parallel_size",
        )
        if summary.get(k) is not None
    }
    if facts:
        head.append("profiled: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    if extra and extra.get("warm_step_ms"):
        head.append(
            f"unprofiled step time (median of warm-up iterations 3..): {extra['warm_step_ms']:.2f} "
            f"ms; profiled iteration: {extra.get('profiled_step_ms') or float('nan'):.2f} ms"
        )
    return "\n".join(head + ["", trace_summary.format_summary(summary)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="tools/bench/profile_step.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", type=argsfile.existing_file, help="flag file (examples/configs/*.args)"
    )
    p.add_argument(
        "--nproc",
        type=argsfile.at_least(1),
        default=1,
        help="GPUs (torchrun --nproc-per-node). Default: 1.",
    )
    p.add_argument(
        "--set",
        action="append",
        type=bench.parse_assignment,
        default=[],
        help="FLAG=VALUE config override (repeatable), as in bench.py.",
    )
    p.add_argument(
        "--flags", default="", help='extra flags, one string (e.g. "--moe-permute-fusion").'
    )
    p.add_argument(
        "--warmup",
        type=argsfile.at_least(0),
        default=5,
        help="iterations before the profiled one. Default: 5.",
    )
    p.add_argument(
        "--upstream",
        action="store_true",
        help="profile unpatched megatron (MEGATRON_PATCHSET=off).",
    )
    p.add_argument(
        "--recipe",
        type=bench.parse_recipe,
        default=None,
        metavar="RECIPE",
        help="NAME [KNOB=VALUE ...]: a named recipe's flags before --flags (python -m "
        "megatron.patchset recipe --list); upstream_best profiles unpatched megatron.",
    )
    bench.add_emulation_arguments(
        p,
        "profile one rank of a WORLD_SIZE-GPU job on this GPU (megatron's --fake-process-group; "
        "see bench.py --emulate).",
    )
    p.add_argument("--out", default="prof-out", help="output folder. Default: prof-out.")
    p.add_argument(
        "--timeout",
        type=argsfile.at_least(1),
        default=900,
        help="seconds for the run. Default: 900.",
    )
    p.add_argument("--summary", default=None, help="print this summary.json and exit (no run).")
    p.add_argument("--trace", default=None, help="reduce this chrome trace and print it (no run).")
    opts = p.parse_args(argv)

    for flag, path in (("--summary", opts.summary), ("--trace", opts.trace)):
        if path:
            try:
                with open(path) as handle:
                    loaded = json.load(handle)
                summary = (
                    loaded
                    if flag == "--summary"
                    else trace_summary.summarize_trace(loaded.get("traceEvents", []))
                )
            except (OSError, ValueError, AttributeError) as exc:
                p.error(f"{flag} {path}: {exc}")
            print(report(summary))
            return 0
    if not opts.config:
        p.error("--config is required (or --summary / --trace)")
    if opts.warmup < 0:
        p.error("--warmup must be >= 0")

    bench.check_emulation(p, opts)
    env: dict = {}
    flags = opts.flags
    if opts.recipe is not None:
        label, words = opts.recipe
        recipe_env, recipe_flags = bench.split_env(words)
        env.update(recipe_env)
        flags = shlex.join(recipe_flags) + (" " + flags if flags else "")
        opts.upstream = opts.upstream or bench.is_upstream(label, recipe_flags)
    if opts.emulate is not None:
        flags += " --fake-process-group"

    iteration = opts.warmup + 1
    out = os.path.abspath(opts.out)
    os.makedirs(out, exist_ok=True)
    summary_path = os.path.join(out, "summary.json")
    if os.path.exists(summary_path):
        os.remove(summary_path)
    train_argv = build_argv(opts.config, opts.set, flags, iteration)
    env[profile.PROFILE_ENV] = f"{out}:{iteration}"
    if opts.upstream:
        env["MEGATRON_PATCHSET"] = "off"
    entry = [os.path.join(ROOT, "pretrain_gpt.py")]
    print(
        f"[profile_step] {opts.config}: {opts.nproc} process(es), profiling iteration {iteration} "
        "...",
        flush=True,
    )
    emulate = bench.emulation(opts)
    code, metrics, log = bench.run_variant(
        "profile", entry + train_argv, env, opts.nproc, out, opts.timeout, emulate=emulate
    )
    if code != 0 or not os.path.exists(summary_path):
        summary_state = "present" if os.path.exists(summary_path) else "missing"
        bench.report_failure("profile_step", f"{opts.config} (summary {summary_state})", code, log)
        return 1
    with open(summary_path) as handle:
        summary = json.load(handle)
    extra = unprofiled_step_ms(metrics, iteration)
    summary["run"] = {
        "config": opts.config,
        "nproc": opts.nproc,
        "overrides": [[f, v] for f, v in opts.set],
        "flags": flags,
        "upstream": opts.upstream,
        **({"emulated_world": opts.emulate, "emulated_rank": opts.emulate_rank} if emulate else {}),
        "facts": bench.device_facts(),
        **extra,
    }
    with open(summary_path, "w") as handle:
        json.dump(summary, handle, indent=1)
    print(report(summary, extra))
    print(f"\nwrote {summary_path} and {summary.get('trace')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
