# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

from types import SimpleNamespace

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, _get_megatron_optimizer_based_on_param_groups
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.optimizer.triton_adam import BLOCK, TritonAdam, TritonAdamW, available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
# One tensor over a kernel block boundary, one of odd length and a matrix.
SHAPES = ((3, BLOCK // 2 + 7), (13,), (7, 5))


def _params(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE, dtype))
        for shape in SHAPES
    ]


def _set_grads(params, seed):
    generator = torch.Generator().manual_seed(100 + seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)


def _groups(params):
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]


requires_kernel = pytest.mark.skipif(
    not available(DEVICE), reason="needs a CUDA device with Triton, or TRITON_INTERPRET=1"
)


@requires_kernel
class TestTritonAdam:
    """The Triton step against torch's Adam and AdamW."""

    @pytest.mark.parametrize(
        "cls, reference_cls", [(TritonAdamW, torch.optim.AdamW), (TritonAdam, torch.optim.Adam)]
    )
    def test_steps_match_torch(self, cls, reference_cls):
        ours, ref = _params(), _params()
        optimizer = cls(_groups(ours), **HYPER)
        reference = reference_cls(_groups(ref), foreach=False, **HYPER)
        for step in range(3):
            _set_grads(ours, step)
            _set_grads(ref, step)
            optimizer.step()
            reference.step()
        assert optimizer.aligned is not None  # the kernel ran
        for param, expected in zip(ours, ref):
            torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-6)
            state, expected_state = optimizer.state[param], reference.state[expected]
            assert state["step"].item() == 3
            torch.testing.assert_close(state["exp_avg"], expected_state["exp_avg"])
            torch.testing.assert_close(state["exp_avg_sq"], expected_state["exp_avg_sq"])

    def test_learning_rate_as_device_tensor(self):
        ours, ref = _params(), _params()
        optimizer = TritonAdamW(_groups(ours), **HYPER)
        reference = torch.optim.AdamW(_groups(ref), foreach=False, **HYPER)
        for group in optimizer.param_groups:
            group["lr"] = torch.tensor(group["lr"], device=DEVICE)
        for step in range(2):
            for group, expected in zip(optimizer.param_groups, reference.param_groups):
                group["lr"].fill_(0.5 * group["lr"].item())  # as OptimizerParamScheduler does
                expected["lr"] *= 0.5
            _set_grads(ours, step)
            _set_grads(ref, step)
            optimizer.step()
            reference.step()
        for param, expected in zip(ours, ref):
            torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-6)

    def test_bf16_moments(self):
        ours, ref = _params(), _params()
        optimizer = TritonAdamW(_groups(ours), moments_dtype=torch.bfloat16, **HYPER)
        reference = torch.optim.AdamW(_groups(ref), foreach=False, **HYPER)
        for step in range(3):
            _set_grads(ours, step)
            _set_grads(ref, step)
            optimizer.step()
            reference.step()
            # the reference keeps its moments as the kernel stores them: rounded to bf16
            for state in reference.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = state[key].bfloat16().float()
        for param, expected in zip(ours, ref):
            torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                assert optimizer.state[param][key].dtype == torch.bfloat16
                torch.testing.assert_close(
                    optimizer.state[param][key], reference.state[expected][key].bfloat16()
                )

    def test_writes_the_bf16_model_params(self):
        """As Float16OptimizerWithFloat16Params sets it up: Adam built over the bf16 params, then
        their fp32 main params put in their place and linked as model_param.main_param."""
        models = _params(torch.bfloat16)
        optimizer = TritonAdamW(_groups(models), **HYPER)
        mains = [torch.nn.Parameter(model.detach().float()) for model in models]
        for model, main in zip(models, mains):
            model.main_param = main
        optimizer.param_groups[0]["params"] = mains[:2]
        optimizer.param_groups[1]["params"] = mains[2:]
        _set_grads(mains, 0)
        optimizer.step()
        for model, main in zip(models, mains):
            assert torch.equal(model, main.detach().bfloat16())
        owner = SimpleNamespace(float16_groups=[models], fp32_from_float16_groups=[mains])
        assert optimizer.take_model_copy(owner)
        assert not optimizer.take_model_copy(owner)  # each step's writes are taken once

    def test_state_dict_is_torchs(self):
        ours, ref = _params(), _params()
        optimizer = TritonAdamW(_groups(ours), **HYPER)
        _set_grads(ours, 0)
        optimizer.step()
        reference = torch.optim.AdamW(_groups(ref), **HYPER)
        reference.load_state_dict(optimizer.state_dict())
        loaded = TritonAdamW(_groups(_params()), **HYPER)
        loaded.load_state_dict(reference.state_dict())
        assert loaded.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@requires_kernel
def test_float16_optimizer_skips_the_copy_the_step_did():
    models = _params(torch.bfloat16)
    config = OptimizerConfig(lr=1e-2, bf16=True, adam_fusion_impl="triton")
    inner = TritonAdamW(_groups(models), **HYPER)
    optimizer = Float16OptimizerWithFloat16Params(inner, config, None, None)
    mains = [main for group in optimizer.fp32_from_float16_groups for main in group]
    _set_grads(mains, 0)
    inner.step()
    optimizer._copy_main_params_to_model_params()
    assert not inner.take_model_copy(optimizer)  # the copy took the step's writes
    for model, main in zip(models, mains):
        assert torch.equal(model, main.detach().bfloat16())


class TestAdamFusionImpl:
    """adam_fusion_impl in OptimizerConfig and in the optimizer factory (CPU)."""

    @staticmethod
    def _build(**kwargs):
        model = torch.nn.Linear(4, 4)
        config = OptimizerConfig(lr=1e-3, **kwargs)
        optimizer, _ = _get_megatron_optimizer_based_on_param_groups(
            config=config,
            model_chunks=[model],
            param_groups=[{"params": list(model.parameters())}],
            skip_megatron_wrapping=True,
        )
        return optimizer

    def test_torch_is_fused_adamw(self):
        optimizer = self._build(adam_fusion_impl="torch")
        assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]
        optimizer = self._build(adam_fusion_impl="torch", decoupled_weight_decay=False)
        assert type(optimizer) is torch.optim.Adam

    def test_triton_is_the_triton_step(self):
        assert type(self._build(adam_fusion_impl="triton")) is TritonAdamW
        optimizer = self._build(adam_fusion_impl="triton", decoupled_weight_decay=False)
        assert type(optimizer) is TritonAdam
        bf16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
        optimizer = self._build(adam_fusion_impl="triton", **bf16)
        assert optimizer.moments_dtype == torch.bfloat16

    @pytest.mark.parametrize("impl", ["torch", "triton"])
    def test_capturable_learning_rate_is_a_tensor(self, impl):
        optimizer = self._build(adam_fusion_impl=impl, optimizer_cuda_graph=True)
        for group in optimizer.param_groups:
            assert isinstance(group["lr"], torch.Tensor) and group["lr"].item() == pytest.approx(
                1e-3
            )
        for group in self._build(adam_fusion_impl=impl).param_groups:
            assert not isinstance(group["lr"], torch.Tensor)

    def test_unknown_impl_is_refused(self):
        with pytest.raises(ValueError, match="adam_fusion_impl must be"):
            OptimizerConfig(adam_fusion_impl="apex")

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(optimizer="sgd"), "optimizer='adam'"),
            (dict(use_distributed_optimizer=True), "distributed optimizer"),
            (dict(use_precision_aware_optimizer=True), "precision-aware optimizer"),
        ],
    )
    def test_unsupported_combinations_are_refused(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            OptimizerConfig(adam_fusion_impl="triton", **kwargs)

    def test_bf16_moments_only_with_triton(self):
        bf16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
        assert OptimizerConfig(adam_fusion_impl="triton", **bf16).exp_avg_dtype == torch.bfloat16
        with pytest.raises(AssertionError, match="exp_avg_dtype can only be fp32"):
            OptimizerConfig(adam_fusion_impl="torch", **bf16)
        with pytest.raises(AssertionError, match="exp_avg_sq_dtype can only be fp32"):
            OptimizerConfig(adam_fusion_impl="triton", exp_avg_sq_dtype=torch.bfloat16)
