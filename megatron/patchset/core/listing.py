"""``python -m megatron.patchset --list``: the registry, grouped by feature, for a 100-column
terminal."""

from __future__ import annotations

from megatron.patchset.core import features, registry, rules
from megatron.patchset.core.versions import SUPPORTED_MCORE_VERSION

WIDTH = 100
# What a feature's configure_config does (README, "How the overlay works").
CONFIG_LINE = "its options copied onto megatron's TransformerConfig, read only by its patches"
# What a feature's resolve_args does (README, "How the overlay works").
RESOLVE_LINE = "megatron arguments its flag chooses, set after megatron's validation"


def wrap(text: str, indent: str, first: str | None = None, width: int = WIDTH) -> list[str]:
    """``text`` filled to ``width`` after ``first`` (then ``indent``); a word longer than a line
    (a dotted path) is broken before a dot, never inside a name."""
    lines: list[str] = []
    current, fresh = (indent if first is None else first), True
    for word in text.split():
        sep = "" if fresh else " "
        if len(current) + len(sep) + len(word) <= width:
            current, fresh = current + sep + word, False
            continue
        if not fresh:
            lines.append(current)
            current, fresh = indent, True
        while len(current) + len(word) > width:
            cut = word.rfind(".", 1, width - len(current))
            if cut <= 0:
                break
            lines.append(current + word[:cut])
            current, word = indent + "  ", word[cut:]
        current, fresh = current + word, False
    if not fresh:
        lines.append(current)
    return lines


def _patch_lines(
    patch: registry.Patch, feature: features.Feature | None, reasons: bool
) -> list[str]:
    notes = [patch.kind]
    if feature is None or patch.when != feature.switches:
        notes.append("always" if not patch.when else "on " + ", ".join(patch.when))
    lines = wrap(f"{patch.name} ({'; '.join(notes)})", "      ", "  ")
    lines += wrap(patch.target, "      ", "      ")
    if feature is None or patch.upstream != feature.upstream_pr:
        lines += wrap(str(patch.upstream), "        ", "      upstream: ")
    if reasons:
        lines += wrap(patch.reason, "        ", "      why: ")
    return lines


def _export_line(feature: features.Feature) -> str:
    """Whether ``python -m megatron.patchset export`` can export the feature, and if not why."""
    from megatron.patchset.export.changes import refusals, series
    from megatron.patchset.export.plan import exportability

    if feature.name in {change.name for change in series()}:
        command = f"python -m megatron.patchset export --series --feature {feature.name}"
        return f"yes, in the patch series ({command})"
    reason = exportability(feature)
    if reason is None:
        line = "yes (python -m megatron.patchset export --feature " + feature.name + ")"
        refusal = refusals().get(feature.name)
        return line if refusal is None else f"{line}; not in the patch series: {refusal.short}"
    return "no (fork-only)" if reason.startswith("fork-only") else f"no ({reason})"


def format_list(reasons: bool = False) -> str:
    """The text ``--list`` prints (``--list --reasons`` adds each patch's reason)."""
    loaded = features.load()
    patches = registry.registered()
    core = [p for p in patches if p.feature is None]
    out = [
        f"megatron-patchset over megatron-core {SUPPORTED_MCORE_VERSION}: {len(patches)} patches, "
        f"{len(loaded)} features (docs/features/<name>.md)",
        "",
    ]
    out.append("core: compat and observe patches, applied whenever their condition holds")
    for p in core:
        out += _patch_lines(p, None, reasons)
    for feature in loaded:
        out += [""] + wrap(f"{feature.name}: {feature.title} [{feature.status}]", "    ", "")
        out += wrap(", ".join(feature.switches) or "its library API", "      ", "  on: ")
        if feature.flags and feature.flags != feature.switches:
            out += wrap(", ".join(feature.flags), "      ", "  flags: ")
        out += wrap(str(feature.upstream_pr), "      ", "  upstream: ")
        out += wrap(_export_line(feature), "      ", "  export: ")
        if feature.configure_config is not None:
            out += wrap(CONFIG_LINE, "      ", "  config: ")
        if feature.resolve_args is not None:
            out += wrap(RESOLVE_LINE, "      ", "  resolves: ")
        feature_rules = [r.name for r in rules.all_rules() if r.feature == feature.name]
        if feature_rules:
            out += wrap(", ".join(feature_rules), "      ", "  rules: ")
        feature_patches = [p for p in patches if p.feature == feature.name]
        if not feature_patches:
            out.append("  no patches")
        for p in feature_patches:
            out += _patch_lines(p, feature, reasons)
    return "\n".join(out)
