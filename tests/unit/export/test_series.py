"""``export --series`` on real Megatron-LM checkouts: the snapshots of core_r0.19.0 and main
(:mod:`.snapshots`). For each: the series ``git am -3``s onto a fresh checkout in order, with
author, date and index lines; the edited tree passes upstream's CPU tests of the arguments and of
ModelParallelConfig with the ``--help`` change's new tests (which fail without its code edit) and
``pretrain_gpt.py --help`` works there; exporting onto the edited branch skips what it holds; the
patches are byte-identical across ``PYTHONHASHSEED`` values; no fork identifier reaches a patch;
upstream's black, isort and pylint (upstream's configs) find the touched files no worse; and the
example configs parse to the same arguments as on the unedited tree."""

import os
import re
import subprocess
import sys

from megatron.patchset.export import changes
from tests.unit.export import snapshots

pytestmark = snapshots.MARKS


def test_the_series_applies_in_order_with_author_date_and_index_lines(series):
    patches = series.patches
    log = snapshots.git(series.edited, "log", "--format=%an <%ae>|%aI|%s", f"-{len(patches)}")
    subjects = [change.subject for change in reversed(changes.series())]
    assert [line.split("|")[2] for line in log.stdout.splitlines()] == subjects
    assert all(
        line.split("|")[:2] == [snapshots.AUTHOR, snapshots.DATE]
        for line in log.stdout.splitlines()
    )
    for path in patches:
        text = open(path).read()
        assert re.search(r"^index [0-9a-f]{40}\.\.[0-9a-f]{40} 100644$", text, re.M), path
        assert "Test plan:" in text and "Motivation:" in text


def test_the_edited_tree_passes_upstreams_tests_and_its_help_works(upstream_tests, help_text):
    """Upstream's CPU tests of the arguments and of the config the series edits, with the --help
    change's new tests (which fail without its code edit: the next test), and pretrain_gpt.py
    --help itself."""
    edited = upstream_tests["edited"]
    for path in snapshots.UPSTREAM_CPU_TESTS:
        outcomes = edited.of(re.escape(path))
        assert outcomes and set(outcomes.values()) == {"PASSED"}, edited.output[-3000:]
    assert edited.counts("::TestArgumentGroupFactoryHelpText::") == {"PASSED": 2}
    assert "--micro-batch-size" in help_text
    assert re.search(r"--cross-entropy-fusion-impl \{native,te,triton\}", help_text)


def test_the_triton_cross_entropy_tests_pass_on_the_edited_tree(upstream_tests):
    """The kernels against torch's cross entropy under Triton's interpreter, and the config; the
    config's tests fail without the change's edit of ModelParallelConfig."""
    edited, without = upstream_tests["edited"], upstream_tests["tests_only"]
    assert edited.counts("test_fused_cross_entropy_triton") == {"PASSED": 5}, edited.output[-3000:]
    assert "FAILED" in without.of("TestTritonCrossEntropyConfig").values()


def test_the_triton_swiglu_tests_pass_on_the_edited_tree(upstream_tests):
    """The kernels against the weighted SwiGLU's formulas under Triton's interpreter, a row's bits
    among more rows, and the config; the config's tests fail without the change's edits of
    TransformerConfig."""
    edited, without = upstream_tests["edited"], upstream_tests["tests_only"]
    assert edited.counts("test_fused_weighted_swiglu_triton") == {"PASSED": 11}, edited.output[
        -3000:
    ]
    assert set(without.of("TestMoeSwigluTritonConfig").values()) == {"FAILED"}


def test_the_new_help_tests_fail_without_the_code_edit(upstream_tests):
    without = upstream_tests["tests_only"]
    assert without.counts("::TestArgumentGroupFactoryHelpText::") == {"FAILED": 2}, without.output[
        -3000:
    ]


def test_exporting_onto_the_edited_branch_skips_what_it_holds(series, tmp_path):
    done = snapshots.export(series.edited, tmp_path / "again", "--author", snapshots.AUTHOR)
    assert done.returncode == 0, done.stderr
    for change in changes.series():
        assert f"skipped {change.name}: already in the checkout" in done.stdout
    assert not list((tmp_path / "again").glob("*.patch"))


def test_the_patches_are_byte_identical_across_hash_seeds(series, tmp_path):
    again = snapshots.export(
        series.plain,
        tmp_path / "seed",
        "--author",
        snapshots.AUTHOR,
        "--date",
        snapshots.DATE,
        seed="12345",
    )
    assert again.returncode == 0, again.stderr
    for path in series.patches:
        assert (
            open(tmp_path / "seed" / os.path.basename(path), "rb").read() == open(path, "rb").read()
        )


def _added_lines(path) -> list[str]:
    return [
        line
        for line in open(path).read().splitlines()
        if not line.startswith(("-", " ", "@@", "diff ", "index ", "new file mode"))
    ]


def test_no_fork_identifier_reaches_a_patch(series):
    for path in series.patches:
        leaks = [line for line in _added_lines(path) if snapshots.LEAKS.search(line)]
        assert not leaks, f"{os.path.basename(path)}: {leaks}"


def _fork_flags() -> list[str]:
    """The flags the fork adds to megatron's parser."""
    import argparse

    from megatron.patchset.core.flags import add_patchset_args

    parser = argparse.ArgumentParser(add_help=False)
    add_patchset_args(parser)
    return [o for action in parser._actions for o in action.option_strings]


def test_no_fork_only_flag_or_argument_reaches_a_patch(series):
    """Every flag of the fork that the series does not add to upstream (as an argument or a
    config field): neither the flag nor its argument name appears in what a patch adds."""
    added = {path: _added_lines(path) for path in series.patches}
    defined = {
        flag
        for lines in added.values()
        for line in lines
        for flag in re.findall(r"""^\+\s*['"](--[a-z0-9-]+)['"],?$""", line)
    }
    defined |= {
        flag
        for lines in added.values()
        for line in lines
        for flag in re.findall(r"""add_argument\(\s*['"](--[a-z0-9-]+)['"]""", line)
    }
    # a new config field is a flag of upstream's argument utilities
    defined |= {
        "--" + field.replace("_", "-")
        for lines in added.values()
        for line in lines
        for field in re.findall(r"^\+    ([a-z][a-z0-9_]*): [^=]+ = ", line)
    }
    fork_only = [flag for flag in _fork_flags() if flag not in defined]
    assert "--moe-static-dispatch" in fork_only and "--adam-impl" in fork_only
    assert "--moe-grouped-gemm-impl" not in fork_only  # the grouped_mm change adds it upstream
    for flag in fork_only:
        name = flag[2:].replace("-", "_")
        found = re.compile(rf"(?<![\w-]){re.escape(flag)}(?![\w-])|\b{name}\b")
        for path, lines in added.items():
            leaks = [line for line in lines if found.search(line)]
            assert not leaks, f"{os.path.basename(path)}: {flag}: {leaks}"


def _lint_counts(tree, paths):
    """{path: {tool: count}}: lines black and isort would change, and pylint's messages (on
    megatron/core only, as upstream's pre-commit runs it), with the tree's configs; a path that
    is not in the tree counts 0. One run of each tool over all paths."""
    counts = {p: {"black": 0, "isort": 0, "pylint": 0} for p in paths}
    present = [p for p in paths if os.path.isfile(os.path.join(tree, p))]
    if not present:
        return counts
    tools = os.path.dirname(sys.executable)

    def run(tool, *argv):
        done = subprocess.run(
            [os.path.join(tools, tool), *argv], capture_output=True, text=True, cwd=tree
        )
        return done.stdout, done.stderr

    changed = re.compile(r"^[+-](?![+-])")
    for tool, argv in (
        ("black", ["--check", "--diff", "-q"]),
        ("isort", ["--check-only", "--diff"]),
    ):
        out, err = run(tool, *argv, *present)
        assert "error: cannot format" not in err, err
        path = None
        for line in out.splitlines():
            header = re.match(r"^(?:---|\+\+\+) (\S+?)(?::before|:after)?(?:\s|$)", line)
            if header:
                path = next((p for p in present if header.group(1).endswith(p)), path)
            elif path and changed.match(line):
                counts[path][tool] += 1
    core = [p for p in present if p.startswith("megatron/core/")]
    if core:
        out, _ = run("pylint", "--rcfile=.pylintrc", *core)
        for line in out.splitlines():
            found = re.match(r"^(\S+?):\d+:\d+: [CRWEF]\d{4}: ", line)
            if found and found.group(1) in counts:
                counts[found.group(1)]["pylint"] += 1
    return counts


def test_upstream_lint_finds_the_touched_files_no_worse(series):
    """Each file the series touches: black and isort, and pylint on megatron/core, no worse than
    on the unedited tree; a new file clean."""
    touched = list(dict.fromkeys(p for change in changes.series() for p in change.paths()))
    after = _lint_counts(series.edited, touched)
    # a file the edited tree finds clean is no worse; the unedited tree is linted where it is not
    dirty = [path for path in touched if any(after[path].values())]
    before = _lint_counts(series.plain, dirty)
    for path in dirty:
        assert all(after[path][k] <= before[path][k] for k in after[path]), (
            path,
            before[path],
            after[path],
        )


def test_configs_without_the_changes_are_checked_as_before(parsed_configs):
    """The example configs, each with upstream flags only (snapshots.VARIANTS), parsed and
    validated by megatron on one GPU: the same arguments and optimizer config, or the same error,
    on both trees, apart from the new arguments at their defaults."""
    names = [f"{c}:{v}" for c in snapshots.EXAMPLE_CONFIGS for v in snapshots.VARIANTS]
    assert len(names) >= 20
    plain, edited = snapshots.as_before(parsed_configs, names)
    assert plain == edited
    assert sum(isinstance(v, dict) for v in plain.values()) >= 10
