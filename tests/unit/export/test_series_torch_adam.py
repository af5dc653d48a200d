"""The torch_adam change of ``export --series`` on the two Megatron-LM snapshots: it applies alone
with ``git am -3``, its upstream tests pass on the edited tree on the CPU (Triton's interpreter)
and its tests of the routing and of the distributed optimizer fail without the code edits, its
new flag parses into ``OptimizerConfig`` there (with the distributed optimizer too), and
upstream's flags without it give the same optimizer config as before
(:func:`test_series.test_configs_without_the_changes_are_checked_as_before`)."""

import re

from megatron.patchset.features.torch_adam.upstream import CHANGE
from tests.unit.export import snapshots

pytestmark = snapshots.MARKS

TESTS = "tests/unit_tests/optimizer/test_triton_adam.py"


def test_the_change_applies_alone_and_touches_upstreams_optimizer(series, tmp_path):
    done = snapshots.export(series.plain, tmp_path, "--feature", CHANGE.name)
    assert done.returncode == 0, done.stderr
    (patch,) = sorted(tmp_path.glob("*.patch"))
    assert snapshots.git(series.plain, "apply", "--check", str(patch)).returncode == 0
    text = patch.read_text()
    touched = sorted(line.split(" b/")[-1] for line in text.splitlines() if line[:5] == "diff ")
    assert touched == sorted(CHANGE.paths())
    added = [line for line in text.splitlines() if line.startswith("+")]
    assert not [line for line in added if snapshots.LEAKS.search(line)]
    assert all(len(line) <= 101 for line in added if not line.startswith("+++"))


def test_its_tests_pass_on_the_edited_tree_under_the_interpreter(upstream_tests):
    edited = upstream_tests["edited"]
    # and one skipped: the copy skip of Float16OptimizerWithFloat16Params needs a GPU
    assert edited.counts(re.escape(TESTS)) == {"PASSED": 18}, edited.output[-3000:]
    assert edited.of("test_distributed_optimizer_steps_as_adamw_and_keeps_its_step")


def test_its_tests_of_the_routing_fail_without_the_code_edits(upstream_tests):
    """With the kernel's new file but none of the in-place edits: the factory and config tests
    and the distributed optimizer's fail, the kernel's own tests pass."""
    without = upstream_tests["tests_only"]
    assert set(without.of(r"test_triton_adam\.py::TestAdamFusionImpl").values()) == {"FAILED"}
    assert set(without.of(r"test_triton_adam\.py::test_distributed_optimizer").values()) == {
        "FAILED"
    }
    assert set(without.of(r"test_triton_adam\.py::TestTritonAdam::").values()) == {"PASSED"}


def test_the_flag_reaches_the_optimizer_config_and_is_checked(parsed_configs):
    """megatron's parser and get_megatron_optimizer_config (what training builds the optimizer
    from) on both trees; the flag's arguments are validated by OptimizerConfig."""
    before, after = parsed_configs["plain"], parsed_configs["edited"]
    assert before["adam_torch"].startswith("SystemExit")  # no such flag upstream
    assert after["adam_torch"]["optimizer"]["adam_fusion_impl"] == "'torch'"
    assert after["adam_torch"]["optimizer"]["optimizer_cuda_graph"] == "True"
    dist_opt = after["adam_triton_dist_opt"]["optimizer"]
    assert dist_opt["adam_fusion_impl"] == "'triton'"
    assert dist_opt["use_distributed_optimizer"] == "True"
