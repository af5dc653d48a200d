"""The series' ``checkpoint_exit_status`` change on both Megatron-LM snapshots, and the refusal of
``p2p_overlap`` by ``export --series``.

``checkpoint_exit_status``: exported alone onto each snapshot, its patch applies; on the
edited tree its six new upstream tests pass on CPU, and on a tree with only its test edits they
fail. Its code edits leave, in megatron-core 0.19.2's ``checkpointing.py``, exactly the bare
``sys.exit()`` that main already turned into ``sys.exit(1)``: the overlay's stand-in for the
module's ``sys`` covers the change's six calls and that one."""

import os
import re

import pytest

from megatron.patchset.core import compat
from megatron.patchset.export import edits
from tests.unit.export import snapshots

pytestmark = snapshots.MARKS

NEW_TESTS = r"test_checkpointing\.py::.*exits_with_status_one"
BARE_EXIT = re.compile(r"^\s*sys\.exit\(\)$", re.M)


@pytest.fixture(scope="module")
def checkpoint_patch(series, tmp_path_factory):
    """The change exported alone onto the unedited snapshot: its one patch file."""
    out = tmp_path_factory.mktemp(f"checkpoint-{series.branch}")
    done = snapshots.export(series.plain, out, "--feature", "checkpoint_exit_status")
    assert done.returncode == 0, done.stderr
    (patch,) = sorted(out.glob("*.patch"))
    assert snapshots.git(series.plain, "apply", "--check", str(patch)).returncode == 0
    return str(patch)


def test_the_change_is_one_patch_of_the_loader_and_its_tests(checkpoint_patch):
    text = open(checkpoint_patch).read()
    stat = re.findall(r"^\+\+\+ b/(\S+)$", text, re.M)
    assert sorted(stat) == [compat.CHECKPOINT_SOURCE, compat.CHECKPOINT_TESTS]
    assert len(re.findall(r"^-\s+sys\.exit\(\)$", text, re.M)) == 6
    assert len(re.findall(r"^\+\s+sys\.exit\(1\)$", text, re.M)) == 6


def test_its_new_tests_pass_on_the_edited_tree(upstream_tests):
    edited = upstream_tests["edited"]
    assert edited.counts(NEW_TESTS) == {"PASSED": 6}, edited.output[-3000:]


def test_its_new_tests_fail_without_the_code_edits(upstream_tests):
    without = upstream_tests["tests_only"]
    assert without.counts(NEW_TESTS) == {"FAILED": 6}, without.output[-3000:]
    assert "SystemExit" in without.output or "None == 1" in without.output


def test_main_already_exits_with_status_one_on_a_missing_checkpoint(series):
    """The one bare sys.exit() the change leaves on 0.19.x is the one main has fixed."""
    branch = series.branch
    source = open(os.path.join(series.edited, compat.CHECKPOINT_SOURCE)).read()
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


def test_p2p_overlap_is_refused_naming_the_context_method_upstream_renamed(series, tmp_path):
    """``--series --feature p2p_overlap`` refuses, naming get_low_precision_context (0.19.2,
    which its schedule plan calls) and get_fp8_context (this snapshot); the names are checked
    in both trees, and nothing is written."""
    import megatron.core

    from megatron.patchset.features.p2p_overlap import upstream

    plain = series.plain
    done = snapshots.export(plain, tmp_path / "p2p", "--feature", "p2p_overlap")
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
