"""The rule engine: validation of flag combinations, one table assembled from the features.

A :class:`Rule` is a function of the parsed arguments that returns ``None`` when the combination
is fine, or a message that names the offending flags and says how to fix it. The core declares
the parallel-layout rules (:mod:`~megatron.patchset.core.layout_rules`), each feature its own in
its folder; :func:`all_rules` is the one table, in load order. Rules run in two phases, both
before any GPU work:

* ``layout``: on the freshly parsed arguments, *before* megatron's ``validate_args``, for the
  parallel layout against the world size (megatron either checks these late, at process-group
  creation, or with messages that do not name the flag);
* ``combination``: after megatron's ``validate_args`` (its derived values such as
  ``data_parallel_size`` are available) and after the model's ``TransformerConfig`` was built.

:func:`validate` runs every rule of a phase and reports all failures at once. No rule changes an
argument: a requested feature is either honoured or refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.provided import provided
from megatron.patchset.core.registry import _feature_of

PHASES = ("layout", "combination")
# Negative controls (a GPU test showing what megatron itself does with a refused combination)
# name the rules to skip here; pretrain_gpt.py says so in its log.
SKIP_RULES_ENV = "MEGATRON_PATCHSET_SKIP_RULES"


class PatchsetArgumentError(ValueError):
    """One or more flag combinations are invalid; the message lists each with its fix."""

    def __init__(self, failures: list[tuple[Rule, str]]):
        self.failures = failures
        lines = [f"megatron-patchset: {len(failures)} invalid flag combination(s):"]
        for rule, message in failures:
            lines.append(f"  [{rule.name}] {message}")
        super().__init__("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class Rule:
    """A validation rule. ``check(args)`` in the layout phase, ``check(args, config)`` in the
    combination phase (``config`` is the model's TransformerConfig); returns None or a message."""

    name: str
    phase: str
    flags: tuple[str, ...]
    check: Callable[..., str | None]
    doc: str
    feature: str | None = None
    gate: bool = False


_RULES: list[Rule] = []


def rule(name: str, *, phase: str, flags: tuple[str, ...], gate: bool = False) -> Callable:
    """Decorator declaring a validation rule (in the core or in a feature's ``rules.py``).

    A ``gate`` rule checks what the later rules of its phase compute with (sizes they divide by):
    when it fails, they are not run and only its message is reported."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    module = sys._getframe(1).f_globals.get("__name__", "")

    def decorate(fn: Callable[..., str | None]):
        if any(r.name == name for r in _RULES):
            raise ValueError(f"rule {name!r} defined twice")
        _RULES.append(
            Rule(
                name, phase, tuple(flags), fn, (fn.__doc__ or "").strip(), _feature_of(module), gate
            )
        )
        return fn

    return decorate


def all_rules() -> list[Rule]:
    """The one validation table: the core's rules, then each feature's, in load order."""
    from megatron.patchset.core import features

    order = {None: -1, **{f.name: i for i, f in enumerate(features.load())}}
    return sorted(_RULES, key=lambda r: order[r.feature])  # stable: declaration order within


def listed(lead: str, problems: list[str]) -> str | None:
    """A rule's message: ``lead`` and the problems, "; "-separated; None when there are none."""
    return f"{lead}{'; '.join(problems)}." if problems else None


def skipped_rules() -> set[str]:
    names = {n.strip() for n in os.environ.get(SKIP_RULES_ENV, "").split(",") if n.strip()}
    known = [r.name for r in all_rules()]
    unknown = sorted(names - set(known))
    if unknown:
        hints = [
            f"{name}: did you mean {' or '.join(close)}?"
            for name in unknown
            if (close := difflib.get_close_matches(name, known, n=2, cutoff=0.6))
        ]
        raise PatchsetError(
            f"megatron-patchset: {SKIP_RULES_ENV} names unknown rules: {', '.join(unknown)}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + ". A rule's name is the bracketed word before its message, e.g. [sizes-positive]."
        )
    return names


def validate(args: argparse.Namespace, phase: str, config: Any = None) -> None:
    """Run every rule of ``phase`` (but those named in ``MEGATRON_PATCHSET_SKIP_RULES``); raise
    :class:`PatchsetArgumentError` listing all failures."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    failures = []
    skip = skipped_rules()
    for r in all_rules():
        if r.phase != phase or provided(r.feature):  # an exported megatron runs its own
            continue
        if r.name in skip:
            print(f"megatron-patchset: rule {r.name} skipped ({SKIP_RULES_ENV})", flush=True)
            continue
        message = _run(r, args, config)
        if message:
            failures.append((r, message))
            if r.gate:
                break
    if failures:
        raise PatchsetArgumentError(failures)


def _run(r: Rule, args: argparse.Namespace, config: Any) -> str | None:
    """The rule's message; a rule that cannot evaluate the arguments (a value of the wrong type or
    range that an earlier rule did not catch) reports that, naming its flags, instead of raising."""
    try:
        return r.check(args) if r.phase == "layout" else r.check(args, config)
    except Exception as exc:  # noqa: BLE001 - reported as a failure of the combination
        return (
            f"the values of {', '.join(r.flags)} could not be checked ({type(exc).__name__}: "
            f"{exc}); check them against --help."
        )
