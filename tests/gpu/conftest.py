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

from megatron.patchset.core import argsfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "configs", "tiny_moe.args")
UPSTREAM_SCRIPT = os.environ.get(
    "MEGATRON_LM_PRETRAIN_GPT", os.path.join(ROOT, ".upstream", "megatron-lm", "pretrain_gpt.py")
)
# Megatron-LM's own script, unmodified: entry=[UPSTREAM_ENTRY, UPSTREAM_SCRIPT].
UPSTREAM_ENTRY = os.path.join(ROOT, "tools", "bench", "run_upstream.py")


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
        self.returncode = 0

    def log_text(self):
        with open(self.log, errors="replace") as handle:
            return handle.read()

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

        times = [
            r["time_s"] for r in self.iterations if r["iteration"] > warmup and r.get("time_s")
        ]
        return 1e3 * statistics.median(times) if times else None

    @property
    def summary(self):
        return next((r["summary"] for r in self.records if "summary" in r), {})


class _Job:
    """One torchrun launch in progress."""

    def __init__(
        self, tmp_path, name, nproc, argv, *, env=None, entry=None, timeout=900, check=True
    ):
        self.name, self.nproc, self.argv, self.env = name, nproc, argv, env or {}
        self.timeout, self.check = timeout, check
        self.metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
        self.log = os.path.join(str(tmp_path), f"{name}.log")
        environ = dict(os.environ)
        environ.update(self.env)
        environ["MEGATRON_PATCHSET_METRICS"] = self.metrics
        environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        entry = entry or [os.path.join(ROOT, "pretrain_gpt.py")]
        paths = [ROOT, environ.get("PYTHONPATH")]
        if entry[0] == UPSTREAM_ENTRY:  # the script's folder first, for its sibling modules
            paths.insert(0, os.path.dirname(os.path.abspath(entry[1])))
        environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *entry,
            *argv,
        ]
        self.started = time.time()
        self.handle = open(self.log, "w")
        self.handle.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        self.handle.flush()
        self.proc = subprocess.Popen(
            cmd, env=environ, stdout=self.handle, stderr=subprocess.STDOUT, cwd=ROOT
        )

    def finish(self):
        try:
            returncode = self.proc.wait(timeout=max(1, self.timeout - (time.time() - self.started)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            returncode = self.proc.wait()
        self.handle.close()
        seconds = time.time() - self.started
        if (returncode != 0 or not os.path.exists(self.metrics)) and self.check:
            with open(self.log, errors="replace") as handle:
                tail = "".join(handle.readlines()[-40:])
            pytest.fail(f"{self.name}: exit code {returncode}; last lines of {self.log}:\n{tail}")
        records = []
        if os.path.exists(self.metrics):
            with open(self.metrics) as handle:
                records = [json.loads(line) for line in handle if line.strip()]
        run = Run(self.name, records, self.log, seconds)
        run.returncode = returncode
        report_dir = os.environ.get("PATCHSET_GPU_REPORT")
        if report_dir:
            os.makedirs(report_dir, exist_ok=True)
            with open(os.path.join(report_dir, f"{self.name}.json"), "w") as handle:
                json.dump(
                    {
                        "name": self.name,
                        "nproc": self.nproc,
                        "argv": self.argv,
                        "env": self.env,
                        "seconds": seconds,
                        "losses": run.losses,
                        "grad_norms": run.grad_norms,
                        "step_ms": run.step_ms(),
                        "summary": run.summary,
                    },
                    handle,
                )
        return run


def launch(tmp_path, name, nproc, argv, *, env=None, entry=None, timeout=900, check=True):
    """torchrun ``entry`` (default pretrain_gpt.py) on ``nproc`` GPUs; returns a :class:`Run`.
    With ``check=False`` a failed run is returned too (``run.returncode``, ``run.log``) instead
    of failing the test."""
    return _Job(
        tmp_path, name, nproc, argv, env=env, entry=entry, timeout=timeout, check=check
    ).finish()


def launch_many(jobs, *, timeout=900):
    """Start several launches at once and wait for all; returns ``{name: Run}``.

    ``jobs`` are dicts of :func:`launch`'s arguments (``tmp_path``, ``name``, ``nproc``, ``argv``,
    optional ``env``, ``entry``, ``check``). The runs share the GPUs (each process is its own
    CUDA context, time-sliced by the driver): use it for numerics, never for timings."""
    started = [_Job(timeout=timeout, **job) for job in jobs]
    runs, failures = {}, []
    for job in started:  # wait for every job before reporting a failure
        try:
            runs[job.name] = job.finish()
        except pytest.fail.Exception as exc:
            failures.append(str(exc))
    if failures:
        pytest.fail("\n\n".join(failures))
    return runs


@pytest.fixture
def one_rank_group():
    """A one-rank NCCL process group, for megatron functions that reduce over a group in-process
    (the gradient norm, the vocab-parallel loss)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def tiny_argv(*extra):

    return argsfile.read(TINY) + list(extra)


def first_difference(a, b):
    """Index and values of the first element where two sequences differ, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    if len(a) != len(b):
        return min(len(a), len(b)), len(a), len(b)
    return None


def assert_trains_alike(ours, reference, label, *, iters, loss_atol=2e-2, grad_norm_rtol=5e-2):
    """``ours`` trained ``iters`` finite iterations within ``loss_atol`` of ``reference``'s losses
    and ``grad_norm_rtol`` of its gradient norms, and learned (its loss fell by more than 2)."""
    import math

    assert len(ours.losses) == len(reference.losses) == iters
    assert all(math.isfinite(x) for x in ours.losses)
    loss_diff = [abs(a - b) for a, b in zip(ours.losses, reference.losses)]
    norm_diff = [abs(a - b) / b for a, b in zip(ours.grad_norms, reference.grad_norms)]
    print(
        f"\n{label}: max |loss diff| {max(loss_diff):.5f}, max grad-norm rel diff "
        f"{max(norm_diff):.4f}; loss {ours.losses[0]:.3f} -> {ours.losses[-1]:.3f}"
    )
    assert max(loss_diff) < loss_atol
    assert max(norm_diff) < grad_norm_rtol
    assert ours.losses[-1] < ours.losses[0] - 2.0
