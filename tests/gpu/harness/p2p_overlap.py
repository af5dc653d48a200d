"""torchrun harness: megatron's fine-grained 1F1B schedule with upstream's model and with the
fork's ``P2POverlapGPTModel``, in one process, on identical seeds and batches.

Usage (what tests/gpu/features/p2p_overlap/test_p2p_overlap.py runs)::

    P2P_OVERLAP_MODES=upstream,upstream,fork:1,fork:2,fork:all:tl:comm \\
    MEGATRON_PATCHSET_METRICS=out.jsonl \\
    torchrun --nproc-per-node 2 tests/gpu/harness/p2p_overlap.py <megatron flags>

The flags are a pretrain_gpt.py command line that enables ``--overlap-moe-expert-parallel-comm``
(and normally ``--delay-wgrad-compute``). megatron is initialized once; then, for each mode in
``P2P_OVERLAP_MODES``, the model and optimizer are built afresh through megatron's
``setup_model_and_optimizer`` (reseeded identically) and trained with megatron's
``train_step`` and pretrain_gpt.py's ``forward_step`` on the same cached batches. Modes:

``upstream``
    megatron-core's GPTModel and its ``TransformerModelChunkSchedulePlan``;
``fork:N[:tl][:comm]``
    the fork's patch installed while the model is built (so megatron's builder instantiates
    ``P2POverlapGPTModel``), with ``overlap_p2p_wgrad_delayed_layer_number`` N (``all``: the
    layers of the largest model chunk), ``tl`` = ``overlap_p2p_with_transformer_layer_wgrad``,
    ``comm`` = ``overlap_p2p_backward_on_comm_stream``.

The options are set on the model's TransformerConfig directly: the command-line rules ask for
an interleaved pipeline, which a run without pipeline parallelism does not have (there the
schedule passes no P2P callbacks; N then only moves when the deferred weight-gradient GEMMs are
enqueued, which must not change any number).

Output: one JSON line per mode and iteration on the last rank, in ``MEGATRON_PATCHSET_METRICS``:
``{"mode", "iteration", "losses": {"lm loss"}, "grad_norm", "skipped", "model_class",
"plan_runs", "options"}``; a repeated mode is labelled ``mode#2``, ``mode#3``...
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys

from megatron.patchset.core import registry
from megatron.patchset.features.p2p_overlap import flags as p2p_flags
from megatron.patchset.features.p2p_overlap import schedule_plan
from tests.gpu.harness.common import (  # the repository root is on PYTHONPATH
    cached_batches,
    initialize,
    metrics_writer,
    prepare_training,
    reseed,
    setup_model_and_optimizer,
    train_one_step,
)

DEFAULT_MODES = "upstream,fork:1,fork:2,fork:all:tl"


@dataclasses.dataclass(frozen=True)
class Mode:
    label: str
    fork: bool
    delayed_layers: str | None = None  # "1", "2", ..., or "all"
    transformer_layer_wgrad: bool = False
    backward_on_comm_stream: bool = False


def parse_modes(text: str) -> list[Mode]:
    modes, seen = [], {}
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        seen[raw] = seen.get(raw, 0) + 1
        label = raw if seen[raw] == 1 else f"{raw}#{seen[raw]}"
        if raw == "upstream":
            modes.append(Mode(label, fork=False))
            continue
        kind, *fields = raw.split(":")
        if kind != "fork" or not fields or not (fields[0] == "all" or fields[0].isdigit()):
            raise SystemExit(
                f"P2P_OVERLAP_MODES: cannot read mode {raw!r} (upstream or fork:N[:tl][:comm])"
            )
        unknown = set(fields[1:]) - {"tl", "comm"}
        if unknown:
            raise SystemExit(f"P2P_OVERLAP_MODES: unknown option(s) {sorted(unknown)} in {raw!r}")
        modes.append(Mode(label, True, fields[0], "tl" in fields[1:], "comm" in fields[1:]))
    return modes


@contextlib.contextmanager
def counting_runs(plan_class, counter: dict):
    """Count calls of ``plan_class.run`` (the chunk plan the schedule dispatches to)."""
    original = plan_class.__dict__["run"]
    inner = original.__func__

    def run(*args, **kwargs):
        counter[plan_class.__name__] = counter.get(plan_class.__name__, 0) + 1
        return inner(*args, **kwargs)

    plan_class.run = staticmethod(run)
    try:
        yield
    finally:
        plan_class.run = original


def build(args, mode: Mode):
    """Model chunks, optimizer and scheduler for ``mode``, through megatron's builder."""
    import pretrain_gpt

    reseed(args)
    model_config = pretrain_gpt.model_config_from_args(args)
    options = {}
    if mode.fork:
        transformer = model_config.transformer
        number = mode.delayed_layers
        options = dict(
            overlap_p2p_backward_on_comm_stream=mode.backward_on_comm_stream,
            overlap_p2p_wgrad_delayed_layer_number=(
                max(p2p_flags.chunk_layer_counts(transformer)) if number == "all" else int(number)
            ),
            overlap_p2p_with_transformer_layer_wgrad=mode.transformer_layer_wgrad,
        )
        p2p_flags.set_p2p_overlap_options(transformer, **options)
    applied = registry.apply_patches([registry.get(schedule_plan.PATCH_NAME)]) if mode.fork else []
    try:
        model, optimizer, scheduler = setup_model_and_optimizer(args, model_config)
    finally:
        registry.revert(applied)
    return model, optimizer, scheduler, options


def train(args, mode: Mode, batches, iterations: int, write) -> None:
    import torch
    from megatron.core.models.common.model_chunk_schedule_plan import (
        TransformerModelChunkSchedulePlan,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.utils import unwrap_model

    model, optimizer, scheduler, options = build(args, mode)
    model_class = type(unwrap_model(model[0]))
    expected = schedule_plan.P2POverlapGPTModel if mode.fork else GPTModel
    if model_class is not expected:
        raise RuntimeError(
            f"mode {mode.label}: megatron built {model_class.__name__}, expected "
            f"{expected.__name__}"
        )

    config, forward_backward_func, data = prepare_training(model, optimizer, batches)

    plan_class = (
        schedule_plan.P2POverlapChunkSchedulePlan
        if mode.fork
        else TransformerModelChunkSchedulePlan
    )
    runs: dict = {}
    with counting_runs(plan_class, runs):
        for iteration in range(iterations):
            record = train_one_step(
                args, iteration, data, model, optimizer, scheduler, config, forward_backward_func
            )
            write(
                {
                    "mode": mode.label,
                    **record,
                    "model_class": model_class.__name__,
                    "plan_runs": dict(runs),
                    "options": options,
                }
            )
    del model, optimizer, scheduler, config
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    import torch
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import print_rank_0

    modes = parse_modes(os.environ.get("P2P_OVERLAP_MODES", DEFAULT_MODES))
    args = initialize(sys.argv[1:])  # compat and observe patches only: the model patch is per mode
    write = metrics_writer()

    # Read before any model is built, so that every mode starts from the same random state.
    batches = cached_batches(args, args.train_iters * get_num_microbatches())
    for mode in modes:
        print_rank_0(f"> p2p-overlap harness: mode {mode.label}")
        train(args, mode, batches, args.train_iters, write)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
