"""The worker of the compiled-training tests: pretrain_gpt.py's model config and forward step on a
tiny local-spec MoE GPT, trained compiled or eagerly in a fresh process (gloo)."""

import json
import os
import sys

import torch.multiprocessing as mp

from megatron.patchset.core import registry
from megatron.patchset.features.torch_compile import eager_regions, monitor
from tests.unit.support.cpu_train import cpu_argv, free_port


def _cpu_router_gating(monkeypatch):
    """CPU-only: Router.gating moves a CPU weight to ``torch.cuda.current_device()`` with a
    ``.data =`` assignment on every call (dead code on GPUs, where the weight is already there),
    which would be a CPU-only graph break. Same computation without the move."""
    import torch
    from megatron.core.transformer.moe import router

    def gating(self, input):
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype
        )
        return router.router_gating_linear(input, self.weight, self.bias, dtype)

    monkeypatch.setattr(router.Router, "gating", gating)


def worker(rank, world_size, argv, port, out, steps, mode):
    """One process of a CPU run: build with the fork's hooks and patches, train, write JSON."""
    os.environ.update(
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import pytest
    import torch
    from megatron.core.tensor_parallel import random as tp_random

    from tests.unit.support import cpu_shims

    real_fork = tp_random.CudaRNGStatesTracker.fork
    patcher = pytest.MonkeyPatch()
    cpu_shims.install(patcher)
    _cpu_router_gating(patcher)
    if mode == "real-fork":
        # megatron's own RNG-tracker fork instead of cpu_shims' no-op, the CPU generator's state
        # standing in for the CUDA one (dynamo skips torch.get_rng_state and
        # torch.cuda.get_rng_state alike), so that compiled code meets the fork as on a GPU.
        patcher.setattr(tp_random.CudaRNGStatesTracker, "fork", real_fork)
        patcher.setattr(tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        patcher.setattr(
            tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)
        )
    # CPU-only: dynamo evaluates torch.cuda.current_device() at trace time (a constant, as on a
    # GPU); cpu_shims' stand-in must be folded the same way or every call is a graph break.
    from torch._dynamo.variables import torch as dynamo_torch

    dynamo_torch.constant_fold_functions[torch.cuda.current_device] = None
    compiled_calls = []
    if mode == "mock":  # record what would be compiled, compile nothing

        def fake_compile(fn, **kwargs):
            compiled_calls.append({"owner": type(fn.__self__).__name__, "kwargs": kwargs})
            return fn

        patcher.setattr(torch, "compile", fake_compile)
    sys.argv = ["pretrain_gpt.py", *argv]
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import set_args
    from megatron.training.models.gpt import GPTModelBuilder

    import pretrain_gpt

    torch.manual_seed(1234)
    args = parse_and_validate_args(extra_args_provider=pretrain_gpt.add_patchset_args)
    set_args(args)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=args.expert_model_parallel_size
    )
    if mode == "real-fork":
        tracker = tp_random.get_cuda_rng_tracker()
        for offset, name in enumerate(
            (
                tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                tp_random.get_expert_parallel_rng_tracker_name(),
                tp_random.get_data_parallel_rng_tracker_name(),
            )
        ):
            tracker.states_[name] = torch.Generator().manual_seed(4321 + offset).get_state()
    model_config = pretrain_gpt.model_config_from_args(args)
    applied = registry.apply(args)
    # megatron's model builder as pretrain calls it (torch_compile.compile_layers compiles the
    # layers there, before wrapping), without the wrappers
    (model,) = GPTModelBuilder(model_config).build_distributed_models(
        ProcessGroupCollection.use_mpu_process_groups(),
        wrap_with_ddp=False,
        mixed_precision_wrapper=None,
    )
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([64, 0, 0])
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    record = {"applied": applied, "losses": [], "stats": [], "error": None, "router_grads": []}
    record["compiled_forwards"] = sorted(
        name
        for name, m in model.named_modules()
        if getattr(m.__dict__.get("forward"), "__megatron_patchset_compiled__", False)
    )
    record["compiled_calls"] = compiled_calls
    record["eager_regions"] = {
        name: bool(
            getattr(*registry.resolve_owner(registry.get(name).target)).__dict__.get(
                "_torchdynamo_disable", False
            )
        )
        for name in eager_regions.EAGER_REGIONS
    }
    record["dtoh_points"] = sorted(
        {
            m.mlp.token_dispatcher.cuda_dtoh_point
            for m in model.modules()
            if hasattr(getattr(m, "mlp", None), "token_dispatcher")
        }
    )
    seq_change_at = 4 if mode == "strict" else 0  # a shorter sequence after warm-up
    try:
        for step in range(steps):
            args.curr_iteration = step
            tokens = batch
            if seq_change_at and step == seq_change_at:
                tokens = {
                    k: (v[:, :64] if torch.is_tensor(v) and v.dim() == 2 else v)
                    for k, v in batch.items()
                }
                tokens["attention_mask"] = None
            output, loss_fn = pretrain_gpt.forward_step(iter([tokens]), model)
            loss, num_tokens, _ = loss_fn(output)
            # As megatron's schedule does for every micro-batch: the aux-loss gradient scale.
            # A different scale every step: a compiled backward holding a stale one would show.
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(step + 1)) / num_tokens)
            (loss / num_tokens).backward()
            if step == 0:
                record["grad_norms"] = {
                    n: p.grad.norm().item()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
            record["router_grads"].append(
                [p.grad.norm().item() for n, p in model.named_parameters() if "router" in n]
            )
            optimizer.step()
            optimizer.zero_grad()
            record["losses"].append((loss / num_tokens).item())
            record["stats"].append(monitor.dynamo_stats())
    except Exception as exc:  # the strict-mode test expects one
        record["error"] = f"{type(exc).__name__}: {exc}"
    with open(f"{out}.rank{rank}.json", "w") as handle:
        json.dump(record, handle)
    torch.distributed.destroy_process_group()


def train(tmp_path, world_size, *extra, mode="real", steps=6):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = str(tmp_path / mode)
    argv = cpu_argv("--global-batch-size", str(2 * world_size), *extra)
    mp.spawn(
        worker, args=(world_size, argv, free_port(), out, steps, mode), nprocs=world_size, join=True
    )
    return [json.load(open(f"{out}.rank{r}.json")) for r in range(world_size)]


COMPILED = ("--compile-transformer-layers", "--compile-transformer-layers-backend", "aot_eager")
