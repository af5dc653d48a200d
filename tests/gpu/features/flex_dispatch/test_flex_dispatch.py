"""The flex token dispatcher on two GPUs (EP=2): DeepEP and TransformerEngine's NCCL EP train the
tiny MoE config like the all-to-all dispatcher.

Tolerance (bf16): the backends route every token to the same experts, but combine the expert
outputs in a different order and their grouped GEMMs see the tokens in a different order, so
results differ by bf16 rounding, which training then carries along. Over 20 iterations every
iteration's loss must agree within 1% (relative) and the first iteration's within 0.2%.

DeepEP is built from source (tools/build/build_deepep.sh, docs/deepep.md); the DeepEP test skips
when ``deep_ep`` is not importable. The NCCL EP test skips when the loaded NCCL is older than
TransformerEngine 2.20.2's libnccl_ep.so needs (2.32.3; load a newer one with LD_PRELOAD) or when
NCCL EP's kernel JIT would not find that NCCL's headers (NCCL_INCLUDE=<include folder>, passed on
as NCCL_EP_JIT_BUILD_INCLUDE_DIR), and a further test checks that pretrain_gpt.py on the old NCCL
refuses the backend with that message instead of training with another dispatcher.
"""

import importlib.util
import math
import os
import subprocess
import sys

import pytest

from megatron.patchset.features.flex_dispatch import probes
from tests.gpu.conftest import ROOT, launch, tiny_argv

pytestmark = pytest.mark.gpu
ITERS = 20
FIRST_REL_TOL = 2e-3
REL_TOL = 1e-2
COMMON = (
    "--expert-model-parallel-size",
    "2",
    "--train-iters",
    str(ITERS),
    "--moe-router-dtype",
    "fp32",
)
NCCLEP = (
    "--moe-token-dispatcher-type",
    "flex",
    "--moe-flex-dispatcher-backend",
    "ncclep",
    "--moe-expert-rank-capacity-factor",
    "2.0",
)
DEEPEP = ("--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep")

_BASELINE: dict = {}


def alltoall(tmp_path):
    """The all-to-all reference run (once per pytest process)."""
    if "run" not in _BASELINE:
        _BASELINE["run"] = launch(tmp_path, "flex_ref_alltoall", 2, tiny_argv(*COMMON))
    return _BASELINE["run"]


def compare(reference, run):
    a, b = reference.losses, run.losses
    assert len(a) == len(b) == ITERS
    assert all(math.isfinite(x) for x in b)
    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    assert rel[0] <= FIRST_REL_TOL, (rel[0], a[0], b[0])
    worst = max(range(ITERS), key=lambda i: rel[i])
    assert rel[worst] <= REL_TOL, (
        f"iteration {worst + 1}: {a[worst]} vs {b[worst]} (rel {rel[worst]:.2e})"
    )
    assert b[-1] < b[0] - 1.0  # it learns
    print(
        f"\n{run.name} vs all-to-all over {ITERS} iterations: max rel loss diff {rel[worst]:.2e} "
        f"(it {worst + 1}); last loss {b[-1]:.4f} vs {a[-1]:.4f}; median step {run.step_ms():.1f} "
        f"ms vs {reference.step_ms():.1f} ms"
    )


def announced(run, backend):
    with open(run.log, errors="replace") as handle:
        return f"flex dispatcher backend {backend} from" in handle.read()


@pytest.mark.gpus(2)
def test_deepep_matches_alltoall(tmp_path):
    if importlib.util.find_spec("deep_ep") is None:
        pytest.skip(
            "deep_ep is not importable: build it with tools/build/build_deepep.sh (docs/deepep.md)"
        )
    run = launch(tmp_path, "flex_deepep", 2, tiny_argv(*COMMON, *DEEPEP))
    assert announced(run, "deepep"), "the run did not build DeepEP's dispatcher"
    compare(alltoall(tmp_path), run)


def _nccl_ep_problem():

    return probes.probe_nccl_ep()


def _nccl_ep_env(monkeypatch):
    """NCCL_INCLUDE=<folder with nccl.h and nccl_device.h of the loaded NCCL> becomes
    NCCL_EP_JIT_BUILD_INCLUDE_DIR for the probe and the runs (NCCL EP JIT-compiles its kernels
    against it at the first dispatch); NCCL_EP_JIT_LOG=1 unless set, so the run's log shows the
    compiles."""
    env = {"NCCL_EP_JIT_LOG": os.environ.get("NCCL_EP_JIT_LOG", "1")}
    include = os.environ.get("NCCL_INCLUDE")
    if include:
        monkeypatch.setenv("NCCL_EP_JIT_BUILD_INCLUDE_DIR", include)
        env["NCCL_EP_JIT_BUILD_INCLUDE_DIR"] = include
    return env


@pytest.mark.gpus(2)
def test_ncclep_matches_alltoall(tmp_path, monkeypatch):
    env = _nccl_ep_env(monkeypatch)
    problem = _nccl_ep_problem()
    if problem:
        pytest.skip(f"NCCL EP cannot run here: {problem}")
    run = launch(tmp_path, "flex_ncclep", 2, tiny_argv(*COMMON, *NCCLEP), env=env)
    assert announced(run, "ncclep"), "the run did not build the NCCL EP dispatcher"
    compare(alltoall(tmp_path), run)


@pytest.mark.gpus(2)
def test_ncclep_on_old_nccl_fails_fast(tmp_path):
    """Without the newer NCCL (LD_PRELOAD dropped), the launch stops at validation, naming the
    NCCL versions, before any model is built; it does not train with another dispatcher."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from megatron.patchset import token_dispatcher as f; "
            "print(f.nccl_runtime_version() >= f.NCCL_EP_MIN_NCCL)",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if probe.stdout.strip() != "False":
        pytest.skip(
            f"torch's own NCCL is new enough here ({probe.stdout.strip()} {probe.stderr[-200:]})"
        )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "pretrain_gpt.py"),
        *tiny_argv(*COMMON, *NCCLEP),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "[flex-backend-installed]" in out and "2.32.3" in out and "LD_PRELOAD" in out, out[
        -3000:
    ]
    assert " iteration " not in out
