"""The backend checks where megatron builds a flex manager (once per process until one passes),
and the NCCL EP bootstrap patch that passes num_topk to TE 2.20 and repairs its ops first."""

import types

import pytest

from megatron.patchset.core import registry
from megatron.patchset.features.flex_dispatch import manager_checks, probes
from tests.unit.conftest import tiny_argv, validated
from tests.unit.features.flex_dispatch.conftest import _fake_te, flex_argv


def test_ncclep_bootstrap_patch_passes_num_topk(monkeypatch, nccl_jit_env):
    """megatron's _NCCLEPManager._ensure_bootstrap -> (patched) ensure_nccl_ep_bootstrapped ->
    TE's ep_bootstrap, which requires num_topk."""
    import torch
    from megatron.core.transformer.moe import token_dispatcher as upstream

    ep = _fake_te(monkeypatch)
    monkeypatch.setattr(probes, "nccl_runtime_version", lambda: probes.NCCL_EP_MIN_NCCL)
    names = ["flex_dispatch.ncclep_bootstrap_topk", "flex_dispatch.ncclep_bootstrap"]
    applied = registry.apply_patches([registry.get(n) for n in names], check=False)
    try:
        assert (
            registry.patched_by(upstream.ensure_nccl_ep_bootstrapped)
            == "flex_dispatch.ncclep_bootstrap"
        )
        manager = upstream._NCCLEPManager.__new__(upstream._NCCLEPManager)
        manager.__dict__.update(
            _bootstrapped=False,
            num_local_tokens=100,
            router_topk=4,
            rank_capacity_factor=2.0,
            alignment=0,
            group=object(),
            num_experts=16,
            hidden_dim=256,
            zero_copy=False,
            config=types.SimpleNamespace(moe_flex_dispatcher_num_sms=None),
        )
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False, raising=False)
        manager._ensure_bootstrap()
        assert ep.calls == [
            dict(
                num_experts=16,
                max_tokens_per_rank=128,
                hidden_dim=256,
                num_topk=4,
                recv_capacity_per_rank=128 * 4 * 2,
                max_num_sms=0,
            )
        ]
        with pytest.raises(probes.FlexBackendError, match="router top-k"):
            upstream.ensure_nccl_ep_bootstrapped(object(), 16, 128, 1024, 256)
    finally:
        registry.revert(applied)
    assert registry.patched_by(upstream.ensure_nccl_ep_bootstrapped) is None


def test_manager_construction_checks_the_backend(deep_ep_package):
    from megatron.core.transformer.moe import token_dispatcher as upstream

    deep_ep_package("broken")
    applied = registry.apply_patches([registry.get("flex_dispatch.deepep_check")], check=False)
    try:
        with pytest.raises(probes.FlexBackendError, match="libnvshmem_host.so.3"):
            upstream._DeepepManager(
                group=None, num_local_experts=4, router_topk=2, num_experts=8, config=None
            )
    finally:
        registry.revert(applied)


def test_manager_check_runs_once_per_process_until_it_passes(monkeypatch, capsys):
    """megatron builds a manager per MoE layer; the probe runs again only while it fails."""
    probed, built = [], []
    outcomes = iter([probes.FlexBackendError("not yet"), None, None])

    def check_backend(backend):
        probed.append(backend)
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(manager_checks, "check_backend", check_backend)
    monkeypatch.setattr(manager_checks, "backend_origin", lambda backend: "/site/deep_ep")
    monkeypatch.setattr(manager_checks, "_CHECKED", set())
    init = manager_checks.checked_init(lambda self: built.append(self), "deepep")
    with pytest.raises(probes.FlexBackendError, match="not yet"):
        init("layer 1")
    for layer in ("layer 1", "layer 2", "layer 3"):
        init(layer)
    assert probed == ["deepep", "deepep"]
    assert built == ["layer 1", "layer 2", "layer 3"]
    assert capsys.readouterr().out.count("flex dispatcher backend deepep from /site/deep_ep") == 1


def test_patches_are_wanted_only_for_their_backend():
    args = validated(flex_argv("ncclep", "--moe-expert-rank-capacity-factor", "2.0"), 2)
    names = {p.name for p in registry.wanted(args)}
    assert {
        "flex_dispatch.ncclep_check",
        "flex_dispatch.ncclep_bootstrap",
        "flex_dispatch.ncclep_bootstrap_topk",
    } <= names
    assert "flex_dispatch.deepep_check" not in names
    plain = {
        p.name
        for p in registry.wanted(validated(tiny_argv("--expert-model-parallel-size", "2"), 2))
    }
    assert not any(n.startswith("flex_dispatch.") for n in plain)
    assert all(registry.get(n).kind == "compat" for n in names if n.startswith("flex_dispatch."))


def test_ncclep_bootstrap_repairs_te_ep_kernels_before_bootstrapping(monkeypatch):
    import sys
    import types

    calls = []
    te, te_pt, fake_ep = (
        types.ModuleType(n)
        for n in (
            "transformer_engine",
            "transformer_engine.pytorch",
            "transformer_engine.pytorch.ep",
        )
    )
    fake_ep.is_ep_bootstrapped = lambda: False
    fake_ep.ep_bootstrap = lambda *a, **k: calls.append(("bootstrap", k["num_topk"]))
    te.pytorch, te_pt.ep = te_pt, fake_ep
    for module in (te, te_pt, fake_ep):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(
        manager_checks, "check_backend", lambda backend: calls.append(("check", backend))
    )
    monkeypatch.setattr(
        manager_checks, "repair_mutable_default_kernels", lambda ns: calls.append(("repair", ns))
    )
    manager_checks._BOOTSTRAP.topk = 8
    try:
        manager_checks.ensure_nccl_ep_bootstrapped(None, 128, 4096, 8192, 2048)
    finally:
        manager_checks._BOOTSTRAP.topk = None
    assert calls == [("check", "ncclep"), ("repair", "transformer_engine_ep"), ("bootstrap", 8)]
