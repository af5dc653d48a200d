"""Feature descriptors and the order in which the overlay loads them.

A feature is one folder, ``megatron/patchset/features/<name>/``: its ``__init__.py`` defines
``FEATURE``, a :class:`Feature` that names the feature's flags, how it is switched on, the modules
that declare its patches and rules, the packages it needs, the upstream PR and its status. The
core's own modules (compat and observe patches, the parallel-layout rules) load first, then the
features in :data:`megatron.patchset.features.ORDER`; the order is that of ``--list``, of the
rule table and of the flags in ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.upstream_pr import UpstreamPR

# The core's modules that declare compat/observe patches and rules.
CORE_MODULES = (
    "megatron.patchset.core.compat",
    "megatron.patchset.core.emulation",
    "megatron.patchset.core.observe.metrics",
    "megatron.patchset.core.observe.profile",
    "megatron.patchset.core.layout_rules",
)
STATUSES = ("stable", "experimental")

PackageList = list[tuple[str, str]]


def _no_packages(_args: Any) -> PackageList:
    return []


@dataclasses.dataclass(frozen=True)
class Feature:
    """What the overlay needs to know about one feature.

    Attributes:
        name: the folder name (``docs/features/<name>.md`` documents it).
        title: one line for tables.
        switches: how a user turns it on, as typed (``--list``'s "on" column, the dry-run).
        enabled: predicate of the parsed arguments (False for a library API without flags).
        upstream_pr: where the feature stands upstream, an :class:`UpstreamPR` or its text:
            ``PR <number> (note)``, ``proposed (note)`` or ``fork-only (reason)``.
        status: ``stable``, ``experimental`` or ``not yet verified on N GPUs``.
        modules: the feature's modules that declare patches and rules (imported on load).
        flags: the fork's own flags the feature adds (``add_arguments`` adds them).
        add_arguments: adds ``flags`` to megatron's parser group.
        packages: ``args -> [(package, why)]`` beyond torch and megatron-core.
        configure_config: ``(args, TransformerConfig) -> None``, called for every run: copies
            the feature's options onto the config as attributes megatron-core does not define,
            for the feature's patches to read (absent attributes mean upstream behaviour). It
            changes nothing else: what changes upstream behaviour is a registered patch.
        in_use: ``args -> [flag as typed]``: what of the feature a run uses (the dry-run prints
            it); the switches by default.
        resolve_args: ``args -> line or None``, called in every launch and ``--dry-run`` after
            megatron's argument validation and before the model's TransformerConfig is built:
            sets megatron arguments that the feature's flag leaves to be chosen from the validated
            layout (a memory budget's levers) and returns a line for the log; raises a
            ``PatchsetError`` with one line when no choice is possible.
        report: ``args -> [line]``: what ``--dry-run`` prints for the feature after the memory
            estimate (a choice ``resolve_args`` made and its alternatives).
    """

    name: str
    title: str
    switches: tuple[str, ...]
    enabled: Callable[[Any], bool]
    upstream_pr: UpstreamPR | str
    status: str
    modules: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    add_arguments: Callable[[argparse._ArgumentGroup], None] | None = None
    packages: Callable[[Any], PackageList] = _no_packages
    configure_config: Callable[[Any, Any], None] | None = None
    in_use: Callable[[Any], list[str]] | None = None
    resolve_args: Callable[[Any], str | None] | None = None
    report: Callable[[Any], list[str]] | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "upstream_pr", UpstreamPR.parse(self.upstream_pr))
        except PatchsetError as exc:
            raise PatchsetError(f"feature {self.name}: {exc}") from None
        verified = self.status.startswith("not yet verified on ") and self.status.endswith(" GPUs")
        if self.status not in STATUSES and not verified:
            raise PatchsetError(
                f"feature {self.name}: status {self.status!r} is not one of {', '.join(STATUSES)} "
                "or 'not yet verified on N GPUs'"
            )
        if bool(self.flags) != (self.add_arguments is not None):
            raise PatchsetError(f"feature {self.name}: flags and add_arguments go together")

    def describe(self, args: Any) -> str:
        """``name (flags in use)``, as the dry-run lists an enabled feature."""
        used = self.in_use(args) if self.in_use is not None else list(self.switches)
        return f"{self.name} ({', '.join(used)})" if used else self.name

    @property
    def package(self) -> str:
        return f"megatron.patchset.features.{self.name}"

    @property
    def patches(self) -> list:
        from megatron.patchset.core import registry

        return [p for p in registry.registered() if p.feature == self.name]

    @property
    def rules(self) -> list:
        from megatron.patchset.core import rules

        return [r for r in rules.all_rules() if r.feature == self.name]


_LOADED: dict[str, Feature] = {}


def load() -> list[Feature]:
    """Import the core's modules and every feature (registering their patches and rules)."""
    if not _LOADED:
        from megatron.patchset.features import ORDER

        for module in CORE_MODULES:
            importlib.import_module(module)
        loaded = {}
        for name in ORDER:
            feature = importlib.import_module(f"megatron.patchset.features.{name}").FEATURE
            if feature.name != name:
                raise PatchsetError(
                    f"features/{name}/__init__.py describes a feature named {feature.name!r}"
                )
            for module in feature.modules:
                importlib.import_module(module)
            loaded[name] = feature
        _LOADED.update(loaded)
    return list(_LOADED.values())


def get(name: str) -> Feature:
    load()
    try:
        return _LOADED[name]
    except KeyError:
        raise PatchsetError(f"no feature named {name!r}; known: {', '.join(_LOADED)}") from None


def enabled(args: Any) -> list[Feature]:
    """The features the parsed arguments switch on."""
    return [f for f in load() if f.enabled(args)]
