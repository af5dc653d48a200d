"""``python -m megatron.patchset --list``: every feature with its switches, rules and patches."""

import re
import subprocess
import sys

import pytest

from megatron.patchset.core import features, listing, registry, rules


def run_list(*extra):
    return subprocess.run(
        [sys.executable, "-m", "megatron.patchset", "--list", *extra],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.mark.parametrize("extra", [(), ("--reasons",)])
def test_list_groups_every_patch_under_its_feature_within_100_columns(extra):
    out = run_list(*extra)
    assert max(len(line) for line in out.splitlines()) <= listing.WIDTH
    joined = re.sub(r"\n +\.", ".", out)  # dotted paths broken before a dot
    sections = re.split(r"\n\n", joined)
    assert sections[1].startswith("core: ")
    for feature in features.load():
        section = next(s for s in sections if s.startswith(f"{feature.name}: "))
        assert f"[{feature.status}]" in section.replace("\n    ", " ")
        for patch in feature.patches:
            assert patch.name in section and patch.target in section
        for rule in feature.rules:
            assert rule.name in section.replace("\n      ", " ")
        assert ("  config: " in section) == (feature.configure_config is not None)
    for patch in registry.registered():
        assert patch.name in joined
    assert ("why: " in out) == bool(extra)


def test_every_rule_belongs_to_the_core_or_a_loaded_feature():
    names = {f.name for f in features.load()}
    assert {r.feature for r in rules.all_rules()} <= names | {None}
    assert [r.name for r in rules.all_rules() if r.feature is None][:3] == [
        "sizes-positive",
        "model-parallel-divides-world-size",
        "expert-parallel-divides-world-size",
    ]


def test_wrap_breaks_a_long_dotted_path_before_a_dot():
    lines = listing.wrap("a." + "b" * 50 + ".c" + "d" * 40, "  ", "      ", width=60)
    assert all(len(line) <= 60 for line in lines)
    assert lines[1].lstrip().startswith(".c")
