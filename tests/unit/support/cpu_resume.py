"""Worker for the CPU resume test: pretrain_gpt.py's model, data provider, forward step and loss
on a tiny local-spec MoE GPT, trained with Adam on megatron's pretraining sampler (gradients
averaged over the data-parallel ranks); the model is
saved and loaded with megatron's distributed checkpointing (the torch_dist format of --save), the
optimizer, the RNG and the consumed samples alongside it, as megatron's checkpoint does.

Modes: ``full`` trains ``last`` iterations; ``save`` trains ``first`` iterations and saves;
``resume`` loads that checkpoint and trains on to ``last``. Each writes the loss and the gradient
norm of every iteration it ran to ``<out>.rank<r>.json``.
"""

import json
import os
import sys


def average_gradients(model, parallel_state):
    """Data-parallel gradient averaging as megatron's DDP does it: dense parameters over the
    data-parallel group, expert parameters (``allreduce`` False) over the expert data-parallel
    group."""
    import torch

    for param in model.parameters():
        if param.grad is None:
            continue
        expert = not getattr(param, "allreduce", True)
        group = (
            parallel_state.get_expert_data_parallel_group()
            if expert
            else parallel_state.get_data_parallel_group()
        )
        torch.distributed.all_reduce(param.grad, group=group)
        param.grad /= torch.distributed.get_world_size(group)


def run(rank, world_size, argv, port, out, mode, first, last, checkpoint):
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

    cpu_shims.install(pytest.MonkeyPatch())
    sys.argv = ["pretrain_gpt.py", *argv]
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.models.gpt import GPTModelBuilder

    import pretrain_gpt

    # One intra-op thread per rank: with several, a BLAS library that adapts its thread count to
    # the machine's load may sum in another order in one run than in the other, and the runs must
    # agree to the bit.
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    args = parse_and_validate_args(extra_args_provider=pretrain_gpt.add_patchset_args)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=args.expert_model_parallel_size
    )
    model = GPTModelBuilder(pretrain_gpt.model_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([64, 0, 0])
    start, consumed, extra = 0, 0, None
    state_file = os.path.join(checkpoint, f"extra.rank{rank}.pt")
    if mode == "resume":
        loaded = dist_checkpointing.load(model.sharded_state_dict(), checkpoint)
        model.load_state_dict(loaded)
        extra = torch.load(state_file, weights_only=False)
        optimizer.load_state_dict(extra["optimizer"])
        start, consumed = extra["iteration"], extra["consumed_samples"]
    stop = first if mode == "save" else last
    loader = iter(build_pretraining_data_loader(train, consumed))
    if extra is not None:
        # After the loader's iterator, which draws its base seed from the default generator: on
        # the CPU that generator is also dropout's (on a GPU, dropout draws from CUDA's).
        torch.set_rng_state(extra["rng"])
    record = {"iterations": [], "losses": [], "grad_norms": []}
    for iteration in range(start + 1, stop + 1):
        output, loss_fn = pretrain_gpt.forward_step(loader, model)
        loss, num_tokens, _ = loss_fn(output)
        (loss / num_tokens).backward()
        average_gradients(model, parallel_state)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        record["grad_norms"].append(
            float(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            )
        )
        optimizer.step()
        optimizer.zero_grad()
        record["iterations"].append(iteration)
        record["losses"].append(float(loss / num_tokens))
        consumed += args.global_batch_size
    if mode == "save":
        os.makedirs(checkpoint, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), checkpoint)
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "iteration": stop,
                "consumed_samples": consumed,
            },
            state_file,
        )
    with open(f"{out}.rank{rank}.json", "w") as handle:
        json.dump(record, handle)
    torch.distributed.destroy_process_group()
