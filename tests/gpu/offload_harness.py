"""torchrun harness for megatron.patchset.offload: the model and optimizer built by megatron's
``setup_model_and_optimizer`` (DDP or Megatron-FSDP, per the flags), trained with megatron's
``train_step`` and pretrain_gpt.py's ``forward_step`` on cached batches, in three modes that start
from identical seeds:

``plain``
    ``--train-iters`` iterations;
``offload``
    half of them, then ``offload(model, optimizer, include_optimizer=True)`` (device memory measured
    before and after with ``torch.cuda.memory_allocated``), ``reload``, then the other half;
``naive``
    half of them, then every parameter moved the naive way (``param.data = param.data.cpu()`` and
    back), then the other half; records how much each parameter changed in the next step.

Usage (what tests/gpu/test_offload.py runs)::

    OFFLOAD_MODES=plain,offload,naive MEGATRON_PATCHSET_METRICS=out.jsonl \\
    torchrun --nproc-per-node 2 tests/gpu/offload_harness.py <pretrain_gpt.py flags>

Output, in ``MEGATRON_PATCHSET_METRICS`` from the last rank: ``{"mode", "iteration", "losses",
"grad_norm", "skipped"}`` per iteration, and per offloading mode one ``{"mode", "event": ...}``
record with the memory figures (``offload``) or the parameter changes (``naive``).
"""

from __future__ import annotations

import gc
import os
import sys

DEFAULT_MODES = "plain,offload,naive"


def initialize(argv: list[str]):
    """pretrain_gpt.py's start-up up to megatron's initialization."""
    import pretrain_gpt
    from megatron.patchset import arguments as ps_args
    from megatron.patchset import patches
    from megatron.training.arguments import parse_and_validate_args, parse_args
    from megatron.training.initialize import initialize_megatron, set_jit_fusion_options

    sys.argv = [sys.argv[0], *argv]
    ps_args.validate(parse_args(ps_args.add_patchset_args), "layout")
    args = parse_and_validate_args(extra_args_provider=ps_args.add_patchset_args)
    patches.apply(args)
    initialize_megatron(get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
    set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)
    return args


def reseed(args) -> None:
    from megatron.training.initialize import _set_random_seed

    _set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker,
                     args.inference_rng_tracker, use_cudagraphable_rng=args.cuda_graph_impl != "none")


def build(args):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import setup_model_and_optimizer

    reseed(args)
    container = pretrain_cfg_container_from_args(args, pretrain_gpt.model_config_from_args(args))
    return setup_model_and_optimizer(
        ModelType.encoder_or_decoder, cfg_container=container,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def cached_batches(args, count: int):
    import pretrain_gpt
    from megatron.training.training import build_train_valid_test_data_iterators

    args.iteration = getattr(args, "iteration", 0)
    train_iterator, _, _ = build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
    if train_iterator is None:
        return None
    return [next(train_iterator) for _ in range(count)]


def _params(model):
    return [p for chunk in model for p in chunk.parameters()]


def run_mode(args, mode: str, batches, write) -> None:
    import torch
    import pretrain_gpt
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.core.utils import get_model_config
    from megatron.patchset import offload as ol
    from megatron.training import get_timers
    from megatron.training.training import train_step

    model, optimizer, scheduler = build(args)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    for chunk in model:
        chunk.train()
    forward_backward_func = get_forward_backward_func()
    data = RerunDataIterator(iter(batches)) if batches is not None else None
    half = args.train_iters // 2

    for iteration in range(args.train_iters):
        if iteration == half and mode == "offload":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            state = ol.offload(model, optimizer, include_optimizer=True)
            during = torch.cuda.memory_allocated()
            ol.reload(model, optimizer)
            after = torch.cuda.memory_allocated()
            write({"mode": mode, "event": "offload", "allocated_before": before,
                   "allocated_offloaded": during, "allocated_reloaded": after, **state.summary(),
                   "param_bytes": sum(p.numel() * p.element_size() for p in _params(model))})
        if iteration == half and mode == "naive":
            for param in _params(model):
                param.data = param.data.cpu()
            torch.cuda.synchronize()
            for param in _params(model):
                param.data = param.data.cuda()
            snapshot = [p.detach().clone() for p in _params(model)]
        args.curr_iteration = iteration
        result = train_step(pretrain_gpt.forward_step, data, model, optimizer, scheduler, config,
                            forward_backward_func, iteration=iteration)
        loss_dict, skipped, grad_norm = result[0], result[1], result[5]
        clear_aux_losses_tracker()
        write({"mode": mode, "iteration": iteration + 1,
               "losses": {key: float(value) for key, value in loss_dict.items()},
               "grad_norm": None if grad_norm is None else float(grad_norm), "skipped": int(skipped)})
        if iteration == half and mode == "naive":
            changes = [float((p.detach() - s).abs().max()) for p, s in zip(_params(model), snapshot)]
            write({"mode": mode, "event": "naive", "params": len(changes),
                   "params_changed": sum(c > 0 for c in changes), "max_change": max(changes)})
    del model, optimizer, scheduler, config
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    import torch
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.patchset import training as ps_training
    from megatron.training import print_rank_0

    modes = [m.strip() for m in os.environ.get("OFFLOAD_MODES", DEFAULT_MODES).split(",") if m.strip()]
    unknown = set(modes) - {"plain", "offload", "naive"}
    if unknown:
        raise SystemExit(f"OFFLOAD_MODES: unknown mode(s) {sorted(unknown)} (plain, offload, naive)")
    args = initialize(sys.argv[1:])
    recorder = ps_training.recorder()
    is_writer = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1

    def write(record):
        if recorder is not None and is_writer:
            recorder.write(record)

    batches = cached_batches(args, args.train_iters * get_num_microbatches())
    seen: dict = {}
    for mode in modes:
        seen[mode] = seen.get(mode, 0) + 1
        label = mode if seen[mode] == 1 else f"{mode}#{seen[mode]}"
        print_rank_0(f"> offload harness: mode {label}")
        run_mode(args, mode, batches, lambda record, _l=label: write({**record, "mode": _l}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
