"""What the export tests share: the exported tree (every exportable feature exported onto
megatron-core's installed source, the wheel's ``megatron/`` package), and for the series the
Megatron-LM snapshots with what runs on them once per pytest run (:mod:`.snapshots`)."""

import os

import pytest

from megatron.patchset.export import changes, export
from tests.unit.export import snapshots


def installed_source() -> str:
    """The folder holding the installed ``megatron/`` package (megatron.core's source)."""
    import megatron.core

    return os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__)))
    )


@pytest.fixture(scope="package")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("exported")
    result = export(installed_source(), str(out))
    return str(out), result


# Built once per branch and pytest run, whatever order pytest runs the parametrized tests in (it
# may set a parametrized fixture up again when its parameter comes back).
_BUILT: dict = {}


def _once(key, build):
    if key not in _BUILT:
        _BUILT[key] = build()
    return _BUILT[key]


@pytest.fixture(scope="package", params=snapshots.BRANCHES)
def series(request, tmp_path_factory) -> snapshots.Trees:
    """A snapshot unedited, with the whole series applied by ``git am -3``, and with only the
    series' new files and test edits; one set per branch and pytest run."""
    if not os.path.isfile(os.path.join(snapshots.SNAPSHOTS, "checkout.sh")):
        pytest.skip(f"no Megatron-LM snapshots at {snapshots.SNAPSHOTS}")
    return _once(("trees", request.param), lambda: _build(request.param, tmp_path_factory))


def _build(branch, tmp_path_factory) -> snapshots.Trees:
    root = tmp_path_factory.mktemp(branch)
    plain = snapshots.checkout(branch, root / "plain")
    edited = snapshots.checkout(branch, root / "edited")
    done = snapshots.export(
        plain, root / "patches", "--author", snapshots.AUTHOR, "--date", snapshots.DATE
    )
    assert done.returncode == 0, done.stderr
    patches = sorted(str(p) for p in (root / "patches").glob("*.patch"))
    assert len(patches) == len(changes.series())
    am = snapshots.git(edited, "am", "-3", *patches)
    assert am.returncode == 0, am.stderr
    tests_only = snapshots.without_code_edits(plain, root / "tests-only")
    return snapshots.Trees(branch, plain, edited, patches, tests_only)


@pytest.fixture(scope="package")
def upstream_tests(series) -> dict:
    """One pytest run on the edited tree (upstream's CPU tests of the arguments and configs and
    every test file of the series) and one of the series' test files on the tree without the
    code edits: {"edited": Outcomes, "tests_only": Outcomes}."""

    def build():
        files = snapshots.changed_test_files()
        paths = dict.fromkeys([*snapshots.UPSTREAM_CPU_TESTS, *files])
        return {
            "edited": snapshots.run_pytest(series.edited, *paths),
            "tests_only": snapshots.run_pytest(series.tests_only, *files),
        }

    return _once(("tests", series.branch), build)


@pytest.fixture(scope="package")
def help_text(series) -> str:
    """``pretrain_gpt.py --help`` on the edited tree (it fails on the unedited snapshots)."""

    def build():
        helped = snapshots.in_tree(series.edited, "pretrain_gpt.py", "--help")
        assert helped.returncode == 0, helped.stderr[-2000:]
        return helped.stdout

    return _once(("help", series.branch), build)


@pytest.fixture(scope="package")
def parsed_configs(series, tmp_path_factory) -> dict:
    """megatron's parser, validate_args and optimizer config for every run of
    :func:`snapshots.all_config_runs`: {"plain": ..., "edited": ...}."""

    def build():
        runs = snapshots.all_config_runs()
        folder = tmp_path_factory.mktemp(f"configs-{series.branch}")
        return {
            label: snapshots.parse_runs(tree, runs, folder / label)
            for label, tree in (("plain", series.plain), ("edited", series.edited))
        }

    return _once(("configs", series.branch), build)
