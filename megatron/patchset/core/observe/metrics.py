"""Exact per-iteration metrics.

``observe.metrics_jsonl`` (observe only): with ``MEGATRON_PATCHSET_METRICS=<path>`` set, every
call of megatron's ``training_log`` also appends one JSON line to ``<path>`` on the last rank,
with the exact values behind megatron's log line (losses and gradient norm at full precision,
not the rounded text), the wall-clock time since the previous iteration, megatron's FLOP count
for the iteration and the GPU memory high-water mark. At the end of training a ``summary``
line records the peak memory over all ranks. Tests compare runs bit for bit from these files and
``tools/bench/bench.py`` computes its table from them. The patch computes nothing that training
uses.

With ``MEGATRON_PATCHSET_TIME_FWD_BWD=1`` the record also carries the forward-backward time
measured around megatron's forward-backward call (:func:`timed_forward_backward`, installed by
the ``observe.train_step`` patch of :mod:`~megatron.patchset.core.observe.profile`),
which also times a full-iteration CUDA graph's replay.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

from megatron.patchset.core.registry import patch

METRICS_ENV = "MEGATRON_PATCHSET_METRICS"


def metrics_path() -> str | None:
    return os.environ.get(METRICS_ENV) or None


def _scalar(value: Any) -> Any:
    """A float for tensors and numbers (exact repr in JSON), None for missing values."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value
    return str(value)


class MetricsRecorder:
    """Appends per-iteration records to a JSON-lines file (only on the last rank)."""

    def __init__(self, path: str):
        self.path = path
        self.last_time: float | None = None
        self._file = None

    def _is_writer(self) -> bool:
        import torch

        if not torch.distributed.is_initialized():
            return True
        if torch.distributed.get_backend() == "fake":  # one process emulates one rank
            return True
        return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1

    def write(self, record: dict) -> None:
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        self._file.write(json.dumps(record) + "\n")

    def iteration(
        self,
        *,
        iteration,
        loss_dict,
        grad_norm,
        learning_rate,
        loss_scale,
        skipped_iter,
        num_zeros,
        fwd_bwd_s: float | None = None,
    ) -> None:
        import torch
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size
        from megatron.training import get_args
        from megatron.training.training import num_floating_point_operations

        now = time.perf_counter()
        elapsed = None if self.last_time is None else now - self.last_time
        self.last_time = now
        if not self._is_writer():
            return
        args = get_args()
        batch = get_current_global_batch_size()
        record = {
            "iteration": int(iteration),
            "time_s": elapsed,
            "losses": {key: _scalar(val) for key, val in (loss_dict or {}).items()},
            "grad_norm": _scalar(grad_norm),
            "learning_rate": _scalar(learning_rate),
            "loss_scale": _scalar(loss_scale),
            "skipped": _scalar(skipped_iter),
            "num_zeros": _scalar(num_zeros),
            "global_batch_size": batch,
            "tokens": batch * args.seq_length,
            "flops": float(num_floating_point_operations(args, batch)),
            "world_size": args.world_size,
        }
        if fwd_bwd_s is not None:
            record["fwd_bwd_s"] = fwd_bwd_s
        if torch.cuda.is_available():
            record["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            record["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        self.write(record)

    def summary(self) -> None:
        """Peak memory over all ranks; one ``summary`` line."""
        import torch

        peak = {"max_allocated_gib": 0.0, "max_reserved_gib": 0.0}
        if torch.cuda.is_available():
            values = torch.tensor(
                [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                dtype=torch.float64,
                device="cuda",
            )
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
            peak = {
                "max_allocated_gib": values[0].item() / 2**30,
                "max_reserved_gib": values[1].item() / 2**30,
            }
        if self._is_writer():
            self.write({"summary": peak})


_RECORDER: MetricsRecorder | None = None


def recorder() -> MetricsRecorder | None:
    """The process's recorder when metrics are requested, else None."""
    global _RECORDER
    path = metrics_path()
    if path is None:
        return None
    if _RECORDER is None or _RECORDER.path != path:
        _RECORDER = MetricsRecorder(path)
    return _RECORDER


FWD_BWD_ENV = "MEGATRON_PATCHSET_TIME_FWD_BWD"
_fwd_bwd = {"seconds": None}


def fwd_bwd_timer_requested() -> bool:
    return os.environ.get(FWD_BWD_ENV, "") not in ("", "0")


def timed_forward_backward(forward_backward_func):
    """``forward_backward_func`` timed from outside, between two device synchronisations (what
    megatron's ``forward-backward`` timer measures, but around the call: a full-iteration CUDA
    graph's replay included, where megatron's own timer cannot run: it synchronises inside the
    captured step). Unlike megatron's timer there is no barrier across ranks; the metrics keep the
    last rank's time. Calls of one iteration add up; :func:`forward_backward_seconds` takes the
    sum."""

    @functools.wraps(forward_backward_func)
    def timed(*args, **kwargs):
        import torch

        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return forward_backward_func(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            _fwd_bwd["seconds"] = (_fwd_bwd["seconds"] or 0.0) + time.perf_counter() - start

    return timed


def forward_backward_seconds() -> float | None:
    """This iteration's forward-backward time (all micro-batches, no optimizer), read before
    ``training_log`` resets megatron's timers. With ``MEGATRON_PATCHSET_TIME_FWD_BWD=1``, the
    fork's outside timer (:func:`timed_forward_backward`); else megatron's ``forward-backward``
    timer, which needs ``--timing-log-level 1`` (below that the timer does not exist) and
    ``--log-interval 1`` (else the timer sums iterations)."""
    from megatron.training import get_args
    from megatron.training.global_vars import get_timers

    if fwd_bwd_timer_requested():
        seconds, _fwd_bwd["seconds"] = _fwd_bwd["seconds"], None
        return seconds
    args = get_args()
    if getattr(args, "timing_log_level", 0) < 1 or getattr(args, "log_interval", 1) != 1:
        return None
    timer = getattr(get_timers(), "_timers", {}).get("forward-backward")
    return None if timer is None else timer.elapsed(reset=False)


@patch(
    "observe.metrics_jsonl",
    "megatron.training.training.training_log",
    reason="exact per-iteration losses, grad norm, time, FLOPs and memory for tests and "
    "tools/bench/bench.py",
    upstream_pr="fork-only (instrumentation)",
    flags=(f"env {METRICS_ENV}",),
    enabled=lambda args: metrics_path() is not None,
    kind="observe",
)
def _wrap_training_log(original):
    @functools.wraps(original)
    def training_log(
        loss_dict,
        total_loss_dict,
        learning_rate,
        iteration,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        num_zeros_in_grad,
        *args,
        **kwargs,
    ):
        fwd_bwd_s = forward_backward_seconds()
        result = original(
            loss_dict,
            total_loss_dict,
            learning_rate,
            iteration,
            loss_scale,
            report_memory_flag,
            skipped_iter,
            grad_norm,
            params_norm,
            num_zeros_in_grad,
            *args,
            **kwargs,
        )
        rec = recorder()
        if rec is not None:
            rec.iteration(
                iteration=iteration,
                loss_dict=loss_dict,
                grad_norm=grad_norm,
                learning_rate=learning_rate,
                loss_scale=loss_scale,
                skipped_iter=skipped_iter,
                num_zeros=num_zeros_in_grad,
                fwd_bwd_s=fwd_bwd_s,
            )
        return result

    return training_log


def write_summary() -> None:
    """Called by the launchers after ``pretrain`` returns (all ranks)."""
    rec = recorder()
    if rec is not None:
        rec.summary()
