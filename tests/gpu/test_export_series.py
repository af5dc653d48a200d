"""The patch series on one GPU: a Megatron-LM core_r0.19.0 checkout (the snapshot at
``MEGATRON_LM_SNAPSHOTS``) with ``export --series`` applied by ``git am -3``, run with the overlay
off (``MEGATRON_PATCHSET=off``) and the checkout first on ``PYTHONPATH``, trains as the overlay does
on the installed megatron-core, bit for bit under ``--deterministic-mode``:

* without any feature's flags (the checkout against the installed wheel, the baseline of the rest);
* for each change of the series that has a training path, the overlay's flags against the flags
  the change adds to upstream (:data:`CHANGE_RUNS`).

Skips without the snapshots.
"""

import glob
import os
import shutil
import subprocess
import sys

import pytest

from megatron.patchset.export import changes
from tests.gpu.conftest import (
    DETERMINISTIC,
    GROUPED_MM_GRAPHED,
    ROOT,
    assert_trains_alike,
    first_difference,
    launch_many,
    tiny_argv,
)
from tests.gpu.features.fsdp_cuda_graphs.test_cuda_graphs_fsdp import ENV as FSDP_ENV
from tests.gpu.features.fsdp_cuda_graphs.test_cuda_graphs_fsdp import FSDP
from tests.gpu.test_export import GRAPHS as TE_LAYER_GRAPHS
from tests.unit.export import snapshots

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1), snapshots.needs_snapshots]

BRANCH = "core_r0.19.0"
ITERS = 10
NUMERICS = (*DETERMINISTIC, "--no-check-for-nan-in-loss-and-grad")
# change name[:variant]: (the overlay's flags, the flags of the edited upstream tree, environment),
# the flags added to the tiny config and NUMERICS
CHANGE_RUNS = {
    "triton_cross_entropy": (
        ("--cross-entropy-loss-fusion", "--cross-entropy-triton"),
        ("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "triton"),
        {},
    ),  # megatron refuses --deterministic-mode with a fused cross entropy: NOT_BITWISE
    "torch_adam": (("--adam-impl", "triton"), ("--adam-fusion-impl", "triton"), {}),
    "torch_adam:distributed_optimizer": (
        ("--adam-impl", "triton", "--use-distributed-optimizer"),
        ("--adam-fusion-impl", "triton", "--use-distributed-optimizer"),
        {},
    ),
    # the step captured with the full iteration (the learning rate a device tensor, the clip's
    # scale computed on the device)
    "torch_adam:captured": (
        (*GROUPED_MM_GRAPHED, "--optimizer-cuda-graph", "--adam-impl", "triton"),
        (*GROUPED_MM_GRAPHED, "--optimizer-cuda-graph", "--adam-fusion-impl", "triton"),
        {},
    ),
    # TE per-layer graphs with Megatron-FSDP, as the feature's own GPU tests run them
    "fsdp_cuda_graphs": ((*FSDP, *TE_LAYER_GRAPHS), (*FSDP, *TE_LAYER_GRAPHS), FSDP_ENV),
    "grouped_mm": (GROUPED_MM_GRAPHED, GROUPED_MM_GRAPHED, {}),
}
# Changes whose upstream form is not the overlay's code path bit for bit, and why: compared within
# the tolerance of the feature's own GPU tests instead.
NOT_BITWISE = {
    "triton_cross_entropy": "megatron refuses --deterministic-mode with "
    "--cross-entropy-loss-fusion, so both runs are nondeterministic",
}


RUN_CHECKOUT = os.path.join(ROOT, "tests", "gpu", "harness", "run_checkout.py")


def _installed_datasets() -> str:
    """The installed megatron-core's datasets folder: its built helpers serve the checkout too (a
    checkout builds them with make and pybind11 at the first run)."""
    import megatron.core.datasets

    return os.path.dirname(os.path.abspath(megatron.core.datasets.__file__))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("series")
    tree = snapshots.checkout(BRANCH, root / "megatron-lm")
    done = snapshots.export(
        tree, root / "patches", "--author", snapshots.AUTHOR, "--date", snapshots.DATE
    )
    assert done.returncode == 0, done.stderr[-3000:]
    patches = sorted(str(p) for p in (root / "patches").glob("*.patch"))
    am = snapshots.git(tree, "am", "-3", *patches)
    assert am.returncode == 0, am.stderr[-3000:]
    # The checkout first; what the environment already has on the path stays behind it.
    inherited = os.environ.get("PYTHONPATH", "")
    edited = {
        "PYTHONPATH": os.pathsep.join(filter(None, [tree, inherited])),
        "MEGATRON_PATCHSET": "off",
    }
    # what the launcher's path (this checkout, then the edited tree) imports as megatron.core
    where = subprocess.run(
        [sys.executable, "-c", "import megatron.core as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **edited, "PYTHONPATH": os.pathsep.join([ROOT, edited["PYTHONPATH"]])},
        timeout=600,
    ).stdout.strip()
    assert where.startswith(tree), where
    tmp = tmp_path_factory.mktemp("series_runs")
    base = tiny_argv("--train-iters", str(ITERS), *NUMERICS)
    loose = tiny_argv("--train-iters", str(ITERS), *NUMERICS[2:])  # without --deterministic-mode
    assert NUMERICS[:2] == ("--deterministic-mode", "--te-rng-tracker")
    # the checkout's own pretrain_gpt.py, recording its metrics (its megatron-core is 0.19.1)
    entry = [RUN_CHECKOUT, os.path.join(tree, "pretrain_gpt.py")]
    for lib in glob.glob(os.path.join(_installed_datasets(), "helpers_cpp*.so")):
        shutil.copy(lib, os.path.join(tree, "megatron", "core", "datasets"))
    jobs = [
        dict(tmp_path=tmp, name="overlay_plain", nproc=1, argv=base),
        dict(tmp_path=tmp, name="series_plain", nproc=1, argv=base, env=edited, entry=entry),
    ]
    in_series = {change.name for change in changes.series()}
    for name, (overlay, upstream, env) in CHANGE_RUNS.items():
        argv = loose if name == "triton_cross_entropy" else base
        if name.partition(":")[0] in in_series:
            jobs += [
                dict(
                    tmp_path=tmp,
                    name=f"overlay_{name}",
                    nproc=1,
                    argv=argv + list(overlay),
                    env=env,
                ),
                dict(
                    tmp_path=tmp,
                    name=f"series_{name}",
                    nproc=1,
                    argv=argv + list(upstream),
                    env={**env, **edited},
                    entry=entry,
                ),
            ]
    return tree, launch_many(jobs)


def _bitwise(ours, theirs):
    assert len(ours.losses) == len(theirs.losses) == ITERS
    assert first_difference(ours.losses, theirs.losses) is None, (ours.name, theirs.name)
    assert first_difference(ours.grad_norms, theirs.grad_norms) is None, (ours.name, theirs.name)


def test_the_edited_checkout_without_feature_flags_trains_as_the_installed_wheel(runs):
    _, done = runs
    _bitwise(done["series_plain"], done["overlay_plain"])


@pytest.mark.parametrize("name", sorted(CHANGE_RUNS))
def test_each_change_trains_on_the_checkout_as_in_the_overlay(runs, name):
    _, done = runs
    if f"series_{name}" not in done:
        pytest.fail(f"{name} is not in the series")
    ours, theirs = done[f"series_{name}"], done[f"overlay_{name}"]
    if name not in NOT_BITWISE:
        _bitwise(ours, theirs)
        return
    print(
        f"\n{name}: first difference {first_difference(ours.losses, theirs.losses)} "
        f"({NOT_BITWISE[name]})"
    )
    assert_trains_alike(ours, theirs, name, iters=ITERS, loss_atol=2e-2, grad_norm_rtol=5e-2)
