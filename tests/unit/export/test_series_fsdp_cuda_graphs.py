"""The fsdp_cuda_graphs change of ``export --series`` on both Megatron-LM snapshots: it applies
alone, its upstream tests pass on the edited tree on CPU and fail on a tree with only its new
files, and configs with Megatron-FSDP but without TE per-layer graphs validate as before."""

import json
import os
import shutil

import pytest

from megatron.patchset.export import edits
from megatron.patchset.features.fsdp_cuda_graphs.upstream import CHANGE
from tests.unit.export.test_series import (
    AUTHOR,
    BRANCHES,
    LEAKS,
    PARSE,
    _checkout,
    _export,
    _git,
    _in_tree,
    pytestmark,  # noqa: F401 - skipped without the snapshots
)

TESTS = "tests/unit_tests/transformer/test_te_cuda_graph_hooks.py"
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]


@pytest.fixture(scope="module", params=BRANCHES)
def trees(request, tmp_path_factory):
    """(unedited checkout, checkout with the change applied by git am -3, patch text)."""
    root = tmp_path_factory.mktemp(f"fsdp-graphs-{request.param}")
    plain = _checkout(request.param, root / "plain")
    edited = _checkout(request.param, root / "edited")
    done = _export(plain, root / "patches", "--feature", CHANGE.name, "--author", AUTHOR)
    assert done.returncode == 0, done.stderr
    patches = sorted(str(p) for p in (root / "patches").glob("*.patch"))
    assert len(patches) == 1, done.stdout
    am = _git(edited, "am", "-3", *patches)
    assert am.returncode == 0, am.stderr
    return plain, edited, open(patches[0]).read()


def test_the_patch_edits_upstreams_functions_in_place(trees):
    _, _, text = trees
    for path in CHANGE.paths():
        assert f"+++ b/{path}" in text
    added = [line for line in text.splitlines() if line.startswith("+")]
    assert not [line for line in added if LEAKS.search(line)]
    assert max(len(line) for line in added) <= 101


def test_the_upstream_tests_pass_on_the_edited_tree(trees):
    _, edited, _ = trees
    run = _in_tree(edited, *PYTEST, TESTS)
    assert run.returncode == 0 and "15 passed" in run.stdout, run.stdout[-3000:]


def test_the_upstream_tests_fail_without_the_code_edits(trees, tmp_path):
    """The new module and tests alone: the tests of __call__, the capture inputs and
    validate_args fail (on the first snapshot only: the check is the same on both)."""
    plain, _, _ = trees
    if os.path.basename(os.path.dirname(plain)).startswith("fsdp-graphs-main"):
        pytest.skip("checked on core_r0.19.0")
    tree = shutil.copytree(plain, tmp_path / "new-files-only", symlinks=True)
    for edit in CHANGE.edits:
        if isinstance(edit, edits.NewFile):
            os.makedirs(os.path.dirname(os.path.join(tree, edit.path)), exist_ok=True)
            with open(os.path.join(tree, edit.path), "w") as handle:
                handle.write(edit.text())
    run = _in_tree(str(tree), *PYTEST, TESTS)
    assert run.returncode == 1, run.stdout[-3000:]
    assert "TestGraphableModuleHooks::test_hooks_fire_around_capture_and_replay" in run.stdout
    assert "TestValidateArgs::test_unsupported_config_is_refused" in run.stdout
    assert "7 failed, 8 passed" in run.stdout, run.stdout[-3000:]


FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
VARIANTS = {
    "fsdp": FSDP,
    "fsdp_graphs_local": FSDP + ["--cuda-graph-impl", "local"],
    "fsdp_full_iteration": FSDP + ["--cuda-graph-impl", "full_iteration"],
    "ddp_te_graphs": ["--cuda-graph-impl", "transformer_engine"],
}


def test_configs_without_fsdp_te_graphs_are_checked_as_before(trees, tmp_path):
    plain, edited, _ = trees
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    base += ["--seq-length", "128", "--max-position-embeddings", "128"]
    base += ["--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-4", "--bf16"]
    base += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    runs = {name: base + extra for name, extra in VARIANTS.items()}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    parsed = {}
    for label, tree in (("plain", plain), ("edited", edited)):
        out = tmp_path / f"{label}.json"
        run = _in_tree(tree, "-c", PARSE, str(out), str(tmp_path / "runs.json"), world_size=1)
        assert run.returncode == 0, run.stderr[-3000:]
        parsed[label] = json.load(open(out))
    assert parsed["plain"] == parsed["edited"]
    assert isinstance(parsed["edited"]["fsdp_graphs_local"], dict)  # accepted, as upstream does
