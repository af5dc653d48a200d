"""GPU test tier: real training runs through torchrun on the local GPUs.

Every test here is marked ``gpu`` and ``gpus(n)``; it skips cleanly when fewer than ``n`` CUDA
GPUs are visible or TransformerEngine does not import. Runs write megatron's exact
per-iteration metrics (``MEGATRON_PATCHSET_METRICS``) and their logs under pytest's tmp dir;
set ``PATCHSET_GPU_REPORT=<dir>`` to also collect a JSON summary of every run there.

``--gpu-part N/M`` (``tools/ci/run_gpu_tier.sh --part N/M``) runs part N of M of the tier: whole
files, so that a module's shared runs stay together, each file in exactly one part (:data:`PARTS`).
"""

import importlib.util
import json
import os
import shlex
import subprocess
import time
import zlib

import pytest

from megatron.patchset.core import argsfile

GPU_TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(GPU_TESTS))
TINY = os.path.join(ROOT, "examples", "configs", "tiny_moe.args")
UPSTREAM_SCRIPT = os.environ.get(
    "MEGATRON_LM_PRETRAIN_GPT", os.path.join(ROOT, ".upstream", "megatron-lm", "pretrain_gpt.py")
)
# The tiny config as the fork's full-iteration recipe runs it on one GPU, without dropout: torch
# grouped GEMMs with the token counts on the device, the whole forward and backward as one CUDA
# graph; the tests of a feature that the recipe adds compare runs with and without it.
FULL_ITERATION_RECIPE = (
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--moe-grouped-gemm-impl",
    "torch",
    "--moe-permute-fusion",
    "--moe-expert-splits-on-device",
    "--no-check-for-nan-in-loss-and-grad",
    "--te-rng-tracker",
    "--cuda-graph-impl",
    "full_iteration",
    "--cuda-graph-warmup-steps",
    "2",
)
# Flags under which two runs of the same model are compared bit for bit.
DETERMINISTIC = (
    "--deterministic-mode",
    "--te-rng-tracker",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
)
# The experts as torch grouped GEMMs with the counts on the device, the step in one
# full-iteration CUDA graph (the grouped_mm feature's flags, as upstream and the fork name them).
GROUPED_MM_GRAPHED = (
    "--moe-permute-fusion",
    "--moe-grouped-gemm-impl",
    "torch",
    "--moe-expert-splits-on-device",
    "--cuda-graph-impl",
    "full_iteration",
    "--cuda-graph-warmup-steps",
    "2",
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


# The tier in 4 parts of under 8 minutes each on one H200, by the files' times there: the tiny
# trainings (over 300 s); torch_adam's training comparisons (about 200 s) and the resume
# recipes (about 150 s); grouped_mm (about 100 s) and the compile-heavy fsdp_cuda_graphs and
# torch_compile; the export (about 60 s), static_dispatch, the Triton loss and the Triton SwiGLU
# (about 70 s). The files of two-GPU tests, which skip on one GPU, are spread over the parts.
# Entries are paths under tests/gpu (a file, or a folder and everything in it); a file that no
# entry names goes to the last part. Another M deals the files out by a hash of their path.
PARTS = {
    4: (
        ("test_train_tiny.py", "features/paged_stash"),
        (
            "features/torch_adam",
            "test_resume.py",
            "test_dp_overlap.py",
            "features/offload",
            "features/dp_grad_scaling",
        ),
        (
            "features/grouped_mm",
            "features/fsdp_cuda_graphs",
            "features/torch_compile",
            "features/p2p_overlap",
        ),
        (
            "test_export.py",
            "test_export_series.py",
            "features/static_dispatch",
            "features/triton_cross_entropy",
            "features/triton_swiglu",
            "features/flex_dispatch",
        ),
    ),
}


def parse_part(text: str) -> tuple[int, int]:
    """``N/M`` -> (N, M), with 1 <= N <= M."""
    number, sep, parts = text.partition("/")
    if not (sep and number.isdigit() and parts.isdigit() and 1 <= int(number) <= int(parts)):
        raise pytest.UsageError(f"--gpu-part {text}: expected N/M with 1 <= N <= M, e.g. 2/4")
    return int(number), int(parts)


def part_of(path: str, parts: int) -> int:
    """The part (1..parts) of the test file at ``path``, relative to tests/gpu with '/'."""
    for number, entries in enumerate(PARTS.get(parts, ()), start=1):
        if any(path == entry or path.startswith(entry + "/") for entry in entries):
            return number
    if parts in PARTS:
        return parts
    return zlib.crc32(path.encode()) % parts + 1


def pytest_addoption(parser):
    parser.addoption(
        "--gpu-part",
        default=None,
        metavar="N/M",
        help="run part N of M of the GPU tier (whole files; tools/ci/run_gpu_tier.sh --part)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs NVIDIA GPUs and TransformerEngine")
    config.addinivalue_line("markers", "gpus(n): needs at least n GPUs")
    if config.getoption("--gpu-part", None):
        parse_part(config.getoption("--gpu-part"))  # a usage error before collection


def select_part(config, items) -> None:
    """Deselect the GPU tests of the other parts (--gpu-part); tests elsewhere stay."""
    number, parts = parse_part(config.getoption("--gpu-part"))
    keep, drop = [], []
    for item in items:
        path = os.path.relpath(str(item.path), GPU_TESTS).replace(os.sep, "/")
        inside = not path.startswith("../")
        (drop if inside and part_of(path, parts) != number else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu-part", None):
        select_part(config, items)
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
        self,
        tmp_path,
        name,
        nproc,
        argv,
        *,
        env=None,
        entry=None,
        timeout=900,
        check=True,
        emulate=None,
    ):
        self.name, self.nproc, self.argv, self.env = name, nproc, argv, env or {}
        self.timeout, self.check = timeout, check
        self.metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
        self.log = os.path.join(str(tmp_path), f"{name}.log")
        import bench  # tools/bench, on pytest's pythonpath

        entry = entry or [os.path.join(ROOT, "pretrain_gpt.py")]
        # this checkout first, then the run's own path or the caller's
        paths = [ROOT, self.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")]
        # the script's folder, for its sibling modules (run_upstream.py moves it behind the
        # installed packages, so that the checkout's own megatron/ does not replace them)
        if entry[0] == UPSTREAM_ENTRY:
            paths.insert(0, os.path.dirname(os.path.abspath(entry[1])))
        extra = {**self.env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        if emulate is not None:  # one process as rank 0 of an `emulate`-GPU job
            cmd, environ = bench.launch_spec(
                [*entry, *argv, "--fake-process-group"], extra, self.metrics, 1, None, (emulate, 0)
            )
        else:
            cmd, environ = bench.launch_spec([*entry, *argv], extra, self.metrics, nproc)
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


def launch(
    tmp_path, name, nproc, argv, *, env=None, entry=None, timeout=900, check=True, emulate=None
):
    """torchrun ``entry`` (default pretrain_gpt.py) on ``nproc`` GPUs; returns a :class:`Run`.
    With ``check=False`` a failed run is returned too (``run.returncode``, ``run.log``) instead
    of failing the test. ``emulate=N``: one process, without torchrun, as rank 0 of an N-GPU job
    under megatron's ``--fake-process-group`` (every collective skipped; the fork's stand-ins for
    the expert-parallel exchanges)."""
    return _Job(
        tmp_path,
        name,
        nproc,
        argv,
        env=env,
        entry=entry,
        timeout=timeout,
        check=check,
        emulate=emulate,
    ).finish()


def launch_many(jobs, *, timeout=900):
    """Start several launches at once and wait for all; returns ``{name: Run}``.

    ``jobs`` are dicts of :func:`launch`'s arguments (``tmp_path``, ``name``, ``nproc``, ``argv``,
    optional ``env``, ``entry``, ``check``, ``emulate``). The runs share the GPUs (each process is
    its own CUDA context, time-sliced by the driver): use it for numerics, never for timings."""
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


def launch_variants(tmp_path, variants: dict, iters: int, nproc: int = 1):
    """Every variant of ``variants`` (``{name: flags}``) on the tiny config for ``iters``
    iterations on ``nproc`` GPUs, all started at once (:func:`launch_many`); ``{name: Run}``."""
    argv = {
        name: tiny_argv("--train-iters", str(iters), *flags) for name, flags in variants.items()
    }
    return launch_many(
        [dict(tmp_path=tmp_path, name=name, nproc=nproc, argv=a) for name, a in argv.items()]
    )


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


def assert_same_bits(ours, reference, label, iters):
    """``ours`` and ``reference`` each logged ``iters`` iterations, with the same losses and
    gradient norms to the last bit; prints ``label``, ours' first and last loss and the first
    difference."""
    assert len(ours.losses) == len(reference.losses) == iters
    print(
        f"\n{label}: losses {ours.losses[0]:.6f} -> {ours.losses[-1]:.6f}; first difference "
        f"{first_difference(ours.losses, reference.losses)}"
    )
    assert first_difference(ours.losses, reference.losses) is None
    assert first_difference(ours.grad_norms, reference.grad_norms) is None


def assert_resumed_exactly(full, first, again, exit_at):
    """A run stopped after iteration ``exit_at`` (``first``) and resumed from its checkpoint
    (``again``) logs every iteration of the uninterrupted run ``full`` once, with bit-identical
    losses, and gradient norms after the resume."""
    iters = len(full.iterations)
    assert [r["iteration"] for r in full.iterations] == list(range(1, iters + 1))
    assert [r["iteration"] for r in first.iterations] == list(range(1, exit_at + 1))
    assert [r["iteration"] for r in again.iterations] == list(range(exit_at + 1, iters + 1))
    assert first_difference(first.losses, full.losses[:exit_at]) is None
    assert first_difference(again.losses, full.losses[exit_at:]) is None, (
        again.losses,
        full.losses,
    )
    assert first_difference(again.grad_norms, full.grad_norms[exit_at:]) is None


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
