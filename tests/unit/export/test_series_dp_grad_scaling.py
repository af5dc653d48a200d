"""The dp_grad_scaling change of ``export --series`` on the core_r0.19.0 and main snapshots: its
patch touches upstream's DDP config, DDP, arguments and training loop and adds one test file; its
upstream tests pass on the edited tree on the CPU (two gloo ranks) and fail without the code edits;
``--help`` lists its flag."""

import re

from megatron.patchset.export import changes
from megatron.patchset.features.dp_grad_scaling import upstream
from tests.unit.export import snapshots

pytestmark = snapshots.MARKS

TESTS = r"test_ddp_scale_gradients_in_loss\.py::"


def test_the_patch_applies_in_its_place_and_touches_what_it_names(series):
    index = [change.name for change in changes.series()].index(upstream.CHANGE.name)
    subjects = snapshots.git(series.edited, "log", "--format=%s").stdout.splitlines()[::-1]
    assert subjects[1 + index] == upstream.CHANGE.subject  # after the snapshot's own commit
    text = open(series.patches[index]).read()
    touched = re.findall(r"^\+\+\+ b/(\S+)$", text, re.M)
    assert sorted(touched) == sorted(upstream.CHANGE.paths())
    added = [line for line in text.splitlines() if line[:1] == "+" and line[:3] != "+++"]
    assert not [line for line in added if snapshots.LEAKS.search(line)]
    assert all(len(line) <= 101 for line in added)
    # today's scaling stays where the option is off: no line of it is removed
    assert not [line for line in text.splitlines() if line[:1] == "-" and line[:3] != "---"]


def test_its_tests_pass_on_the_edited_tree_and_fail_without_the_code_edits(upstream_tests):
    edited, without = upstream_tests["edited"], upstream_tests["tests_only"]
    assert edited.counts(TESTS) == {"PASSED": 2}, edited.output[-3000:]
    assert without.counts(TESTS) == {"FAILED": 2}, without.output[-3000:]


def test_help_lists_its_flag(help_text):
    assert "--ddp-scale-gradients-in-loss" in help_text
