"""``export --series`` on real Megatron-LM checkouts: the snapshots of core_r0.19.0 and main
(``MEGATRON_LM_SNAPSHOTS``, by default ``../shared/upstream`` beside this repository, made into git
checkouts by its ``checkout.sh``). For each: the series ``git am -3``s onto a fresh checkout, the
edited tree passes upstream's test file with the change's new tests (which fail on the unedited
tree) and ``pretrain_gpt.py --help`` works there; exporting onto the edited branch skips what it
holds; the patches are byte-identical across ``PYTHONHASHSEED`` values; no fork identifier
reaches a patch; upstream's black, isort and pylint (upstream's configs) find the touched files
no worse; and the example configs parse to the same arguments as on the unedited tree."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron.patchset.core import compat
from megatron.patchset.export import changes, edits
from tests.unit.conftest import ROOT

SNAPSHOTS = os.environ.get(
    "MEGATRON_LM_SNAPSHOTS", os.path.join(os.path.dirname(ROOT), "shared", "upstream")
)
BRANCHES = ("core_r0.19.0", "main")
AUTHOR = "Jane Doe <jane@example.com>"
DATE = "2026-11-27T12:00:00+00:00"
# What would give away the fork in an upstream patch
LEAKS = re.compile(
    r"patchset|PATCHSET|fork\b|>>>|noreply|1970|--moe-static-dispatch|--adam-impl|tools/bench|"
    r"features/|\b_enable_",
    re.IGNORECASE,
)
TIMEOUT = 600

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(SNAPSHOTS, "checkout.sh")),
    reason=f"no Megatron-LM snapshots at {SNAPSHOTS} (set MEGATRON_LM_SNAPSHOTS)",
)


def _checkout(branch, dest):
    subprocess.run(
        ["bash", os.path.join(SNAPSHOTS, "checkout.sh"), branch, str(dest)],
        check=True,
        capture_output=True,
        timeout=TIMEOUT,
    )
    return str(dest)


def _export(checkout, out, *extra, seed="0"):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_PATCHSET"}
    env |= {"PYTHONHASHSEED": seed, "PYTHONPATH": ROOT}
    argv = ["--series", "--megatron-lm", checkout, "--out", str(out)]
    return subprocess.run(
        [sys.executable, "-m", "megatron.patchset", "export", *argv, *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=TIMEOUT,
    )


def _in_tree(tree, *argv, interpret=False, world_size=None):
    """``python ARGV`` with ``tree`` (a Megatron-LM checkout) first on the path (and Triton's
    interpreter on with ``interpret``, megatron's world size with ``world_size``)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MEGATRON_PATCHSET", "TRITON_INTERPRET")
    }
    env["PYTHONPATH"] = tree
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if world_size:
        env |= {"WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=tree, env=env, timeout=TIMEOUT
    )


# upstream's own tests of the arguments and of ModelParallelConfig that run on CPU
UPSTREAM_CPU_TESTS = (
    "tests/unit_tests/test_argument_utils.py",
    "tests/unit_tests/test_model_parallel_config.py",
)


def _git(tree, *argv):
    ident = ["-c", "user.name=Reviewer", "-c", "user.email=reviewer@example.com"]
    return subprocess.run(
        ["git", "-C", tree, *ident, *argv], capture_output=True, text=True, timeout=TIMEOUT
    )


@pytest.fixture(scope="module", params=BRANCHES)
def series(request, tmp_path_factory):
    """(branch, unedited checkout, checkout with the series applied by git am -3, patch files)."""
    root = tmp_path_factory.mktemp(request.param)
    plain = _checkout(request.param, root / "plain")
    edited = _checkout(request.param, root / "edited")
    done = _export(plain, root / "patches", "--author", AUTHOR, "--date", DATE)
    assert done.returncode == 0, done.stderr
    patches = sorted(str(p) for p in (root / "patches").glob("*.patch"))
    assert len(patches) == len(changes.series())
    am = _git(edited, "am", "-3", *patches)
    assert am.returncode == 0, am.stderr
    return request.param, plain, edited, patches


def test_the_series_applies_in_order_with_author_date_and_index_lines(series):
    branch, plain, edited, patches = series
    log = _git(edited, "log", "--format=%an <%ae>|%aI|%s", f"-{len(patches)}").stdout.splitlines()
    subjects = [change.subject for change in reversed(changes.series())]
    assert [line.split("|")[2] for line in log] == subjects
    assert all(line.split("|")[:2] == [AUTHOR, DATE] for line in log)
    for path in patches:
        text = open(path).read()
        assert re.search(r"^index [0-9a-f]{40}\.\.[0-9a-f]{40} 100644$", text, re.M), path
        assert "Test plan:" in text and "Motivation:" in text


def test_the_edited_tree_passes_upstreams_tests_and_its_help_works(series):
    """Upstream's CPU tests of the arguments and of the config the series edits, with the --help
    change's new tests (which fail without its code edit: the next test), and pretrain_gpt.py
    --help itself."""
    _, _, edited, _ = series
    tests = ["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--noconftest"]
    run = _in_tree(edited, *tests, *UPSTREAM_CPU_TESTS)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:]
    assert len(re.findall(r"^PASSED .*::TestArgumentGroupFactoryHelpText::", run.stdout, re.M)) == 2
    helped = _in_tree(edited, "pretrain_gpt.py", "--help")
    assert helped.returncode == 0 and "--micro-batch-size" in helped.stdout, helped.stderr[-2000:]
    assert re.search(r"--cross-entropy-fusion-impl \{native,te,triton\}", helped.stdout)


def test_the_triton_cross_entropy_tests_pass_on_the_edited_tree(series):
    """The kernels against torch's cross entropy under Triton's interpreter, and the config."""
    _, _, edited, _ = series
    tests = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]
    env_run = _in_tree(
        edited,
        *tests,
        "tests/unit_tests/fusions/test_fused_cross_entropy_triton.py",
        interpret=True,
    )
    assert "5 passed" in env_run.stdout, env_run.stdout[-3000:]


def test_the_new_tests_fail_without_the_code_edit(series, tmp_path):
    """Upstream's tree with only the change's test edits: its new tests fail."""
    branch, plain, _, _ = series
    tree = shutil.copytree(plain, tmp_path / "tests-only", symlinks=True)
    test_edits = [e for e in compat.HELP_PERCENT_CHANGE.edits if e.path.startswith("tests/")]
    path = os.path.join(tree, compat.HELP_TESTS)
    source = open(path).read()
    for edit in test_edits:
        source = edits.apply_to_source(source, edit)
    open(path, "w").write(source)
    tests = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-k", "HelpText"]
    run = _in_tree(str(tree), *tests, compat.HELP_TESTS)
    assert run.returncode == 1 and "2 failed" in run.stdout, run.stdout[-3000:]


def test_exporting_onto_the_edited_branch_skips_what_it_holds(series, tmp_path):
    _, _, edited, _ = series
    done = _export(edited, tmp_path / "again", "--author", AUTHOR)
    assert done.returncode == 0, done.stderr
    for change in changes.series():
        assert f"skipped {change.name}: already in the checkout" in done.stdout
    assert not list((tmp_path / "again").glob("*.patch"))


def test_the_patches_are_byte_identical_across_hash_seeds(series, tmp_path):
    _, plain, _, patches = series
    again = _export(plain, tmp_path / "seed", "--author", AUTHOR, "--date", DATE, seed="12345")
    assert again.returncode == 0, again.stderr
    for path in patches:
        assert (
            open(tmp_path / "seed" / os.path.basename(path), "rb").read() == open(path, "rb").read()
        )


def test_no_fork_identifier_reaches_a_patch(series):
    for path in series[3]:
        added = [
            line
            for line in open(path).read().splitlines()
            if not line.startswith(("-", " ", "@@", "diff ", "index ", "new file mode"))
        ]
        leaks = [line for line in added if LEAKS.search(line)]
        assert not leaks, f"{os.path.basename(path)}: {leaks}"


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
    _, plain, edited, _ = series
    touched = list(dict.fromkeys(p for change in changes.series() for p in change.paths()))
    before, after = _lint_counts(plain, touched), _lint_counts(edited, touched)
    for path in touched:
        assert all(after[path][k] <= before[path][k] for k in after[path]), (
            path,
            before[path],
            after[path],
        )


PARSE = """
import contextlib, io, json, os, sys, types
import torch
# as on one Hopper GPU: validate_args reads the device's compute capability
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
    major=9, minor=0, name="H100", total_memory=80 << 30, multi_processor_count=132
)
torch.cuda.device_count = lambda: 1
from megatron.training.arguments import parse_args, validate_args
target, runs, out = sys.argv[1], json.load(open(sys.argv[2])), {}
for name, words in runs.items():
    sys.argv = ["pretrain_gpt.py", *words]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args()
            validate_args(args, {})
        out[name] = {k: repr(v) for k, v in sorted(vars(args).items())}
    except BaseException as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
json.dump(out, open(target, "w"))
"""
# upstream flags only: each example config with each of these
VARIANTS = {
    "plain": [],
    "ce_fusion": ["--cross-entropy-loss-fusion"],
    "ce_fusion_te": ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
    "dist_opt": ["--use-distributed-optimizer"],
    "full_iteration": ["--cuda-graph-impl", "full_iteration"],
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep4": ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall"],
}


def test_configs_without_the_changes_are_checked_as_before(series, tmp_path):
    """21 runs of upstream flags (3 example configs x 7 variants), parsed and validated by
    megatron on one GPU: the same arguments, or the same error, on both trees."""
    _, plain, edited, _ = series
    folder = os.path.join(ROOT, "examples", "configs")
    runs = {}
    for config in sorted(n for n in os.listdir(folder) if n.endswith(".args")):
        lines = open(os.path.join(folder, config)).read().splitlines()
        words = [w for line in lines for w in line.split("#")[0].split()]
        for variant, extra in VARIANTS.items():
            runs[f"{config}:{variant}"] = words + extra
    assert len(runs) >= 20
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    parsed = {}
    for label, tree in (("plain", plain), ("edited", edited)):
        out = tmp_path / f"{label}.json"
        run = _in_tree(tree, "-c", PARSE, str(out), str(tmp_path / "runs.json"), world_size=1)
        assert run.returncode == 0, run.stderr[-3000:]
        parsed[label] = json.load(open(out))
    added = new_arguments(parsed["plain"], parsed["edited"])
    assert parsed["plain"] == parsed["edited"] and len(parsed["plain"]) == len(runs)
    assert sum(isinstance(v, dict) for v in parsed["plain"].values()) >= 10
    assert all(value == repr(DEFAULTS_OF_NEW_ARGUMENTS[k]) for k, value in added.items()), added


# The arguments a change of the series adds to upstream's parser, with their defaults: a run
# without the change's flags must hold exactly these on the edited tree.
DEFAULTS_OF_NEW_ARGUMENTS = {"adam_fusion_impl": "auto"}


def new_arguments(plain, edited):
    """Take the arguments only the edited tree defines out of ``edited``'s parsed runs (in place);
    returns {name: repr of its value}, which must be one value in every run."""
    added = {}
    for name, parsed in edited.items():
        if not isinstance(parsed, dict) or not isinstance(plain.get(name), dict):
            continue
        for key in [k for k in parsed if k not in plain[name]]:
            value = parsed.pop(key)
            assert added.setdefault(key, value) == value, (name, key, value)
    return added
