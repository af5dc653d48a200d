"""Result checks of a stashed attempt: replayed in order when clean, dropped (with the RNG states
put back) when the attempt overflowed, without keeping its autograd graph alive."""

import math
import types

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.features.paged_stash import report, rerun


class CheckingMachine:
    """Stands in for megatron's rerun state machine: records what validate_result was given."""

    def __init__(self):
        self.checked = []

    def validate_result(self, result, rejection_func, message, **kwargs):
        self.checked.append((result, message, rejection_func(result)))


def _runner(stashing=True):
    return types.SimpleNamespace(config=types.SimpleNamespace(moe_paged_stash=stashing))


def _attempt(machine, results):
    """A forward-backward that checks its loss and a gradient norm, as megatron's does."""

    def forward_backward(**kwargs):
        for message, value in results:
            machine.validate_result(value, math.isnan, message)
        return "losses"

    return forward_backward


def test_checks_of_a_clean_stashed_attempt_are_replayed_in_order():
    machine, runner = CheckingMachine(), _runner()
    deferred = rerun.DeferredResultChecks(
        runner,
        _attempt(machine, [("loss", 2.5), ("grad norm", 1.0)]),
        lambda: machine,
        lambda r: (0, 0, 0),
    )
    assert deferred(forward_only=False) == "losses"
    assert machine.checked == [(2.5, "loss", False), (1.0, "grad norm", False)]
    assert getattr(runner, report.FLAGS_ATTR) == (0, 0, 0)
    assert "validate_result" not in vars(machine)  # the method is back


def test_checks_of_an_overflowed_attempt_are_dropped(capsys):
    machine, runner = CheckingMachine(), _runner()
    nan = float("nan")
    deferred = rerun.DeferredResultChecks(
        runner,
        _attempt(machine, [("loss", 2.5), ("grad norm", nan)]),
        lambda: machine,
        lambda r: (1, 0, 0),
    )
    deferred(forward_only=False)
    assert machine.checked == [] and deferred.dropped == 2
    assert "2 result check(s) of the overflowed attempt dropped" in capsys.readouterr().out
    # the re-run attempt (megatron turned paging off) is checked as it runs
    runner.config.moe_paged_stash = False
    deferred.forward_backward_func = _attempt(machine, [("grad norm", 3.0)])
    deferred(forward_only=False)
    assert machine.checked == [(3.0, "grad norm", False)]


def test_held_checks_neither_keep_the_graph_alive_nor_see_later_in_place_changes():
    """megatron checks a loss that is still attached to its graph, then scales it in place; the
    held check keeps a detached copy (holding the loss kept every micro-batch's autograd graph,
    and the buffers its op contexts reference, allocated until the step ended)."""
    import weakref

    machine, runner = CheckingMachine(), _runner()
    seen = {}

    class KeepsBuffer(torch.autograd.Function):
        """An op whose context keeps a tensor that backward does not free (as the TE ops do)."""

        @staticmethod
        def forward(ctx, x):
            ctx.buffer = torch.zeros(4)
            return x * 2.0

        @staticmethod
        def backward(ctx, grad):
            return grad * 2.0

    def forward_backward(**kwargs):
        w = torch.ones(3, requires_grad=True)
        loss = KeepsBuffer.apply(w).sum()
        machine.validate_result(loss, lambda r: bool(torch.isnan(r)), "loss")
        graph = weakref.ref(loss.grad_fn.next_functions[0][0].buffer)
        loss.backward()
        loss.detach().div_(4.0)  # the schedule's in-place scaling after the check
        del loss
        seen["graph_alive"] = graph() is not None
        return "losses"

    deferred = rerun.DeferredResultChecks(
        runner, forward_backward, lambda: machine, lambda r: (0, 0, 0)
    )
    deferred(forward_only=False)
    assert seen["graph_alive"] is False
    ((value, message, rejected),) = machine.checked
    assert value.item() == 6.0 and value.grad_fn is None and message == "loss" and rejected is False


def test_method_is_restored_when_the_attempt_raises():
    machine, runner = CheckingMachine(), _runner()

    def broken(**kwargs):
        raise RuntimeError("boom")

    deferred = rerun.DeferredResultChecks(runner, broken, lambda: machine, lambda r: (0, 0, 0))
    with pytest.raises(RuntimeError, match="boom"):
        deferred()
    assert "validate_result" not in vars(machine)


def test_megatron_rerun_state_machine_can_be_deferred():
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    machine = RerunStateMachine(mode=RerunMode.DISABLED)
    runner = _runner()
    deferred = rerun.DeferredResultChecks(
        runner, _attempt(machine, [("loss", 1.0)]), lambda: machine, lambda r: (0, 0, 0)
    )
    deferred()  # the finite loss passes megatron's own check on replay
    assert machine.validate_result.__func__ is RerunStateMachine.validate_result


def test_report_uses_the_flags_the_deferral_already_reduced(capsys):
    calls = []

    class Runner:
        config = None

        def check(self):
            calls.append(1)
            return (0, 0, 0)

    wrapped = registry.get("paged_stash.report_overflow").factory(Runner.check)
    runner = Runner()
    setattr(runner, report.FLAGS_ATTR, (0, 0, 1))
    assert wrapped(runner) == (0, 0, 1) and calls == []  # no second all-reduce
    assert wrapped(runner) == (0, 0, 0) and calls == [1]  # consumed once
    assert "spilled activations" in capsys.readouterr().out


def test_upstream_check_flags_skips_the_report_wrapper():
    class Runner:
        def check_moe_overflow(self):
            return (1, 0, 0)

    Runner.check_moe_overflow = registry.get("paged_stash.report_overflow").factory(
        Runner.check_moe_overflow
    )
    report._REPORT.rerun_pending = False
    assert rerun._upstream_check_flags(Runner()) == (1, 0, 0)  # megatron's flags, as they are
    assert (
        report._REPORT.rerun_pending is False
    )  # the report wrapper did not run (it would flag a re-run)


class FakeTracker:
    """megatron's RNG tracker interface: named states, tensors or (graph-safe) Generators."""

    def __init__(self):
        gen = torch.Generator()
        gen.manual_seed(7)
        self.states_ = {
            "model-parallel-rng": gen,
            "data-parallel-rng": torch.tensor([1, 2, 3], dtype=torch.uint8),
        }

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states


def _drawing_attempt(tracker, draws):
    """A forward-backward with dropout: draws from every stream the step uses."""
    import random

    def forward_backward(**kwargs):
        gen = tracker.states_["model-parallel-rng"]
        draws.append((random.random(), torch.rand(1).item(), torch.rand(1, generator=gen).item()))
        tracker.states_["data-parallel-rng"] = (
            tracker.states_["data-parallel-rng"] + 1
        )  # advanced in place
        return "losses"

    return forward_backward


@pytest.mark.parametrize("overflowed", [True, False])
def test_an_overflowed_attempts_random_draws_are_undone(overflowed):
    """After an overflowed attempt the re-run draws the same numbers again (as a step that never
    paged); after a clean attempt the streams go on."""
    tracker, draws = FakeTracker(), []
    machine, runner = CheckingMachine(), _runner()
    generator = tracker.states_["model-parallel-rng"]
    deferred = rerun.DeferredResultChecks(
        runner,
        _drawing_attempt(tracker, draws),
        lambda: machine,
        lambda r: (int(overflowed), 0, 0),
        rng=rerun.RngStates(tracker=lambda: tracker, cuda=False),
    )
    deferred(forward_only=False)
    runner.config.moe_paged_stash = (
        False  # megatron's re-run (or, clean, the next step) pages no more
    )
    deferred(forward_only=False)
    assert (draws[1] == draws[0]) is overflowed
    assert (
        tracker.states_["model-parallel-rng"] is generator
    )  # set in place: a graph keeps its generator
    assert tracker.states_["data-parallel-rng"].tolist() == ([2, 3, 4] if overflowed else [3, 4, 5])
