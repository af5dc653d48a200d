"""megatron's gradient clipping applied by torch's fused Adam (its grad_scale), and the fp32 -> bf16
copy of the main parameters as one foreach copy: the same update as megatron's own passes, the
fallback to megatron's function wherever the fused path does not hold, and the registry patches."""

import types

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.features.torch_adam import clipping, param_copy
from megatron.patchset.features.torch_adam.optimizer import build_adam
from tests.unit.conftest import parse, tiny_argv

KW = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
MAX_NORM = 1.0


def params(scale, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((7, 5), (11,), (2, 3, 4))]
    for p in out:
        p.grad = scale * torch.randn(p.shape, generator=gen)
    return out


def total_norm(ps):
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps])).reshape(1)


def megatrons_clip(ps, max_norm, norm):
    """What megatron-core's clip_grad_by_total_norm_fp32 does to the gradients."""
    coeff = torch.clamp_max(max_norm / (norm + 1.0e-6), 1.0)
    for p in ps:
        p.grad.mul_(coeff)


def refuse(*args, **kwargs):
    raise AssertionError("megatron's own clip was called")


@pytest.mark.parametrize("grad_scale", [10.0, 0.01])  # clipped, and below the clip norm
def test_the_fused_clip_gives_megatrons_update(grad_scale):
    ours, ref = params(grad_scale), params(grad_scale)
    opt = build_adam(ours, **KW)
    reference = torch.optim.AdamW(ref, foreach=False, **KW)
    for step in range(3):
        if step:
            for a, b in zip(ours, ref):
                a.grad.copy_(b.grad.normal_(generator=torch.Generator().manual_seed(step)))
                a.grad.mul_(grad_scale), b.grad.mul_(grad_scale)
        norm = total_norm(ours)
        assert clipping.clip_into_adam(refuse)(ours, MAX_NORM, norm) is None
        expected = max(1.0, (norm.item() + 1e-6) / MAX_NORM)
        assert opt.grad_scale.item() == pytest.approx(expected)
        if grad_scale < 1:
            assert opt.grad_scale.item() == 1.0  # below the clip norm: the gradients as they are
        megatrons_clip(ref, MAX_NORM, total_norm(ref))
        opt.step()
        reference.step()
        assert opt.grad_scale is None  # dropped after the step: no stale scale next time
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_python_float_norm_is_accepted():
    ours = params(10.0)
    opt = build_adam(ours, **KW)
    clipping.clip_into_adam(refuse)(ours, MAX_NORM, 50.0)
    assert opt.grad_scale.dtype == torch.float32 and opt.grad_scale.item() == pytest.approx(50.0)


def test_anything_but_whole_fused_optimizers_goes_to_megatrons_function():
    ps, other = params(10.0), params(10.0, seed=1)
    opt = build_adam(ps, **KW)
    torch.optim.AdamW(other, **KW)  # not built by build_adam
    calls = []

    def original(parameters, max_norm, total_norm, use_decoupled_grad=False):
        calls.append((len(parameters), use_decoupled_grad))

    clip = clipping.clip_into_adam(original)
    clip(ps[:2], MAX_NORM, 5.0)  # part of an optimizer (a separate grad-norm group)
    clip(ps + other, MAX_NORM, 5.0)  # plus parameters of another optimizer
    clip(other, MAX_NORM, 5.0)
    clip(ps, MAX_NORM, 5.0, use_decoupled_grad=True)
    clip([], MAX_NORM, 5.0)
    assert calls == [(2, False), (6, False), (3, False), (3, True), (0, False)]
    assert getattr(opt, "grad_scale", None) is None


def test_two_fused_optimizers_clipped_together_each_get_the_scale():
    a, b = params(10.0), params(10.0, seed=1)
    opt_a, opt_b = build_adam(a, **KW), build_adam(b, **KW)
    clipping.clip_into_adam(refuse)(a + b, MAX_NORM, torch.tensor([4.0]))
    assert opt_a.grad_scale.item() == opt_b.grad_scale.item() == pytest.approx(4.0)


def fake_float16_optimizer(model, main, overflow_buf=None):
    return types.SimpleNamespace(
        _dummy_overflow_buf=overflow_buf,
        _get_model_and_main_params_data_float16=lambda: (model, main),
    )


def test_the_foreach_copy_rounds_like_megatrons_per_parameter_copy():
    main = [torch.randn(s) * 3 for s in ((64, 33), (5,), (3, 7, 9))]
    ours = [torch.zeros(m.shape, dtype=torch.bfloat16) for m in main]
    copy = param_copy.foreach_copy_main_to_model(refuse)
    calls = []
    real = torch._foreach_copy_

    def record(selves, srcs):
        calls.append(len(selves))
        return real(selves, srcs)

    torch._foreach_copy_ = record
    try:
        copy(fake_float16_optimizer(ours, main))
    finally:
        torch._foreach_copy_ = real
    assert calls == [3]
    for o, m in zip(ours, main):
        assert o.dtype == torch.bfloat16 and torch.equal(o, m.to(torch.bfloat16))


def test_fp16_keeps_megatrons_multi_tensor_copy():
    seen = []
    copy = param_copy.foreach_copy_main_to_model(seen.append)
    fake = fake_float16_optimizer([], [], overflow_buf=torch.zeros(1, dtype=torch.int))
    copy(fake)
    assert seen == [fake]


def test_the_patches_apply_only_with_adam_impl_torch():
    from megatron.core.optimizer import optimizer as mcore

    clip, copy = (
        mcore.clip_grad_by_total_norm_fp32,
        (mcore.Float16OptimizerWithFloat16Params._copy_main_params_to_model_params),
    )
    names = {"torch_adam.clip", "torch_adam.foreach_param_copy"}
    assert not names & {p.name for p in registry.selected(parse(tiny_argv()))}
    applied = registry.apply(parse(tiny_argv("--adam-impl", "torch")))
    try:
        assert names <= set(applied)
        assert mcore.clip_grad_by_total_norm_fp32.__wrapped__ is clip
        patched = mcore.Float16OptimizerWithFloat16Params._copy_main_params_to_model_params
        assert patched is not copy and patched.__wrapped__ is copy
    finally:
        registry.revert(applied)
    assert mcore.clip_grad_by_total_norm_fp32 is clip
    assert mcore.Float16OptimizerWithFloat16Params._copy_main_params_to_model_params is copy
