"""GPU test tier: real training runs through torchrun on the local GPUs.

Every test here is marked ``gpu`` and ``gpus(n)``; it skips cleanly when fewer than ``n`` CUDA
GPUs are visible or TransformerEngine does not import. Runs write megatron's exact
per-iteration metrics (``MEGATRON_PATCHSET_METRICS``) and their logs under pytest's tmp dir;
set ``PATCHSET_GPU_REPORT=<dir>`` to also collect a JSON summary of every run there.
"""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "configs", "tiny_moe.args")
UPSTREAM_SCRIPT = os.environ.get(
    "MEGATRON_LM_PRETRAIN_GPT", os.path.join(ROOT, ".upstream", "megatron-lm", "pretrain_gpt.py")
)


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs NVIDIA GPUs and TransformerEngine")
    config.addinivalue_line("markers", "gpus(n): needs at least n GPUs")


def pytest_collection_modifyitems(config, items):
    count, te = gpu_count(), have_te()
    for item in items:
        marker = item.get_closest_marker("gpus")
        if item.get_closest_marker("gpu") is None and marker is None:
            continue
        need = marker.args[0] if marker else 1
        if count < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s), {count} visible"))
        elif not te:
            item.add_marker(pytest.mark.skip(reason="needs TransformerEngine"))


class Run:
    """One finished training run: its metrics records and log."""

    def __init__(self, name, records, log, seconds):
        self.name, self.records, self.log, self.seconds = name, records, log, seconds

    @property
    def iterations(self):
        return [r for r in self.records if "iteration" in r]

    @property
    def losses(self):
        return [r["losses"]["lm loss"] for r in self.iterations]

    @property
    def grad_norms(self):
        return [r["grad_norm"] for r in self.iterations]

    def step_ms(self, warmup=5):
        import statistics

        times = [r["time_s"] for r in self.iterations if r["iteration"] > warmup and r.get("time_s")]
        return 1e3 * statistics.median(times) if times else None

    @property
    def summary(self):
        return next((r["summary"] for r in self.records if "summary" in r), {})


def launch(tmp_path, name, nproc, argv, *, env=None, entry=None, timeout=900):
    """torchrun ``entry`` (default pretrain_gpt.py) on ``nproc`` GPUs; returns a :class:`Run`."""
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    log = os.path.join(str(tmp_path), f"{name}.log")
    environ = dict(os.environ)
    environ.update(env or {})
    environ["MEGATRON_PATCHSET_METRICS"] = metrics
    environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    environ["PYTHONPATH"] = ROOT + os.pathsep + environ.get("PYTHONPATH", "")
    entry = entry or [os.path.join(ROOT, "pretrain_gpt.py")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *entry, *argv]
    started = time.time()
    with open(log, "w") as handle:
        handle.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        handle.flush()
        proc = subprocess.run(cmd, env=environ, stdout=handle, stderr=subprocess.STDOUT,
                              timeout=timeout, cwd=ROOT)
    seconds = time.time() - started
    if proc.returncode != 0 or not os.path.exists(metrics):
        with open(log, errors="replace") as handle:
            tail = "".join(handle.readlines()[-40:])
        pytest.fail(f"{name}: exit code {proc.returncode}; last lines of {log}:\n{tail}")
    with open(metrics) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    run = Run(name, records, log, seconds)
    report_dir = os.environ.get("PATCHSET_GPU_REPORT")
    if report_dir:
        os.makedirs(report_dir, exist_ok=True)
        with open(os.path.join(report_dir, f"{name}.json"), "w") as handle:
            json.dump({"name": name, "nproc": nproc, "argv": argv, "env": env or {},
                       "seconds": seconds, "losses": run.losses, "grad_norms": run.grad_norms,
                       "step_ms": run.step_ms(), "summary": run.summary}, handle)
    return run


def tiny_argv(*extra):
    from megatron.patchset import argsfile

    return argsfile.read(TINY) + list(extra)


def first_difference(a, b):
    """Index and values of the first element where two sequences differ, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    if len(a) != len(b):
        return min(len(a), len(b)), len(a), len(b)
    return None
