"""Worker for the CPU training tests: pretrain_gpt.py's own data, model config, forward_step
and loss_func on a tiny local-spec MoE GPT, in a fresh process (gloo), ``steps`` Adam steps on
one fixed micro-batch. Writes what it saw as JSON to ``out`` (one file per rank)."""

import json
import os
import socket
import sys


def free_port():
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_argv(*extra):
    """The tiny config as it runs on the CPU: local spec, fp32, 128 tokens, two sequences."""
    from megatron.patchset.core import argsfile
    from tests.unit.conftest import tiny_argv
    from tests.unit.support import cpu_shims

    argv = argsfile.remove(argsfile.remove(tiny_argv(), "--moe-grouped-gemm"), "--bf16")
    argv = argsfile.override(argv, "--seq-length", "128")
    argv = argsfile.override(argv, "--max-position-embeddings", "128")
    argv = argsfile.override(argv, "--micro-batch-size", "2")
    return argv + cpu_shims.CPU_FLAGS + list(extra)


def run(rank, world_size, argv, port, out, steps, emulated_rank=None):
    """Train ``steps`` steps as ``rank`` of ``world_size`` gloo processes; with ``emulated_rank``
    this one process is that rank of a ``world_size`` layout under megatron's
    ``--fake-process-group`` (every collective skipped; the fork's stand-ins for the
    expert-parallel exchanges installed through the registry)."""
    if emulated_rank is not None:
        rank = emulated_rank
    os.environ.update(
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import pytest
    import torch

    from tests.unit.support import cpu_shims

    patcher = pytest.MonkeyPatch()
    cpu_shims.install(patcher)
    sys.argv = ["pretrain_gpt.py", *argv]
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    import pretrain_gpt

    torch.manual_seed(1234)
    args = parse_and_validate_args(extra_args_provider=pretrain_gpt.add_patchset_args)
    fake = emulated_rank is not None
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from megatron.patchset.core import registry

        registry.apply(args)
        torch.distributed.init_process_group(
            "fake", store=FakeStore(), rank=rank, world_size=world_size
        )
    else:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=args.expert_model_parallel_size,
        create_gloo_process_groups=not fake,
    )
    model_config = pretrain_gpt.model_config_from_args(args)
    model = GPTModelBuilder(model_config).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([64, 0, 0])
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    record = {"losses": [], "tokens": [], "reports": [], "grad_norms": {}, "expert_tokens": []}
    experts = next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))

    def count_tokens(module, args, kwargs):  # the first MoE layer's tokens per local expert
        counts = args[1] if len(args) > 1 else kwargs["tokens_per_expert"]
        record["expert_tokens"].append([int(c) for c in counts])

    experts.register_forward_pre_hook(count_tokens, with_kwargs=True)
    for _ in range(steps):
        output, loss_fn = pretrain_gpt.forward_step(iter([batch]), model)
        loss, num_tokens, report = loss_fn(output)
        (loss / num_tokens).backward()
        if not record["grad_norms"]:
            for name, param in model.named_parameters():
                if param.grad is not None:
                    record["grad_norms"][name] = param.grad.norm().item()
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append((loss / num_tokens).item())
        record["tokens"].append(int(num_tokens))
        record["reports"].append([float(v) for v in report["lm loss"]])
    record["output_shape"] = list(output.shape)
    record["dataset"] = type(train).__name__
    record["batch_tokens"] = batch["tokens"][0, :16].tolist()
    record["local_experts"] = sum(
        1 for name, _ in model.named_modules() if name.endswith(".experts.local_experts.0")
    )
    record["ep"] = parallel_state.get_expert_model_parallel_world_size()
    with open(f"{out}.rank{rank}.json", "w") as handle:
        json.dump(record, handle)
    torch.distributed.destroy_process_group()
