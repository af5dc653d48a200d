"""Edits anchored on named definitions (megatron/patchset/export/edits.py): where they apply,
how a source that holds them or has drifted is told apart, and the overlay's recompiled function
(the compat patch for --help is the upstream change's own edit)."""

import argparse
import dataclasses

import pytest

from megatron.patchset.core import compat, features, registry
from megatron.patchset.export import changes, edits

SOURCE = '''\
import os


class Box:
    """A box."""

    def size(self):
        # upstream's comment
        return len(self.items)  # count


def free():
    return os.sep
'''

REPLACE = edits.Replace(
    "pkg/box.py", "Box.size", "return len(self.items)", "return 2 * len(self.items)"
)
INSERT = edits.InsertAfter("pkg/box.py", "Box", "\n\nclass Bag(Box):\n    pass\n")


def test_replace_edits_the_named_definition_in_place_and_keeps_the_rest():
    out = edits.apply_to_source(SOURCE, REPLACE)
    assert out == SOURCE.replace("return len(self.items)", "return 2 * len(self.items)")
    assert "# upstream's comment" in out and "# count" in out
    assert edits.status(SOURCE, REPLACE) == edits.APPLIES
    assert edits.status(out, REPLACE) == edits.APPLIED


def test_an_edit_that_keeps_the_old_text_is_seen_as_applied():
    """A new branch after an existing one: the old text stays inside the new."""
    keep = edits.Replace("pkg/box.py", "Box.size", "# count\n", "# count\n        del self\n")
    out = edits.apply_to_source(SOURCE, keep)
    assert edits.status(SOURCE, keep) == edits.APPLIES
    assert edits.status(out, keep) == edits.APPLIED


def test_insert_after_lands_after_the_definition_and_is_seen_as_applied():
    out = edits.apply_to_source(SOURCE, INSERT)
    assert out.index("class Bag(Box)") > out.index("return len(self.items)")
    assert out.index("class Bag(Box)") < out.index("def free()")
    assert edits.status(out, INSERT) == edits.APPLIED
    assert edits.status(SOURCE, INSERT) == edits.APPLIES


def test_text_outside_the_definition_does_not_count():
    elsewhere = edits.Replace("pkg/box.py", "free", "len(self.items)", "0")
    assert edits.status(SOURCE, elsewhere) == edits.DRIFTED
    with pytest.raises(edits.EditError, match="free holds the text this edit replaces 0 times"):
        edits.apply_to_source(SOURCE, elsewhere)


def test_a_moved_or_rewritten_definition_is_refused_by_name():
    renamed = SOURCE.replace("def size", "def length")
    assert edits.status(renamed, REPLACE) == edits.DRIFTED
    with pytest.raises(edits.EditError, match="no definition named Box.size"):
        edits.apply_to_source(renamed, REPLACE)
    rewritten = SOURCE.replace("len(self.items)", "self.count")
    assert edits.status(rewritten, REPLACE) == edits.DRIFTED


@dataclasses.dataclass
class Cfg:
    share: float = 0.1
    """Share, e.g. 10%."""


def test_the_compat_patch_is_the_upstream_changes_edit_recompiled():
    """The installed method, patched, is upstream's with the change's edit: it keeps its module's
    globals, wraps the original and turns a docstring's '%' into argparse's '%%'."""
    from megatron.training import argument_utils

    factory = argument_utils.ArgumentGroupFactory
    original = factory._build_argparse_kwargs_from_field
    assert compat.HELP_EDIT in compat.HELP_PERCENT_CHANGE.edits
    name = "compat.help_percent_signs"
    already = name in registry.applied()
    registry.revert([name])
    try:
        registry.apply_patches([registry.get(name)])
        patched = factory._build_argparse_kwargs_from_field
        assert patched is not original and patched.__wrapped__ is original
        assert patched.__globals__ is vars(argument_utils)
        parser = argparse.ArgumentParser()
        factory(Cfg).build_group(parser, title="t")
        assert "Share, e.g. 10%." in parser.format_help()
        registry.revert([name])
        assert factory._build_argparse_kwargs_from_field is original
        parser = argparse.ArgumentParser()
        factory(Cfg).build_group(parser, title="t")
        with pytest.raises(ValueError, match="format"):
            parser.format_help()
    finally:
        if already:
            registry.apply_patches([registry.get(name)])


def _change(name, edit, needs=()):
    return changes.UpstreamChange(name, f"box: {name}", "m", "d", "f", "t", (edit,), needs)


def test_a_change_that_builds_on_another_is_refused_without_it(tmp_path, monkeypatch):
    """``needs``: refused by the needed change's name unless it comes first in the same run or
    the checkout holds it."""
    import subprocess

    from megatron.patchset.export import series

    path = "megatron/box.py"
    base = _change("base", dataclasses.replace(REPLACE, path=path))
    follow_up = _change(
        "follow_up",
        edits.Replace(path, "Box.size", "return 2 * len(", "return 3 * len("),
        needs=("base",),
    )
    monkeypatch.setattr(changes, "series", lambda: [base, follow_up])
    repo = tmp_path / "repo"
    (repo / "megatron").mkdir(parents=True)
    (repo / path).write_text(SOURCE)
    git = ["git", "-C", str(repo), "-c", "user.name=A", "-c", "user.email=a@example.com"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "upstream"], check=True)

    def write(selected, out):
        return series.write_series(str(repo), str(tmp_path / out), selected, author="A <a@x.org>")

    alone = write([follow_up], "alone")
    assert alone.patches == [] and alone.refused == {
        "follow_up": "needs base first (export it with this change, or apply its patch to the "
        "checkout)"
    }
    assert len(write([base, follow_up], "both").patches) == 2
    (repo / path).write_text(edits.apply_to_source(SOURCE, base.edits[0]))
    subprocess.run([*git, "commit", "-q", "-am", "base"], check=True)
    onto_base = write([follow_up], "onto-base")
    assert len(onto_base.patches) == 1 and not onto_base.refused


def test_a_change_needs_only_earlier_changes_of_the_series():
    names = [change.name for change in changes.series()]
    for index, change in enumerate(changes.series()):
        assert set(change.needs) <= set(names[:index]), change.name


def test_the_commit_message_has_every_section_wrapped_at_72_columns():
    message = compat.HELP_PERCENT_CHANGE.message()
    subject, blank, *body = message.splitlines()
    assert subject.startswith("argument_utils: ") and blank == ""
    for section in ("Motivation:", "Design:", "Measured:", "Test plan:"):
        assert section in body
    assert max(len(line) for line in body) <= changes.WIDTH
    assert "$ pytest tests/unit_tests/test_argument_utils.py" in body


def test_an_unknown_change_is_refused_with_the_series():
    with pytest.raises(Exception, match="no upstream change named nope; the series holds: help"):
        changes.select(["nope"])
    assert [c.name for c in changes.select(None)] == [c.name for c in changes.series()]
    with pytest.raises(Exception, match=r"static_dispatch: fork-only \(.*\), not sent upstream"):
        changes.select(["static_dispatch"])
    # every feature meant for upstream is in the series or refused by name
    declared = {c.name for c in changes.series()} | set(changes.refusals())
    meant = {f.name for f in features.load() if f.upstream_pr.exportable}
    assert meant <= declared, meant - declared
    with pytest.raises(Exception, match="p2p_overlap: not in the patch series: .*get_fp8_context"):
        changes.select(["p2p_overlap"])


def test_one_of_applies_the_alternative_that_fits_and_knows_either_applied():
    other = edits.Replace("pkg/box.py", "Box.size", "no such text\n", "x\n")
    either = edits.OneOf((other, REPLACE))
    assert either.path == "pkg/box.py" and edits.status(SOURCE, either) == edits.APPLIES
    out = edits.apply_to_source(SOURCE, either)
    assert out == edits.apply_to_source(SOURCE, REPLACE)
    assert edits.status(out, either) == edits.APPLIED
    assert edits.status(SOURCE, edits.OneOf((other,))) == edits.DRIFTED
    with pytest.raises(edits.EditError):
        edits.OneOf((REPLACE, edits.Replace("pkg/other.py", "", "a", "b")))
