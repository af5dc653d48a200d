# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import contextlib
import socket
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

WORLD_SIZE = 2


def _reduced_grads(scale_gradients_in_loss, use_distributed_optimizer, dtype, scale_loss=True):
    """The main grads of a Linear layer in DDP after one backward pass of this rank's own input
    and the reduction; the loss gradient is seeded with the DDP's loss_scaling_factor (as the
    training loop's grad_scale_func does) unless ``scale_loss`` is False."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1),
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=use_distributed_optimizer,
            scale_gradients_in_loss=scale_gradients_in_loss,
        ),
        torch.nn.Linear(37, 11, dtype=dtype, device=device),
    )
    torch.manual_seed(1 + torch.distributed.get_rank())
    loss = model(torch.randn(8, 37, dtype=dtype, device=device)).float().square().sum()
    if scale_loss:
        loss = loss * model.loss_scaling_factor
    loss.backward()
    model.finish_grad_sync()
    factors = {b.gradient_scaling_factor for b in model.buffers for b in b.buckets}
    return model.loss_scaling_factor, factors, [p.main_grad.clone() for p in model.parameters()]


def _on_cpu():
    """Without a GPU: DDP's buffers on the CPU (it makes them on the current CUDA device) and a
    stand-in for the current stream its gradient reduction asks for."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("torch.cuda.current_device", return_value="cpu"))
    stack.enter_context(mock.patch("torch.cuda.current_stream", return_value=mock.Mock()))
    return stack


def _worker(rank, world_size, port):
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    parallel_state.initialize_model_parallel()
    try:
        with _on_cpu():
            _check_against_todays_scaling(world_size)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _check_against_todays_scaling(world_size):
    for use_distributed_optimizer in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            case = (use_distributed_optimizer, dtype)
            factor, factors, today = _reduced_grads(False, *case)
            assert factor == 1.0 and factors == {1.0 / world_size}, (case, factor, factors)
            factor, factors, folded = _reduced_grads(True, *case)
            assert factor == 1.0 / world_size and factors == {1.0}, (case, factor, factors)
            for a, b in zip(folded, today):
                assert torch.equal(a, b), case
            # Without the loss-gradient half the gradients are dp_size times larger.
            _, _, unscaled = _reduced_grads(True, *case, scale_loss=False)
            for a, b in zip(unscaled, today):
                torch.testing.assert_close(a, b * world_size)


def test_scale_gradients_in_loss_gives_the_same_reduced_gradients():
    if torch.cuda.is_available() and torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"needs {WORLD_SIZE} GPUs")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(WORLD_SIZE, port), nprocs=WORLD_SIZE, join=True)


def test_scale_gradients_in_loss_refuses_average_in_collective():
    with pytest.raises(AssertionError, match="average_in_collective"):
        DistributedDataParallelConfig(scale_gradients_in_loss=True, average_in_collective=True)
