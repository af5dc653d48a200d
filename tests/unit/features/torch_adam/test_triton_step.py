"""``--adam-impl triton``: torch's AdamW stepped by one Triton kernel (run by Triton's interpreter
on the CPU) that applies the clip and writes the bf16 model parameters. Its steps against torch's
own Adam and AdamW, its state against torch's, the bf16 write inside megatron's mixed-precision
optimizer (which then skips its copy), and the fallback to torch's step."""

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.features.torch_adam import param_copy, triton_step
from megatron.patchset.features.torch_adam.optimizer import build_adam
from tests.unit.conftest import parse, tiny_argv, triton_interpreter

pytest.importorskip("triton")

KW = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
# One tensor over a block boundary, one with an odd length, a matrix and a vector.
SHAPES = ((3, triton_step.BLOCK // 2 + 7), (13,), (7, 5), (2048,))


@pytest.fixture
def interpreter(monkeypatch):
    yield from triton_interpreter(monkeypatch, triton_step._kernel)


def params(seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in out:
        p.grad = torch.randn(p.shape, generator=gen)
    return out


def regrad(ps, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)


def groups(ps):
    return [{"params": ps[:2], "wd_mult": 1.0}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}]


def assert_same_state(ours, ref):
    for a, b in zip(ours.state.values(), ref.state.values()):
        assert set(a) == set(b) == {"step", "exp_avg", "exp_avg_sq"}
        assert a["step"].dtype == torch.float32 and a["step"].item() == b["step"].item()
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"])
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"])


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_the_kernels_steps_are_torchs_adamw_and_adam(interpreter, adam_w_mode):
    ours, ref = params(), params()
    opt = build_adam(groups(ours), adam_w_mode=adam_w_mode, impl="triton", **KW)
    assert isinstance(opt, torch.optim.AdamW if adam_w_mode else torch.optim.Adam)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    reference = cls(groups(ref), foreach=False, **KW)
    for step in range(3):
        regrad(ours, step)
        regrad(ref, step)
        opt.step()
        reference.step()
        assert opt._plan is not None  # the kernel ran, not torch's fallback
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    assert_same_state(opt, reference)
    assert not torch.equal(ours[0], params()[0])


def test_the_clip_scale_divides_the_gradients_and_leaves_them_as_they_are(interpreter):
    ours, ref = params(), params()
    opt = build_adam(ours, impl="triton", **KW)
    reference = torch.optim.AdamW(ref, foreach=False, **KW)
    grads = [p.grad.clone() for p in ours]
    opt.grad_scale = torch.tensor(4.0)
    for p in ref:
        p.grad.div_(4.0)
    opt.step()
    reference.step()
    assert opt.grad_scale is None  # dropped after the step, as for torch's kernel
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads))


def test_a_learning_rate_tensor_filled_in_place_is_the_one_used(interpreter):
    ours, ref = params(), params()
    opt = build_adam(ours, capturable=True, impl="triton", **KW)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    reference = torch.optim.AdamW(ref, foreach=False, **KW)
    for step, lr in enumerate((1e-2, 4e-3)):
        opt.param_groups[0]["lr"].fill_(lr)
        reference.param_groups[0]["lr"] = lr
        regrad(ours, step)
        regrad(ref, step)
        opt.step()
        reference.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_unaligned_tensors_take_the_unhinted_kernel_with_the_same_result(interpreter):
    storage = torch.randn(1 + 2 * 37)
    ours = [torch.nn.Parameter(storage[1:38]), torch.nn.Parameter(storage[38:].clone())]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, ref):
        a.grad = torch.randn(a.shape)
        b.grad = a.grad.clone()
    opt = build_adam(ours, impl="triton", **KW)
    reference = torch.optim.AdamW(ref, foreach=False, **KW)
    opt.step()
    reference.step()
    assert opt.aligned is False
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_the_state_dict_is_torchs_both_ways(interpreter):
    ours, ref = params(), params()
    opt = build_adam(ours, impl="triton", **KW)
    opt.step()
    reference = torch.optim.AdamW(ref, fused=True, **KW)
    reference.step()
    reference.load_state_dict(opt.state_dict())
    with torch.no_grad():
        for a, b in zip(ours, ref):
            b.copy_(a)
    fresh = build_adam(params(), impl="triton", **KW)
    fresh.load_state_dict(reference.state_dict())
    assert_same_state(fresh, opt)
    opt.step()
    reference.step()
    assert_same_state(opt, reference)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_without_the_kernel_it_is_torchs_fused_step(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_step.available(torch.device("cpu"))
    ours, ref = params(), params()
    opt = build_adam(ours, impl="triton", **KW)
    reference = torch.optim.AdamW(ref, fused=True, **KW)
    opt.step()
    reference.step()
    assert opt._plan is None and not opt.take_model_copy(object())
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_a_tensor_the_kernel_does_not_take_sends_the_step_to_torch(interpreter):
    ours = params()
    ours[1] = torch.nn.Parameter(ours[1].detach().to(torch.bfloat16))
    ours[1].grad = torch.randn(ours[1].shape, dtype=torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, ref):
        b.grad = a.grad.clone()
    opt = build_adam(ours, impl="triton", **KW)
    reference = torch.optim.AdamW(ref, fused=True, **KW)
    opt.step()
    reference.step()
    assert opt._plan is None
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def megatron_bf16_optimizer(models, impl, monkeypatch):
    """megatron-core's real bf16 optimizer around an Adam built as megatron builds it: over the bf16
    model parameters, whose main_grad is fp32 (its CUDA scalars made on the CPU, its check of the
    parameters' CUDA type answered for CPU tensors)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    real, real_type = torch.tensor, torch.Tensor.type

    def on_the_cpu(*args, device=None, **kwargs):
        return real(*args, device=None if device == "cuda" else device, **kwargs)

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    inner = build_adam([{"params": models}], impl=impl, **KW)
    config = OptimizerConfig(optimizer="adam", lr=KW["lr"], bf16=True, clip_grad=0.0)
    with monkeypatch.context() as m:
        m.setattr(torch, "tensor", on_the_cpu)
        m.setattr(torch.Tensor, "type", cuda_type)
        wrapper = Float16OptimizerWithFloat16Params(inner, config, None, lambda opt, cfg: None)
    gen = torch.Generator().manual_seed(7)
    for model in models:
        model.main_grad = torch.randn(model.shape, generator=gen)
    wrapper._copy_model_grads_to_main_grads()
    return wrapper


def test_inside_megatrons_bf16_optimizer_the_kernel_writes_the_model_parameters(
    interpreter, monkeypatch
):
    models = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params()]
    wrapper = megatron_bf16_optimizer(models, "triton", monkeypatch)
    mains = wrapper.fp32_from_float16_groups[0]
    assert all(m.main_param is p for m, p in zip(models, mains))
    copies = []
    monkeypatch.setattr(
        type(wrapper),
        "_copy_main_params_to_model_params",
        param_copy.foreach_copy_main_to_model(lambda self: copies.append(self)),
    )
    real_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a: copies.append(a) or real_copy(*a))
    before = [m.detach().clone() for m in models]
    wrapper.step_with_ready_grads()
    assert copies == []  # megatron's copy found the model parameters written
    for model, main, old in zip(models, mains, before):
        assert torch.equal(model, main.to(torch.bfloat16)) and not torch.equal(model, old)
    # A later copy without a step (megatron's reload after loading a checkpoint) copies.
    with torch.no_grad():
        mains[0].add_(1.0)
    wrapper._copy_main_params_to_model_params()
    assert len(copies) == 1 and torch.equal(models[0], mains[0].to(torch.bfloat16))


def test_a_model_parameter_the_step_did_not_write_leaves_the_copy_to_megatron(
    interpreter, monkeypatch
):
    models = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params()]
    wrapper = megatron_bf16_optimizer(models, "triton", monkeypatch)
    del models[2].main_param  # the link the kernel follows is missing for one parameter
    wrapper.optimizer._plan = None
    wrapper.optimizer.step()
    assert wrapper.optimizer.take_model_copy(wrapper) is False


def test_torch_and_triton_give_the_same_training_inside_megatrons_optimizer(
    interpreter, monkeypatch
):
    results = []
    for impl in ("torch", "triton"):
        models = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params()]
        applied = registry.apply(parse(tiny_argv("--adam-impl", impl)))
        try:
            wrapper = megatron_bf16_optimizer(models, impl, monkeypatch)
            for _ in range(2):
                wrapper.step_with_ready_grads()
        finally:
            registry.revert(applied)
        results.append([m.detach().float() for m in wrapper.fp32_from_float16_groups[0]])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_the_patch_selected_follows_the_implementation():
    names = {
        impl: {p.name for p in registry.selected(parse(tiny_argv("--adam-impl", impl)))}
        for impl in ("te", "torch", "triton")
    }
    shared = {"torch_adam.clip", "torch_adam.foreach_param_copy"}
    assert not (shared | {"torch_adam.fused_step", "torch_adam.triton_step"}) & names["te"]
    assert shared | {"torch_adam.fused_step"} <= names["torch"]
    assert "torch_adam.triton_step" not in names["torch"]
    assert shared | {"torch_adam.triton_step"} <= names["triton"]
    assert "torch_adam.fused_step" not in names["triton"]


def bf16_moments_reference(ps, steps):
    """AdamW with both moments stored in bf16: each step widens them to fp32, updates the
    parameter in fp32 (torch's order of operations) and rounds them back to nearest even."""
    state = [(torch.zeros(p.shape, dtype=torch.bfloat16),) * 2 for p in ps]
    lr, (beta1, beta2), eps, decay = KW["lr"], KW["betas"], KW["eps"], KW["weight_decay"]
    for step in range(1, steps + 1):
        regrad(ps, step - 1)
        for i, p in enumerate(ps):
            m, v = (t.float() for t in state[i])
            with torch.no_grad():
                p.mul_(1 - lr * decay)
                m = beta1 * m + (1 - beta1) * p.grad
                v = beta2 * v + (1 - beta2) * p.grad * p.grad
                denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
                p.sub_(lr / (1 - beta1**step) * m / denom)
            state[i] = (m.to(torch.bfloat16), v.to(torch.bfloat16))
    return state


def test_bf16_moments_are_kept_in_bf16_and_step_as_adamw_on_them(interpreter):
    ours, ref = params(), params()
    opt = build_adam(ours, impl="triton", moments_dtype="bf16", **KW)
    for step in range(3):
        regrad(ours, step)
        opt.step()
        assert opt._plan is not None and opt._plan.moments_bf16
    expected = bf16_moments_reference(ref, 3)
    for p, r, state, (m, v) in zip(ours, ref, opt.state.values(), expected):
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["exp_avg"].element_size() * state["exp_avg"].numel() == 2 * p.numel()
        torch.testing.assert_close(p, r, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(state["exp_avg"], m, rtol=0, atol=0)
        torch.testing.assert_close(state["exp_avg_sq"], v, rtol=0, atol=0)


def test_fp32_moments_of_a_checkpoint_are_rounded_to_bf16_and_torchs_step_keeps_them(
    interpreter, monkeypatch
):
    """Moments that arrive in fp32 (a checkpoint of the fp32 step, megatron's dummy state on
    load) are rounded at the first step; where the kernel does not run, torch's step works on
    them widened and stores them back in bf16."""
    ours = params()
    opt = build_adam(ours, impl="triton", moments_dtype="bf16", **KW)
    for p in ours:
        opt.state[p].update(exp_avg=torch.full(p.shape, 0.1), exp_avg_sq=torch.full(p.shape, 0.2))
    opt.step()
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
    monkeypatch.setattr(triton_step, "available", lambda device: False)
    before = [p.detach().clone() for p in ours]
    regrad(ours, 1)
    opt.step()
    assert opt._plan is None or not opt._wrote_model_params
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in opt.state.values())
    assert all(not torch.equal(a, b) for a, b in zip(ours, before))


def test_bf16_moments_need_the_one_kernel_step():
    from tests.unit.conftest import failures

    rule = "adam-moments-dtype-needs-triton"
    bf16 = ("--adam-moments-dtype", "bf16")
    assert rule not in failures(tiny_argv("--adam-impl", "triton", *bf16))
    for impl in ("te", "torch"):
        message = failures(tiny_argv("--adam-impl", impl, *bf16))[rule]
        assert f"--adam-impl {impl}" in message and "add --adam-impl triton" in message
    with pytest.raises(Exception, match="acts only with --adam-impl triton"):
        build_adam(params(), impl="torch", moments_dtype="bf16", **KW)
