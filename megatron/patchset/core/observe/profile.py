"""One profiled training iteration: where the host time of a step goes
(``tools/bench/profile_step.py``).

``observe.train_step`` (observe only): with ``MEGATRON_PATCHSET_PROFILE=<dir>:<N>`` set,
megatron's ``train_step`` runs iteration ``N`` (1-based, as in megatron's log lines) under
``torch.profiler`` (CPU activity, plus CUDA when a GPU is visible; no shapes, no stacks). During
that one call, megatron's MoE and attention methods, the pipeline's P2P calls, the optimizer step
and the gradient reduction run inside ``record_function`` labels named
``ps:<category>[/<detail>]:<layer>`` (:mod:`~megatron.patchset.core.observe.labels`). The labels
are installed at the run's first training iteration, before ``torch.compile`` traces anything,
and stay to the end of the run; outside the profiled iteration they call the original without a
label. They are not registered patches (README, "How the overlay works"). Rank 0 writes
``<dir>/trace.json`` (a chrome trace, open it in Perfetto) and ``<dir>/summary.json``, its
reduction (:mod:`~megatron.patchset.core.observe.trace_summary`); every other rank ``r`` the same
files under ``<dir>/rank<r>/``.

With ``MEGATRON_PATCHSET_TIME_FWD_BWD=1`` the same patch times megatron's forward-backward call
from outside (:func:`~megatron.patchset.core.observe.metrics.timed_forward_backward`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.observe import metrics
from megatron.patchset.core.observe.labels import RECORDING, STEP_LABEL, Labels
from megatron.patchset.core.observe.trace_summary import summarize_trace
from megatron.patchset.core.registry import patch

PROFILE_ENV = "MEGATRON_PATCHSET_PROFILE"


def profile_request() -> tuple[str, int] | None:
    """(output folder, 1-based iteration) from ``MEGATRON_PATCHSET_PROFILE``, or None."""
    value = os.environ.get(PROFILE_ENV)
    if not value:
        return None
    folder, sep, number = value.rpartition(":")
    if not sep or not folder or not number.isdigit() or int(number) < 1:
        raise ValueError(f"{PROFILE_ENV}={value!r}: expected <dir>:<iteration>, iteration >= 1")
    return folder, int(number)


def _rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _meta(iteration: int) -> dict:
    import torch

    meta: dict = {
        "iteration": iteration,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name(0)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        meta["world_size"] = torch.distributed.get_world_size()
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            meta["pp_rank"] = ps.get_pipeline_model_parallel_rank()
            meta["pp_group_ranks"] = torch.distributed.get_process_group_ranks(
                ps.get_pipeline_model_parallel_group()
            )
    except Exception:  # no megatron parallel state (tests, CPU)
        pass
    try:
        from megatron.training import get_args

        args = get_args()
        for key in (
            "micro_batch_size",
            "global_batch_size",
            "seq_length",
            "num_layers",
            "hidden_size",
            "num_experts",
            "moe_router_topk",
            "moe_token_dispatcher_type",
            "expert_model_parallel_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
        ):
            meta[key] = getattr(args, key, None)
    except Exception:  # megatron's globals are not set (tests)
        pass
    return meta


_INSTALLED: list = []  # the run's Labels, installed at its first training iteration


def install_labels(optimizer=None, config=None) -> None:
    """Install the labels for the rest of the run (idempotent); they record in profile_call."""
    if not _INSTALLED:
        _INSTALLED.append(Labels(optimizer=optimizer, config=config))


def remove_labels() -> None:
    """Put the originals back (tests; a training run keeps the labels to its end)."""
    while _INSTALLED:
        _INSTALLED.pop().remove()


def profile_call(
    step: Callable, folder: str, iteration: int, *, optimizer=None, config=None
) -> Any:
    """Run ``step()`` once under the profiler with the labels; rank 0 writes the trace and
    summary."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    labels = None if _INSTALLED else Labels(optimizer=optimizer, config=config)
    RECORDING[0] = True
    try:
        with profile(
            activities=activities, record_shapes=False, with_stack=False, profile_memory=False
        ) as prof:
            with record_function(STEP_LABEL):
                result = step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        RECORDING[0] = False
        if labels is not None:
            labels.remove()
    rank = _rank()
    out = rank_folder(folder, rank)
    os.makedirs(out, exist_ok=True)
    trace = os.path.join(out, "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as handle:
        events = json.load(handle).get("traceEvents", [])
    summary = summarize_trace(events, meta={**_meta(iteration), "rank": rank, "trace": trace})
    with open(os.path.join(out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    return result


def rank_folder(folder: str, rank: int) -> str:
    """Where a rank writes its trace and summary: ``<dir>`` for rank 0, ``<dir>/rank<r>`` else."""
    return folder if rank == 0 else os.path.join(folder, f"rank{rank}")


@patch(
    "observe.train_step",
    "megatron.training.training.train_step",
    reason="profile one training iteration (host time by MoE stage, launches, syncs, GPU idle) "
    "for tools/bench/profile_step.py; time forward-backward from outside for tools/bench/bench.py",
    upstream_pr="fork-only (instrumentation)",
    flags=(f"env {PROFILE_ENV}", f"env {metrics.FWD_BWD_ENV}"),
    enabled=lambda args: profile_request() is not None or metrics.fwd_bwd_timer_requested(),
    kind="observe",
)
def _wrap_train_step(original):
    calls = [0]

    @functools.wraps(original)
    def train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        opt_param_scheduler,
        config,
        forward_backward_func,
        *args,
        **kwargs,
    ):
        calls[0] += 1
        if metrics.fwd_bwd_timer_requested():
            forward_backward_func = metrics.timed_forward_backward(forward_backward_func)
        request = profile_request()
        iteration = kwargs.get("iteration", args[0] if args else None)
        number = calls[0] if iteration is None else int(iteration) + 1
        call = functools.partial(
            original,
            forward_step_func,
            data_iterator,
            model,
            optimizer,
            opt_param_scheduler,
            config,
            forward_backward_func,
            *args,
            **kwargs,
        )
        if request is not None:
            install_labels(optimizer=optimizer, config=config)
        if request is None or number != request[1]:
            return call()
        return profile_call(call, request[0], number, optimizer=optimizer, config=config)

    return train_step
