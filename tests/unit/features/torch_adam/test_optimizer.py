"""torch's fused Adam built from megatron-core's Adam arguments: the class, the hyperparameters,
the learning rate as a device tensor when capturable, refusal of TE-only arguments, and the
registry patch that puts it in megatron-core's place."""

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.features.torch_adam.optimizer import build_adam
from tests.unit.conftest import parse, tiny_argv

KW = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.nn.Parameter(torch.randn(7, 5, generator=gen)) for _ in range(3)]
    for p in out:
        p.grad = torch.randn(p.shape, generator=gen)
    return out


def test_adam_w_mode_selects_adamw_and_its_steps_equal_torch_reference():
    ours, ref = params(), params()
    opt = build_adam([{"params": ours, "wd_mult": 1.0}], adam_w_mode=True, **KW)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["wd_mult"] == 1.0
    reference = torch.optim.AdamW(ref, foreach=False, **KW)
    for _ in range(3):
        opt.step()
        reference.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    assert not torch.equal(ours[0], params()[0])


def test_without_adam_w_mode_it_is_adam_with_l2_weight_decay():
    ours, ref = params(), params()
    opt = build_adam(ours, adam_w_mode=False, **KW)
    assert type(opt) is torch.optim.Adam
    reference = torch.optim.Adam(ref, foreach=False, **KW)
    opt.step()
    reference.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_capturable_makes_each_groups_learning_rate_a_tensor_the_scheduler_fills():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = build_adam(
        [{"params": params()[:2]}, {"params": params()[2:], "lr": 1e-3}], capturable=True, **KW
    )
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 for lr in lrs)
    assert [lr.item() for lr in lrs] == pytest.approx([3e-4, 1e-3])
    scheduler = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=3e-4,
        min_lr=3e-5,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    scheduler.step(1)
    # filled in place: the tensors a captured step reads are the ones the scheduler wrote
    assert [g["lr"] for g in opt.param_groups] == lrs
    assert lrs[0].item() == pytest.approx(1.5e-4)


def test_arguments_only_te_fused_adam_takes_are_refused_with_the_flag_named():
    with pytest.raises(PatchsetError, match=r"--adam-impl torch.*exp_avg_dtype, master_weights"):
        build_adam(params(), master_weights=True, exp_avg_dtype=torch.bfloat16, **KW)


def test_the_patch_replaces_megatron_cores_adam_only_when_asked():
    import megatron.core.optimizer as mcore_optimizer

    original = mcore_optimizer.Adam
    assert "torch_adam.fused_step" not in {p.name for p in registry.selected(parse(tiny_argv()))}
    applied = registry.apply(parse(tiny_argv("--adam-impl", "torch")))
    try:
        assert "torch_adam.fused_step" in applied
        assert mcore_optimizer.Adam is not original
        assert mcore_optimizer.Adam.__wrapped__ is original
        opt = mcore_optimizer.Adam(params=params(), capturable=False, adam_w_mode=True, **KW)
        assert type(opt) is torch.optim.AdamW
    finally:
        registry.revert(applied)
    assert mcore_optimizer.Adam is original
    assert not hasattr(build_adam, "__wrapped__")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_loaded_learning_rate_becomes_a_0d_fp32_tensor_on_the_params_device(impl):
    """A checkpoint's param groups may hold the learning rate as another tensor (on the GPU rank 0
    saved it from, in another dtype); a captured step needs it 0-d, fp32, on its params' device."""
    opt = build_adam([{"params": params()}], capturable=True, impl=impl, **KW)
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = torch.tensor([5e-4], dtype=torch.float64)
    opt.load_state_dict(saved)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.dim() == 0
    assert lr.device == opt.param_groups[0]["params"][0].device
    assert lr.item() == pytest.approx(5e-4)
