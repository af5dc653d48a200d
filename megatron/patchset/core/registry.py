"""The patch registry: every change this overlay makes to upstream megatron-core behaviour.

A :class:`Patch` names one upstream attribute by its dotted path (the single name upstream code
looks up at call time), a factory that builds the replacement from the upstream original, why,
the upstream pull request it corresponds to, and when it is on. There is one way to declare one,
the :func:`patch` decorator on the factory::

    @patch("torch_compile.rope_traceable",
           "megatron.core.transformer.attention.apply_rotary_pos_emb",
           reason="...", enabled=traceable_substitutes)
    def _rope(original):
        ...
        return replacement

Several patches of the same shape are several decorated factories that call one helper.

A patch declared inside a feature's folder (``megatron.patchset.features.<name>``) belongs to that
feature, is named ``<name>.<what>``, and takes the feature's switches, predicate and upstream PR
unless it gives its own; a patch declared in the core is a ``compat`` or ``observe`` patch, named
``compat.<what>`` or ``observe.<what>``. :func:`patch` refuses any other name. :func:`apply`
installs exactly the patches the parsed arguments ask for.

Guarantees:

* **Version guard** (:mod:`~megatron.patchset.core.versions`) before anything is applied.
* **Clear drift errors.** A target that no longer exists upstream raises
  :class:`PatchTargetError` naming the dotted path and the versions.
* **Idempotent.** Applying twice changes nothing; an installed replacement carries the sentinel
  attribute ``__megatron_patchset__`` (the patch name) and ``__wrapped__`` (the upstream
  original), as Liger-Kernel's adapters do.
* **Revertible.** :func:`revert` puts every original back, in reverse order, including attributes
  a class only inherited (those are deleted again rather than shadowed). Objects built while a
  patch was installed keep what it gave them (README, "How the overlay works").
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from megatron.patchset.core.errors import PatchsetError, PatchTargetError
from megatron.patchset.core.provided import provided
from megatron.patchset.core.upstream_pr import UpstreamPR
from megatron.patchset.core.versions import (
    SUPPORTED_MCORE_VERSION,
    check_versions,
    installed_mcore_version,
)

logger = logging.getLogger(__name__)

SENTINEL = "__megatron_patchset__"
KINDS = ("compat", "observe", "feature")
FEATURES_PACKAGE = "megatron.patchset.features"
CORE_PACKAGE = "megatron.patchset.core"
CORE_KINDS = ("compat", "observe")
SKIP_ENV = "MEGATRON_PATCHSET_SKIP_PATCHES"
UPSTREAM_ENV = "MEGATRON_PATCHSET"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One registered change to an upstream symbol.

    Attributes:
        name: short unique id, ``<feature>.<what>`` for a feature's patch, ``compat.<what>`` or
            ``observe.<what>`` for the core's (what ``MEGATRON_PATCHSET_SKIP_PATCHES`` takes).
        target: dotted path of the upstream attribute, ``package.module[.Class].attr``.
        factory: called with the upstream original, returns the replacement object.
        reason: one line: why upstream's behaviour must change.
        module: the module that declared the patch.
        feature: the feature folder it belongs to (None for the core's patches).
        upstream_pr: where the change stands upstream (:class:`UpstreamPR`: ``PR <number>``,
            ``proposed`` or ``fork-only (reason)``); None takes the feature's.
        flags: the flags (or ``env VAR``) that turn it on, for ``--list``; None takes the feature's
            switches, () means always.
        enabled: predicate of the parsed arguments (``None`` when there are none, as under
            ``tools/bench/run_upstream.py``); None takes the feature's predicate, or always for
            the core.
        kind: ``compat`` (needed to run from the wheel at all, or a diagnostic that never changes
            a result), ``observe`` (records metrics, changes no computation) or ``feature``
            (changes what training does). ``MEGATRON_PATCHSET=off`` applies compat and observe
            patches only.
    """

    name: str
    target: str
    factory: Callable[[Any], Any]
    reason: str
    module: str
    feature: str | None = None
    upstream_pr: UpstreamPR | None = None
    flags: tuple[str, ...] | None = None
    enabled: Callable[[Any], bool] | None = None
    kind: str = "feature"

    def _feature(self):
        if self.feature is None:
            return None
        from megatron.patchset.core import features

        return features.get(self.feature)

    @property
    def when(self) -> tuple[str, ...]:
        """The flags that turn the patch on (empty: always)."""
        if self.flags is not None:
            return self.flags
        feature = self._feature()
        return feature.switches if feature is not None else ()

    @property
    def upstream(self) -> UpstreamPR:
        if self.upstream_pr is not None:
            return self.upstream_pr
        feature = self._feature()
        return feature.upstream_pr if feature is not None else UpstreamPR("fork-only", None, "core")

    def wanted(self, args: Any) -> bool:
        if self.enabled is not None:
            return bool(self.enabled(args))
        feature = self._feature()
        return feature is None or (args is not None and bool(feature.enabled(args)))


@dataclasses.dataclass
class _Applied:
    patch: Patch
    owner: Any
    attr: str
    original: Any  # the raw attribute (descriptor included) found on the owner
    owned: bool  # whether the owner defined the attribute itself (vs. inheriting it)


_REGISTRY: dict[str, Patch] = {}
_APPLIED: dict[str, _Applied] = {}  # insertion-ordered: revert walks it backwards


def _feature_of(module: str) -> str | None:
    if module.startswith(FEATURES_PACKAGE + "."):
        return module[len(FEATURES_PACKAGE) + 1 :].split(".")[0]
    return None


def check_name(name: str, module: str, kind: str) -> None:
    """Refuse a patch name that does not say where the patch lives: ``<feature>.<what>`` in a
    feature's folder, ``compat.<what>`` / ``observe.<what>`` (its kind) in the core. Patches
    declared outside the package (tests) are not checked."""
    prefix, _, what = name.partition(".")
    feature = _feature_of(module)
    if feature is not None:
        if prefix != feature or not what:
            raise PatchsetError(
                f"patch {name!r} is declared in {module}, so it belongs to the feature {feature} "
                f"and must be named {feature}.<what>"
            )
    elif module == CORE_PACKAGE or module.startswith(CORE_PACKAGE + "."):
        if kind not in CORE_KINDS:
            raise PatchsetError(
                f"patch {name!r} is declared in the core ({module}): a core patch is a compat or "
                f"observe patch, not {kind!r}; a patch that changes what training does belongs "
                "to a feature's folder"
            )
        if prefix != kind or not what:
            raise PatchsetError(
                f"patch {name!r} is declared in the core ({module}) as a {kind} patch and must be "
                f"named {kind}.<what>"
            )


def patch(
    name: str,
    target: str,
    *,
    reason: str,
    upstream_pr: UpstreamPR | str | None = None,
    flags: Iterable[str] | None = None,
    enabled: Callable[[Any], bool] | None = None,
    kind: str = "feature",
) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Declare a patch: decorates the factory that turns the upstream original into the
    replacement, and returns the factory unchanged. See :class:`Patch` for the arguments; a name
    that does not start with the declaring feature's folder name (``compat.`` / ``observe.`` in
    the core) raises :class:`PatchsetError` here."""
    if kind not in KINDS:
        raise PatchsetError(f"patch {name!r}: kind must be one of {KINDS}, not {kind!r}")
    module = sys._getframe(1).f_globals.get("__name__", "")
    check_name(name, module, kind)
    upstream = None if upstream_pr is None else _parse_upstream(name, upstream_pr)

    def declare(factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
        if name in _REGISTRY:
            raise PatchsetError(f"patch {name!r} is registered twice")
        _REGISTRY[name] = Patch(
            name=name,
            target=target,
            factory=factory,
            reason=reason,
            module=module,
            feature=_feature_of(module),
            upstream_pr=upstream,
            flags=None if flags is None else tuple(flags),
            enabled=enabled,
            kind=kind,
        )
        return factory

    return declare


def _parse_upstream(name: str, value: UpstreamPR | str) -> UpstreamPR:
    try:
        return UpstreamPR.parse(value)
    except PatchsetError as exc:
        raise PatchsetError(f"patch {name!r}: {exc}") from None


def registered() -> list[Patch]:
    """All registered patches: the core's, then each feature's, in declaration order."""
    from megatron.patchset.core import features

    features.load()
    return list(_REGISTRY.values())


def applied() -> list[str]:
    """Names of the patches currently installed, in the order they were applied."""
    return list(_APPLIED)


def wanted(args: Any) -> list[Patch]:
    """The patches the parsed arguments ask for."""
    return [p for p in registered() if p.wanted(args)]


def get(name: str) -> Patch:
    known = {p.name: p for p in registered()}
    try:
        return known[name]
    except KeyError:
        raise PatchsetError(f"no patch named {name!r}; known: {', '.join(known)}") from None


# ---------------------------------------------------------------------------------------
# Resolving targets
# ---------------------------------------------------------------------------------------


def resolve_owner(target: str) -> tuple[Any, str]:
    """Split ``pkg.module.Class.attr`` into (the module or class object, ``attr``).

    The longest importable module prefix is imported; the rest is walked with getattr.
    """
    parts = target.split(".")
    if len(parts) < 2:
        raise PatchTargetError(f"patch target {target!r} is not a dotted path")
    module = None
    split = 0
    for i in range(len(parts) - 1, 0, -1):
        attempted = ".".join(parts[:i])
        try:
            module = importlib.import_module(attempted)
        except ModuleNotFoundError as exc:
            # Only "this prefix is not a module" moves on to a shorter prefix; a module that
            # exists but fails on a missing dependency of its own is a real error.
            missing = exc.name or ""
            if missing and (attempted == missing or attempted.startswith(missing + ".")):
                continue
            raise
        split = i
        break
    if module is None:
        raise PatchTargetError(_drift_message(target, f"no module of {target!r} can be imported"))
    owner = module
    for name in parts[split:-1]:
        if not hasattr(owner, name):
            raise PatchTargetError(
                _drift_message(target, f"{owner.__name__!s} has no attribute {name!r}")
            )
        owner = getattr(owner, name)
    attr = parts[-1]
    if not hasattr(owner, attr):
        owner_name = getattr(owner, "__name__", owner)
        raise PatchTargetError(_drift_message(target, f"{owner_name!s} has no attribute {attr!r}"))
    return owner, attr


def _drift_message(target: str, detail: str) -> str:
    try:
        mcore = installed_mcore_version()
    except Exception:  # pragma: no cover - megatron-core missing entirely
        mcore = "not installed"
    return (
        f"patch target {target} no longer exists ({detail}); megatron-core {mcore} is installed "
        f"and the patch was written for {SUPPORTED_MCORE_VERSION}. The upstream symbol moved or "
        "was renamed: update the patch's target."
    )


def _raw_attribute(owner: Any, attr: str) -> tuple[Any, bool]:
    """The attribute as stored (staticmethod/classmethod kept), and whether owner defines it."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in vars(klass):
                return vars(klass)[attr], klass is owner
        return getattr(owner, attr), False
    return getattr(owner, attr), True


def _unwrap_descriptor(raw: Any) -> Any:
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    return raw


def _mark(replacement: Any, patch: Patch, original: Any) -> Any:
    """Attach the sentinel and ``__wrapped__`` to the replacement (or its function)."""
    inner = _unwrap_descriptor(replacement)
    try:
        setattr(inner, SENTINEL, patch.name)
        if getattr(inner, "__wrapped__", None) is None:
            inner.__wrapped__ = _unwrap_descriptor(original)
    except (AttributeError, TypeError) as exc:
        raise PatchsetError(
            f"patch {patch.name}: the replacement {inner!r} cannot carry the patch sentinel"
        ) from exc
    return replacement


def patched_by(obj: Any) -> str | None:
    """Name of the patch that installed ``obj``, or None for an upstream object."""
    return getattr(_unwrap_descriptor(obj), SENTINEL, None)


# ---------------------------------------------------------------------------------------
# Apply / revert
# ---------------------------------------------------------------------------------------


def apply_patches(patches: Iterable[Patch], *, check: bool = True) -> list[str]:
    """Install the given patches; returns the names newly applied (idempotent)."""
    if check:
        check_versions()
    newly = []
    for patch in patches:
        if patch.name in _APPLIED:
            continue
        owner, attr = resolve_owner(patch.target)
        raw, owned = _raw_attribute(owner, attr)
        current = patched_by(raw)
        if current is not None:
            raise PatchsetError(
                f"{patch.target} is already replaced by patch {current!r}; two patches may not "
                "target the same symbol"
            )
        original = raw
        # Class attributes keep their descriptor kind (staticmethod stays staticmethod).
        replacement = patch.factory(_unwrap_descriptor(original))
        if isinstance(original, staticmethod) and not isinstance(replacement, staticmethod):
            replacement = staticmethod(replacement)
        elif isinstance(original, classmethod) and not isinstance(replacement, classmethod):
            replacement = classmethod(replacement)
        _mark(replacement, patch, original)
        setattr(owner, attr, replacement)
        _APPLIED[patch.name] = _Applied(patch, owner, attr, original, owned)
        newly.append(patch.name)
        logger.debug("megatron-patchset: applied %s -> %s", patch.name, patch.target)
    return newly


# MEGATRON_PATCHSET's values (case-insensitive): the fork (unset or empty is "on"), or the
# unpatched upstream path.
PATCHED_VALUES = ("on", "1")
UPSTREAM_VALUES = ("off", "0", "upstream")


def upstream_mode(environ: Any = None) -> bool:
    """Whether ``MEGATRON_PATCHSET=off`` asks for the unpatched upstream path (in ``environ``,
    default ``os.environ``); any value other than :data:`PATCHED_VALUES` and
    :data:`UPSTREAM_VALUES` is an error."""
    value = (os.environ if environ is None else environ).get(UPSTREAM_ENV, "").strip()
    if value.lower() in UPSTREAM_VALUES:
        return True
    if not value or value.lower() in PATCHED_VALUES:
        return False
    raise PatchsetError(
        f"megatron-patchset: {UPSTREAM_ENV}={value!r} is not one of {', '.join(PATCHED_VALUES)} "
        f"(the fork, as when unset) or {', '.join(UPSTREAM_VALUES)} (unpatched upstream "
        "megatron-core)."
    )


def skipped_patches() -> set[str]:
    """Patch names in ``MEGATRON_PATCHSET_SKIP_PATCHES`` (comma-separated): left out by
    :func:`apply` even where the flags want them, to measure what one patch does (A/B runs).
    An unknown name is an error."""
    names = {n.strip() for n in os.environ.get(SKIP_ENV, "").split(",") if n.strip()}
    if names:
        known = [p.name for p in registered()]
        unknown = sorted(names - set(known))
        if unknown:
            raise PatchsetError(
                f"{SKIP_ENV}: no patch named "
                + ", ".join(name + _closest(name, known) for name in unknown)
                + "; python -m megatron.patchset --list names every patch"
            )
    return names


def _closest(name: str, known: list[str]) -> str:
    """ " (did you mean <patch>?)" for the known name closest to ``name``, else ""."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def selected(args: Any) -> list[Patch]:
    """The patches :func:`apply` installs for ``args``: those the flags want, less the ones
    ``MEGATRON_PATCHSET_SKIP_PATCHES`` names, and the feature patches of features the running
    megatron already contains (:mod:`~megatron.patchset.core.provided`). Under
    ``MEGATRON_PATCHSET=off`` a fork flag (a wanted ``feature`` patch) is refused: that mode runs
    unpatched upstream."""
    patches = wanted(args)
    skipped = skipped_patches()
    # A feature exported into the running megatron (python -m megatron.patchset export) installs
    # its own patches.
    patches = [
        p
        for p in patches
        if p.name not in skipped and not (p.kind == "feature" and provided(p.feature))
    ]
    if upstream_mode():
        feature = [p for p in patches if p.kind == "feature"]
        if feature:
            raise PatchsetError(
                "MEGATRON_PATCHSET=off runs unpatched upstream megatron-core, but these fork "
                "flags are set: " + ", ".join(sorted({f for p in feature for f in p.when}))
            )
    return patches


def apply(args: Any) -> list[str]:
    """Apply exactly the patches the parsed arguments need (:func:`selected`). Idempotent.

    ``apply(None)`` installs what needs no flags (the compat patches, and observe patches that an
    environment variable asks for): the launch does it before the command line is parsed.
    """
    skipped = skipped_patches()
    if skipped and os.environ.get("RANK", "0") == "0":
        left_out = [p.name for p in wanted(args) if p.name in skipped]
        print(
            f"megatron-patchset: {SKIP_ENV} leaves out {', '.join(left_out) or 'nothing'} "
            "(diagnostics: the run is not the fork's configuration)",
            flush=True,
        )
    return apply_patches(selected(args))


def revert(names: Iterable[str] | None = None) -> list[str]:
    """Put upstream's originals back (all applied patches by default), newest first."""
    selected = set(_APPLIED) if names is None else set(names)
    reverted = []
    for name in reversed(list(_APPLIED)):
        if name not in selected:
            continue
        record = _APPLIED.pop(name)
        if record.owned:
            setattr(record.owner, record.attr, record.original)
        else:
            delattr(record.owner, record.attr)
        reverted.append(name)
    return reverted
