"""The torch_adam change of ``export --series`` on the two Megatron-LM snapshots: it applies alone
with ``git am -3``, its upstream tests pass on the edited tree on the CPU (Triton's interpreter)
and fail on the unedited one, its new flag parses into ``OptimizerConfig`` there, and upstream's
flags without it give the same optimizer config as before."""

import json
import os
import shutil

import pytest

from megatron.patchset.features.torch_adam.upstream import CHANGE
from tests.unit.conftest import ROOT
from tests.unit.export.test_series import (
    AUTHOR,
    BRANCHES,
    LEAKS,
    _checkout,
    _export,
    _git,
    _in_tree,
    pytestmark,  # noqa: F401 - skipped without the snapshots
)

TESTS = "tests/unit_tests/optimizer/test_triton_adam.py"
# the repository's small example config, its comments dropped
BASE = " ".join(
    word
    for line in open(os.path.join(ROOT, "examples", "configs", "tiny_moe.args"))
    for word in line.split("#")[0].split()
)
PYTEST = ("-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--noconftest")


@pytest.fixture(scope="module", params=BRANCHES)
def change(request, tmp_path_factory):
    """(unedited checkout, checkout with the change applied by git am -3, patch text)."""
    root = tmp_path_factory.mktemp(f"torch_adam-{request.param}")
    plain = _checkout(request.param, root / "plain")
    edited = _checkout(request.param, root / "edited")
    done = _export(plain, root / "patches", "--feature", "torch_adam", "--author", AUTHOR)
    assert done.returncode == 0, done.stderr
    (patch,) = sorted(str(p) for p in (root / "patches").glob("*.patch"))
    am = _git(edited, "am", "-3", patch)
    assert am.returncode == 0, am.stderr
    return plain, edited, open(patch).read()


def test_the_change_touches_upstreams_optimizer_and_adds_its_tests(change):
    _, _, text = change
    touched = sorted(line.split(" b/")[-1] for line in text.splitlines() if line[:5] == "diff ")
    assert touched == sorted(CHANGE.paths())
    added = [line for line in text.splitlines() if line.startswith("+")]
    assert not [line for line in added if LEAKS.search(line)]
    assert all(len(line) <= 101 for line in added if not line.startswith("+++"))


def test_its_tests_pass_on_the_edited_tree_under_the_interpreter(change):
    _, edited, _ = change
    run = _in_tree(edited, *PYTEST, TESTS, interpret=True)
    assert "15 passed, 1 skipped" in run.stdout, run.stdout[-3000:]


def test_its_tests_fail_on_the_unedited_tree(change, tmp_path):
    plain, _, _ = change
    tree = shutil.copytree(plain, tmp_path / "tests-only", symlinks=True)
    test_file = next(e for e in CHANGE.edits if e.path == TESTS)
    with open(os.path.join(tree, TESTS), "w") as handle:
        handle.write(test_file.text())
    run = _in_tree(str(tree), *PYTEST, TESTS, interpret=True)
    assert run.returncode != 0 and "No module named 'megatron.core.optimizer.triton_adam'" in (
        run.stdout
    ), run.stdout[-3000:]


CONFIG = """
import contextlib, io, json, sys, types
import torch
# as on one Hopper GPU: validate_args reads the device's compute capability
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
    major=9, minor=0, name="H100", total_memory=80 << 30, multi_processor_count=132
)
torch.cuda.device_count = lambda: 1
from megatron.training.arguments import parse_args, validate_args
from megatron.training.training import get_megatron_optimizer_config
target, runs, base = sys.argv[1], json.load(open(sys.argv[2])), open(sys.argv[3]).read().split()
out = {}
for name, words in runs.items():
    sys.argv = ["pretrain_gpt.py", *base, *words]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args()
            validate_args(args, {})
        config, _ = get_megatron_optimizer_config(args)
        out[name] = {k: repr(v) for k, v in sorted(vars(config).items()) if k != "timers"}
    except BaseException as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
json.dump(out, open(target, "w"))
"""
RUNS = {
    "plain": [],
    "dist_opt": ["--use-distributed-optimizer"],
    "torch": ["--adam-fusion-impl", "torch", "--optimizer-cuda-graph"],
    "triton_dist_opt": ["--adam-fusion-impl", "triton", "--use-distributed-optimizer"],
}


def test_the_flag_reaches_the_optimizer_config_and_other_configs_are_unchanged(change, tmp_path):
    """megatron's parser and get_megatron_optimizer_config (what training builds the optimizer
    from) on both trees; the flag's arguments are validated by OptimizerConfig."""
    plain, edited, _ = change
    (tmp_path / "runs.json").write_text(json.dumps(RUNS))
    parsed = {}
    for label, tree in (("plain", plain), ("edited", edited)):
        out = tmp_path / f"{label}.json"
        (tmp_path / "base.args").write_text(BASE)
        argv = (str(out), str(tmp_path / "runs.json"), str(tmp_path / "base.args"))
        run = _in_tree(tree, "-c", CONFIG, *argv, world_size=1)
        assert run.returncode == 0, run.stderr[-3000:]
        parsed[label] = json.load(open(out))
    before, after = parsed["plain"], parsed["edited"]
    for name in ("plain", "dist_opt"):
        assert after[name].pop("adam_fusion_impl") == "'auto'"
        assert after[name] == before[name]
    assert before["torch"].startswith("SystemExit")  # no such flag upstream
    assert after["torch"]["adam_fusion_impl"] == "'torch'"
    assert after["torch"]["optimizer_cuda_graph"] == "True"
    assert (
        after["triton_dist_opt"].startswith("ValueError")
        and "distributed" in (after["triton_dist_opt"])
    )
