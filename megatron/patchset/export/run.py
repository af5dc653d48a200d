"""The export itself: copy the checkout's ``megatron/`` package, edit the features in, write the
patch files. Exporting twice into the same folder writes the same files."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

from megatron.patchset.core import features as features_mod
from megatron.patchset.export import edit, patchfile, uses
from megatron.patchset.export.plan import exportability, plan
from megatron.patchset.export.source import ExportRefused, SourceTree

PATCHES = "patches"
_PATCH_FILE = re.compile(r"^\d{4}-[A-Za-z0-9_]+\.patch$")
_VERSION = re.compile(r"""^\s*(MAJOR|MINOR|PATCH)\s*=\s*(\d+)""", re.MULTILINE)


@dataclasses.dataclass
class ExportResult:
    exported: list[str]  # feature names, in load order
    refused: dict[str, str]  # feature -> why
    files: list[str]  # edited files, relative to the output folder
    patches: list[str]  # patch files, relative to the output folder


def source_version(tree: SourceTree) -> str:
    """megatron-core's version as the checkout's ``package_info.py`` gives it."""
    relative = tree.module_path("megatron.core.package_info")
    if relative is None:
        return "unknown"
    found = dict(_VERSION.findall(tree.read(relative)))
    return ".".join(found.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))


def _selected(names: list[str] | None) -> tuple[list, dict[str, str]]:
    loaded = features_mod.load()
    if not names:
        chosen = [f for f in loaded if exportability(f) is None]
        return chosen, {}
    known = {f.name: f for f in loaded}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ExportRefused(f"no feature named {', '.join(unknown)}; known: {', '.join(known)}")
    return [f for f in loaded if f.name in names], {}


def _copy_package(tree: SourceTree, out: str) -> None:
    source, target = os.path.join(tree.root, "megatron"), os.path.join(out, "megatron")
    if os.path.abspath(source) == os.path.abspath(target):
        return
    if os.path.isdir(target):
        shutil.rmtree(target)
    shutil.copytree(
        source,
        target,
        ignore=lambda folder, names: [
            n
            for n in names
            if n == "__pycache__"
            or (os.path.samefile(folder, source) and n == "patchset")  # the overlay itself
        ],
    )


def export(megatron_lm: str, out: str, names: list[str] | None = None) -> ExportResult:
    """Export the named features (default: every exportable one) from the checkout at
    ``megatron_lm`` into ``out``. A feature that cannot be exported is refused (listed in the
    result with why); when every requested feature is refused, :class:`ExportRefused` is raised."""
    tree = SourceTree(megatron_lm)
    chosen, refused = _selected(names)
    regions: dict[str, list[edit.Region]] = {}
    exported = []
    installed = uses.installed_tree()
    for feature in chosen:
        try:
            regions.update(plan([feature], tree))
        except ExportRefused as exc:
            refused[feature.name] = str(exc)
            continue
        code = "\n".join(region.text for region in regions[feature.name])
        added = set().union(*(uses.bound_by(r.relative, r.text) for r in regions[feature.name]))
        lacking = uses.missing(code, tree, installed, added)
        if lacking:
            refused[feature.name] = "upstream code it uses is missing: " + "; ".join(lacking)
            continue
        exported.append(feature.name)
    if not exported:
        raise ExportRefused("; ".join(refused.values()) or "no exportable feature")
    # every feature's regions renamed consistently: plan them together
    regions = plan([f for f in chosen if f.name in exported], tree)
    version = source_version(tree)

    files: dict[str, str] = {}  # relative -> baseline (without the exported features' regions)
    for feature in exported:
        for region in regions[feature]:
            if region.relative not in files:
                files[region.relative] = tree.read(region.relative)

    def apply(features_in: list[str]) -> dict[str, str]:
        edited = {}
        for relative, baseline in files.items():
            mine = [r for f in features_in for r in regions[f] if r.relative == relative]
            edited[relative] = edit.insert(baseline, mine) if mine else baseline
        return edited

    _copy_package(tree, out)
    full = apply(exported)
    for relative, text in full.items():
        with open(os.path.join(out, relative), "w", encoding="utf-8") as handle:
            handle.write(text)

    folder = os.path.join(out, PATCHES)
    os.makedirs(folder, exist_ok=True)
    for stale in os.listdir(folder):
        if _PATCH_FILE.match(stale):
            os.remove(os.path.join(folder, stale))
    written = []
    for index, name in enumerate(exported, start=1):
        alone = apply([name])
        changes = {r: (files[r], alone[r]) for r in files if alone[r] != files[r]}
        relative = os.path.join(PATCHES, f"{index:04d}-{name}.patch")
        with open(os.path.join(out, relative), "w", encoding="utf-8") as handle:
            handle.write(patchfile.format_patch(features_mod.get(name), changes, version))
        written.append(relative)
    changed = sorted(r for r in full if full[r] != files[r])
    return ExportResult(exported, refused, changed, written)
