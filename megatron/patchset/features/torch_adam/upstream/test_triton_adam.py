# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import contextlib
import os
import socket
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

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

    @pytest.mark.parametrize("impl", ["torch", "triton"])
    def test_a_loaded_learning_rate_goes_back_to_the_params_device(self, impl):
        optimizer = self._build(adam_fusion_impl=impl, optimizer_cuda_graph=True)
        state_dict = optimizer.state_dict()
        # as a checkpoint may bring it: another dtype and shape (or the device it was saved from)
        state_dict["param_groups"][0]["lr"] = torch.tensor([5e-4], dtype=torch.float64)
        optimizer.load_state_dict(state_dict)
        lr = optimizer.param_groups[0]["lr"]
        assert lr.dtype == torch.float32 and lr.dim() == 0 and lr.item() == pytest.approx(5e-4)
        assert lr.device == optimizer.param_groups[0]["params"][0].device

    def test_unknown_impl_is_refused(self):
        with pytest.raises(ValueError, match="adam_fusion_impl must be"):
            OptimizerConfig(adam_fusion_impl="apex")

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(optimizer="sgd"), "optimizer='adam'"),
            (dict(use_precision_aware_optimizer=True), "precision-aware optimizer"),
        ],
    )
    def test_unsupported_combinations_are_refused(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            OptimizerConfig(adam_fusion_impl="triton", **kwargs)

    def test_distributed_optimizer_is_accepted(self):
        config = OptimizerConfig(adam_fusion_impl="triton", use_distributed_optimizer=True)
        assert config.use_distributed_optimizer

    def test_bf16_moments_only_with_triton(self):
        bf16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
        assert OptimizerConfig(adam_fusion_impl="triton", **bf16).exp_avg_dtype == torch.bfloat16
        with pytest.raises(AssertionError, match="exp_avg_dtype can only be fp32"):
            OptimizerConfig(adam_fusion_impl="torch", **bf16)
        with pytest.raises(AssertionError, match="exp_avg_sq_dtype can only be fp32"):
            OptimizerConfig(adam_fusion_impl="triton", exp_avg_sq_dtype=torch.bfloat16)


def _cuda_names_on_cpu():
    """megatron's optimizers tell bf16 from fp32 params by their CUDA type names and make their
    buffers on the current CUDA device; without a GPU, CPU tensors stand in for CUDA ones."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    tensor_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = tensor_type(self, *args, **kwargs)
        return name if args or kwargs else name.replace("torch.", "torch.cuda.", 1)

    def on_cpu(factory):
        def make(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return factory(*args, device=device, **kwargs)

        return make

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(torch.Tensor, "type", cuda_type))
    stack.enter_context(mock.patch("torch.cuda.current_device", return_value="cpu"))
    for name in ("tensor", "zeros", "empty"):
        stack.enter_context(mock.patch(f"torch.{name}", on_cpu(getattr(torch, name))))
    return stack


def _spawn(worker, *args, world_size=2):
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` ranks: gloo on CPU, NCCL with a
    GPU per rank."""
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(world_size, port, *args), nprocs=world_size, join=True)


def _adam(impl, use_distributed_optimizer=False, clip_grad=0.0):
    """A bf16 Linear layer in DDP and megatron's optimizer over it (adam_fusion_impl ``impl``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(37, 11, dtype=torch.bfloat16, device=DEVICE)
    model = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1),
        DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer),
        model,
    )
    config = OptimizerConfig(
        optimizer="adam",
        bf16=True,
        use_distributed_optimizer=use_distributed_optimizer,
        adam_fusion_impl=impl,
        clip_grad=clip_grad,
        lr=HYPER["lr"],
        weight_decay=HYPER["weight_decay"],
        adam_beta1=HYPER["betas"][0],
        adam_beta2=HYPER["betas"][1],
        adam_eps=HYPER["eps"],
    )
    return model, get_megatron_optimizer(config, [model])


def _distributed_adam(impl):
    """``_adam`` with the distributed optimizer, and the DistributedOptimizer inside the
    ChainedOptimizer."""
    model, optimizer = _adam(impl, use_distributed_optimizer=True)
    return model, optimizer, optimizer.chained_optimizers[0]


def _set_main_grads(model, seed):
    """The same grads on every rank, in DDP's grad buffer (as reduced); returns them by name, in
    fp32."""
    generator = torch.Generator().manual_seed(100 + seed)
    grads = {}
    for name, param in model.named_parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=generator))
        grads[name] = param.main_grad.float()
    return grads


def _shards(distributed):
    """(bf16 model shard, fp32 main shard, model param) of every param this rank steps."""
    return [
        (shard, main, model_param)
        for models, shards, mains in zip(
            distributed.model_float16_groups,
            distributed.shard_float16_groups,
            distributed.shard_fp32_from_float16_groups,
        )
        for model_param, shard, main in zip(models, shards, mains)
    ]


def _distributed_optimizer_worker(rank, world_size, port, impls):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(backend, world_size=world_size, rank=rank)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    # The distributed optimizer's checkpoint code as with TransformerEngine installed, where it
    # keeps the step as TE's FusedAdam does.
    te_installed = mock.patch.multiple(
        "megatron.core.optimizer.distrib_optimizer", HAVE_APEX_OR_TE=True, USING_TE_OPTIMIZER=True
    )
    try:
        with _cuda_names_on_cpu(), te_installed:
            for impl in impls:
                _check_distributed_optimizer(impl)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _check_distributed_optimizer(impl, steps=3):
    model, optimizer, distributed = _distributed_adam(impl)
    # torch's AdamW over the full params (without OptimizerParamScheduler, which applies the
    # groups' wd_mult, every group keeps the config's weight_decay)
    full = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    reference = torch.optim.AdamW(full.values(), foreach=False, **HYPER)
    copies_taken = []
    take_model_copy = getattr(distributed.optimizer, "take_model_copy", None)
    if take_model_copy is not None:

        def recorded(owner):
            copies_taken.append(take_model_copy(owner))
            return copies_taken[-1]

        distributed.optimizer.take_model_copy = recorded
    for step in range(steps):
        for name, grad in _set_main_grads(model, step).items():
            full[name].grad = grad
        update_successful, _, _ = optimizer.step()
        assert update_successful
        reference.step()

    # each rank's main shards are torch's AdamW's, its bf16 shards (in DDP's param buffer,
    # all-gathered into the model) their rounding
    names = {param: name for name, param in model.named_parameters()}
    for shard, main, model_param in _shards(distributed):
        param_range = distributed._get_model_param_range_map(model_param)["param"]
        expected = full[names[model_param]].view(-1)[param_range.start : param_range.end]
        torch.testing.assert_close(main, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(shard, main.bfloat16())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.float(), full[name], rtol=1e-2, atol=1e-2)
    if impl == "triton":
        assert distributed.optimizer.aligned is not None  # the kernel ran
        assert copies_taken == [True] * steps  # and wrote the bf16 shards

    # The step goes into the checkpoint's param groups and back into every param's state; the
    # param state is loaded without the per-param step, as the model-space formats keep it.
    state_dict = distributed.state_dict()
    assert [g["step"] for g in state_dict["optimizer"]["param_groups"]] == [steps, steps]
    param_state = distributed.get_parameter_state_dp_reshardable()
    for key, buffer_state in param_state.items():
        if key in ("per_bucket_numel", "per_bucket_numel_unpadded"):
            continue
        for buckets in buffer_state.values():
            for bucket in buckets:
                for tensors in bucket:
                    tensors.pop("step")
                    tensors["padding"] = False
    loaded_model, loaded_optimizer, loaded = _distributed_adam(impl)
    loaded.load_state_dict(state_dict)
    loaded.load_parameter_state_from_dp_reshardable(param_state)
    loaded_model.load_state_dict(model.state_dict())
    for group in loaded.optimizer.param_groups:
        for param in group["params"]:
            step = loaded.optimizer.state[param]["step"]
            assert step.dtype == torch.float32 and step.device == param.device
            assert step.item() == steps
    assert loaded.state_dict() == state_dict

    # and the next step is the same, to the bit
    for each_model, each_optimizer in ((model, optimizer), (loaded_model, loaded_optimizer)):
        _set_main_grads(each_model, steps)
        assert each_optimizer.step()[0]
    for (shard, main, _), (loaded_shard, loaded_main, _) in zip(
        _shards(distributed), _shards(loaded), strict=True
    ):
        assert torch.equal(loaded_main, main) and torch.equal(loaded_shard, shard)
        state, loaded_state = distributed.optimizer.state[main], loaded.optimizer.state[loaded_main]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded_state[key], state[key]), key


def test_distributed_optimizer_steps_as_adamw_and_keeps_its_step():
    """Two data-parallel ranks: the distributed optimizer with 'torch' and 'triton' steps as
    torch's AdamW over the full params, the Triton step writes the bf16 shards, and the step
    goes through state_dict and load_state_dict."""
    impls = ["torch"] + (["triton"] if available(DEVICE) else [])
    _spawn(_distributed_optimizer_worker, impls)
