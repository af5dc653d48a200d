"""The paged-stash patches: targets, switches, and apply/revert against the pinned megatron-core."""

from megatron.patchset.core import registry
from tests.unit.conftest import parse, tiny_argv
from tests.unit.features.paged_stash.conftest import GRAPHS, STASH


def test_patches_registered_with_targets_and_switches():
    names = {p.name: p for p in registry.registered()}
    expected = {
        "paged_stash.te_expert_ops": (
            "megatron.core.transformer.moe.experts.TEGroupedMLP._make_fused_ops",
            "feature",
        ),
        "paged_stash.hybridep_budget_on_graph_replay": (
            "megatron.core.transformer.moe.token_dispatcher._HybridEPManager.dispatch",
            "feature",
        ),
        "paged_stash.report_buffers": (
            "megatron.core.transformer.moe.paged_stash.PagedStashManager.allocate_stash_buffers",
            "observe",
        ),
        "paged_stash.report_overflow": (
            "megatron.core.transformer.moe.paged_stash.PagedStashRunner.check_moe_overflow",
            "observe",
        ),
        "paged_stash.defer_result_checks": (
            "megatron.core.transformer.moe.paged_stash.PagedStashRunner.__init__",
            "feature",
        ),
    }
    for name, (target, kind) in expected.items():
        assert names[name].target == target and names[name].kind == kind and names[name].reason
    stash = parse(tiny_argv(*STASH), 2)
    graphs = parse(tiny_argv(*STASH, *GRAPHS), 2)
    plain = parse(tiny_argv(), 1)
    wanted = lambda a: {p.name for p in registry.wanted(a) if p.name.startswith("paged_stash.")}  # noqa: E731
    assert wanted(plain) == set()
    assert wanted(stash) == set(expected) - {"paged_stash.hybridep_budget_on_graph_replay"}
    assert wanted(graphs) == set(expected)


def test_megatron_targets_resolve():
    for name in (
        "paged_stash.te_expert_ops",
        "paged_stash.hybridep_budget_on_graph_replay",
        "paged_stash.report_buffers",
        "paged_stash.report_overflow",
        "paged_stash.defer_result_checks",
    ):
        owner, attr = registry.resolve_owner(registry.get(name).target)
        assert callable(getattr(owner, attr))


def test_megatron_patches_apply_and_revert():
    from megatron.core.transformer.moe import paged_stash as upstream

    original = upstream.PagedStashRunner.check_moe_overflow
    names = [
        "paged_stash.report_overflow",
        "paged_stash.report_buffers",
        "paged_stash.hybridep_budget_on_graph_replay",
        "paged_stash.te_expert_ops",
        "paged_stash.defer_result_checks",
    ]
    original_init = upstream.PagedStashRunner.__init__
    try:
        registry.apply_patches([registry.get(n) for n in names])
        assert (
            registry.patched_by(upstream.PagedStashRunner.check_moe_overflow)
            == "paged_stash.report_overflow"
        )
        assert (
            registry.patched_by(upstream.PagedStashRunner.__init__)
            == "paged_stash.defer_result_checks"
        )
    finally:
        registry.revert(names)
    assert upstream.PagedStashRunner.check_moe_overflow is original
    assert upstream.PagedStashRunner.__init__ is original_init
