"""The budget's choice: the fastest combination of memory levers whose estimated peak fits.

A budget of ``<N>G`` (the card's memory as its maker names it) allows an estimated peak of
``(1 - HEADROOM) x N`` GiB per rank: the rest is for what the estimate does not hold (the CUDA
context, NCCL's buffers, the caching allocator's reserve above its allocated peak) and its error.
The combinations are tried in :data:`COMBINATIONS`' order and the first that fits is taken; when
none does, the launch is refused before training with the leanest one's estimate.

:data:`COMBINATIONS` is the order of the step times measured in docs/benchmarks/ (reference config,
4x4096 tokens, one GPU, the records the feature's page names), with one exception: no lever comes
first, because bf16 moments, measured a little faster there (the Adam kernel moves 22 bytes per
parameter instead of 30), round the moments at every step; a budget leaves a run that fits as it
is (``MEMORY=moments`` asks for them anyway). The fp32-moment combinations with recomputation are
slower than bf16 moments with the same recomputation and hold more memory, so they come last: a
budget reaches them only where bf16 moments are not available (megatron's own Adam without the
distributed optimizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.features.memory_budget import flags
from megatron.patchset.features.memory_budget.estimate import Estimate, Levers, Shape, estimate

HEADROOM = 0.10
MOE_ACT = ("moe_act",)
MOE_ACT_NORM = ("moe_act", "layernorm")
COMBINATIONS = (
    Levers(),
    Levers(bf16_moments=True),
    Levers(bf16_moments=True, recompute=MOE_ACT),
    Levers(bf16_moments=True, recompute=MOE_ACT_NORM),
    Levers(recompute=MOE_ACT),
    Levers(recompute=MOE_ACT_NORM),
)


class BudgetError(PatchsetError):
    """No combination of levers fits the budget; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a budget chose: every candidate's estimate in the order tried, and the one taken."""

    budget: str
    allowed_gib: float
    estimates: tuple[Estimate, ...]
    chosen: Estimate | None

    def fits(self, e: Estimate) -> bool:
        return e.gib <= self.allowed_gib

    @property
    def leanest(self) -> Estimate:
        return min(self.estimates, key=lambda e: e.total)

    def line(self) -> str:
        """The line a launch logs."""
        e = self.chosen
        return (
            f"memory budget {self.budget}: {e.levers.describe()} (estimated peak {e.gib:.1f} GiB "
            f"per rank, {self.allowed_gib:.1f} GiB allowed)"
        )


def allowed_gib(budget: str) -> float:
    return flags.budget_gib(budget) * (1 - HEADROOM)


def moments_lever(args: Any) -> str | None:
    """How this run keeps bf16 Adam moments: ``--adam-moments-dtype bf16`` (the one-kernel Adam),
    megatron's precision-aware optimizer (the distributed optimizer), or None."""
    if getattr(args, "adam_impl", None) == "triton":
        return "one-kernel"
    if args.use_distributed_optimizer and not getattr(args, "use_megatron_fsdp", False):
        return "precision-aware"
    return None


def candidates(args: Any) -> tuple[Levers, ...]:
    """The combinations this run can take, in the order a budget tries them."""
    if moments_lever(args) is None:
        return tuple(c for c in COMBINATIONS if not c.bf16_moments)
    return COMBINATIONS


def choose(shape: Shape, budget: str, combinations: tuple[Levers, ...] = COMBINATIONS) -> Choice:
    """The first of ``combinations`` whose estimate fits ``budget`` (None when none does)."""
    allowed = allowed_gib(budget)
    estimates = tuple(estimate(shape, levers) for levers in combinations)
    chosen = next((e for e in estimates if e.gib <= allowed), None)
    return Choice(budget, allowed, estimates, chosen)


def refusal(choice: Choice, args: Any) -> str:
    """One line: the budget, the leanest estimate and what to change."""
    lean = choice.leanest
    changes = [
        "more GPUs or a larger --expert-model-parallel-size (now "
        f"{args.expert_model_parallel_size}; fewer experts per rank)"
    ]
    if not args.use_distributed_optimizer:
        changes.append("--use-distributed-optimizer (DIST_OPT=1)")
    factor = getattr(args, "moe_static_dispatch_capacity_factor", None)
    if getattr(args, "moe_static_dispatch", False) and factor and factor > 1:
        changes.append(
            f"a smaller --moe-static-dispatch-capacity-factor (now {factor:g}; CAPACITY_FACTOR)"
        )
    if args.micro_batch_size > 1:
        changes.append(f"a smaller --micro-batch-size (now {args.micro_batch_size})")
    wanted = ", ".join(changes[:-1]) + " or " + changes[-1] if len(changes) > 1 else changes[0]
    return (
        f"megatron-patchset: MEMORY={choice.budget} ({flags.FLAG} {choice.budget}): even the "
        f"leanest combination, {lean.levers.describe()}, needs about {lean.gib:.1f} GiB per "
        f"rank, more than the {choice.allowed_gib:.1f} GiB that {choice.budget} allows "
        f"({HEADROOM:.0%} headroom); use {wanted}."
    )


def apply(args: Any, levers: Levers) -> None:
    """Set the levers on megatron's validated arguments."""
    if levers.recompute:
        args.recompute_granularity = "selective"
        args.recompute_modules = list(levers.recompute)
    if levers.bf16_moments:
        if moments_lever(args) == "one-kernel":
            args.adam_moments_dtype = "bf16"
        else:
            import torch

            args.use_precision_aware_optimizer = True
            args.exp_avg_dtype = torch.bfloat16
            args.exp_avg_sq_dtype = torch.bfloat16


def shape_of(args: Any) -> Shape:
    """The :class:`Shape` of megatron's validated arguments (the parameter counts of a model
    built on the meta device)."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron.patchset.core import dry_run, preflight

    dry_run.fill_padded_vocab_size(args)
    with contextlib.redirect_stdout(io.StringIO()):
        config = preflight.megatron_validated(lambda: core_transformer_config_from_args(args))
        dense, expert = dry_run.parameter_split(args, config)
    return Shape.from_args(args, dense, expert)


def resolve(args: Any) -> str | None:
    """``Feature.resolve_args``: choose and set the levers for ``--memory-budget``; the line to
    log. Raises :class:`BudgetError` when nothing fits."""
    if not flags.requested(args):
        return None
    from megatron.patchset.core import dry_run

    unknown = dry_run.fill_padded_vocab_size(args)
    if unknown:
        if getattr(args, "dry_run", False):
            args.memory_budget_choice = unknown
            return None
        raise BudgetError(f"megatron-patchset: {flags.FLAG} needs the vocabulary size: {unknown}")
    choice = choose(shape_of(args), args.memory_budget, candidates(args))
    args.memory_budget_choice = choice
    if choice.chosen is None:
        raise BudgetError(refusal(choice, args))
    apply(args, choice.chosen.levers)
    return choice.line()


def report(args: Any) -> list[str]:
    """``Feature.report``: the budget, every candidate's estimate and the one chosen."""
    choice = getattr(args, "memory_budget_choice", None)
    if choice is None:
        return []
    if isinstance(choice, str):
        return [
            f"memory budget {args.memory_budget}: not chosen here ({choice}); the launch chooses"
        ]
    lines = [
        f"memory budget {choice.budget} ({flags.FLAG}): estimated peak per rank of each "
        f"combination, in the order tried; {choice.allowed_gib:.1f} GiB allowed "
        f"({HEADROOM:.0%} headroom):"
    ]
    for e in choice.estimates:
        mark = "chosen" if e is choice.chosen else ("fits" if choice.fits(e) else "too large")
        lines.append(f"  {e.gib:6.1f} GiB  {mark:<9}  {e.levers.describe()}")
    if choice.chosen is not None:
        lines.append(f"  chosen, by part (GiB): {choice.chosen.parts()}")
    return lines
