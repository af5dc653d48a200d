"""The flex-dispatcher rules refuse a backend that cannot run (never falling back to all-to-all),
checking the combination, not the installation, under --dry-run."""

import sys

from megatron.patchset.core import rules
from megatron.patchset.features.flex_dispatch import probes
from tests.unit.conftest import tiny_argv, validated
from tests.unit.features.flex_dispatch.conftest import flex_argv


def combination_failures(argv, world_size=2):
    args = validated(argv, world_size)
    try:
        rules.validate(args, "combination", config=None)
    except rules.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures}
    return {}


def test_rule_refuses_deepep_that_is_missing(deep_ep_package):
    deep_ep_package("broken")
    failures = combination_failures(flex_argv("deepep"))
    assert "flex-backend-installed" in failures
    assert "libnvshmem_host.so.3" in failures["flex-backend-installed"]
    assert "--moe-flex-dispatcher-backend deepep" in failures["flex-backend-installed"]


def test_rule_accepts_a_matching_deepep(deep_ep_package):
    deep_ep_package("v1")
    assert combination_failures(flex_argv("deepep")) == {}


def test_dry_run_checks_the_combination_not_the_installation(deep_ep_package):
    deep_ep_package("broken")
    failures = combination_failures(flex_argv("deepep", "--dry-run"))
    assert "flex-backend-installed" not in failures


def test_rule_group_size(deep_ep_package):
    deep_ep_package("v1")
    one = combination_failures(
        tiny_argv("--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"),
        world_size=1,
    )
    assert "TPxEP > 1" in one["flex-backend-group-size"]
    # 8 experts over EP=4 on 4 GPUs is a size the stand-in supports; EP=8 would be too, 6 is not.
    assert "flex-backend-group-size" not in combination_failures(
        tiny_argv("--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "flex"),
        world_size=4,
    )


def test_other_dispatchers_are_not_checked(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    assert combination_failures(tiny_argv("--expert-model-parallel-size", "2")) == {}
    assert probes.requested_backend(None) is None


def test_ncclep_rules(monkeypatch):
    monkeypatch.setattr(
        probes, "probe_nccl_ep", lambda check_runtime=True: "NCCL 2.28.9 is loaded, but ..."
    )
    failures = combination_failures(flex_argv("ncclep"))
    assert "--moe-expert-rank-capacity-factor" in failures["ncclep-needs-rank-capacity"]
    assert "NCCL 2.28.9" in failures["flex-backend-installed"]
    monkeypatch.setattr(probes, "probe_nccl_ep", lambda check_runtime=True: None)
    assert (
        combination_failures(flex_argv("ncclep", "--moe-expert-rank-capacity-factor", "2.0")) == {}
    )
