"""The training step around the static dispatch: after forward-backward, one all-reduce of the
overflow flag; a step that overflowed is discarded and re-run through megatron's dynamic
all-to-all (``--moe-static-dispatch-on-overflow rerun``), or stops with an error (``fail``).

The re-run sees the same micro-batches (they are read once, before the first attempt), starts
from zeroed gradients, the random states of the first attempt and cleared MoE metrics, so its
result is that of a run that never overflowed. Under ``--cuda-graph-impl full_iteration`` the
first attempt is megatron's graph (captured or replayed) and the re-run is eager; the graph is
kept for the next step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from megatron.patchset.core.registry import patch
from megatron.patchset.features.paged_stash.rerun import RngStates
from megatron.patchset.features.static_dispatch import flags, state
from megatron.patchset.features.static_dispatch.dispatcher import orient_experts

logger = logging.getLogger(__name__)
_TRAINING = "megatron.training.training"


class StaticDispatchOverflow(RuntimeError):
    """A step routed more rows to a peer than the static dispatch's capacity."""


@dataclasses.dataclass
class Held:
    """A step's micro-batches, read once: per model chunk a list of them (None: no data on this
    pipeline stage), and whether the schedule was given a list of iterators or one."""

    chunks: list
    as_list: bool

    def iterators(self):
        its = [None if chunk is None else iter(chunk) for chunk in self.chunks]
        return its if self.as_list else its[0]


def hold(data_iterator, num_microbatches: int) -> Held:
    as_list = isinstance(data_iterator, list)
    chunks = data_iterator if as_list else [data_iterator]
    return Held(
        [None if it is None else [next(it) for _ in range(num_microbatches)] for it in chunks],
        as_list,
    )


class Stats:
    steps = 0
    reruns = 0


def discard_attempt(model, saved_rng: dict, rng: RngStates) -> None:
    """Undo what an overflowed attempt left: gradients, MoE metrics, random states, the flag."""
    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        zero = getattr(chunk, "zero_grad_buffer", None)
        if zero is not None:
            zero()
        else:
            chunk.zero_grad(set_to_none=True)
    try:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
    except ImportError:  # pragma: no cover - megatron-core without the tracker
        pass
    rng.restore(saved_rng)
    state.reset()


def run_step(first_attempt, eager, kwargs: dict, rng: RngStates | None = None):
    """``first_attempt(**kwargs)`` with static dispatch; on overflow anywhere, per the policy:
    raise, or discard it and return ``eager(**kwargs)`` under megatron's dynamic dispatch."""
    rng = rng or RngStates()
    orient_experts(kwargs.get("model"))
    held: Held = kwargs["data_iterator"]
    saved = rng.save()
    state.reset()
    Stats.steps += 1
    result = first_attempt(**{**kwargs, "data_iterator": held.iterators()})
    if not state.overflowed():
        return result
    if state.ON_OVERFLOW == "fail":
        raise StaticDispatchOverflow(
            f"{flags.FLAG}: a rank routed more token rows to one expert-parallel peer than the "
            f"capacity ({flags.FACTOR_FLAG} x tokens x top-k / EP). Raise {flags.FACTOR_FLAG}, "
            f"or use {flags.OVERFLOW_FLAG} rerun to re-run such steps with the dynamic all-to-all."
        )
    Stats.reruns += 1
    logger.warning(
        "megatron-patchset: %s overflowed its capacity in this step (%d of %d steps so far); "
        "re-running it with megatron's dynamic all-to-all",
        flags.FLAG,
        Stats.reruns,
        Stats.steps,
    )
    discard_attempt(kwargs["model"], saved, rng)
    with state.dynamic():
        return eager(**{**kwargs, "data_iterator": held.iterators()})


class OverflowRerunner:
    """megatron's forward-backward function with :func:`run_step` around it (no full-iteration
    graph)."""

    def __init__(self, forward_backward_func):
        self.forward_backward_func = forward_backward_func

    def __call__(self, **kwargs):
        kwargs["data_iterator"] = hold(kwargs["data_iterator"], kwargs["num_microbatches"])
        return run_step(self.forward_backward_func, self.forward_backward_func, kwargs)


def _full_iteration(args: Any) -> bool:
    return flags.requested(args) and getattr(args, "cuda_graph_impl", None) == "full_iteration"


def _eager_steps(args: Any) -> bool:
    return flags.requested(args) and getattr(args, "cuda_graph_impl", None) != "full_iteration"


@patch(
    "static_dispatch.graph_step",
    f"{_TRAINING}.FullCudaGraphWrapper",
    reason="a step whose static dispatch overflowed must not be used: after the graph's "
    "forward-backward, all-reduce the overflow flag and re-run such a step eagerly with the "
    "dynamic all-to-all (or stop), keeping the graph for the next step",
    flags=(flags.FLAG, "--cuda-graph-impl full_iteration"),
    enabled=_full_iteration,
)
def graph_wrapper(original: type) -> type:
    """megatron's FullCudaGraphWrapper with :func:`run_step` around its call: the graph is the
    first attempt, the inner forward-backward function (eager) the re-run."""

    class StaticDispatchGraphWrapper(original):
        _held = None

        def data_read(self, data_iterator, model, training, num_microbatches):
            if self._held is not None:  # already in the static buffers: the same batches again
                return self._held.iterators()
            return super().data_read(data_iterator, model, training, num_microbatches)

        def __call__(self, *args, **kwargs):
            training = not kwargs["forward_only"]
            loaded = super().data_read(
                kwargs["data_iterator"], kwargs["model"], training, kwargs["num_microbatches"]
            )
            self._held = Held([None if it is None else list(it) for it in loaded], as_list=True)
            kwargs["data_iterator"] = self._held
            try:
                return run_step(
                    lambda **kw: original.__call__(self, *args, **kw),
                    lambda **kw: self.forward_backward_func(*args, **kw),
                    kwargs,
                )
            finally:
                self._held = None

    StaticDispatchGraphWrapper.__module__ = __name__
    StaticDispatchGraphWrapper.__qualname__ = "StaticDispatchGraphWrapper"
    return StaticDispatchGraphWrapper


@patch(
    "static_dispatch.eager_step",
    f"{_TRAINING}.get_forward_backward_func",
    reason="a step whose static dispatch overflowed must not be used: after forward-backward, "
    "all-reduce the overflow flag and re-run such a step with the dynamic all-to-all (or stop)",
    enabled=_eager_steps,
)
def _eager_step(original):
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        return OverflowRerunner(original(*args, **kwargs))

    return get_forward_backward_func
