"""The grouped_mm change of ``export --series`` on the core_r0.19.0 and main snapshots: it applies
after the series' earlier changes with ``git am -3`` (its ``TEGroupedMLP.forward`` edit in the form
each snapshot holds), its upstream tests pass on the edited tree on CPU (the Triton accumulation
under Triton's interpreter) and its tests of the config fail without the code edits, and
``--help`` lists its two flags."""

import re

from megatron.patchset.export import changes
from megatron.patchset.features.grouped_mm import upstream
from tests.unit.export import snapshots

pytestmark = snapshots.MARKS

TESTS = r"test_torch_grouped_gemm\.py"


def test_the_change_applies_with_the_forward_edit_of_each_snapshot(series):
    index = [change.name for change in changes.series()].index(upstream.CHANGE.name)
    subjects = snapshots.git(series.edited, "log", "--format=%s").stdout.splitlines()[::-1]
    assert subjects[1 + index] == upstream.CHANGE.subject  # after the snapshot's own commit
    text = open(series.patches[index]).read()
    if series.branch == "main":
        assert "+        elif self.config.moe_expert_splits_on_device:" in text
    else:
        assert "-        tokens_per_expert: list[int] = tokens_per_expert.tolist()" in text
    added = [line for line in text.splitlines() if line.startswith("+")]
    assert not [line for line in added if snapshots.LEAKS.search(line)]
    assert all(len(line) <= 101 for line in added if not line.startswith("+++"))


def test_its_upstream_tests_pass_on_the_edited_tree_and_fail_without_it(upstream_tests):
    edited, without = upstream_tests["edited"], upstream_tests["tests_only"]
    assert edited.counts(TESTS) == {"PASSED": 21}, edited.output[-3000:]  # 2 skip without a GPU
    assert "FAILED" in without.of(TESTS).values(), without.output[-3000:]


def test_help_lists_its_flags(help_text):
    assert re.search(r"--moe-grouped-gemm-impl \{te,torch\}", help_text)
    assert "--moe-expert-splits-on-device" in help_text
