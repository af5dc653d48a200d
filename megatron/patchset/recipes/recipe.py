"""What a recipe is: named knobs with defaults, and a function from their values to flags.

A recipe is the set of megatron flags (and environment defaults) that make one training technique,
named once. Launchers, ``tools/bench/bench.py --recipe``, the tests and the docs read it by name
(:func:`megatron.patchset.recipes.get`), so no copy of its flags can drift. The model, the data,
the batch sizes and the job's size stay outside: they come from the flag file and the launcher.

Knob names are the launchers' environment variables (``EP``, ``GRAPHS``); values arrive as text,
as a shell passes them, and a bad value is refused with one line naming the knob.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from types import SimpleNamespace

from megatron.patchset.core.errors import PatchsetError

KINDS = ("whole", "number", "switch", "choice", "words")
_WHOLE = re.compile(r"^[0-9]+$")
_NUMBER = re.compile(r"^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")


class KnobError(PatchsetError):
    """A knob value the recipe cannot take; the message is one line naming the knob."""


@dataclasses.dataclass(frozen=True)
class Knob:
    """One setting of a recipe.

    Attributes:
        name: the environment variable a launcher reads (upper case).
        kind: ``whole`` (an integer >= ``minimum``), ``number`` (a finite number >= 0),
            ``switch`` (0 or 1), ``choice`` (one of ``choices``, or text that ``pattern``
            matches) or ``words`` (a list of words).
        default: the value as text.
        help: one line for ``--list`` and the docs.
        choices: the values a ``choice`` knob takes.
        minimum: the least value of a ``whole`` knob.
        pattern: a regular expression of the further values a ``choice`` knob takes, matched in
            full (``[0-9]+G``); ``pattern_name`` is how the docs and messages write it (``<N>G``).
    """

    name: str
    kind: str
    default: str
    help: str
    choices: tuple[str, ...] = ()
    minimum: int = 1
    pattern: str = ""
    pattern_name: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise PatchsetError(f"knob {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == "choice") != bool(self.choices):
            raise PatchsetError(f"knob {self.name}: choices go with kind 'choice' only")
        if bool(self.pattern) != bool(self.pattern_name) or (self.pattern and not self.choices):
            raise PatchsetError(
                f"knob {self.name}: a pattern goes with its name and a 'choice' knob only"
            )
        self.parse(self.default)

    @property
    def values_text(self) -> tuple[str, ...]:
        """The values of a ``choice`` knob as the docs write them: its choices, then its
        pattern's name."""
        return self.choices + ((self.pattern_name,) if self.pattern else ())

    def parse(self, text: str):
        """The value of ``text`` (str), or :class:`KnobError` naming the knob."""
        text = str(text).strip()
        if self.kind == "whole":
            if not _WHOLE.match(text) or int(text) < self.minimum:
                raise KnobError(
                    f"{self.name} must be a whole number >= {self.minimum} (got '{text}')"
                )
            return int(text)
        if self.kind == "number":
            if not _NUMBER.match(text) or not math.isfinite(float(text)):
                raise KnobError(f"{self.name} must be a number >= 0 (got '{text}')")
            return float(text)
        if self.kind == "switch":
            if text not in ("0", "1"):
                raise KnobError(f"{self.name} must be 0 or 1 (got '{text}')")
            return text == "1"
        if self.kind == "choice":
            if text not in self.choices and not (self.pattern and re.fullmatch(self.pattern, text)):
                *rest, last = self.values_text
                raise KnobError(f"{self.name} must be {', '.join(rest)} or {last} (got '{text}')")
            return text
        words = text.split()
        if not words:
            raise KnobError(f"{self.name} must name at least one word (got '{text}')")
        return words

    def describe(self) -> str:
        if self.kind == "choice":
            values = "|".join(self.values_text)
        elif self.kind == "whole":
            values = f"whole number >= {self.minimum}"
        else:
            values = {"number": "number >= 0", "switch": "0|1", "words": "words"}[self.kind]
        return f"{self.name} ({values}, default {self.default}): {self.help}"


def whole(name: str, default: int, help: str, minimum: int = 1) -> Knob:
    return Knob(name, "whole", str(default), help, minimum=minimum)


def number(name: str, default: float, help: str) -> Knob:
    return Knob(name, "number", str(default), help)


def switch(name: str, default: bool, help: str) -> Knob:
    return Knob(name, "switch", "1" if default else "0", help)


def choice(
    name: str,
    default: str,
    choices: tuple[str, ...],
    help: str,
    pattern: str = "",
    pattern_name: str = "",
) -> Knob:
    return Knob(
        name, "choice", default, help, choices=choices, pattern=pattern, pattern_name=pattern_name
    )


def words(name: str, default: str, help: str) -> Knob:
    return Knob(name, "words", default, help)


@dataclasses.dataclass(frozen=True)
class Built:
    """What a recipe gives for one set of knob values."""

    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # defaults: a value already set in the environment wins


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named training technique.

    Attributes:
        name: how launchers, tools, tests and docs call it (``small_batch``).
        summary: one line.
        knobs: its settings.
        build: ``values -> (flags, env)``, ``values`` a namespace with one attribute per knob
            (lower case: ``values.ep``).
        baseline: True for a recipe of upstream flags only (it runs with ``MEGATRON_PATCHSET=off``
            in benchmarks).
    """

    name: str
    summary: str
    knobs: tuple[Knob, ...]
    build: Callable[[SimpleNamespace], Built]
    baseline: bool = False

    def __post_init__(self):
        names = [k.name for k in self.knobs]
        if len(set(names)) != len(names):
            raise PatchsetError(f"recipe {self.name}: a knob is declared twice")

    def knob(self, name: str) -> Knob:
        for knob in self.knobs:
            if knob.name == name:
                return knob
        raise KnobError(
            f"recipe {self.name} has no knob {name}; its knobs: "
            + ", ".join(k.name for k in self.knobs)
        )

    def values(self, settings: Mapping[str, str] | None = None) -> SimpleNamespace:
        """The knob values: ``settings`` (name -> text) over the defaults. An unknown name or a
        bad value raises :class:`KnobError`."""
        settings = dict(settings or {})
        for name in settings:
            self.knob(name)
        return SimpleNamespace(
            **{k.name.lower(): k.parse(settings.get(k.name, k.default)) for k in self.knobs}
        )

    def __call__(self, settings: Mapping[str, str] | None = None, **knobs) -> Built:
        """The flags and environment defaults for ``settings`` and keyword knobs
        (``recipe(EP=8)``; values may be text or numbers)."""
        merged = dict(settings or {})
        merged.update({k: _text(v) for k, v in knobs.items()})
        built = self.build(self.values(merged))
        if not isinstance(built, Built):
            built = Built(tuple(built))
        return built

    def flags(self, settings: Mapping[str, str] | None = None, **knobs) -> list[str]:
        return list(self(settings, **knobs).flags)


def _text(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)
