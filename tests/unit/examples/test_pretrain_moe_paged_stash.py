"""examples/pretrain_moe_paged_stash.sh passes --dry-run with each backend and stash setting."""

import pytest

from megatron.patchset.features.paged_stash import flags as stash_flags


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"GRAPHS": "0", "STASH": "0"},
        {"BACKEND": "hybridep"},
        {"BACKEND": "hybridep", "GRAPHS": "0", "STASH": "0"},
    ],
)
def test_example_script_passes_dry_run(knobs):
    from tests.unit.conftest import dry_run_example

    # the script sets the CuTe-DSL variable itself
    proc = dry_run_example(
        "examples/pretrain_moe_paged_stash.sh", drop=(stash_flags.CUTEDSL_ENV,), **knobs
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "expert model parallel (EP) ........ 2" in out and out.rstrip().endswith("dry-run: OK")
    assert "paged_stash.te_expert_ops" in out
    hybridep = knobs.get("BACKEND", "ncclep") == "hybridep"
    assert ("paged_stash.hybridep_budget_on_graph_replay" in out) == (
        hybridep and knobs.get("GRAPHS", "1") == "1"
    )
    assert ("flex_dispatch.ncclep_bootstrap " in out) == (not hybridep)
