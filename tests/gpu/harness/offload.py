"""torchrun harness for megatron.patchset.features.offload: the model and optimizer built by
megatron's ``setup_model_and_optimizer`` (DDP or Megatron-FSDP, per the flags), trained with
megatron's ``train_step`` and pretrain_gpt.py's ``forward_step`` on cached batches, in three modes
that start from identical seeds:

``plain``
    ``--train-iters`` iterations;
``offload``
    half of them, then ``offload(model, optimizer, include_optimizer=True)`` (device memory measured
    before and after with ``torch.cuda.memory_allocated``), ``reload``, then the other half;
``naive``
    half of them, then every parameter moved the naive way (``param.data = param.data.cpu()`` and
    back), then the other half; records how much each parameter changed in the next step;
``save``
    half of them, then offload and reload, then megatron's ``save_checkpoint`` into
    ``OFFLOAD_CHECKPOINT``;
``load``
    megatron's ``load_checkpoint`` from ``OFFLOAD_CHECKPOINT``, offload and reload, then the other
    half (the resumed run of ``save``).

Usage (what tests/gpu/features/offload/test_offload.py runs)::

    OFFLOAD_MODES=plain,offload,naive MEGATRON_PATCHSET_METRICS=out.jsonl \\
    torchrun --nproc-per-node 2 tests/gpu/harness/offload.py <pretrain_gpt.py flags>

Output, in ``MEGATRON_PATCHSET_METRICS`` from the last rank: ``{"mode", "iteration", "losses",
"grad_norm", "skipped"}`` per iteration, and per offloading mode one ``{"mode", "event": ...}``
record with the memory figures (``offload``) or the parameter changes (``naive``).
"""

from __future__ import annotations

import gc
import os
import sys

from megatron.patchset.features import offload
from tests.gpu.harness.common import (  # the repository root is on PYTHONPATH
    cached_batches,
    initialize,
    metrics_writer,
    prepare_training,
    reseed,
    setup_model_and_optimizer,
    train_one_step,
)

DEFAULT_MODES = "plain,offload,naive"


def build(args):
    import pretrain_gpt

    reseed(args)
    return setup_model_and_optimizer(args, pretrain_gpt.model_config_from_args(args))


def _params(model):
    return [p for chunk in model for p in chunk.parameters()]


def offload_and_reload(model, optimizer) -> None:
    offload.offload(model, optimizer, include_optimizer=True)
    offload.reload(model, optimizer)


def run_mode(args, mode: str, batches, write) -> None:
    import torch
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    model, optimizer, scheduler = build(args)
    half = args.train_iters // 2
    start, stop = 0, (half if mode == "save" else args.train_iters)
    if mode == "load":
        args.load = os.environ["OFFLOAD_CHECKPOINT"]
        start, _ = load_checkpoint(model, optimizer, scheduler)
        offload_and_reload(model, optimizer)
        batches = None if batches is None else batches[start * get_num_microbatches() :]
    config, forward_backward_func, data = prepare_training(model, optimizer, batches)

    for iteration in range(start, stop):
        if iteration == half and mode == "offload":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            state = offload.offload(model, optimizer, include_optimizer=True)
            during = torch.cuda.memory_allocated()
            offload.reload(model, optimizer)
            after = torch.cuda.memory_allocated()
            write(
                {
                    "mode": mode,
                    "event": "offload",
                    "allocated_before": before,
                    "allocated_offloaded": during,
                    "allocated_reloaded": after,
                    **state.summary(),
                    "param_bytes": sum(p.numel() * p.element_size() for p in _params(model)),
                }
            )
        if iteration == half and mode == "naive":
            for param in _params(model):
                param.data = param.data.cpu()
            torch.cuda.synchronize()
            for param in _params(model):
                param.data = param.data.cuda()
            snapshot = [p.detach().clone() for p in _params(model)]
        record = train_one_step(
            args, iteration, data, model, optimizer, scheduler, config, forward_backward_func
        )
        write({"mode": mode, **record})
        if iteration == half and mode == "naive":
            changes = [
                float((p.detach() - s).abs().max()) for p, s in zip(_params(model), snapshot)
            ]
            write(
                {
                    "mode": mode,
                    "event": "naive",
                    "params": len(changes),
                    "params_changed": sum(c > 0 for c in changes),
                    "max_change": max(changes),
                }
            )
    if mode == "save":
        offload_and_reload(model, optimizer)
        args.save = os.environ["OFFLOAD_CHECKPOINT"]
        args.consumed_train_samples = stop * args.global_batch_size
        save_checkpoint(stop, model, optimizer, scheduler, 0)
    del model, optimizer, scheduler, config
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    import torch
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import print_rank_0

    modes = [
        m.strip() for m in os.environ.get("OFFLOAD_MODES", DEFAULT_MODES).split(",") if m.strip()
    ]
    unknown = set(modes) - {"plain", "offload", "naive", "save", "load"}
    if unknown:
        raise SystemExit(
            f"OFFLOAD_MODES: unknown mode(s) {sorted(unknown)} (plain, offload, naive, save, load)"
        )
    args = initialize(sys.argv[1:])
    write = metrics_writer()

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
