"""The grouped_mm change of ``export --series`` on the core_r0.19.0 and main snapshots: it
applies after the series' earlier changes with ``git am -3`` (its ``TEGroupedMLP.forward`` edit
in the form each snapshot holds), its upstream tests pass on the edited tree on CPU (the Triton
accumulation under Triton's interpreter) and fail on the unedited one, and ``--help`` lists its
two flags."""

import os
import re
import shutil

import pytest

from megatron.patchset.features.grouped_mm import upstream
from tests.unit.export.test_series import (
    AUTHOR,
    BRANCHES,
    DATE,
    LEAKS,
    SNAPSHOTS,
    _checkout,
    _export,
    _git,
    _in_tree,
)

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(SNAPSHOTS, "checkout.sh")),
    reason=f"no Megatron-LM snapshots at {SNAPSHOTS} (set MEGATRON_LM_SNAPSHOTS)",
)
TESTS = "tests/unit_tests/transformer/moe/test_torch_grouped_gemm.py"


@pytest.fixture(scope="module", params=BRANCHES)
def change(request, tmp_path_factory):
    """(branch, unedited checkout, checkout with the series applied by git am -3, the text of
    this change's patch, the last)."""
    root = tmp_path_factory.mktemp(f"grouped_mm-{request.param}")
    plain = _checkout(request.param, root / "plain")
    edited = _checkout(request.param, root / "edited")
    done = _export(plain, root / "patches", "--author", AUTHOR, "--date", DATE)
    assert done.returncode == 0, done.stderr
    patches = sorted(str(p) for p in (root / "patches").glob("*.patch"))
    am = _git(edited, "am", "-3", *patches)
    assert am.returncode == 0, am.stderr
    return request.param, plain, edited, open(patches[-1]).read()


def test_the_change_applies_with_the_forward_edit_of_each_snapshot(change):
    branch, _, edited, text = change
    assert _git(edited, "log", "-1", "--format=%s").stdout.strip() == upstream.CHANGE.subject
    if branch == "main":
        assert "+        elif self.config.moe_expert_splits_on_device:" in text
    else:
        assert "-        tokens_per_expert: list[int] = tokens_per_expert.tolist()" in text
    added = [line for line in text.splitlines() if line.startswith("+")]
    assert not [line for line in added if LEAKS.search(line)]
    assert all(len(line) <= 101 for line in added if not line.startswith("+++"))


def test_its_upstream_tests_pass_on_the_edited_tree_and_fail_without_it(change, tmp_path):
    _, plain, edited, _ = change
    tests = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", TESTS]
    run = _in_tree(edited, *tests, interpret=True)
    assert re.search(r"\b21 passed, 2 skipped\b", run.stdout), run.stdout[-3000:]
    tree = shutil.copytree(plain, tmp_path / "tests-only", symlinks=True)
    shutil.copy(os.path.join(edited, TESTS), os.path.join(tree, TESTS))
    unedited = _in_tree(str(tree), *tests, interpret=True)
    assert unedited.returncode != 0 and " passed" not in unedited.stdout, unedited.stdout[-3000:]


def test_help_lists_its_flags(change):
    _, _, edited, _ = change
    helped = _in_tree(edited, "pretrain_gpt.py", "--help")
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert re.search(r"--moe-grouped-gemm-impl \{te,torch\}", helped.stdout)
    assert "--moe-expert-splits-on-device" in helped.stdout
