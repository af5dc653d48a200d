"""Result checks of an attempt that overflowed the paged stash: held until the overflow flags are
known, and dropped (with the RNG states the attempt advanced put back) when it overflowed."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.registry import patch
from megatron.patchset.features.paged_stash.flags import requested
from megatron.patchset.features.paged_stash.report import FLAGS_ATTR, say


class RngStates:
    """Every random stream a training step draws from, saved and put back: Python's, NumPy's,
    torch's CPU and CUDA default generators (what megatron's rerun state machine saves for its own
    re-runs) and the named states of megatron's CUDA RNG tracker (model-parallel dropout; with
    ``--te-rng-tracker`` / CUDA graphs these are graph-safe ``torch.Generator`` objects, saved by
    value and set in place so that captured graphs keep their generator)."""

    def __init__(self, tracker: Callable[[], Any] | None = None, cuda: bool | None = None):
        self._tracker = tracker
        self._cuda = cuda

    def cuda(self) -> bool:
        import torch

        return torch.cuda.is_available() if self._cuda is None else self._cuda

    def tracker(self) -> Any:
        if self._tracker is not None:
            return self._tracker()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker()

    def save(self) -> dict:
        import random

        import numpy as np
        import torch

        named = {}
        for name, state in self.tracker().get_states().items():
            named[name] = state.get_state() if isinstance(state, torch.Generator) else state.clone()
        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if self.cuda() else None,
            "tracker": named,
        }

    def restore(self, saved: dict) -> None:
        import random

        import numpy as np
        import torch

        random.setstate(saved["python"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["cpu"])
        if saved["cuda"] is not None:
            torch.cuda.set_rng_state(saved["cuda"])
        tracker = self.tracker()
        current = tracker.get_states()
        tensors = {}
        for name, value in saved["tracker"].items():
            live = current.get(name)
            if isinstance(live, torch.Generator):
                live.set_state(value)  # in place: a captured graph holds this generator
                tensors[name] = live
            else:
                tensors[name] = value.clone()
        tracker.set_states(tensors)


def _snapshot(value: Any) -> Any:
    """A tensor's value at this point, without its autograd graph; anything else as it is."""
    import torch

    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class DeferredResultChecks:
    """The forward-backward function of megatron's ``PagedStashRunner``, with the rerun state
    machine's result checks (NaN loss, NaN gradient norm per DDP bucket, spiky loss) held back
    while paged stashing is on, until the attempt's overflow flags are known.

    An attempt that overflowed the stash restores garbage activations in backward, so its
    gradients can be NaN; megatron-core 0.19.2 checks them inside the attempt, before its runner
    looks at the overflow flags. The rerun state machine then takes the NaN for a fault, re-runs
    the whole iteration (which overflows again on the same data) and saves a checkpoint and
    exits (without ``--save``: a TypeError). Here the checks are recorded during a stashed
    attempt and, once the (one, all-reduced) flags are in: replayed in order if nothing
    overflowed, dropped if it did (the runner re-runs the step without stashing, and that
    attempt is checked as usual). An overflowed attempt's random draws are undone as well
    (``RngStates``): megatron's runner does not, so with dropout the re-run, and every step after
    it, would draw other masks than a run that never overflowed.
    """

    def __init__(
        self,
        runner: Any,
        forward_backward_func: Callable,
        state_machine: Callable[[], Any],
        check_flags: Callable[[Any], tuple],
        rng: RngStates | None = None,
    ):
        self.rng = rng or RngStates()
        self.runner = runner
        self.forward_backward_func = forward_backward_func
        self.state_machine = state_machine
        self.check_flags = check_flags
        self.dropped = 0

    def stashing(self) -> bool:
        return bool(getattr(getattr(self.runner, "config", None), "moe_paged_stash", False))

    def __call__(self, *args, **kwargs):
        if not self.stashing():  # the re-run attempt, or paging off: checked as usual
            return self.forward_backward_func(*args, **kwargs)
        machine = self.state_machine()
        held: list[tuple[tuple, dict]] = []
        # shadows the method; keeps detached copies of tensor arguments: the loss megatron checks
        # is still attached to its autograd graph (which would stay allocated until the step ends,
        # where upstream frees each micro-batch's graph after its backward), and the schedule
        # scales it in place after the check
        machine.validate_result = lambda *a, **k: held.append(
            (tuple(_snapshot(v) for v in a), {key: _snapshot(v) for key, v in k.items()})
        )
        rng = self.rng.save()
        try:
            result = self.forward_backward_func(*args, **kwargs)
        finally:
            del machine.validate_result
        flags = tuple(self.check_flags(self.runner))
        setattr(self.runner, FLAGS_ATTR, flags)
        stash_overflow, over_budget = flags[0], flags[1]
        if stash_overflow or over_budget:
            self.dropped += len(held)
            if held:
                say(
                    f"{len(held)} result check(s) of the overflowed attempt dropped (its gradients "
                    "are not used; the re-run is checked)"
                )
            # the re-run draws the attempt's dropout masks again, as a step that never paged would
            self.rng.restore(rng)
            return result
        for a, k in held:
            machine.validate_result(*a, **k)
        return result


def _upstream_check_flags(runner: Any) -> tuple:
    """megatron's own check_moe_overflow (one all-reduce), without the fork's report wrapper."""
    method = type(runner).check_moe_overflow
    return getattr(method, "__wrapped__", method)(runner)


@patch(
    "paged_stash.defer_result_checks",
    "megatron.core.transformer.moe.paged_stash.PagedStashRunner.__init__",
    reason="an attempt that overflows the paged stash has NaN gradients, which megatron's rerun "
    "state machine checks inside the attempt, before the runner sees the overflow: it takes them "
    "for a fault, re-runs the iteration (overflowing again) and exits; hold the checks until the "
    "overflow flags are known and drop those of an overflowed attempt, and put back the RNG "
    "states the attempt advanced (dropout), so the re-run equals a step that never overflowed",
    upstream_pr="fork-only (megatron-core 0.19.2's overflow re-run stops at the NaN check)",
    flags=("--moe-paged-stash",),
    enabled=requested,
)
def _wrap_runner_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        self.forward_backward_func = DeferredResultChecks(
            self, self.forward_backward_func, get_rerun_state_machine, _upstream_check_flags
        )

    return __init__
