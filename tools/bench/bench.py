#!/usr/bin/env python3
"""Side-by-side training benchmark: named variants of one config, on the same GPUs, in one run.

    python tools/bench/bench.py --config examples/configs/reference_moe.args --nproc 1 \\
        --variant upstream \\
        --variant "graphs-attn=--cuda-graph-impl transformer_engine --cuda-graph-modules attn"

Every variant trains the config through ``pretrain_gpt.py`` under ``torchrun`` for ``--iters``
iterations with ``MEGATRON_PATCHSET_METRICS`` set, so megatron's own training loop records
each iteration's exact loss, wall-clock time, FLOPs (megatron's formula) and memory. The
variant named ``upstream`` is the baseline: unpatched megatron-core (``MEGATRON_PATCHSET=off``,
or Megatron-LM's own script through ``tools/bench/run_upstream.py`` with ``--upstream-script``);
so is any variant named ``upstream-...``, with upstream flags of its own
(``upstream-graphs=--cuda-graph-impl transformer_engine``).

Per variant it prints: median step time after ``--warmup`` iterations, tokens/s, model
TFLOP/s per GPU and MFU against the GPU's bf16 peak, peak memory (max over ranks), final loss
and the speed-up over the first variant (of the same sweep value). With ``--set timing-log-level=1``
three more columns: megatron's ``forward-backward`` timer (all micro-batches, no optimizer), its
MFU and its speed-up; ``--time-fwd-bwd`` gives the same columns from the fork's timer around the
forward-backward call (between two device synchronisations, as megatron's timer, but without its
barrier across ranks: the last rank's time), which also times a full-iteration CUDA graph
(``--cuda-graph-impl full_iteration``). It writes ``bench.json`` and ``bench.png`` (step
time, MFU, memory and loss curves) into ``--out``.

A variant named ``torchtitan`` or ``torchtitan-...`` trains torchtitan's Qwen3-MoE model on the
same flag file instead (``tools/bench/peers/torchtitan_runner.py``: same shape, batch, optimizer and
learning-rate schedule, synthetic tokens distributed as megatron's mock data, the same metrics
records and FLOP formula); its ``--tt-...`` flags choose torchtitan's options
(``--variant "torchtitan=--tt-compile --tt-cuda-graphs"``). It needs ``pip install
.[bench-peers]``.

``--repeat N`` runs the variants N times, every second time in mirrored order (ABC CBA ...), and
prints a second table pooling each variant's repeats, for configs whose step time drifts during a
run (a single order would hand the drift to the later variants).
Leading ``NAME=VALUE`` tokens of a variant are environment variables of that variant only
(``--variant "no-norm=MEGATRON_PATCHSET_SKIP_PATCHES=torch_compile.te_norm_traceable
--compile-transformer-layers"``). A ``PYTHONPATH`` token does not swap the fork itself: the
launched ``pretrain_gpt.py``'s folder, this checkout, comes first on ``sys.path``; to compare two
versions of the fork, run each checkout's ``bench.py`` on the same machine.
``--sweep FLAG=V1,V2`` repeats every variant for each value (e.g. ``--sweep
micro-batch-size=1,2,4``); ``--set FLAG=VALUE`` overrides the config for all variants.
``--profile-iteration N`` runs iteration N of every variant under ``torch.profiler`` (every
rank; ``megatron/patchset/core/observe/profile.py``) and prints a second table: pipeline P2P
kernel time per direction and its exposed part (no compute kernel running), mean over ranks.

``--record SLUG`` then writes the run's dated record ``docs/benchmarks/<YYYY-MM-DD>-SLUG.md``
(``--record-dir``) from bench.json: title, date, device, software versions, this command line,
the tables above and the chart, copied beside it (``record.py``). ``--record-from
OUT/bench.json --record SLUG`` writes the record of an earlier run without running anything.
Records are never edited: an existing one is refused unless ``--record-overwrite``.

A variant whose training fails is reported with its cause (:func:`failure_cause`): the training
process's exception line or the fork's refusal, not torchrun's report that ends the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time

import comm_model  # siblings: this script's folder is on sys.path
import record

from megatron.patchset.core import argsfile
from megatron.patchset.core.observe import trace_summary
from megatron.patchset.core.observe.metrics import FWD_BWD_ENV
from megatron.patchset.core.observe.profile import PROFILE_ENV

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Dense bf16 matrix-multiply rate used as the MFU denominator, TFLOP/s. For Hopper it is the
# rate measured on H100 and H200 GPUs (788-798 TFLOP/s for 8192^3 bf16 GEMMs); the
# datasheet's 989 would give MFUs 0.8x as large. Override with --peak-tflops.
PEAK_BF16_TFLOPS = {
    "H100": 790.0,
    "H200": 790.0,
    "H800": 790.0,
    "H20": 148.0,
    "A100": 312.0,
    "B200": 2250.0,
}
# torchrun --numa-binding modes (torch/numa/binding.py).
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")


ENV_TOKEN = re.compile(r"^[A-Z][A-Z0-9_]*=")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    name = name.strip()
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r} has no name")
    return name, shlex.split(flags)


def parse_recipe(text: str) -> tuple[str, list[str]]:
    """``[label=]NAME [KNOB=VALUE ...]``: a variant of a named recipe (megatron/patchset/recipes,
    docs/recipes.md), its flags and environment defaults as leading ``NAME=VALUE`` tokens. The
    label defaults to the recipe's name with its settings (``small-batch`` or
    ``small-batch:EP=8``); a recipe of upstream flags only (``upstream_best``) is labelled
    ``upstream-...`` and runs unpatched."""
    from megatron.patchset import recipes

    words = shlex.split(text)
    label = None
    if words and "=" in words[0] and not words[0].split("=", 1)[0].isupper():
        label, words[0] = words[0].split("=", 1)
    if not words or not words[0]:
        raise argparse.ArgumentTypeError(f"recipe {text!r} names no recipe")
    name, settings = words[0], words[1:]
    try:
        recipe = recipes.get(name)
        pairs = dict(s.split("=", 1) if "=" in s else (s, "") for s in settings)
        bad = [s for s in settings if "=" not in s]
        if bad:
            raise recipes.KnobError(f"{bad[0]!r}: expected KNOB=VALUE")
        built = recipe(pairs)
    except recipes.KnobError as exc:
        raise argparse.ArgumentTypeError(f"--recipe {text!r}: {exc}") from None
    if label is None:
        label = name.replace("_", "-") + (":" + ",".join(settings) if settings else "")
        if recipe.baseline and not label.startswith("upstream"):
            label = f"upstream-{label.removeprefix('upstream-')}"
    if recipe.baseline and not label.startswith("upstream-"):
        raise argparse.ArgumentTypeError(
            f"--recipe {text!r}: {name} is upstream's flags; its label must start with 'upstream-'"
        )
    return label, [f"{k}={v}" for k, v in built.env] + list(built.flags)


def split_env(flags: list[str]) -> tuple[dict, list[str]]:
    """Leading ``NAME=VALUE`` tokens of a variant (upper-case names) are environment variables
    for that variant only, e.g. ``--variant "no-norm=MEGATRON_PATCHSET_SKIP_PATCHES=x --flag"``."""
    env = {}
    rest = list(flags)
    while rest and ENV_TOKEN.match(rest[0]):
        key, _, value = rest.pop(0).partition("=")
        env[key] = value
    return env, rest


def parse_assignment(text: str) -> tuple[str, list[str]]:
    flag, sep, values = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FLAG=VALUE")
    flag = flag if flag.startswith("--") else f"--{flag}"
    return flag, [v for v in values.split(",") if v != ""]


def device_facts() -> dict:
    facts: dict = {"host_cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as handle:
            facts["host_cpu"] = next(
                (line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")),
                None,
            )
    except OSError:
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["device"] = torch.cuda.get_device_name(0)
            facts["device_count"] = torch.cuda.device_count()
            facts["device_memory_gib"] = round(
                torch.cuda.get_device_properties(0).total_memory / 2**30, 1
            )
    except ImportError:
        pass
    try:
        from megatron.patchset.core.versions import installed_mcore_version

        facts["megatron_core"] = installed_mcore_version()
    except ImportError:
        pass
    from importlib import metadata

    packages = (("transformer_engine", "transformer-engine"), ("torchtitan", "torchtitan"))
    for key, package in packages:
        try:
            facts[key] = metadata.version(package)
        except Exception:
            facts[key] = None
    return facts


def default_peak(device: str | None) -> float | None:
    if not device:
        return None
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device:
            return value
    return None


def summarize(
    records: list[dict], warmup: int, peak_tflops: float | None, exclude: tuple[int, ...] = ()
) -> dict:
    """Reduce one variant's metrics lines to the table's numbers (``exclude``: iterations left
    out of the timing, such as the profiled one)."""
    iters = [r for r in records if "iteration" in r]
    summary = next((r["summary"] for r in records if "summary" in r), {})
    timed = [
        r
        for r in iters
        if r["iteration"] > warmup and r.get("time_s") and r["iteration"] not in exclude
    ]
    if not timed:
        raise ValueError(f"no timed iterations after warm-up {warmup} ({len(iters)} recorded)")
    step = statistics.median(r["time_s"] for r in timed)
    last = iters[-1]
    world = last["world_size"]

    def tflops_at(seconds: float) -> float:  # megatron's FLOPs of the iteration, per GPU
        return last["flops"] / seconds / world / 1e12

    tflops = tflops_at(step)
    losses = [r["losses"].get("lm loss") for r in iters]
    result = {
        "iterations": len(iters),
        "timed_iterations": len(timed),
        "step_ms": step * 1e3,
        "step_ms_min": min(r["time_s"] for r in timed) * 1e3,
        "step_ms_max": max(r["time_s"] for r in timed) * 1e3,
        "tokens_per_s": last["tokens"] / step,
        "tokens_per_s_per_gpu": last["tokens"] / step / world,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "peak_allocated_gib": summary.get("max_allocated_gib", last.get("max_allocated_gib")),
        "peak_reserved_gib": summary.get("max_reserved_gib", last.get("max_reserved_gib")),
        "final_loss": losses[-1],
        "losses": losses,
        "grad_norms": [r.get("grad_norm") for r in iters],
        "step_ms_series": [None if r.get("time_s") is None else r["time_s"] * 1e3 for r in iters],
        "timed_step_ms": [r["time_s"] * 1e3 for r in timed],
    }
    fwd_bwd = [r["fwd_bwd_s"] for r in timed if r.get("fwd_bwd_s")]
    if fwd_bwd:  # megatron's forward-backward timer (--timing-log-level 1): no optimizer
        median = statistics.median(fwd_bwd)
        result["fwd_bwd_ms"] = median * 1e3
        result["timed_fwd_bwd_ms"] = [t * 1e3 for t in fwd_bwd]
        result["fwd_bwd_mfu"] = tflops_at(median) / peak_tflops if peak_tflops else None
    return result


def read_metrics(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def variant_files(out_dir: str, name: str) -> tuple[str, str]:
    """The metrics (JSON lines) and log file of one variant in the output folder."""
    return os.path.join(out_dir, f"{name}.jsonl"), os.path.join(out_dir, f"{name}.log")


def emulation_env(world_size: int, rank: int) -> dict:
    """The environment of one process that is ``rank`` of a ``world_size`` job: megatron reads the
    world and the rank from it; the fake process group needs no rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def add_emulation_arguments(p: argparse.ArgumentParser, help: str) -> None:
    """``--emulate WORLD_SIZE`` and ``--emulate-rank``, for bench.py and profile_step.py."""
    p.add_argument(
        "--emulate", metavar="WORLD_SIZE", type=argsfile.at_least(2), default=None, help=help
    )
    p.add_argument(
        "--emulate-rank",
        type=argsfile.at_least(0),
        default=0,
        help="with --emulate: the rank this GPU runs. Default: 0.",
    )


def check_emulation(p: argparse.ArgumentParser, opts) -> None:
    """An emulated rank is one process, of a rank below the world size."""
    if opts.emulate is None:
        return
    if opts.nproc != 1:
        p.error("--emulate runs one process: --nproc must be 1")
    if opts.emulate_rank >= opts.emulate:
        p.error(f"--emulate-rank must be below --emulate {opts.emulate}")


def check_real(p: argparse.ArgumentParser, opts) -> None:
    """--check-real runs the emulated layout for real on the GPUs of this one host."""
    if not opts.check_real:
        return
    if opts.emulate is None:
        p.error("--check-real needs --emulate WORLD_SIZE: the layout to run for real")
    if opts.emulate > opts.gpus_per_node:
        p.error(
            f"--check-real runs on the GPUs of this host: --emulate {opts.emulate} is more than "
            f"--gpus-per-node {opts.gpus_per_node}"
        )


def emulation(opts) -> tuple[int, int] | None:
    """``(world size, rank)`` of ``--emulate``, or None."""
    return None if opts.emulate is None else (opts.emulate, opts.emulate_rank)


def launch_spec(
    entry_argv: list[str],
    env_extra: dict,
    metrics: str,
    nproc: int,
    numa_binding: str | None = None,
    emulate: tuple[int, int] | None = None,
) -> tuple[list[str], dict]:
    """The command line and environment of one training run (bench.py's variants and the GPU
    test tier's runs): ``torchrun`` on ``nproc`` GPUs, or with ``emulate`` one process as rank
    ``emulate[1]`` of ``emulate[0]`` (``entry_argv`` carries ``--fake-process-group``); the fork's
    metrics go to ``metrics``; ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless the environment or
    ``env_extra`` sets it."""
    env = dict(os.environ)
    env.update(env_extra)
    env["MEGATRON_PATCHSET_METRICS"] = metrics
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # The run's own PYTHONPATH (Megatron-LM's folder for its pretrain_gpt.py), this checkout, then
    # the caller's.
    paths = (env_extra.get("PYTHONPATH"), ROOT, os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if emulate is not None:  # one process, rank emulate[1] of emulate[0]: no torchrun
        env.update(emulation_env(*emulate))
        return [sys.executable, *entry_argv], env
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *([f"--numa-binding={numa_binding}"] if numa_binding else []),
        *entry_argv,
    ]
    return cmd, env


def run_variant(
    name,
    entry_argv,
    env_extra,
    nproc,
    out_dir,
    timeout,
    numa_binding: str | None = None,
    emulate: tuple[int, int] | None = None,
) -> tuple[int, str, str]:
    metrics, log = variant_files(out_dir, name)
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd, env = launch_spec(entry_argv, env_extra, metrics, nproc, numa_binding, emulate)
    with open(log, "w") as handle:
        handle.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        handle.flush()
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, metrics, log


def tail(path: str, lines: int = 25) -> str:
    with open(path, errors="replace") as handle:
        return "".join(handle.readlines()[-lines:])


TRACEBACK = "Traceback (most recent call last):"
# torchrun's prefix of a process's lines ("[rank1]: ", "[default0]:").
RANK_PREFIX = re.compile(r"^\[[A-Za-z_]*\d+\]:\s?")
# torchrun's report on a failed process starts here; its own traceback follows.
LAUNCHER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\)")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: .*)?$")  # ValueError: ..., KeyboardInterrupt
LOG_LINE = re.compile(r"^\[?[IWEF]\d{4} ")  # torch's and NCCL's C++ log lines (W1127 10:11:12 ...)
REFUSAL = "megatron-patchset: "
CONTINUATION_LINES = 8


def failure_cause(text: str) -> str | None:
    """The cause of a failed training run in its torchrun output: the exception line of the first
    Python traceback of the training processes (``ValueError: ...``), else the fork's refusal (a
    ``megatron-patchset: ...`` message, printed without a traceback) when a process that exited
    with code 1 printed it last; a message's indented lines follow it. torchrun's report on the
    failure (its own traceback, at the end of the output) is not a cause. None when there is no
    such line (a process killed by a signal)."""
    lines = text.splitlines()
    end, code = len(lines), None
    for i, line in enumerate(lines):
        found = LAUNCHER_FAILED.search(line)
        if found:
            end, code = i, int(found.group(1))
            break
    streams: dict[str, list[tuple[int, str]]] = {}  # one per process, with torchrun's prefix
    for i, line in enumerate(lines[:end]):
        prefix = RANK_PREFIX.match(line)
        key = prefix.group(0).strip() if prefix else ""
        streams.setdefault(key, []).append((i, line[prefix.end() :] if prefix else line))
    found = [c for c in (_raised(s) for s in streams.values()) if c]
    if not found and code in (None, 1):
        found = [c for c in (_refused(s) for s in streams.values()) if c]
    return min(found)[1] if found else None


def _with_continuation(stream: list[tuple[int, str]], at: int) -> tuple[int, str]:
    """Line ``at`` of ``stream`` and the indented lines right after it."""
    out = [stream[at][1].rstrip()]
    for _, line in stream[at + 1 : at + 1 + CONTINUATION_LINES]:
        if not line.strip() or not line[0].isspace():
            break
        out.append(line.rstrip())
    return stream[at][0], "\n".join(out)


def _raised(stream: list[tuple[int, str]]) -> tuple[int, str] | None:
    """The exception line of the first traceback in one process's lines."""
    starts = [k for k, (_, line) in enumerate(stream) if line.strip() == TRACEBACK]
    if not starts:
        return None
    for k in range(starts[0] + 1, len(stream)):
        line = stream[k][1]
        if line.strip() and not line[0].isspace() and EXCEPTION_LINE.match(line):
            return _with_continuation(stream, k)
    return None


def _refused(stream: list[tuple[int, str]]) -> tuple[int, str] | None:
    """The fork's refusal, when it is the last message of one process's lines."""
    for k in range(len(stream) - 1, -1, -1):
        line = stream[k][1]
        if not line.strip() or line[0].isspace() or LOG_LINE.match(line):
            continue
        return _with_continuation(stream, k) if line.startswith(REFUSAL) else None
    return None


def report_failure(tool: str, label: str, code: int, log: str) -> str | None:
    """Print why a run failed: its cause (:func:`failure_cause`), or the last lines of its log
    when none is found (or the run timed out). Returns the cause."""
    cause = None
    if code != 124:
        with open(log, errors="replace") as handle:
            cause = failure_cause(handle.read())
    if cause:
        print(f"[{tool}] {label} FAILED (exit {code}): {cause}\n  whole output: {log}", flush=True)
    else:
        print(
            f"[{tool}] {label} FAILED (exit {code}); last lines of {log}:\n{tail(log)}", flush=True
        )
    return cause


def read_profiles(folder: str) -> list[dict]:
    """The per-rank summaries megatron/patchset/core/observe/profile.py wrote under ``folder``."""
    paths = [os.path.join(folder, "summary.json")]
    if os.path.isdir(folder):
        paths += sorted(
            os.path.join(folder, d, "summary.json")
            for d in os.listdir(folder)
            if d.startswith("rank")
        )
    out = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as handle:
                out.append(json.load(handle))
    return out


def profile_columns(summaries: list[dict]) -> dict:
    """Pipeline P2P and GPU idle time of the profiled iteration: mean and max over ranks."""
    if not summaries:
        return {}
    result: dict = {"profiled_ranks": len(summaries)}
    directions = sorted({d for s in summaries for d in (s.get("p2p") or {})})
    for direction in directions:
        for key in ("kernel_ms", "exposed_ms"):
            values = [((s.get("p2p") or {}).get(direction) or {}).get(key, 0.0) for s in summaries]
            result[f"p2p_{direction}_{key}_mean"] = statistics.mean(values)
            result[f"p2p_{direction}_{key}_max"] = max(values)
    split = pipeline_pairs(summaries)
    for direction in sorted({d for row in split for d in row}):
        for key in ("peer_wait_ms", "transfer_ms", "transfer_exposed_ms"):
            values = [row.get(direction, {}).get(key, 0.0) for row in split]
            result[f"p2p_{direction}_{key}_mean"] = statistics.mean(values)
    if split:
        result["p2p_paired_ranks"] = len(split)
    idle = [s["gpu_idle_ms"] for s in summaries if s.get("gpu_idle_ms") is not None]
    if idle:
        result["gpu_idle_ms_mean"] = statistics.mean(idle)
    result["profiled_step_host_ms_max"] = max(s["step_host_ms"] for s in summaries)
    return result


def pipeline_pairs(summaries: list[dict]) -> list[dict]:
    """For each rank whose pipeline group has two ranks (PP=2: both directions go to the same
    peer), its P2P kernels split into peer wait and transfer against the peer's
    (``trace_summary.split_p2p_wait``). Ranks whose peer's summary is missing are left out."""
    by_rank = {s.get("rank"): s for s in summaries if s.get("rank") is not None}
    out = []
    for summary in summaries:
        group = summary.get("pp_group_ranks") or []
        if len(group) != 2 or summary.get("rank") not in group:
            continue
        peer = by_rank.get(group[1] if group[0] == summary["rank"] else group[0])
        if peer is None:
            continue
        split = trace_summary.split_p2p_wait(
            summary.get("p2p_kernels") or [], peer.get("p2p_kernels") or []
        )
        if split is not None:
            out.append(split)
    return out


def format_profile_table(rows: list[dict]) -> str:
    """Exposed pipeline P2P per variant (profiled iteration, mean over ranks)."""
    head = [
        "variant",
        "bwd P2P ms",
        "bwd P2P exposed ms",
        "bwd peer wait ms",
        "bwd transfer ms",
        "bwd transfer exposed ms",
        "fwd P2P ms",
        "fwd P2P exposed ms",
        "GPU idle ms",
        "exposed bwd vs first",
        "exposed bwd transfer vs first",
    ]
    table = [head]
    first = next((r for r in rows if not r.get("error")), {})
    base = first.get("p2p_backward_exposed_ms_mean")
    base_transfer = first.get("p2p_backward_transfer_exposed_ms_mean")

    def versus(value, reference):
        return (
            f"{100 * (value - reference) / reference:+.0f}%"
            if reference and value is not None
            else "-"
        )

    def cell(r, key):
        value = r.get(key)
        return "-" if value is None else f"{value:.2f}"

    for r in rows:
        if r.get("error") or "profiled_ranks" not in r:
            table.append([r["variant"]] + ["-"] * (len(head) - 1))
            continue
        table.append(
            [
                r["variant"],
                cell(r, "p2p_backward_kernel_ms_mean"),
                cell(r, "p2p_backward_exposed_ms_mean"),
                cell(r, "p2p_backward_peer_wait_ms_mean"),
                cell(r, "p2p_backward_transfer_ms_mean"),
                cell(r, "p2p_backward_transfer_exposed_ms_mean"),
                cell(r, "p2p_forward_kernel_ms_mean"),
                cell(r, "p2p_forward_exposed_ms_mean"),
                cell(r, "gpu_idle_ms_mean"),
                versus(r.get("p2p_backward_exposed_ms_mean"), base),
                versus(r.get("p2p_backward_transfer_exposed_ms_mean"), base_transfer),
            ]
        )
    return trace_summary.markdown_table(table)


REPEAT_MARK = "#"


def run_order(variants: list, repeat: int) -> list[tuple[str, str, list]]:
    """(label, name, flags) in the order to run: the variants, then again in mirrored order
    (ABC CBA ABC ...), so that a drift over the run falls alike on every variant when the
    repeats are pooled. With repeat > 1 every label gets its repeat number, ``NAME#k``."""
    order = []
    for k in range(repeat):
        for name, flags in variants if k % 2 == 0 else variants[::-1]:
            order.append((name if repeat == 1 else f"{name}{REPEAT_MARK}{k + 1}", name, flags))
    return order


def pooled_rows(rows: list[dict]) -> list[dict]:
    """Per variant (and sweep value), every repeat's timed iterations together: the median over
    all of them, and each repeat's own median."""
    groups: dict = {}
    for r in rows:
        base = r["variant"].split(REPEAT_MARK)[0]
        groups.setdefault((base, r.get("sweep_value")), []).append(r)
    pooled = []
    for (base, value), members in groups.items():
        ok = [m for m in members if not m.get("error") and m.get("timed_step_ms")]
        row = {
            "variant": base,
            "sweep_value": value,
            "runs": len(ok),
            "failed": len(members) - len(ok),
        }
        if ok:
            row["step_ms"] = statistics.median(t for m in ok for t in m["timed_step_ms"])
            row["step_ms_per_run"] = [m["step_ms"] for m in ok]
            fwd = [t for m in ok for t in m.get("timed_fwd_bwd_ms", [])]
            if fwd:
                row["fwd_bwd_ms"] = statistics.median(fwd)
                row["fwd_bwd_ms_per_run"] = [m.get("fwd_bwd_ms") for m in ok]
        pooled.append(row)
    return pooled


def first_per_sweep(rows: list[dict]) -> dict:
    """The first row of each sweep value: what that value's speed-ups are measured against."""
    firsts: dict = {}
    for r in rows:
        firsts.setdefault(r.get("sweep_value"), r)
    return firsts


def format_pooled_table(pooled: list[dict]) -> str:
    """The pooled medians; speed-ups against the first variant of the same sweep value."""
    fwd_bwd = any(r.get("fwd_bwd_ms") for r in pooled)
    head = ["variant", "runs", "step ms (pooled)", "per run", "speed-up"]
    if fwd_bwd:
        head += ["fwd+bwd ms (pooled)", "per run", "fwd+bwd speed-up"]
    table = [head]
    firsts = first_per_sweep(pooled)
    for r in pooled:
        first = firsts[r.get("sweep_value")]
        if not r.get("step_ms"):
            table.append(
                [r["variant"], f"{r['runs']} ({r['failed']} failed)"] + ["-"] * (len(head) - 2)
            )
            continue
        runs = str(r["runs"]) + (f" ({r['failed']} failed)" if r["failed"] else "")
        row = [
            r["variant"],
            runs,
            f"{r['step_ms']:.1f}",
            " / ".join(f"{t:.1f}" for t in r["step_ms_per_run"]),
            f"{first['step_ms'] / r['step_ms']:.2f}x" if first.get("step_ms") else "-",
        ]
        if fwd_bwd:
            ok = r.get("fwd_bwd_ms") and first.get("fwd_bwd_ms")
            row += [
                f"{r['fwd_bwd_ms']:.1f}" if r.get("fwd_bwd_ms") else "-",
                " / ".join(f"{t:.1f}" for t in r.get("fwd_bwd_ms_per_run", []) if t) or "-",
                f"{first['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if ok else "-",
            ]
        table.append(row)
    return trace_summary.markdown_table(table)


PEER_RUNNERS = {"torchtitan": os.path.join(HERE, "peers", "torchtitan_runner.py")}


def peer_runner(name: str) -> str | None:
    """The runner script of a peer variant: one named after a peer (``torchtitan``) or
    starting with its name and a dash (``torchtitan-graphs``); None for megatron variants."""
    for peer, script in PEER_RUNNERS.items():
        if name == peer or name.startswith(f"{peer}-"):
            return script
    return None


def is_upstream(name: str, flags: list) -> bool:
    """'upstream' alone, or any variant named 'upstream-...' (with upstream flags), runs
    unpatched."""
    return (name == "upstream" and not flags) or name.startswith("upstream-")


def format_table(rows: list[dict], peak: float | None) -> str:
    """One row per variant; the speed-up is against the first variant of the same sweep value. With
    megatron's forward-backward timer recorded, three columns more: its time, MFU and speed-up."""
    fwd_bwd = any(r.get("fwd_bwd_ms") for r in rows)
    head = [
        "variant",
        "step ms",
        "tokens/s",
        "TFLOP/s/GPU",
        f"MFU@{peak:.0f}" if peak else "MFU",
        "peak alloc GiB",
        "peak resv GiB",
        "final loss",
        "speed-up",
    ]
    emulated = any(r.get("emulated_world") for r in rows)
    if emulated:
        head[3:3] = ["tokens/s/GPU"]
    if fwd_bwd:
        head[2:2] = ["fwd+bwd ms", "fwd+bwd MFU", "fwd+bwd speed-up"]
    table = [head]
    firsts = first_per_sweep(rows)
    for r in rows:
        first = firsts[r.get("sweep_value")]
        base = first.get("step_ms")  # None when the first variant failed
        if r.get("error"):
            why = (r.get("cause") or r["error"]).splitlines()[0][:60].replace("|", "/")
            table.append([r["variant"], "FAILED", why] + [""] * (len(head) - 3))
            continue
        row = [
            r["variant"],
            f"{r['step_ms']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tflops_per_gpu']:.1f}",
            f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-",
            f"{r['peak_allocated_gib']:.2f}" if r.get("peak_allocated_gib") is not None else "-",
            f"{r['peak_reserved_gib']:.2f}" if r.get("peak_reserved_gib") is not None else "-",
            f"{r['final_loss']:.6f}" if r.get("final_loss") is not None else "-",
            f"{base / r['step_ms']:.2f}x" if base else "-",
        ]
        if emulated:
            row[3:3] = [f"{r['tokens_per_s_per_gpu']:,.0f}"]
        if fwd_bwd:
            ok = r.get("fwd_bwd_ms") and first.get("fwd_bwd_ms")
            row[2:2] = [
                f"{r['fwd_bwd_ms']:.1f}" if r.get("fwd_bwd_ms") else "-",
                f"{100 * r['fwd_bwd_mfu']:.1f}%" if r.get("fwd_bwd_mfu") is not None else "-",
                f"{first['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if ok else "-",
            ]
        table.append(row)
    return trace_summary.markdown_table(table)


def plot(rows: list[dict], path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if not r.get("error")]
    if not ok:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    names = [r["variant"] for r in ok]
    axes[0].bar(names, [r["step_ms"] for r in ok], color="tab:blue")
    axes[0].set_ylabel("median step time (ms)")
    axes[1].bar(names, [100 * (r.get("mfu") or 0) for r in ok], color="tab:green")
    axes[1].set_ylabel("MFU (%)")
    axes[2].bar(
        names, [r.get("peak_reserved_gib") or 0 for r in ok], color="tab:red", label="reserved"
    )
    axes[2].bar(
        names, [r.get("peak_allocated_gib") or 0 for r in ok], color="tab:orange", label="allocated"
    )
    axes[2].set_ylabel("peak GPU memory (GiB)")
    axes[2].legend()
    for r in ok:
        axes[3].plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["variant"])
    axes[3].set_xlabel("iteration")
    axes[3].set_ylabel("lm loss")
    axes[3].legend(fontsize=7)
    for ax in axes[:3]:
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/bench/bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        type=argsfile.existing_file,
        help="flag file (examples/configs/*.args); required unless --record-from.",
    )
    p.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        default=[],
        help="NAME=FLAGS; repeatable. 'upstream' (no flags) is the unpatched baseline. "
        "Default: upstream only.",
    )
    p.add_argument(
        "--recipe",
        action="append",
        dest="variant",
        type=parse_recipe,
        metavar="RECIPE",
        help="[label=]NAME [KNOB=VALUE ...]: a variant running a named recipe "
        "(python -m megatron.patchset recipe --list), in command-line order with the --variant "
        "ones; e.g. --recipe upstream_best --recipe 'small_batch EP=8'. A baseline recipe "
        "(upstream_best) runs unpatched as 'upstream-best'.",
    )
    add_emulation_arguments(
        p,
        "run every variant as one rank of a WORLD_SIZE-GPU job on this one GPU: megatron's "
        "--fake-process-group with WORLD_SIZE and RANK set, every collective skipped and the "
        "expert-parallel exchanges stood in by the rank's own routing (megatron/patchset/core/"
        "emulation.py). The tables add tokens/s per GPU and the communication the emulation "
        "skipped, as predicted by tools/bench/comm_model.py.",
    )
    comm_model.add_arguments(p)
    p.add_argument(
        "--check-real",
        action="store_true",
        help="with --emulate WORLD_SIZE: after the emulated runs, run every variant again for "
        "real on WORLD_SIZE GPUs of this host (torchrun, no fake process group) and print the "
        "measured step beside the emulated step plus the predicted communication. Needs "
        "WORLD_SIZE GPUs here and WORLD_SIZE at most --gpus-per-node.",
    )
    p.add_argument(
        "--nproc",
        type=argsfile.at_least(1),
        default=1,
        help="GPUs (torchrun --nproc-per-node). Default: 1.",
    )
    p.add_argument(
        "--iters",
        type=argsfile.at_least(1),
        default=30,
        help="training iterations per variant. Default: 30.",
    )
    p.add_argument(
        "--warmup",
        type=argsfile.at_least(0),
        default=10,
        help="iterations excluded from timing. Default: 10.",
    )
    p.add_argument(
        "--repeat",
        type=argsfile.at_least(1),
        default=1,
        help="run the variants this many times, every second time in mirrored order (ABC CBA "
        "...), and print a second table pooling the repeats: for configs whose step time drifts "
        "during a run. Rows are named NAME#k. Default: 1.",
    )
    p.add_argument(
        "--set",
        action="append",
        type=parse_assignment,
        default=[],
        help="FLAG=VALUE config override for every variant (repeatable).",
    )
    p.add_argument(
        "--sweep",
        type=parse_assignment,
        default=None,
        help="FLAG=V1,V2,...: run every variant once per value.",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="bf16 dense peak for MFU. Default: by device (Hopper: 790, measured).",
    )
    p.add_argument(
        "--upstream-script",
        default=None,
        help="Megatron-LM's pretrain_gpt.py: the 'upstream' variant runs it through "
        "tools/bench/run_upstream.py instead of this repo's script with MEGATRON_PATCHSET=off.",
    )
    p.add_argument(
        "--numa-binding",
        choices=NUMA_BINDINGS,
        default=None,
        help="torchrun --numa-binding: bind each rank to the CPUs near its GPU (node: the "
        "GPU's NUMA node). Host-bound configs (small micro-batches) vary from run to run with "
        "where the scheduler puts the rank's threads. Default: no binding.",
    )
    p.add_argument("--out", default="bench-out", help="output folder. Default: bench-out.")
    p.add_argument(
        "--timeout",
        type=argsfile.at_least(1),
        default=900,
        help="seconds per variant. Default: 900.",
    )
    p.add_argument("--title", default=None, help="chart title.")
    p.add_argument(
        "--profile-iteration",
        type=int,
        default=None,
        help="run this iteration (1-based, after the warm-up) of every variant under "
        "torch.profiler (megatron/patchset/core/observe/profile.py, every rank) and add a table "
        "of exposed pipeline P2P time; the iteration is left out of the step time.",
    )
    p.add_argument(
        "--time-fwd-bwd",
        action="store_true",
        help="time megatron's forward-backward call from outside, between two device "
        "synchronisations, in every variant (MEGATRON_PATCHSET_TIME_FWD_BWD=1): the fwd+bwd "
        "columns without --timing-log-level 1, whose timer cannot run inside a full-iteration "
        "CUDA graph.",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild the table, bench.json and chart from the metrics files "
        "an earlier run with the same --out and variants left (for a run cut off after its "
        "variants had finished). Pass --peak-tflops when this machine has no GPU.",
    )
    p.add_argument(
        "--record",
        metavar="SLUG",
        type=record_slug,
        default=None,
        help="after the run, write the dated record <record-dir>/<YYYY-MM-DD>-SLUG.md from "
        "bench.json (title, date, device, software versions, this command line, the tables) "
        "with the chart beside it as <YYYY-MM-DD>-SLUG.png. An existing record is refused.",
    )
    p.add_argument(
        "--record-dir",
        default=os.path.join(ROOT, "docs", "benchmarks"),
        help="folder of the records. Default: docs/benchmarks of this checkout.",
    )
    p.add_argument(
        "--record-from",
        metavar="BENCH_JSON",
        default=None,
        help="run nothing: write the --record of an earlier run from its bench.json (and the "
        "bench.png beside it).",
    )
    p.add_argument(
        "--record-overwrite",
        action="store_true",
        help="replace an existing record of the same date and slug (records are otherwise never "
        "edited).",
    )
    return p


def record_slug(text: str) -> str:
    try:
        return record.check_slug(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parse_options(argv: list[str]) -> argparse.Namespace:
    """The command line, checked: argparse's errors and the checks between options exit 2."""
    p = build_parser()
    opts = p.parse_args(argv)
    if opts.record_from:
        if not opts.record:
            p.error("--record-from needs --record SLUG")
        return opts
    if not opts.config:
        p.error("the following arguments are required: --config")
    if opts.record:
        try:  # before the run: a run of minutes whose record is then refused helps no one
            record.refuse_existing(opts.record_dir, today(), opts.record, opts.record_overwrite)
        except record.RecordError as exc:
            p.error(str(exc))
    check_emulation(p, opts)
    check_real(p, opts)
    if opts.emulate is not None:
        peers = [name for name, _ in opts.variant if peer_runner(name)]
        if peers:
            p.error(f"--emulate runs megatron variants only, not {', '.join(peers)}")
    if opts.repeat < 1:
        p.error("--repeat must be at least 1")
    if opts.warmup >= opts.iters:
        p.error("--warmup must be smaller than --iters")
    if (
        opts.profile_iteration is not None
        and not opts.warmup < opts.profile_iteration <= opts.iters
    ):
        p.error("--profile-iteration must be after the warm-up and at most --iters")
    if opts.profile_iteration is not None and opts.iters - opts.warmup < 2:
        p.error("--profile-iteration needs at least one more timed iteration after the warm-up")
    return opts


def base_argv(opts: argparse.Namespace) -> list[str]:
    """The config's flags with the --set overrides, --iters and a log line per iteration."""
    argv = argsfile.read(opts.config)
    for flag, values in opts.set:
        argv = argsfile.override(argv, flag, *values)
    argv = argsfile.override(argv, "--train-iters", str(opts.iters))
    return argsfile.override(argv, "--log-interval", "1")


FAKE_GROUP = "--fake-process-group"


@dataclasses.dataclass
class Planned:
    """One training run of the benchmark: a variant at one sweep value, in one repeat."""

    label: str  # its row: NAME, NAME#k with --repeat, then " FLAG=VALUE" with --sweep
    name: str  # the label as a file name in --out (metrics, log, profile folder)
    entry: list[str]  # what torchrun starts: the script and its leading arguments
    argv: list[str]  # the megatron flags: the config's, then the variant's own
    flags: list[str]  # the variant's own flags
    env: dict  # the variant's environment variables
    sweep_value: str | None
    profile_dir: str | None


def variant_entry(name: str, flags: list[str], upstream_script: str | None) -> tuple[list, dict]:
    """What torchrun starts for a variant, and the environment that goes with it: a peer's
    runner, unpatched megatron (this repo's script with MEGATRON_PATCHSET=off, or Megatron-LM's
    own through run_upstream.py with its folder on PYTHONPATH) or the fork."""
    peer = peer_runner(name)
    if peer is not None:
        return [peer], {}
    if not is_upstream(name, flags):
        return [os.path.join(ROOT, "pretrain_gpt.py")], {}
    if upstream_script:
        entry = [os.path.join(HERE, "run_upstream.py"), upstream_script]
        return entry, {"PYTHONPATH": os.path.dirname(os.path.abspath(upstream_script))}
    return [os.path.join(ROOT, "pretrain_gpt.py")], {"MEGATRON_PATCHSET": "off"}


def plan_runs(opts: argparse.Namespace) -> list[Planned]:
    """Every run in the order it runs: per sweep value, the variants in ``run_order``."""
    variants = opts.variant or [("upstream", [])]
    base = base_argv(opts)
    sweep_flag, sweep_values = opts.sweep if opts.sweep else (None, [None])
    planned = []
    for value in sweep_values:
        for label, name, flags in run_order(variants, opts.repeat):
            label = label if value is None else f"{label} {sweep_flag[2:]}={value}"
            argv = base if value is None else argsfile.override(base, sweep_flag, value)
            env, flags = split_env(flags)
            entry, entry_env = variant_entry(name, flags, opts.upstream_script)
            env.update(entry_env)
            if opts.time_fwd_bwd:
                env[FWD_BWD_ENV] = "1"
            if opts.emulate is not None:
                flags = [*flags, FAKE_GROUP]
            safe = label.replace(" ", "_").replace("=", "-").replace("/", "-")
            profile_dir = None
            if opts.profile_iteration is not None:
                profile_dir = os.path.abspath(os.path.join(opts.out, f"{safe}-profile"))
                env[PROFILE_ENV] = f"{profile_dir}:{opts.profile_iteration}"
            planned.append(
                Planned(label, safe, entry, argv + flags, flags, env, value, profile_dir)
            )
    return planned


def run_planned(run: Planned, opts: argparse.Namespace, peak: float | None) -> dict:
    """Train one planned run (or, with --report-only, find its metrics) and reduce it to its
    table row."""
    if opts.report_only:
        metrics, log = variant_files(opts.out, run.name)
        code = 0 if os.path.exists(metrics) else 2
    else:
        print(f"[bench] {run.label}: {len(run.argv)} flags, {opts.nproc} GPU(s) ...", flush=True)
        code, metrics, log = run_variant(
            run.name,
            run.entry + run.argv,
            run.env,
            opts.nproc,
            opts.out,
            opts.timeout,
            opts.numa_binding,
            emulate=emulation(opts),
        )
    row = {
        "variant": run.label,
        "flags": run.flags,
        **({"argv": run.argv, "emulated_world": opts.emulate} if opts.emulate else {}),
        "env": run.env,
        "exit_code": code,
        "log": log,
        "sweep_value": run.sweep_value,
    }
    if opts.report_only and code != 0:
        row["error"] = f"no metrics file {metrics}"
        print(f"[bench] {run.label}: {row['error']}", flush=True)
    elif code != 0 or not os.path.exists(metrics):
        row["error"] = f"exit code {code}"
        cause = report_failure("bench", run.label, code, log)
        if cause:
            row["cause"] = cause
    else:
        exclude = (opts.profile_iteration,) if opts.profile_iteration is not None else ()
        try:
            row.update(summarize(read_metrics(metrics), opts.warmup, peak, exclude))
        except ValueError as exc:
            row["error"] = str(exc)
        if run.profile_dir is not None:
            row.update(profile_columns(read_profiles(run.profile_dir)))
    return row


def real_run(run: Planned) -> Planned:
    """The emulated run as a real one: the same flags without the fake process group, its files
    named ``NAME-real``."""
    argv = [a for a in run.argv if a != FAKE_GROUP]
    flags = [a for a in run.flags if a != FAKE_GROUP]
    return dataclasses.replace(
        run, label=f"{run.label} (real)", name=f"{run.name}-real", argv=argv, flags=flags
    )


def run_real(run: Planned, opts: argparse.Namespace, peak: float | None) -> dict:
    """--check-real: one emulated run trained for real on ``opts.emulate`` GPUs of this host."""
    real_opts = argparse.Namespace(**{**vars(opts), "emulate": None, "nproc": opts.emulate})
    row = run_planned(real_run(run), real_opts, peak)
    keep = ("exit_code", "error", "cause", "log", "step_ms", "fwd_bwd_ms", "tflops_per_gpu")
    keep += ("tokens_per_s_per_gpu", "peak_allocated_gib", "peak_reserved_gib", "losses")
    return {k: row[k] for k in keep if k in row}


# The caller's environment variables that change what a run measures; bench.json keeps them
# beside the command line.
LAUNCH_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "PYTHONPATH")
LAUNCH_ENV_PREFIXES = ("MEGATRON_", "NCCL_", "NVTE_", "TORCH_", "PYTORCH_")


def launch_environment(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(environ.items())
        if k in LAUNCH_ENV or k.startswith(LAUNCH_ENV_PREFIXES)
    }


def today(at: float | None = None) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(at))


def default_title(config: str, nproc: int, facts: dict) -> str:
    return f"{os.path.basename(config)} on {nproc}x {facts.get('device', '?')}"


def build_result(
    opts: argparse.Namespace,
    argv: list[str],
    facts: dict,
    peak: float | None,
    rows: list[dict],
    started: float,
) -> dict:
    """What bench.json holds: the command line, the run's settings, the device facts (with the
    software versions) and one row per run."""
    result = {
        "title": opts.title or default_title(opts.config, opts.nproc, facts),
        "date": today(started),
        "argv": argv,
        "launch_env": launch_environment(),
        "config": opts.config,
        "nproc": opts.nproc,
        "numa_binding": opts.numa_binding,
        "iters": opts.iters,
        "warmup": opts.warmup,
        "overrides": [[f, v] for f, v in opts.set],
        "sweep": [opts.sweep[0], opts.sweep[1]] if opts.sweep else None,
        "profile_iteration": opts.profile_iteration,
        "peak_tflops": peak,
        "facts": facts,
        "wall_s": time.time() - started,
        "repeat": opts.repeat,
        "variants": rows,
    }
    if opts.repeat > 1:
        result["pooled"] = pooled_rows(rows)
    if opts.emulate:
        result["emulate"] = emulation_result(opts, facts, rows)
    return result


def emulation_result(opts: argparse.Namespace, facts: dict, rows: list[dict]) -> dict:
    """The emulated layout, the links of the prediction, and per successful row the skipped
    communication (tools/bench/comm_model.py) with the step it predicts."""
    system, links = comm_model.links_of(opts, facts.get("device"))
    anchors = ()
    for row in rows:
        if row.get("error") or "argv" not in row:
            continue
        shape = comm_model.shape_of(row["argv"], opts.emulate)
        anchors = anchors or comm_model.anchors_for(shape)
        predicted = comm_model.predict(shape, links, opts.gpus_per_node)
        predicted.update(
            comm_model.with_compute(
                predicted, row["step_ms"], row.get("fwd_bwd_ms"), row["tflops_per_gpu"]
            )
        )
        row["comm"] = predicted
    return {
        "world_size": opts.emulate,
        "rank": opts.emulate_rank,
        "system": system,
        "gpus_per_node": opts.gpus_per_node,
        "links": dataclasses.asdict(links),
        "anchors": [anchor.describe() for anchor in anchors],
        "device": facts.get("device"),
    }


def format_comm_table(rows: list[dict]) -> str:
    head = [
        "variant",
        "all-to-all ms",
        "grad reduce ms",
        "param gather ms",
        "emulated step ms",
        "predicted step ms",
        "predicted TFLOP/s/GPU",
    ]
    table = [head]
    for r in rows:
        c = r.get("comm")
        if c is None:
            continue
        a2a = f"{c['a2a_ms']:.1f} ({c['a2a_count']} x {c['a2a_mb_each']:.0f} MB, {c['a2a_link']})"
        if c.get("a2a_chunks", 1) > 1:
            a2a += f"; {c['a2a_exposed_ms']:.1f} exposed in {c['a2a_chunks']} chunks"
        table.append(
            [
                r["variant"],
                a2a,
                f"{c['grad_ms']:.1f} ({c['dp_link']})",
                f"{c['param_ms']:.1f}",
                f"{r['step_ms']:.1f}",
                f"{c['step_overlapped_ms']:.1f} - {c['step_exposed_ms']:.1f}",
                f"{c['tflops_overlapped']:.0f} - {c['tflops_exposed']:.0f}",
            ]
        )
    return trace_summary.markdown_table(table)


def format_real_table(rows: list[dict]) -> str:
    head = [
        "variant",
        "emulated step ms",
        "predicted step ms",
        "real step ms",
        "real / predicted",
        "emulated peak GiB",
        "real peak GiB",
        "real TFLOP/s/GPU",
        "real final loss",
    ]
    table = [head]
    for r in rows:
        real, c = r.get("real"), r.get("comm")
        if real is None:
            continue
        if real.get("error"):
            cause = real.get("cause") or real["error"]
            table.append([r["variant"], f"{r['step_ms']:.1f}", "-", cause, *["-"] * 5])
            continue
        low, high = (c["step_overlapped_ms"], c["step_exposed_ms"]) if c else (None, None)
        table.append(
            [
                r["variant"],
                f"{r['step_ms']:.1f}",
                f"{low:.1f} - {high:.1f}" if c else "-",
                f"{real['step_ms']:.1f}",
                f"{real['step_ms'] / low:.2f} - {real['step_ms'] / high:.2f}" if c else "-",
                _gib(r.get("peak_allocated_gib")),
                _gib(real.get("peak_allocated_gib")),
                f"{real['tflops_per_gpu']:.1f}",
                f"{real['losses'][-1]:.6f}" if real.get("losses") else "-",
            ]
        )
    return trace_summary.markdown_table(table)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_outputs(result: dict, out_dir: str) -> str | None:
    """bench.json and the chart (bench.png; None when matplotlib is missing or nothing ran)."""
    with open(os.path.join(out_dir, "bench.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    return plot(result["variants"], os.path.join(out_dir, "bench.png"), result["title"])


def report_sections(result: dict) -> list[tuple[str, str]]:
    """The tables of a run as (caption, Markdown table): the variants, then the pooled repeats
    (--repeat) and the profiled iteration (--profile-iteration) when there are any."""
    iters, rows = result["iters"], result["variants"]
    sections = [
        (
            f"{iters} iterations, median of the last {iters - result['warmup']}",
            format_table(rows, result["peak_tflops"]),
        )
    ]
    if result.get("pooled") is not None:
        sections.append(
            (
                f"pooled over {result['repeat']} repeats in mirrored order (ABC CBA ...): median "
                "of every repeat's timed iterations, each repeat's own median, speed-up against "
                "the first variant",
                format_pooled_table(result["pooled"]),
            )
        )
    emulate = result.get("emulate")
    if emulate:
        rank, world = emulate["rank"], emulate["world_size"]
        sections[0] = (
            f"{sections[0][0]}; each variant ran as rank {rank} of {world} under "
            "--fake-process-group: the expert-parallel exchanges are stand-ins (every rank is "
            f"taken to route as rank {rank}; the tokens and counts of other ranks are not real) "
            "and the other collectives are skipped",
            sections[0][1],
        )
    if emulate and any(r.get("comm") for r in result["variants"]):
        links = emulate["links"]
        anchors = emulate.get("anchors") or []
        device = emulate.get("device") or ""
        measured_on = (
            f" The emulated steps are this {device}'s: only the links are {emulate['system']}'s."
            if device and emulate["system"].upper() not in device.upper()
            else ""
        )
        published = (
            " Published for this model, with communication: " + "; ".join(anchors) + "."
            if anchors
            else ""
        )
        sections.append(
            (
                f"the communication the emulation skipped (rank {emulate['rank']} of "
                f"{emulate['world_size']}), predicted for {emulate['system']} nodes of "
                f"{emulate['gpus_per_node']} GPUs: bus bandwidths {links['a2a_nvlink']:.0f} GB/s "
                f"all-to-all and {links['nvlink']:.0f} GB/s gather and reduce on NVLink, "
                f"{links['nic']:.0f} GB/s per GPU's network card across nodes. The step adds "
                "the all-to-all, not overlapped (with --moe-static-dispatch-chunks: the part the "
                "experts of the other chunks do not cover, at the step's average TFLOP/s), and "
                "the data-parallel traffic hidden behind "
                "forward and backward up to their length (first figure) or not at all (second). "
                "A plan, not a measurement: tools/bench/comm_model.py." + measured_on + published,
                format_comm_table(result["variants"]),
            )
        )
    if any(r.get("real") for r in result["variants"]):
        sections.append(
            (
                f"the prediction checked: every variant trained again for real on "
                f"{emulate['world_size']} GPUs of this host (torchrun, NCCL, no fake process "
                "group). Real / predicted is the measured step over each bound of the predicted "
                "one (all-to-all not overlapped; data-parallel traffic hidden, or exposed); the "
                "real peak is the highest of its ranks'",
                format_real_table(result["variants"]),
            )
        )
    if result.get("profile_iteration") is not None:
        sections.append(
            (
                f"torch.profiler, iteration {result['profile_iteration']}, mean over ranks: "
                "pipeline P2P kernel time and the part of it with no compute kernel running "
                "(exposed); with PP=2 each kernel is also split, against its peer's matching "
                "kernel, into peer wait (until the peer's kernel starts: the pipeline "
                "dependency) and transfer (the rest)",
                format_profile_table(rows),
            )
        )
    return sections


def versions_text(facts: dict) -> str:
    return (
        f"torch {facts.get('torch')}, megatron-core {facts.get('megatron_core')}, "
        f"transformer-engine {facts.get('transformer_engine')}"
        + (f", torchtitan {facts['torchtitan']}" if facts.get("torchtitan") else "")
    )


def print_report(result: dict, out_dir: str, chart: str | None) -> None:
    (caption, table), *more = report_sections(result)
    print()
    print(f"{result['title']}; {versions_text(result['facts'])}; {caption}")
    print(table)
    for caption, table in more:
        print()
        print(caption)
        print(table)
    print(f"wrote {os.path.join(out_dir, 'bench.json')}" + (f" and {chart}" if chart else ""))


def write_record(result: dict, out_dir: str, opts: argparse.Namespace) -> str:
    """The dated record of a bench.json (``record.py``), with the tables bench.py prints."""
    return record.write(
        result,
        date=result["date"],
        title=result["title"],
        sections=report_sections(result),
        chart_source=os.path.join(out_dir, "bench.png"),
        record_dir=opts.record_dir,
        slug=opts.record,
        overwrite=opts.record_overwrite,
    )


def record_from(opts: argparse.Namespace) -> str:
    """--record-from: the record of an earlier run's bench.json. A bench.json without a date or
    title (older runs) takes its file's date and the default title."""
    try:
        with open(opts.record_from) as handle:
            result = json.load(handle)
    except (OSError, ValueError) as exc:
        raise record.RecordError(f"--record-from {opts.record_from}: {exc}") from exc
    result.setdefault("date", today(os.path.getmtime(opts.record_from)))
    facts = result.get("facts") or {}
    result.setdefault("title", default_title(result["config"], result["nproc"], facts))
    if opts.title:
        result["title"] = opts.title
    if result.get("emulate") and opts.system:  # the prediction for other machines
        opts.emulate = result["emulate"]["world_size"]
        opts.emulate_rank = result["emulate"]["rank"]
        result["emulate"] = emulation_result(opts, facts, result["variants"])
    return write_record(result, os.path.dirname(os.path.abspath(opts.record_from)), opts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parse_options(argv)
    if opts.record_from:
        try:
            print(f"wrote {record_from(opts)}")
        except record.RecordError as exc:
            print(f"tools/bench/bench.py: error: {exc}", file=sys.stderr)
            return 2
        return 0
    planned = plan_runs(opts)
    os.makedirs(opts.out, exist_ok=True)
    # A rebuilt report cannot know the device of the original run: say so instead of guessing.
    facts = {"report_only": True} if opts.report_only else device_facts()
    peak = opts.peak_tflops or default_peak(facts.get("device"))
    started = time.time()
    if opts.check_real and not opts.report_only:
        count = facts.get("device_count", 0)
        if count < opts.emulate:
            print(
                f"tools/bench/bench.py: error: --check-real --emulate {opts.emulate} needs "
                f"{opts.emulate} GPUs on this host; it has {count}",
                file=sys.stderr,
            )
            return 2
    rows = [run_planned(run, opts, peak) for run in planned]
    if opts.check_real:
        for run, row in zip(planned, rows):
            if not row.get("error"):
                row["real"] = run_real(run, opts, peak)
    result = build_result(opts, argv, facts, peak, rows, started)
    chart = write_outputs(result, opts.out)
    print_report(result, opts.out, chart)
    if opts.record:
        try:
            print(f"wrote {write_record(result, opts.out, opts)}")
        except record.RecordError as exc:
            print(f"tools/bench/bench.py: error: {exc}", file=sys.stderr)
            return 2
    failed = [r for r in rows if r.get("error") or (r.get("real") or {}).get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
