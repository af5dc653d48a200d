"""Observe patches: what the stash allocated, and one clear line per overflow and re-run."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.registry import patch
from megatron.patchset.features.paged_stash.flags import requested

logger = logging.getLogger(__name__)

# Lines printed by the observe patches (tests and tools grep for these prefixes).
LOG_PREFIX = "megatron-patchset: paged stash"

# The overflow flags of the attempt just run, kept on the runner for its own check_moe_overflow.
FLAGS_ATTR = "_megatron_patchset_overflow_flags"


def _rank0() -> bool:
    try:
        import torch

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0
    except Exception:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0")) == 0


def _iteration() -> int | None:
    try:
        from megatron.training import get_args

        return getattr(get_args(), "curr_iteration", None)
    except Exception:
        return None


def say(message: str) -> None:
    """Print one fork line on rank 0 (independent of megatron's logging level)."""
    if _rank0():
        print(f"{LOG_PREFIX}: {message}", flush=True)


def describe_buffers(stash_buffers: dict | None) -> list[str]:
    """One line per stash buffer: dtype, width, pages and bytes on the GPU and the host."""
    lines = []
    for dtype, by_width in (stash_buffers or {}).items():
        for width, buf in by_width.items():
            cuda = getattr(buf, "cuda_buffer", None)
            host = getattr(buf, "host_buffer", None)
            cuda_bytes = cuda.numel() * cuda.element_size() if cuda is not None else 0
            host_bytes = host.numel() * host.element_size() if host is not None else 0
            tokens = cuda.shape[0] if cuda is not None else 0
            lines.append(
                f"{str(dtype).replace('torch.', '')} width {width}: {tokens} token rows, "
                f"{cuda_bytes / 2**20:.1f} MiB GPU"
                + (f", {host_bytes / 2**20:.1f} MiB pinned host" if host_bytes else "")
            )
    return lines


@patch(
    "paged_stash.report_buffers",
    "megatron.core.transformer.moe.paged_stash.PagedStashManager.allocate_stash_buffers",
    reason="say what paged stashing allocated, and say clearly when the capture step marked "
    "nothing (megatron only logs 'max_tokens_dict is None' at INFO)",
    upstream_pr="fork-only (instrumentation)",
    flags=("--moe-paged-stash",),
    enabled=requested,
    kind="observe",
)
def _wrap_allocate(original):
    @functools.wraps(original)
    def allocate_stash_buffers(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        lines = describe_buffers(getattr(self, "stash_buffers", None))
        if lines:
            say("allocated stash buffers (" + "; ".join(lines) + ")")
        else:
            say(
                "WARNING: no MoE activation was marked for stashing in the capture step, so "
                "nothing is paged and activations are saved at full size. The expert MLP must run "
                "TE's op fuser (--use-transformer-engine-op-fuser) with megatron-patchset's TE "
                "patches applied."
            )
        return result

    return allocate_stash_buffers


class OverflowReport:
    """Turns megatron's per-step overflow flags into one line per event."""

    def __init__(self, emit: Callable[[str], None] = say):
        self.emit = emit
        self.rerun_pending = False
        self.reruns = 0
        self.spills = 0

    def __call__(
        self, stash_overflow: int, over_budget: int, host_spill: int, config: Any = None
    ) -> None:
        where = _iteration()
        step = f"iteration {where + 1}" if isinstance(where, int) else "this step"
        if stash_overflow or over_budget:
            causes = []
            if stash_overflow:
                causes.append(f"stash buffer full on {stash_overflow} rank(s)")
            if over_budget:
                causes.append(
                    f"HybridEP receive budget exceeded (tokens dropped) on {over_budget} rank(s)"
                )
            keeps_budget = getattr(config, "moe_flex_dispatcher_backend", None) == "ncclep"
            hints = []
            if stash_overflow:
                hints.append(
                    "--moe-paged-stash-buffer-size-factor-cuda (now "
                    f"{getattr(config, 'moe_paged_stash_buffer_size_factor_cuda', '?')}) or "
                    "--moe-paged-stash-buffer-size-factor-cpu (now "
                    f"{getattr(config, 'moe_paged_stash_buffer_size_factor_cpu', '?')})"
                )
            if over_budget:
                hints.append(
                    "--moe-expert-rank-capacity-factor (now "
                    f"{getattr(config, 'moe_expert_rank_capacity_factor', '?')})"
                )
            self.reruns += 1
            self.rerun_pending = True
            how = (
                "with the same NCCL EP receive budget (NCCL EP cannot drop tokens) and without "
                "paged stashing"
                if keeps_budget
                else "without the receive budget and without paged stashing"
            )
            self.emit(
                f"OVERFLOW in {step} ({'; '.join(causes)}): megatron re-runs the step on the same "
                f"data {how} (gradients zeroed first). Re-runs cost a step each; raise "
                f"{' and '.join(hints)} to avoid them."
            )
            return
        if self.rerun_pending:
            self.rerun_pending = False
            self.emit(
                f"re-run of {step} finished without overflow ({self.reruns} re-run(s) so far); "
                "training continues"
            )
        if host_spill:
            self.spills += 1
            self.emit(
                f"{step} spilled activations to pinned host memory on {host_spill} rank(s) (GPU "
                "stash full); no re-run needed"
            )


_REPORT = OverflowReport()


@patch(
    "paged_stash.report_overflow",
    "megatron.core.transformer.moe.paged_stash.PagedStashRunner.check_moe_overflow",
    reason="one clear line when a step overflows the paged stash or the HybridEP receive budget "
    "and megatron re-runs it (with ncclep: budget kept, paging off), and when the re-run finished "
    "(megatron logs at INFO only)",
    upstream_pr="fork-only (instrumentation)",
    flags=("--moe-expert-rank-capacity-factor",),
    enabled=lambda args: getattr(args, "moe_expert_rank_capacity_factor", None) is not None,
    kind="observe",
)
def _wrap_check_overflow(original):
    @functools.wraps(original)
    def check_moe_overflow(self, *args, **kwargs):
        # DeferredResultChecks already all-reduced this attempt's flags: use them (no second
        # collective).
        cached = self.__dict__.pop(FLAGS_ATTR, None)
        result = cached if cached is not None else original(self, *args, **kwargs)
        try:
            _REPORT(*result, config=getattr(self, "config", None))
        except Exception as exc:  # pragma: no cover - reporting must never break training
            logger.warning("paged stash overflow report failed: %s", exc)
        return result

    return check_moe_overflow
