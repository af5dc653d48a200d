# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import contextlib
from unittest import mock

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import (
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    clip_grads,
    get_megatron_optimizer,
)
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.triton_adam import available
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import (
    local_multi_tensor_applier,
    local_multi_tensor_l2_norm,
    local_multi_tensor_scale,
)
from tests.unit_tests.optimizer.test_triton_adam import (
    DEVICE,
    HYPER,
    _adam,
    _cuda_names_on_cpu,
    _set_main_grads,
)

CLIP_GRAD = 1.0  # below the norm of the grads _set_main_grads writes (about 20)


@pytest.fixture(scope="module")
def one_rank():
    """megatron's parallel state over this process alone (gloo on CPU, NCCL with a GPU), unless
    the test run has set one up."""
    new_group = not torch.distributed.is_initialized()
    if new_group:
        torch.distributed.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            store=torch.distributed.HashStore(),
            rank=0,
            world_size=1,
        )
    new_state = not parallel_state.model_parallel_is_initialized()
    if new_state:
        parallel_state.initialize_model_parallel()
    yield
    if new_state:
        parallel_state.destroy_model_parallel()
    if new_group:
        torch.distributed.destroy_process_group()


def _norm_on_device():
    """The grad norm as a device tensor, as with TransformerEngine or Apex: on CPU, megatron's
    local multi-tensor functions in their place."""
    stack = contextlib.ExitStack()
    if clip_grads.multi_tensor_scale_tensor_impl is None:
        for name, local in (
            ("multi_tensor_applier", local_multi_tensor_applier),
            ("l2_norm_impl", local_multi_tensor_l2_norm),
            ("multi_tensor_scale_impl", local_multi_tensor_scale),
            ("multi_tensor_scale_tensor_impl", local_multi_tensor_scale),
        ):
            stack.enter_context(mock.patch.object(clip_grads, name, local))
    return stack


def _scales_seen(optimizer):
    """The grad_scale each step of the inner torch optimizer reads, as a list."""
    seen = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(getattr(opt, "grad_scale", None))
    )
    return seen


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@pytest.mark.parametrize("through", ["ChainedOptimizer", "MegatronOptimizer"])
def test_the_step_clips_as_clip_grad_by_total_norm(
    one_rank, impl, use_distributed_optimizer, through
):
    """The clip in the step against clip_grad_by_total_norm_fp32 followed by the same step."""
    with _cuda_names_on_cpu(), _norm_on_device():
        model, chained = _adam(impl, use_distributed_optimizer, CLIP_GRAD)
        ref_model, ref_chained = _adam(impl, use_distributed_optimizer, CLIP_GRAD)
        # ChainedOptimizer.step clips each of its optimizers; their own step clips its params
        optimizer, reference = chained, ref_chained
        if through == "MegatronOptimizer":
            optimizer, reference = chained.chained_optimizers[0], ref_chained.chained_optimizers[0]
        inner, ref_inner = chained.chained_optimizers[0], ref_chained.chained_optimizers[0]
        scales, ref_scales = _scales_seen(inner.optimizer), _scales_seen(ref_inner.optimizer)
        for step in range(3):
            _set_main_grads(model, step)
            _set_main_grads(ref_model, step)
            with mock.patch.object(
                MegatronOptimizer, "_clip_grads_in_optimizer_step", return_value=False
            ):
                ref_success, ref_norm, _ = reference.step()
            success, grad_norm, _ = optimizer.step()
            assert success and ref_success
            assert float(grad_norm) == float(ref_norm) > 10 * CLIP_GRAD
            assert scales[-1].shape == () and scales[-1].dtype == torch.float32
            assert scales[-1].item() == pytest.approx((float(grad_norm) + 1e-6) / CLIP_GRAD)
            assert inner.optimizer.grad_scale is None  # dropped after the step
        assert len(scales) == 3 and ref_scales == [None] * 3
        if impl == "triton" and available(DEVICE):
            assert inner.optimizer.aligned is not None  # the kernel ran, and took the scale
        for main, ref_main in zip(inner.get_parameters(), ref_inner.get_parameters(), strict=True):
            torch.testing.assert_close(main, ref_main, rtol=1e-6, atol=1e-6)


def test_the_clip_stays_clip_grad_by_total_norm_elsewhere(one_rank):
    """'auto', decoupled grads, part of the params: no scale; the clip is megatron's pass."""
    with _cuda_names_on_cpu():
        _, chained = _adam("torch", clip_grad=CLIP_GRAD)
        inner = chained.chained_optimizers[0]
        params = inner.get_parameters()
        assert not inner._clip_grads_in_optimizer_step(params[:1], CLIP_GRAD, 4.0, False)
        assert not inner._clip_grads_in_optimizer_step(params, CLIP_GRAD, 4.0, True)
        assert getattr(inner.optimizer, "grad_scale", None) is None
        # a Python float norm (megatron's norm without TransformerEngine or Apex)
        assert inner._clip_grads_in_optimizer_step(params, CLIP_GRAD, 4.0, False)
        scale = inner.optimizer.grad_scale
        assert scale.shape == () and scale.dtype == torch.float32
        assert scale.device == params[0].device and scale.item() == pytest.approx(4.0)
        inner.optimizer.grad_scale = None
        _, auto = _adam("auto", clip_grad=CLIP_GRAD)
        auto_inner = auto.chained_optimizers[0]
        assert not auto_inner._clip_grads_in_optimizer_step(
            auto_inner.get_parameters(), CLIP_GRAD, 4.0, False
        )
        assert getattr(auto_inner.optimizer, "grad_scale", None) is None


def test_a_separate_grad_norm_group_keeps_clip_grad_by_total_norm(one_rank):
    """A param in MTP's grad-norm group: the main params and the group are each clipped by
    clip_grad_by_total_norm_fp32, and the step gets no scale."""
    with _cuda_names_on_cpu(), _norm_on_device():
        torch.manual_seed(0)
        model = torch.nn.Linear(37, 11, dtype=torch.bfloat16, device=DEVICE)
        model.bias.grad_norm_group = "mtp"
        model = DistributedDataParallel(
            TransformerConfig(num_attention_heads=1, num_layers=1),
            DistributedDataParallelConfig(),
            model,
        )
        config = OptimizerConfig(
            lr=HYPER["lr"], bf16=True, adam_fusion_impl="torch", clip_grad=CLIP_GRAD
        )
        inner = get_megatron_optimizer(config, [model]).chained_optimizers[0]
        scales = _scales_seen(inner.optimizer)
        _set_main_grads(model, 0)
        with mock.patch(
            "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
            wraps=clip_grads.clip_grad_by_total_norm_fp32,
        ) as clip:
            assert inner.step()[0]
        assert clip.call_count == 2 and scales == [None]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_scale_holds_for_one_step(impl):
    """A step without a clip after one with it reads no scale."""
    model = torch.nn.Linear(4, 4)
    optimizer, _ = _get_megatron_optimizer_based_on_param_groups(
        config=OptimizerConfig(lr=1e-3, adam_fusion_impl=impl),
        model_chunks=[model],
        param_groups=[{"params": list(model.parameters())}],
        skip_megatron_wrapping=True,
    )
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.grad_scale = torch.tensor(4.0)
    optimizer.step()
    assert optimizer.grad_scale is None
