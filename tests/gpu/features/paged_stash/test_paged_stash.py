"""MoE paged stashing on two Hopper GPUs (EP=2, bf16, a static receive budget, TE op-fuser
experts), for both flex backends that take a budget: TransformerEngine's NCCL EP (``ncclep``,
with ``--moe-ncclep-static-shape``) and DeepEP's HybridEP (``hybridep``). For each: stash on vs
off give the same losses, eagerly and with TE partial CUDA graphs over attention, router and MoE
preprocessing; a stash buffer far too small overflows, megatron re-runs the step (the fork prints
one line for it) and training continues.

Each backend skips at its own probe: ncclep when the loaded NCCL is older than TE 2.20.2's
libnccl_ep.so needs or NCCL EP's kernel JIT would not find that NCCL's headers (as in
test_flex_dispatch.py: LD_PRELOAD a newer NCCL, NCCL_INCLUDE=<its include folder>); hybridep when
``from deep_ep import HybridEPBuffer`` fails. Tolerance: the paged stash only moves saved
activations (the same bytes come back), so losses are expected to be bit-identical; the assertion
allows ``LOSS_ATOL`` (absolute, per iteration) for run-to-run nondeterminism of the dispatch in
bf16. ``PAGED_STASH_GPU_ITERS`` shortens the runs (default 20).
"""

import math
import os

import pytest

from megatron.patchset.features.flex_dispatch import probes
from tests.gpu.conftest import first_difference, launch, tiny_argv

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

ITERS = int(os.environ.get("PAGED_STASH_GPU_ITERS", "20"))
LOSS_ATOL = 2e-2
PREFIX = "megatron-patchset: paged stash"

BACKENDS = {
    # NCCL EP traps when its budget is exceeded, hence 2.0; the static shape hands the experts the
    # whole [budget, hidden] receive buffer (paged stashing needs it).
    "ncclep": (
        "--moe-flex-dispatcher-backend",
        "ncclep",
        "--moe-ncclep-static-shape",
        "--moe-expert-rank-capacity-factor",
        "2.0",
    ),
    "hybridep": (
        "--moe-flex-dispatcher-backend",
        "hybridep",
        "--moe-router-dtype",
        "fp32",
        "--moe-expert-rank-capacity-factor",
        "1.5",
    ),
}
COMMON = (
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "flex",
    "--use-transformer-engine-op-fuser",
    "--train-iters",
    str(ITERS),
)
STASH = ("--moe-paged-stash",)
GRAPHS = (
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-modules",
    "attn",
    "moe_router",
    "moe_preprocess",
    "--cuda-graph-warmup-steps",
    "2",
)
ENV = {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}


def _hybridep_problem():
    try:
        from deep_ep import HybridEPBuffer  # noqa: F401
    except Exception as exc:  # ImportError or a broken build
        return (
            f"DeepEP hybrid-ep is not importable ({exc}); build it with tools/build/build_deepep.sh"
        )
    return None


def _ncclep_problem(mp):
    """NCCL_INCLUDE becomes NCCL_EP_JIT_BUILD_INCLUDE_DIR for the probe and the runs."""
    include = os.environ.get("NCCL_INCLUDE")
    if include and not os.environ.get("NCCL_EP_JIT_BUILD_INCLUDE_DIR"):
        mp.setenv("NCCL_EP_JIT_BUILD_INCLUDE_DIR", include)

    problem = probes.probe_nccl_ep()
    return f"NCCL EP cannot run here: {problem}" if problem else None


class Backend:
    def __init__(self, name, env, reference_dir):
        self.name = name
        self.env = env
        self.reference_dir = reference_dir
        self._off = None

    def argv(self, *extra):
        return tiny_argv(*COMMON, *BACKENDS[self.name], *extra)

    def stash_off(self):
        """The reference: the same static budget and experts, eager, without paged stashing."""
        if self._off is None:
            self._off = launch(
                self.reference_dir, f"{self.name}_stash_off_eager", 2, self.argv(), env=self.env
            )
        return self._off


@pytest.fixture(scope="module", params=sorted(BACKENDS, reverse=True))  # ncclep first
def backend(request, tmp_path_factory):
    name = request.param
    mp = pytest.MonkeyPatch()
    try:
        env = dict(ENV)
        if name == "ncclep":
            problem = _ncclep_problem(mp)
            env["NCCL_EP_JIT_LOG"] = os.environ.get("NCCL_EP_JIT_LOG", "1")
            if os.environ.get("NCCL_EP_JIT_BUILD_INCLUDE_DIR"):
                env["NCCL_EP_JIT_BUILD_INCLUDE_DIR"] = os.environ["NCCL_EP_JIT_BUILD_INCLUDE_DIR"]
        else:
            problem = _hybridep_problem()
        if problem:
            pytest.skip(problem)
        yield Backend(name, env, tmp_path_factory.mktemp(f"{name}_stash_off"))
    finally:
        mp.undo()


def _log(run):
    with open(run.log, errors="replace") as handle:
        return handle.read()


def _check_equal(off, on, label):
    assert len(off.losses) == len(on.losses) == ITERS, (len(off.losses), len(on.losses))
    assert all(math.isfinite(x) for x in on.losses)
    worst = max(abs(a - b) for a, b in zip(off.losses, on.losses))
    diff = first_difference(off.losses, on.losses)
    print(
        f"\n{label}: max |loss diff| {worst:.3g} over {ITERS} iterations "
        f"({'bit-identical' if diff is None else f'first difference at iteration {diff[0] + 1}'}); "
        f"last loss off {off.losses[-1]:.5f} on {on.losses[-1]:.5f}; peak "
        f"{off.summary.get('max_allocated_gib', 0):.2f} -> "
        f"{on.summary.get('max_allocated_gib', 0):.2f} GiB; median step {off.step_ms():.1f} -> "
        f"{on.step_ms():.1f} ms"
    )
    assert worst <= LOSS_ATOL, (
        f"{label}: losses differ by {worst} (> {LOSS_ATOL}): {off.losses} vs {on.losses}"
    )
    assert on.losses[-1] < on.losses[0] - (1.0 if ITERS >= 20 else 0.3)


def _check_paged(run):
    log = _log(run)
    assert f"{PREFIX}: allocated stash buffers" in log, (
        "paged stash allocated nothing (see the run log)"
    )
    assert "no MoE activation was marked" not in log


def test_paged_stash_matches_no_stash_eager(tmp_path, backend):
    on = launch(
        tmp_path, f"{backend.name}_stash_on_eager", 2, backend.argv(*STASH), env=backend.env
    )
    _check_paged(on)
    _check_equal(backend.stash_off(), on, f"{backend.name}: paged stash eager")


def test_paged_stash_matches_with_partial_cuda_graphs(tmp_path, backend):
    on = launch(
        tmp_path,
        f"{backend.name}_stash_on_graphs",
        2,
        backend.argv(*STASH, *GRAPHS),
        env=backend.env,
    )
    _check_paged(on)
    _check_equal(
        backend.stash_off(),
        on,
        f"{backend.name}: paged stash + TE graphs (attn, moe_router, moe_preprocess)",
    )


def test_overflow_reruns_and_training_continues(tmp_path, backend):
    run = launch(
        tmp_path,
        f"{backend.name}_stash_overflow",
        2,
        backend.argv(*STASH, "--moe-paged-stash-buffer-size-factor-cuda", "0.02"),
        env=backend.env,
    )
    log = _log(run)
    overflows = log.count(f"{PREFIX}: OVERFLOW")
    reruns_done = log.count("finished without overflow")
    print(
        f"\n{backend.name} overflow run: {overflows} overflow line(s), {reruns_done} finished "
        f"re-run line(s); losses {run.losses[0]:.4f} -> {run.losses[-1]:.4f}"
    )
    assert overflows >= 1 and "stash buffer full" in log
    if backend.name == "ncclep":
        assert "with the same NCCL EP receive budget" in log
    assert reruns_done >= 1
    # the re-run is without stashing: the losses are those of the run that never pages
    _check_equal(backend.stash_off(), run, f"{backend.name}: overflow (re-run) vs no stash")
