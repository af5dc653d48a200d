"""The series' ``checkpoint_exit_status`` change on both Megatron-LM snapshots, and the refusal of
``p2p_overlap`` by ``export --series``.

``checkpoint_exit_status``: exported alone onto each snapshot, its patch ``git am``s; on the
edited tree its six new upstream tests pass on CPU, and on a tree with only its test edits they
fail. Its code edits leave, in megatron-core 0.19.2's ``checkpointing.py``, exactly the bare
``sys.exit()`` that main already turned into ``sys.exit(1)``: the overlay's stand-in for the
module's ``sys`` covers the change's six calls and that one."""

import os
import re
import shutil

import pytest

from megatron.patchset.core import compat
from megatron.patchset.export import edits
from tests.unit.export import test_series
from tests.unit.export.test_series import AUTHOR, BRANCHES, DATE, _checkout, _export, _git, _in_tree

pytestmark = test_series.pytestmark  # skipped without the Megatron-LM snapshots

TESTS = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]
NEW_TESTS = "exits_with_status_one"
BARE_EXIT = re.compile(r"^\s*sys\.exit\(\)$", re.M)


@pytest.fixture(scope="module", params=BRANCHES)
def checkpoint_series(request, tmp_path_factory):
    """(branch, unedited checkout, checkout with the change applied by git am -3, patches)."""
    root = tmp_path_factory.mktemp(f"checkpoint-{request.param}")
    plain = _checkout(request.param, root / "plain")
    edited = _checkout(request.param, root / "edited")
    done = _export(
        plain,
        root / "patches",
        "--feature",
        "checkpoint_exit_status",
        "--author",
        AUTHOR,
        "--date",
        DATE,
    )
    assert done.returncode == 0, done.stderr
    patches = sorted(str(p) for p in (root / "patches").glob("*.patch"))
    assert len(patches) == 1, done.stdout
    am = _git(edited, "am", "-3", *patches)
    assert am.returncode == 0, am.stderr
    return request.param, plain, edited, patches


def test_the_change_is_one_patch_of_the_loader_and_its_tests(checkpoint_series):
    _, plain, edited, patches = checkpoint_series
    stat = _git(edited, "diff", "--numstat", "HEAD~1", "HEAD").stdout.split("\n")
    assert sorted(line.split("\t")[2] for line in stat if line) == [
        compat.CHECKPOINT_SOURCE,
        compat.CHECKPOINT_TESTS,
    ]
    assert stat[0].split("\t")[:2] == ["6", "6"]  # six calls, one line each
    text = open(patches[0]).read()
    assert len(re.findall(r"^-\s+sys\.exit\(\)$", text, re.M)) == 6
    assert len(re.findall(r"^\+\s+sys\.exit\(1\)$", text, re.M)) == 6


def test_its_new_tests_pass_on_the_edited_tree(checkpoint_series):
    _, _, edited, _ = checkpoint_series
    run = _in_tree(edited, *TESTS, "-k", NEW_TESTS, compat.CHECKPOINT_TESTS)
    assert run.returncode == 0 and "6 passed" in run.stdout, run.stdout[-3000:]


def test_its_new_tests_fail_without_the_code_edits(checkpoint_series, tmp_path):
    _, plain, _, _ = checkpoint_series
    tree = shutil.copytree(plain, tmp_path / "tests-only", symlinks=True)
    path = os.path.join(tree, compat.CHECKPOINT_TESTS)
    source = open(path).read()
    for edit in compat.CHECKPOINT_EXIT_CHANGE.edits:
        if edit.path == compat.CHECKPOINT_TESTS:
            source = edits.apply_to_source(source, edit)
    open(path, "w").write(source)
    run = _in_tree(str(tree), *TESTS, "-k", NEW_TESTS, compat.CHECKPOINT_TESTS)
    assert run.returncode == 1 and "6 failed" in run.stdout, run.stdout[-3000:]
    assert "SystemExit" in run.stdout or "None == 1" in run.stdout


def test_main_already_exits_with_status_one_on_a_missing_checkpoint(checkpoint_series):
    """The one bare sys.exit() the change leaves on 0.19.x is the one main has fixed."""
    branch, _, edited, _ = checkpoint_series
    source = open(os.path.join(edited, compat.CHECKPOINT_SOURCE)).read()
    first, last = edits.definition_lines(source, "_load_base_checkpoint")
    body = "".join(source.splitlines(keepends=True)[first:last])
    assert len(BARE_EXIT.findall(source)) == (1 if branch == "core_r0.19.0" else 0)
    assert ("exit-on-missing-checkpoint" in body) and (
        ("sys.exit(1)" in body.split("exit_on_missing_checkpoint")[1].split("return")[0])
        == (branch == "main")
    )


def test_the_overlay_covers_the_changes_calls_and_mains_fix():
    """megatron-core 0.19.2's checkpointing.py with the change's code edits holds one bare
    sys.exit(), after --exit-on-missing-checkpoint; the overlay's ``sys`` stand-in turns every
    bare one into status 1, so it runs the change plus main's fix."""
    from megatron.training import checkpointing

    source = open(checkpointing.__file__).read()
    before = len(BARE_EXIT.findall(source))
    for edit in compat.CHECKPOINT_EXIT_EDITS:
        assert edits.status(source, edit) == edits.APPLIES, edit
        source = edits.apply_to_source(source, edit)
    left = [m.start() for m in BARE_EXIT.finditer(source)]
    assert before == 7 and len(left) == 1
    assert "'--exit-on-missing-checkpoint' set" in source[left[0] - 300 : left[0]]


def test_p2p_overlap_is_refused_naming_the_context_method_upstream_renamed(
    checkpoint_series, tmp_path
):
    """``--series --feature p2p_overlap`` refuses, naming get_low_precision_context (0.19.2,
    which its schedule plan calls) and get_fp8_context (this snapshot); the names are checked
    in both trees, and nothing is written."""
    import megatron.core

    from megatron.patchset.features.p2p_overlap import upstream

    _, plain, _, _ = checkpoint_series
    done = _export(plain, tmp_path / "p2p", "--feature", "p2p_overlap")
    assert done.returncode == 1, done.stdout + done.stderr
    message = done.stderr
    assert "export refused: p2p_overlap: not in the patch series:" in message
    for name in ("get_low_precision_context", "get_fp8_context", upstream.SCHEDULE_PLAN):
        assert name in message
    assert not (tmp_path / "p2p").exists()

    snapshot = open(os.path.join(plain, upstream.SCHEDULE_PLAN)).read()
    assert "def get_fp8_context(self):" in snapshot
    assert "get_low_precision_context" not in snapshot
    wheel = os.path.join(os.path.dirname(os.path.dirname(megatron.core.__file__)), "..")
    installed = open(os.path.join(wheel, upstream.SCHEDULE_PLAN)).read()
    assert "def get_low_precision_context(self):" in installed
    assert "get_fp8_context" not in installed
    fork = os.path.join(os.path.dirname(upstream.__file__), "schedule_plan.py")
    assert "get_low_precision_context()" in open(fork).read()
