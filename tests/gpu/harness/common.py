"""What the torchrun harnesses of the GPU tests share: pretrain_gpt.py's start-up, reseeding,
cached batches, and the set-up megatron's ``train()`` does before its loop.

The harnesses import it as ``tests.gpu.harness.common`` (the repository root is on PYTHONPATH
when tests/gpu/conftest.py launches them).
"""

from __future__ import annotations

import sys

from megatron.patchset.core import flags, registry, rules
from megatron.patchset.core.observe import metrics


def initialize(argv: list[str]):
    """pretrain_gpt.py's start-up up to megatron's initialization: the fork's layout rules,
    megatron's argument validation, the patches the flags ask for."""
    from megatron.training.arguments import parse_and_validate_args, parse_args
    from megatron.training.initialize import initialize_megatron, set_jit_fusion_options

    import pretrain_gpt

    sys.argv = [sys.argv[0], *argv]
    rules.validate(parse_args(flags.add_patchset_args), "layout")
    args = parse_and_validate_args(extra_args_provider=flags.add_patchset_args)
    registry.apply(args)
    initialize_megatron(get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
    set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)
    return args


def reseed(args) -> None:
    """The seeding initialize_megatron did (python, numpy, torch and megatron's CUDA RNG
    tracker)."""
    from megatron.training.initialize import _set_random_seed

    graphable = args.cuda_graph_impl != "none"
    _set_random_seed(
        args.seed,
        args.data_parallel_random_init,
        args.te_rng_tracker,
        args.inference_rng_tracker,
        use_cudagraphable_rng=graphable,
    )


def setup_model_and_optimizer(args, model_config):
    """Model chunks, optimizer and scheduler through megatron's own builder."""
    from megatron.core.enums import ModelType
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import setup_model_and_optimizer as megatron_setup

    container = pretrain_cfg_container_from_args(args, model_config)
    return megatron_setup(
        ModelType.encoder_or_decoder,
        cfg_container=container,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def cached_batches(args, count: int):
    """``count`` micro-batches from megatron's data iterators, read once for every mode."""
    from megatron.training.training import build_train_valid_test_data_iterators

    import pretrain_gpt

    args.iteration = getattr(args, "iteration", 0)  # normally set by setup_model_and_optimizer
    train_iterator, _, _ = build_train_valid_test_data_iterators(
        pretrain_gpt.train_valid_test_datasets_provider
    )
    if train_iterator is None:  # ranks that read no data (tensor-parallel ranks > 0)
        return None
    return [next(train_iterator) for _ in range(count)]


def prepare_training(model, optimizer, batches):
    """What megatron's train() sets up before its loop; returns ``(config,
    forward_backward_func, data_iterator)``."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import get_timers

    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    for chunk in model:
        chunk.train()
    if batches is None:
        data = None
    elif len(model) > 1:
        # Interleaved pipeline: one iterator per model chunk, as megatron's pretrain() builds
        # them (each chunk that reads data -- the first and the last stage -- reads every batch).
        data = [RerunDataIterator(iter(batches)) for _ in model]
    else:
        data = RerunDataIterator(iter(batches))
    return config, get_forward_backward_func(), data


def train_one_step(
    args, iteration, data, model, optimizer, scheduler, config, forward_backward_func
) -> dict:
    """One megatron ``train_step`` with pretrain_gpt.py's ``forward_step``; returns the
    iteration's record (``iteration`` counted from 1, ``losses``, ``grad_norm``, ``skipped``)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.training.training import train_step

    import pretrain_gpt

    args.curr_iteration = iteration
    result = train_step(
        pretrain_gpt.forward_step,
        data,
        model,
        optimizer,
        scheduler,
        config,
        forward_backward_func,
        iteration=iteration,
    )
    loss_dict, skipped, grad_norm = result[0], result[1], result[5]
    clear_aux_losses_tracker()
    return {
        "iteration": iteration + 1,
        "losses": {key: float(value) for key, value in loss_dict.items()},
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "skipped": int(skipped),
    }


def metrics_writer():
    """``write(record)``: appends to ``MEGATRON_PATCHSET_METRICS`` from the last rank only."""
    import torch

    recorder = metrics.recorder()
    is_writer = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1

    def write(record):
        if recorder is not None and is_writer:
            recorder.write(record)

    return write
