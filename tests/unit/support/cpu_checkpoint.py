"""Worker for the checkpoint tests: megatron's own ``save_checkpoint`` and ``load_checkpoint``
(torch_dist format, the layout of ``--save``: ``latest_checkpointed_iteration.txt`` and
``iter_*`` folders) on pretrain_gpt.py's tiny local-spec MoE GPT, in a fresh process (gloo).

Modes: ``save`` writes a checkpoint at each of ``iterations``, the weights changed between them;
``load`` runs the launch's checkpoint check (the one ``pretrain_gpt.py`` runs) and then megatron's
loader. Both write the sum of the model's weights (per saved iteration, or after the load) and
the iteration loaded to ``<out>.json``.
"""

import json
import os
import sys

# Smaller than the CPU training tests' model: the checkpoint tests copy it once per test.
SMALL = {
    "--hidden-size": "64",
    "--ffn-hidden-size": "128",
    "--moe-ffn-hidden-size": "64",
    "--num-attention-heads": "4",
    "--vocab-size": "512",
}


def checkpoint_argv(folder, *extra):
    """The CPU config with megatron's checkpoint flags (model weights only: the CPU has no CUDA
    RNG state, and the test's optimizer is not megatron's)."""
    from megatron.patchset.core import argsfile
    from tests.unit.support import cpu_train

    argv = cpu_train.cpu_argv("--global-batch-size", "2")
    for flag, value in SMALL.items():
        argv = argsfile.override(argv, flag, value)
    return argv + [
        "--load",
        str(folder),
        "--save",
        str(folder),
        "--save-interval",
        "10",
        "--no-save-optim",
        "--no-save-rng",
        "--no-load-optim",
        "--no-load-rng",
        *extra,
    ]


def _cpu_stand_ins(patcher, torch):
    """megatron's checkpoint code reads the CUDA RNG state and all-reduces the tracker's iteration
    in a CUDA tensor: answer both on the CPU."""
    patcher.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    real_tensor = torch.tensor

    def tensor(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = None
        return real_tensor(*args, device=device, **kwargs)

    patcher.setattr(torch, "tensor", tensor)


def _die_while_saving(patcher) -> None:
    """The process ends (as under SIGKILL: no cleanup, status 137) when torch's checkpoint writer
    finishes, after the shards are written and before the ``.metadata`` and megatron's tracker."""
    from torch.distributed.checkpoint import filesystem

    def killed(*_args, **_kwargs):
        os._exit(137)

    patcher.setattr(filesystem.FileSystemWriter, "finish", killed)


def weight_sum(model) -> float:
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def run(rank, world_size, argv, port, out, mode, iterations):
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
    _cpu_stand_ins(patcher, torch)
    sys.argv = ["pretrain_gpt.py", *argv]
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_and_validate_args, parse_args
    from megatron.training.models.gpt import GPTModelBuilder

    import pretrain_gpt
    from megatron.patchset.core import checkpoint_check, registry

    registry.apply(None)  # what pretrain_gpt.py applies before it parses the flags
    record = {}
    if mode == "load":
        record["check"] = checkpoint_check.check(parse_args(pretrain_gpt.add_patchset_args))
    torch.manual_seed(4321 if mode == "load" else 1234)  # a load must overwrite the weights
    args = parse_and_validate_args(extra_args_provider=pretrain_gpt.add_patchset_args)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=args.expert_model_parallel_size
    )
    model = GPTModelBuilder(pretrain_gpt.model_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    if mode in ("save", "killed"):
        record["sums"] = {}
        for at, iteration in enumerate(iterations):
            if mode == "killed" and at == len(iterations) - 1:
                _die_while_saving(patcher)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 0.01)
            checkpointing.save_checkpoint(iteration, [model], None, None, 0)
            record["sums"][str(iteration)] = weight_sum(model)
    else:
        record["before"] = weight_sum(model)
        record["iteration"], _ = checkpointing.load_checkpoint([model], None, None)
        record["sum"] = weight_sum(model)
    with open(f"{out}.json", "w") as handle:
        json.dump(record, handle)
    torch.distributed.destroy_process_group()
