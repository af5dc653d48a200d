"""--overlap-dispatch-backward-with-experts-wgrad with the torch grouped GEMMs: the backward pass
computes the data gradient only, ``backward_dw()`` adds the same weight-gradient bits later, and
megatron's TEGroupedMLP reaches the linears' ``backward_dw``."""

import copy

import pytest
import torch

from megatron.patchset.features.grouped_mm import linears
from tests.unit.conftest import failures, tiny_argv, validated
from tests.unit.features.grouped_mm.conftest import (
    IN,
    OUT,
    SPLITS,
    FakeTEGroupedLinear,
    ddp_main_grads,
    grouped_mlp,
    rows,
)


def pair(role="Column", ddp=True):
    """Two linears with the same weights, the second with megatron's ``delay_wgrad_compute``;
    with ``ddp`` each weight carries fp32 main grads (0.5) laid out as DDP's buffer."""
    cls = linears.grouped_mm_linear(FakeTEGroupedLinear, role)
    now = cls(len(SPLITS), IN, OUT)
    later = copy.deepcopy(now)
    later.delay_wgrad_compute = True
    if ddp:
        for linear in (now, later):
            ddp_main_grads(weights(linear))
    return now, later


def weights(linear):
    return [getattr(linear, f"weight{i}") for i in range(linear.num_gemms)]


def splits_cases():
    total = sum(SPLITS)
    return {
        "host list": (list(SPLITS), total),
        "device, padded, descending": (
            linears.DeviceSplits(torch.tensor(SPLITS[::-1]), padded=True, descending=True),
            total + 6,
        ),
    }


@pytest.mark.parametrize("case", list(splits_cases()))
def test_backward_dw_adds_the_same_bits_into_main_grad_after_the_backward_pass(case):
    splits, m = splits_cases()[case]
    now, later = pair()
    outputs = {}
    for seed in (1, 3):  # two micro-batches accumulate into the same main grads
        x = rows(m, seed=seed)
        if isinstance(splits, linears.DeviceSplits):
            x[sum(SPLITS) :] = 0  # the static dispatch's zero rows after the last expert's
        dy = rows(m, OUT, seed=seed + 1)
        for name, linear in (("now", now), ("later", later)):
            xi = x.clone().requires_grad_(True)
            out, _ = linear(xi, splits)
            out.backward(dy)
            outputs[name] = (out.detach(), xi.grad)
        before = [w.main_grad.clone() for w in weights(later)]
        assert torch.equal(outputs["now"][0], outputs["later"][0])
        assert torch.equal(outputs["now"][1], outputs["later"][1])
        for w, old in zip(weights(later), before):
            # DDP's hook got what the immediate path hands it, and nothing was added yet.
            assert w.grad_added_to_main_grad is True and w.grad is not None
            assert torch.equal(w.main_grad, old)
        later.backward_dw()
        for w_now, w_later in zip(weights(now), weights(later)):
            assert torch.equal(w_now.main_grad, w_later.main_grad)
    assert any(
        not torch.equal(w.main_grad, torch.full_like(w.main_grad, 0.5)) for w in weights(now)
    )
    later.backward_dw()  # nothing kept: a second call adds nothing
    for w_now, w_later in zip(weights(now), weights(later)):
        assert torch.equal(w_now.main_grad, w_later.main_grad)


def test_without_ddp_backward_dw_writes_grad():
    now, later = pair(role="Row", ddp=False)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    for step in range(2):
        before = [None if w.grad is None else w.grad.clone() for w in weights(later)]
        for linear in (now, later):
            linear(x, SPLITS)[0].backward(dy)
        for w, old in zip(weights(later), before):
            assert (w.grad is None) if step == 0 else torch.equal(w.grad, old)
        later.backward_dw()
    for w_now, w_later in zip(weights(now), weights(later)):
        assert w_now.grad is not None and torch.equal(w_now.grad, w_later.grad)


def test_a_forward_after_a_backward_without_backward_dw_is_a_clear_error():
    _, later = pair()
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    later(x, SPLITS)[0].backward(dy)
    with pytest.raises(RuntimeError, match="backward_dw\\(\\) did not run"):
        later(x, SPLITS)
    with torch.no_grad():  # evaluation keeps nothing and checks nothing
        later(x, SPLITS)
    later.backward_dw()
    later(x, SPLITS)


def test_megatrons_grouped_mlp_backward_dw_reaches_both_linears():
    """TEGroupedMLP.backward_dw calls linear_fc2's and then linear_fc1's: with the linears'
    weight gradients delayed, the experts' parameter gradients after it equal the immediate ones."""
    mlp_now = grouped_mlp(SPLITS)
    mlp_later = copy.deepcopy(mlp_now)
    for linear in (mlp_later.linear_fc1, mlp_later.linear_fc2):
        linear.delay_wgrad_compute = True
    x = rows(sum(SPLITS))
    probs = torch.rand(sum(SPLITS), generator=torch.Generator().manual_seed(3))
    grads = {}
    for name, mlp in (("now", mlp_now), ("later", mlp_later)):
        out, _ = mlp(x, torch.tensor(SPLITS), probs)
        out.float().square().sum().backward()
        if name == "later":
            assert all(p.grad is None for p in mlp.parameters())
            mlp.backward_dw()
        grads[name] = [p.grad for p in mlp.parameters()]
    assert len(grads["now"]) == 2 * len(SPLITS)
    for g_now, g_later in zip(grads["now"], grads["later"]):
        assert torch.equal(g_now, g_later)


TORCH = ("--moe-grouped-gemm-impl", "torch")
RULE = "moe-grouped-gemm-impl-torch-requirements"


def test_rule_takes_the_flag_and_refuses_it_with_overlapped_grad_reduce():
    flag = "--overlap-dispatch-backward-with-experts-wgrad"
    assert RULE not in failures(tiny_argv(*TORCH, flag))
    refused = failures(tiny_argv(*TORCH, flag, "--overlap-grad-reduce"))[RULE]
    assert "no --overlap-grad-reduce with --overlap-dispatch-backward-with-experts-wgrad" in refused


def test_rule_refuses_delay_wgrad_compute_and_names_the_flag_that_works():
    refused = failures(tiny_argv(*TORCH, "--delay-wgrad-compute"))[RULE]
    assert "no --delay-wgrad-compute" in refused
    assert "--overlap-dispatch-backward-with-experts-wgrad defers" in refused


@pytest.mark.parametrize("world_size", [1, 2], ids=["ep1", "ep2"])
def test_megatrons_moe_layer_computes_the_delayed_weight_gradients_with_the_same_bits(
    tmp_path, world_size
):
    """megatron's MoELayer with the flag: after its dispatch's backward all-to-all it calls
    ``backward_dw`` once per backward pass, nothing stays pending, and output, input gradient and
    every parameter gradient equal the immediate run's bit for bit (two gloo ranks at EP 2)."""
    import torch.multiprocessing as mp

    from tests.unit.features.grouped_mm import delayed_wgrad_worker
    from tests.unit.support.cpu_train import free_port

    out = str(tmp_path / "delayed")
    mp.spawn(
        delayed_wgrad_worker.worker,
        args=(world_size, free_port(), out),
        nprocs=world_size,
        join=True,
    )
    for rank in range(world_size):
        result = torch.load(f"{out}.rank{rank}.pt")
        now, later = result[False], result[True]
        assert now["backward_dw_calls"] == []
        assert later["backward_dw_calls"] == [{"routed_experts": True, "shared_experts": False}] * 2
        assert later["pending"] == [0, 0]
        assert torch.equal(now["out"], later["out"])
        assert torch.equal(now["hidden_grad"], later["hidden_grad"])
        assert now["grads"].keys() == later["grads"].keys()
        assert any(name.startswith("experts.linear_fc1.weight") for name in now["grads"])
        for name, grad in now["grads"].items():
            assert torch.equal(grad, later["grads"][name]), f"rank {rank}: {name}"


CARVEOUT_RULE = "moe-wgrad-sm-carveout-requirements"
OVERLAP = "--overlap-dispatch-backward-with-experts-wgrad"


def test_carveout_rule_needs_the_deferred_weight_gradients_of_these_gemms():
    assert CARVEOUT_RULE not in failures(
        tiny_argv(*TORCH, OVERLAP, "--moe-wgrad-sm-carveout", "24")
    )
    assert CARVEOUT_RULE not in failures(tiny_argv(*TORCH, "--moe-wgrad-sm-carveout", "0"))
    refused = failures(tiny_argv(*TORCH, "--moe-wgrad-sm-carveout", "24"))[CARVEOUT_RULE]
    assert refused.startswith("--moe-wgrad-sm-carveout 24 needs: ")
    assert OVERLAP in refused and "--moe-grouped-gemm-impl torch" not in refused
    refused = failures(tiny_argv(OVERLAP, "--moe-wgrad-sm-carveout", "8"))[CARVEOUT_RULE]
    assert "--moe-grouped-gemm-impl torch" in refused and OVERLAP not in refused


class _CarveoutSpy:
    """torch's SM carve-out setting, recorded: what the GEMMs inside saw and what was restored."""

    def __init__(self, monkeypatch, sms=132):
        from megatron.patchset.features.grouped_mm import delayed_wgrad

        self.value, self.seen = None, []
        monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: self.value)
        monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", self.put)
        props = type("Props", (), {"multi_processor_count": sms})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        self.module = delayed_wgrad

    def put(self, value):
        self.value = value


def test_sm_carveout_is_set_for_the_block_and_restored(monkeypatch):
    from megatron.patchset.core.errors import PatchsetError

    spy = _CarveoutSpy(monkeypatch)
    with spy.module.sm_carveout(24, "cuda:0"):
        assert spy.value == 24
    assert spy.value is None
    spy.value = 4  # a carve-out set by someone else comes back
    with spy.module.sm_carveout(20, "cuda"):
        assert spy.value == 20
    assert spy.value == 4
    spy.value = None
    with spy.module.sm_carveout(0, "cuda"), spy.module.sm_carveout(24, "cpu"):
        assert spy.value is None  # nothing to carve: no SMs, or none asked
    with pytest.raises(PatchsetError, match="--moe-wgrad-sm-carveout 132 leaves no SM"):
        with spy.module.sm_carveout(132, "cuda"):
            pass
    assert spy.value is None
    with pytest.raises(ValueError, match="inside"):  # an error inside the block restores it too
        with spy.module.sm_carveout(24, "cuda"):
            assert spy.value == 24
            raise ValueError("inside")
    assert spy.value is None


def test_a_torch_without_the_carveout_is_a_clear_error(monkeypatch):
    from megatron.patchset.core.errors import PatchsetError
    from megatron.patchset.features.grouped_mm import delayed_wgrad

    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental", raising=False)
    with pytest.raises(PatchsetError) as refused:
        with delayed_wgrad.sm_carveout(24, "cuda"):
            pass
    assert str(refused.value).startswith("--moe-wgrad-sm-carveout 24: torch ")
    assert "or drop the flag" in str(refused.value)


def test_backward_dw_runs_the_kept_gemms_under_the_requested_carveout(monkeypatch):
    """backward_dw sets the carve-out around its weight-gradient GEMMs only, and restores it after;
    the immediate path runs without it. (On the CPU the carve-out changes nothing; the GPU tests
    in tests/gpu/features/grouped_mm compare the bits with it.)"""
    from megatron.patchset.features.grouped_mm import torch_grouped_gemm

    spy = _CarveoutSpy(monkeypatch)
    monkeypatch.setattr(spy.module, "requested_carveout", lambda module: 24)
    # the GEMMs of this CPU test run on the CPU: let the carve-out act as on a GPU
    real = spy.module.sm_carveout

    def on_gpu(sms, device):
        return real(sms, "cuda")

    monkeypatch.setattr(spy.module, "sm_carveout", on_gpu)
    original = torch_grouped_gemm.weight_gradients

    def weight_gradients(*args):
        spy.seen.append(spy.value)
        return original(*args)

    monkeypatch.setattr(torch_grouped_gemm, "weight_gradients", weight_gradients)
    now, later = pair()
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    for linear in (now, later):
        linear(x, SPLITS)[0].backward(dy)
    assert spy.seen == [None] and spy.value is None  # the immediate path: no carve-out
    later.backward_dw()
    assert spy.seen == [None, 24] and spy.value is None


def test_the_requested_carveout_is_the_flag_on_the_linears_config():
    """configure_config copies the flag onto megatron's TransformerConfig (only when set), and the
    linear reads it from its config; megatron's own config and a module without one give 0."""
    from megatron.core.transformer import TransformerConfig

    from megatron.patchset.features.grouped_mm import delayed_wgrad, flags

    args = validated(tiny_argv(*TORCH, OVERLAP, "--moe-wgrad-sm-carveout", "20"))
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    linear = type("Linear", (), {"config": config})()
    assert delayed_wgrad.requested_carveout(linear) == 0  # upstream's config: no carve-out
    flags.configure_config(args, config)
    assert delayed_wgrad.requested_carveout(linear) == 20
    unset = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    flags.configure_config(validated(tiny_argv(*TORCH)), unset)
    assert not hasattr(unset, flags.CONFIG_CARVEOUT)
    assert delayed_wgrad.requested_carveout(object()) == 0
    # megatron's TEGroupedMLP hands both linears its own config: the copy reaches them
    mlp = grouped_mlp(SPLITS)
    assert delayed_wgrad.requested_carveout(mlp.linear_fc1) == 0
    flags.configure_config(args, mlp.config)
    assert delayed_wgrad.requested_carveout(mlp.linear_fc1) == 20
    assert delayed_wgrad.requested_carveout(mlp.linear_fc2) == 20
