"""The fsdp_cuda_graphs change of ``export --series`` on both Megatron-LM snapshots: it applies
alone, its upstream tests pass on the edited tree on CPU and those of its in-place edits fail on a
tree with only its new files, and configs with Megatron-FSDP but without TE per-layer graphs (or
TE graphs without FSDP) validate as before."""

from megatron.patchset.features.fsdp_cuda_graphs.upstream import CHANGE
from tests.unit.export import snapshots

pytestmark = snapshots.MARKS

TESTS = r"test_te_cuda_graph_hooks\.py"


def test_the_change_applies_alone_and_edits_upstreams_functions_in_place(series, tmp_path):
    done = snapshots.export(series.plain, tmp_path, "--feature", CHANGE.name)
    assert done.returncode == 0, done.stderr
    (patch,) = sorted(tmp_path.glob("*.patch"))
    assert snapshots.git(series.plain, "apply", "--check", str(patch)).returncode == 0
    text = patch.read_text()
    for path in CHANGE.paths():
        assert f"+++ b/{path}" in text
    added = [line for line in text.splitlines() if line.startswith("+")]
    assert not [line for line in added if snapshots.LEAKS.search(line)]
    assert max(len(line) for line in added) <= 101


def test_the_upstream_tests_pass_on_the_edited_tree(upstream_tests):
    edited = upstream_tests["edited"]
    assert edited.counts(TESTS) == {"PASSED": 15}, edited.output[-3000:]


def test_the_upstream_tests_fail_without_the_code_edits(upstream_tests):
    """The new module and tests alone: the tests of __call__, the capture inputs and
    validate_args fail; those of the new module pass."""
    without = upstream_tests["tests_only"]
    assert without.counts(TESTS) == {"FAILED": 7, "PASSED": 8}, without.output[-3000:]
    failed = [k for k, v in without.of(TESTS).items() if v == "FAILED"]
    assert any(
        "TestGraphableModuleHooks::test_hooks_fire_around_capture_and_replay" in k for k in failed
    )
    assert any("TestValidateArgs::test_unsupported_config_is_refused" in k for k in failed)


def test_configs_without_fsdp_te_graphs_are_checked_as_before(parsed_configs):
    runs = ("fsdp", "fsdp_graphs_local", "fsdp_full_iteration", "ddp_te_graphs")
    plain, edited = snapshots.as_before(parsed_configs, runs)
    assert plain == edited
    assert isinstance(edited["fsdp_graphs_local"], dict)  # accepted, as upstream does
