"""The torch_adam_clip change of ``export --series`` on the two Megatron-LM snapshots: its patch
(the series' fourth, after torch_adam) touches upstream's optimizer, factory and one new test file;
its upstream tests pass on the edited tree on the CPU (Triton's interpreter) and fail without the
code edits; exported without torch_adam onto a checkout that lacks it, it is refused by the name of
the change it needs."""

import re

from megatron.patchset.export import changes
from megatron.patchset.export import series as series_writer
from megatron.patchset.features.torch_adam.upstream import CHANGE as TORCH_ADAM
from megatron.patchset.features.torch_adam.upstream import CLIP_CHANGE as CHANGE
from tests.unit.export import snapshots

pytestmark = snapshots.MARKS

TESTS = r"test_adam_grad_clip\.py::"


def test_the_patch_follows_torch_adam_and_touches_upstreams_optimizer(series):
    names = [change.name for change in changes.series()]
    assert names.index(CHANGE.name) == names.index(TORCH_ADAM.name) + 1
    assert CHANGE.needs == (TORCH_ADAM.name,)
    text = open(series.patches[names.index(CHANGE.name)]).read()
    assert f"Subject: [PATCH {names.index(CHANGE.name) + 1}/{len(names)}] optimizer: clip" in text
    touched = re.findall(r"^\+\+\+ b/(\S+)$", text, re.M)
    assert sorted(touched) == sorted(CHANGE.paths())
    added = [line for line in text.splitlines() if line[:1] == "+" and line[:3] != "+++"]
    assert all(len(line) <= 101 for line in added)
    # megatron's clip pass stays where the step cannot take the clip
    assert not [
        line for line in text.splitlines() if line.startswith("-") and "clip_grad_by" in line
    ]


def test_its_tests_pass_on_the_edited_tree_under_the_interpreter(upstream_tests):
    edited = upstream_tests["edited"]
    assert edited.counts(TESTS) == {"PASSED": 12}, edited.output[-3000:]


def test_its_tests_fail_without_the_code_edits(upstream_tests):
    without = upstream_tests["tests_only"]
    assert without.counts(TESTS) == {"FAILED": 12}, without.output[-3000:]


def test_without_torch_adam_it_is_refused_by_that_name(series, tmp_path):
    """Onto the unedited snapshot, the change alone: refused in one line naming torch_adam."""
    result = series_writer.write_series(
        series.plain, str(tmp_path), changes.select([CHANGE.name]), author=snapshots.AUTHOR
    )
    assert result.patches == [] and result.skipped == {}
    assert list(result.refused) == [CHANGE.name]
    why = result.refused[CHANGE.name]
    assert why.startswith(f"needs {TORCH_ADAM.name} first") and "\n" not in why
