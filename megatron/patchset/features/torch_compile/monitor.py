"""Dynamo's counters and the warm-up monitor of the compiled layers."""

from __future__ import annotations

import time
from collections.abc import Callable


def dynamo_stats() -> dict:
    """Process-wide dynamo counters: graphs, graph breaks (with reasons), frames, compile time.

    ``frames`` - ``frames_ok`` are frames dynamo chose not to compile (a resume function that only
    calls an eager region, a frame with nothing to trace): they run eagerly by design. A frame
    that *fails* to compile raises instead, as long as ``suppress_errors`` (recorded) is off."""
    import torch._dynamo
    from torch._dynamo.utils import compilation_time_metrics, counters

    breaks = dict(counters["graph_break"])
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": {reason: int(n) for reason, n in breaks.items()},
        "frames": int(counters["frames"]["total"]),
        "frames_ok": int(counters["frames"]["ok"]),
        "suppress_errors": bool(torch._dynamo.config.suppress_errors),
        "compile_s": float(sum(compilation_time_metrics.get("_compile.compile_inner", []))),
    }


def _megatron_iteration() -> int | None:
    """Megatron's ``args.curr_iteration`` (set before every train_step), None outside training."""
    try:
        from megatron.training.global_vars import get_args

        return getattr(get_args(), "curr_iteration", None)
    except (AssertionError, ImportError):
        return None


def _rank_and_world() -> tuple[int, int]:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class CompileMonitor:
    """Tracks training iterations (a forward pre-hook on the first model chunk reads megatron's
    current iteration) to time the compile warm-up, switch the compiled layers to strict mode
    after it, and report dynamo's counters."""

    def __init__(
        self, warmup_iters: int, iteration: Callable[[], int | None] = _megatron_iteration
    ):
        self.warmup_iters = warmup_iters
        self.iteration = iteration
        self.strict = False
        self.first: tuple[int, float] | None = None
        self.current: int | None = None
        self.reports: list[dict] = []
        # Taken when the model is built: at exit the process group may be gone already.
        self.rank, self.world = _rank_and_world()

    def pre_forward(self, module, _args) -> None:
        if not module.training:
            return
        iteration = self.iteration()
        if iteration is None or iteration == self.current:
            return
        self.current = iteration
        self.iteration_started(iteration)

    def iteration_started(self, iteration: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = (iteration, now)
            return
        done = iteration - self.first[0]
        seconds = now - self.first[1]
        if done == 1:
            self._say(
                f"compile: first training iteration (compile warm-up) took {seconds:.1f} s, "
                f"dynamo/inductor compile time {dynamo_stats()['compile_s']:.1f} s"
            )
        if done == self.warmup_iters and not self.strict:
            self.report("warmup", iterations=done, seconds=seconds)
            self.strict = True

    def report(self, phase: str, **extra) -> dict:
        stats = dict(dynamo_stats(), phase=phase, **extra)
        if self.reports:
            stats["graphs_since_warmup"] = stats["graphs"] - self.reports[0]["graphs"]
            stats["frames_since_warmup"] = stats["frames"] - self.reports[0]["frames"]
        self.reports.append(stats)
        reasons = "; ".join(
            f"{n}x {' '.join(r.split())[:200]}" for r, n in stats["graph_break_reasons"].items()
        )
        self._say(
            f"compile: {phase}: {stats['graphs']} graphs, {stats['graph_breaks']} graph breaks, "
            f"{stats['frames_ok']} of {stats['frames']} frames compiled (dynamo runs the others "
            f"eagerly: TORCH_LOGS=graph_breaks says why), compile time {stats['compile_s']:.1f} s"
            + (
                f" (after {extra['iterations']} iterations, {extra['seconds']:.1f} s; from now on "
                "a recompile of a compiled layer is an error)"
                if phase == "warmup"
                else ""
            )
            + (
                f"; since warm-up +{stats['graphs_since_warmup']} graphs, "
                f"+{stats['frames_since_warmup']} frames"
                if "graphs_since_warmup" in stats
                else ""
            )
            + (f"; breaks: {reasons}" if reasons else "")
        )
        self._record(stats)
        return stats

    def final_report(self) -> None:
        if self.reports:
            self.report("final")

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(f"> {line}", flush=True)

    def _record(self, stats: dict) -> None:
        """On the last rank, as megatron's metrics lines are (``MEGATRON_PATCHSET_METRICS``)."""
        from megatron.patchset.core.observe import metrics

        recorder = metrics.recorder()
        if recorder is not None and self.rank == self.world - 1:
            recorder.write({"compile": stats})
