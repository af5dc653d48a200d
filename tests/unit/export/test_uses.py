"""The upstream names exported code uses, checked in the destination tree
(megatron/patchset/export/uses.py): on small trees, and on the Megatron-LM snapshots, where
p2p_overlap calls a method that 0.19.1 and main do not have."""

import os

import pytest

from megatron.patchset.export import run, uses
from megatron.patchset.export.source import SourceTree
from tests.unit.export import snapshots

PLAN = """\
class Base:
    def shared(self):
        pass


class Plan(Base):
    def {method}(self):
        pass
"""
CODE = """\
from megatron.core.plan import Plan, helper


def run(plan):
    with plan.new_context():
        return plan.shared()
"""


def _tree(root, method, helper=True):
    os.makedirs(root / "megatron" / "training")
    os.makedirs(root / "megatron" / "core")
    (root / "megatron" / "training" / "arguments.py").write_text("")
    text = PLAN.format(method=method) + ("\n\ndef helper():\n    pass\n" if helper else "")
    (root / "megatron" / "core" / "plan.py").write_text(text)
    return SourceTree(str(root))


def test_a_method_the_installed_class_has_and_the_tree_lacks_is_named(tmp_path):
    installed = _tree(tmp_path / "installed", "new_context")
    older = _tree(tmp_path / "older", "old_context", helper=False)
    assert uses.missing(CODE, installed, installed) == []
    assert uses.missing(CODE, older, installed) == [
        "megatron.core.plan.helper (imported) is not in this checkout",
        "Plan.new_context (megatron.core.plan), which the exported code calls, is not defined by "
        "this checkout's class",
    ]
    # names the export itself adds to the tree are not missing
    assert len(uses.missing(CODE, older, installed, {("megatron.core.plan", "helper")})) == 1


def test_an_inherited_method_counts_and_an_unknown_one_is_not_reported(tmp_path):
    installed = _tree(tmp_path / "installed", "new_context")
    assert uses.defines(installed, "megatron.core.plan", "Plan", "shared") is True
    assert uses.defines(installed, "megatron.core.plan", "Plan", "absent") is False
    code = "from megatron.core.plan import Plan\n\ndef f(p):\n    return p.elsewhere()\n"
    assert uses.missing(code, _tree(tmp_path / "t", "x"), installed) == []


@pytest.mark.xdist_group("megatron-lm-snapshots")
@snapshots.needs_snapshots
def test_p2p_overlap_is_refused_on_trees_without_the_method_it_calls(series, tmp_path):
    """0.19.1 and main name the schedule plan's context get_fp8_context; 0.19.2's exported code
    calls get_low_precision_context: refused by name instead of an AttributeError at run time."""
    checkout = series.plain
    try:
        result = run.export(checkout, str(tmp_path / "out"), ["p2p_overlap"])
        refused = result.refused["p2p_overlap"]
    except run.ExportRefused as exc:
        refused = str(exc)
    assert "TransformerLayerSchedulePlan.get_low_precision_context" in refused
    assert "model_chunk_schedule_plan" in refused
