"""The patch registry: every change this fork makes to upstream megatron-core behaviour.

A :class:`Patch` names one upstream attribute by its dotted path (the single name upstream
code looks up at call time), the object that replaces it, why, the upstream pull request it
corresponds to, and the command-line flags that turn it on. Area modules (``datasets``,
``cuda_graphs``, ``schedule_plan``, ...) declare their patches with :func:`register`;
:func:`apply` installs exactly those the parsed arguments ask for.

Guarantees:

* **Version guard.** Nothing is applied against a megatron-core other than
  :data:`SUPPORTED_MCORE_VERSION`, or a TransformerEngine outside :data:`SUPPORTED_TE_RANGE`
  (when TE is installed at all); the error names the installed and the expected version.
* **Clear drift errors.** A target that no longer exists upstream raises
  :class:`PatchTargetError` naming the dotted path and the versions.
* **Idempotent.** Applying twice changes nothing; an installed replacement carries the
  sentinel attribute ``__megatron_patchset__`` (the patch name) and ``__wrapped__`` (the
  upstream original), as Liger-Kernel's adapters do.
* **Revertible.** :func:`revert` puts every original back, in reverse order, including
  attributes a class only inherited (those are deleted again rather than shadowed).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from typing import Any, Callable, Iterable, Optional, Sequence

logger = logging.getLogger(__name__)

SUPPORTED_MCORE_VERSION = "0.19.2"
# TransformerEngine versions the patches were written and tested against: [low, high).
SUPPORTED_TE_RANGE = ("2.20.2", "2.21.0")

SENTINEL = "__megatron_patchset__"
KINDS = ("compat", "observe", "feature")

# Area modules that declare patches. Importing them must stay cheap: they import upstream
# modules lazily, inside their replacement functions or factories.
AREA_MODULES = (
    "megatron.patchset.datasets",
    "megatron.patchset.training",
    "megatron.patchset.profiling",
    "megatron.patchset.schedule_plan",
    "megatron.patchset.megatron_fsdp",
    "megatron.patchset.cuda_graphs",
    "megatron.patchset.compile",
    "megatron.patchset.token_dispatcher",
    "megatron.patchset.paged_stash",
    "megatron.patchset.experts",
)


class PatchsetError(RuntimeError):
    """Base class for errors raised by the patch registry."""


class PatchsetVersionError(PatchsetError):
    """The installed megatron-core or TransformerEngine is not the one the patches target."""


class PatchTargetError(PatchsetError):
    """A patch target (an upstream module attribute) does not exist any more."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One registered change to an upstream symbol.

    Attributes:
        name: short unique id, ``<area>.<what>``.
        target: dotted path of the upstream attribute, ``package.module[.Class].attr``.
        factory: called with the upstream original, returns the replacement object.
        reason: one line: why upstream's behaviour must change.
        upstream_pr: the upstream PR this corresponds to (``NVIDIA/Megatron-LM#1234``), or a
            short note such as ``fork-only`` when no upstream PR exists.
        flags: the command-line flags (or ``env VAR``) that turn the patch on; empty for a
            patch that the fork always needs to run from the megatron-core wheel.
        enabled: predicate of the parsed arguments (``None`` when there are none, as under
            ``tools/run_upstream.py``); ``None`` means always.
        kind: ``compat`` (needed to run from the wheel at all), ``observe`` (records metrics,
            changes no computation) or ``feature`` (changes what training does). The
            unpatched-upstream mode (``MEGATRON_PATCHSET=off``) applies compat and observe
            patches only.
    """

    name: str
    target: str
    factory: Callable[[Any], Any]
    reason: str
    upstream_pr: str
    flags: tuple[str, ...] = ()
    enabled: Optional[Callable[[Any], bool]] = None
    kind: str = "feature"

    def wanted(self, args: Any) -> bool:
        return self.enabled is None or bool(self.enabled(args))


@dataclasses.dataclass
class _Applied:
    patch: Patch
    owner: Any
    attr: str
    original: Any  # the raw attribute (descriptor included) found on the owner
    owned: bool  # whether the owner defined the attribute itself (vs. inheriting it)


_REGISTRY: dict[str, Patch] = {}
_APPLIED: dict[str, _Applied] = {}  # insertion-ordered: revert walks it backwards
_areas_loaded = False


def register(
    name: str,
    target: str,
    *,
    reason: str,
    upstream_pr: str,
    flags: Sequence[str] = (),
    enabled: Optional[Callable[[Any], bool]] = None,
    wraps: bool = False,
    kind: str = "feature",
) -> Callable[[Callable], Callable]:
    """Decorator declaring a patch.

    With ``wraps=False`` (default) the decorated object *is* the replacement. With
    ``wraps=True`` the decorated function is a factory: it receives the upstream original and
    returns the replacement (use this to wrap rather than replace, or to build a subclass of
    an upstream class).
    """

    if kind not in KINDS:
        raise PatchsetError(f"patch {name!r}: kind must be one of {KINDS}, not {kind!r}")

    def decorate(obj: Callable) -> Callable:
        if name in _REGISTRY:
            raise PatchsetError(f"patch {name!r} is registered twice")
        factory = obj if wraps else (lambda _original, _obj=obj: _obj)
        _REGISTRY[name] = Patch(
            name=name,
            target=target,
            factory=factory,
            reason=reason,
            upstream_pr=upstream_pr,
            flags=tuple(flags),
            enabled=enabled,
            kind=kind,
        )
        return obj

    return decorate


def load_areas() -> None:
    """Import every area module so that its patches are registered."""
    global _areas_loaded
    if _areas_loaded:
        return
    for module in AREA_MODULES:
        importlib.import_module(module)
    _areas_loaded = True


def registered() -> list[Patch]:
    """All registered patches, in registration order."""
    load_areas()
    return list(_REGISTRY.values())


def applied() -> list[str]:
    """Names of the patches currently installed, in the order they were applied."""
    return list(_APPLIED)


def wanted(args: Any) -> list[Patch]:
    """The patches the parsed arguments ask for."""
    return [p for p in registered() if p.wanted(args)]


# ---------------------------------------------------------------------------------------
# Version guard
# ---------------------------------------------------------------------------------------


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):  # "0rc1", "2dev": stop at the pre-release marker
            break
    return tuple(parts)


def installed_mcore_version() -> str:
    """megatron-core's release version. (``package_info.__version__`` gets ``+<git hash>``
    appended when the installed package sits inside any git work tree, e.g. a .venv in a
    checkout, so the release is read from ``VERSION`` instead.)"""
    from megatron.core import package_info

    major, minor, patch, pre = package_info.VERSION[:4]
    return f"{major}.{minor}.{patch}{pre}"


def installed_te_version() -> Optional[str]:
    """TransformerEngine's version, or None when it is not installed."""
    try:
        from importlib import metadata

        for dist in ("transformer-engine", "transformer_engine"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except Exception:  # pragma: no cover - metadata machinery broken
        pass
    return None


def check_versions(
    mcore_version: Optional[str] = None, te_version: Optional[str] = "__detect__"
) -> None:
    """Refuse to patch an upstream the patches were not written for."""
    mcore = installed_mcore_version() if mcore_version is None else mcore_version
    if mcore != SUPPORTED_MCORE_VERSION:
        raise PatchsetVersionError(
            f"megatron-patchset targets megatron-core=={SUPPORTED_MCORE_VERSION}, but "
            f"megatron-core {mcore} is installed. Install the pinned version "
            f"(pip install megatron-core=={SUPPORTED_MCORE_VERSION}); patches are not applied "
            f"to other versions because the upstream symbols they replace may have changed."
        )
    te = installed_te_version() if te_version == "__detect__" else te_version
    if te is not None:
        low, high = SUPPORTED_TE_RANGE
        if not (_version_tuple(low) <= _version_tuple(te) < _version_tuple(high)):
            raise PatchsetVersionError(
                f"megatron-patchset is tested with transformer-engine >={low},<{high}, but "
                f"transformer-engine {te} is installed (megatron-core {mcore}). Install "
                f"transformer-engine[pytorch]=={low}."
            )


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
        raise PatchTargetError(
            _drift_message(target, f"{getattr(owner, '__name__', owner)!s} has no attribute {attr!r}")
        )
    return owner, attr


def _drift_message(target: str, detail: str) -> str:
    try:
        mcore = installed_mcore_version()
    except Exception:  # pragma: no cover - megatron-core missing entirely
        mcore = "not installed"
    return (
        f"patch target {target} no longer exists ({detail}); megatron-core {mcore} is "
        f"installed and the patch was written for {SUPPORTED_MCORE_VERSION}. The upstream "
        f"symbol moved or was renamed: update the patch's target."
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
            setattr(inner, "__wrapped__", _unwrap_descriptor(original))
    except (AttributeError, TypeError) as exc:
        raise PatchsetError(
            f"patch {patch.name}: the replacement {inner!r} cannot carry the patch sentinel"
        ) from exc
    return replacement


def patched_by(obj: Any) -> Optional[str]:
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
                f"{patch.target} is already replaced by patch {current!r}; two patches may "
                f"not target the same symbol"
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
        logger.info("megatron-patchset: applied %s -> %s", patch.name, patch.target)
    return newly


def apply(args: Any) -> list[str]:
    """Apply exactly the patches the parsed arguments need. Idempotent.

    Setting the environment variable ``MEGATRON_PATCHSET=off`` runs the unpatched upstream
    path: only ``compat`` patches (needed to run from the megatron-core wheel at all) and
    ``observe`` patches (metrics recording) are applied, and a fork feature flag is refused.
    """
    patches = wanted(args)
    skipped = skipped_patches()
    if skipped:
        left_out = [p.name for p in patches if p.name in skipped]
        if os.environ.get("RANK", "0") == "0":
            print(f"megatron-patchset: {SKIP_ENV} leaves out {', '.join(left_out) or 'nothing'} "
                  f"(diagnostics: the run is not the fork's configuration)", flush=True)
        patches = [p for p in patches if p.name not in skipped]
    if upstream_mode():
        feature = [p for p in patches if p.kind == "feature"]
        if feature:
            raise PatchsetError(
                "MEGATRON_PATCHSET=off runs unpatched upstream megatron-core, but these fork "
                "flags are set: "
                + ", ".join(sorted({f for p in feature for f in p.flags}))
            )
    return apply_patches(patches)


SKIP_ENV = "MEGATRON_PATCHSET_SKIP_PATCHES"


def skipped_patches() -> set[str]:
    """Patch names in ``MEGATRON_PATCHSET_SKIP_PATCHES`` (comma-separated): left out by
    :func:`apply` even where the flags want them, to measure what one patch does (A/B runs).
    An unknown name is an error."""
    names = {n.strip() for n in os.environ.get(SKIP_ENV, "").split(",") if n.strip()}
    if names:
        load_areas()
        unknown = sorted(names - set(_REGISTRY))
        if unknown:
            raise PatchsetError(f"{SKIP_ENV}: no patch named {', '.join(unknown)}")
    return names


def upstream_mode() -> bool:
    """Whether ``MEGATRON_PATCHSET=off`` asks for the unpatched upstream path."""
    return os.environ.get("MEGATRON_PATCHSET", "").lower() in ("off", "0", "upstream")


def revert(names: Optional[Iterable[str]] = None) -> list[str]:
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


def get(name: str) -> Patch:
    load_areas()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PatchsetError(f"no patch named {name!r}; known: {', '.join(_REGISTRY)}") from None


def format_table(patches: Optional[Sequence[Patch]] = None, *, reasons: bool = False) -> str:
    """The registry as a plain-text table (what ``python -m megatron.patchset --list`` prints)."""
    rows = [("patch", "kind", "upstream target", "flag", "upstream PR")]
    if reasons:
        rows[0] = rows[0] + ("reason",)
    for p in registered() if patches is None else patches:
        row = (p.name, p.kind, p.target, " ".join(p.flags) or "(always)", p.upstream_pr)
        rows.append(row + ((p.reason,) if reasons else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [cell.ljust(widths[j]) if j < len(row) - 1 else cell for j, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
