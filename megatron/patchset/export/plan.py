"""What exporting one feature edits, and where (:func:`plan`), and whether it can be exported at
all (:func:`exportability`).

A feature's pieces go where upstream keeps its own:

* **flags**: a ``_add_<feature>_args(parser)`` group in ``megatron/training/arguments.py``,
  called from ``add_megatron_arguments``;
* **layout rules** (checked on the parsed flags): ``_validate_<feature>_args(args)`` at the
  start of ``validate_args``;
* **combination rules** and the **config hook**: ``_configure_<feature>(args, config)`` at the
  end of ``core_transformer_config_from_args`` (megatron/training/argument_utils.py), where the
  model's ``TransformerConfig`` exists, as the overlay runs them;
* **patches**: each patch's factory and what it uses, in the module of its target, with an
  ``_enable_<patch>()`` that rebinds the target as the overlay does; ``validate_args`` ends with
  ``_enable_<feature>(args)``, which calls them when the flags ask for the feature.

What several of these modules use is defined in one of them and imported by the others
(:meth:`FeaturePlan.homes`).

A rule's failure raises ``ValueError`` with one ``[rule-name] message`` line per failed rule, the
lines the overlay prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from megatron.patchset.core import features as features_mod
from megatron.patchset.core import registry
from megatron.patchset.export.edit import Region
from megatron.patchset.export.inline import Inliner, Origin, assign_names
from megatron.patchset.export.source import ExportRefused, SourceTree, digest, find_symbol

ARGUMENTS = "megatron.training.arguments"
ARGUMENT_UTILS = "megatron.training.argument_utils"


def recorded_digests() -> dict[str, str]:
    """``{target: sha256}`` of the upstream symbols the patches were written against."""
    from megatron.patchset.export import recorded

    return dict(recorded.TARGETS)


def feature_patches(feature: features_mod.Feature) -> list[registry.Patch]:
    """The feature's patches that change training (compat and observe patches stay in the
    overlay: they apply in every mode)."""
    return [p for p in feature.patches if p.kind == "feature"]


def _plain_function(fn) -> bool:
    return callable(fn) and getattr(fn, "__name__", "<lambda>") != "<lambda>"


def exportability(feature: features_mod.Feature) -> str | None:
    """None when the feature can be exported, else why not (one line)."""
    pr = feature.upstream_pr
    if not pr.exportable:
        return f"fork-only: {pr.note}"
    patches = feature_patches(feature)
    if not (patches or feature.rules or feature.add_arguments):
        return "no flags, rules or patches to export"
    if not _plain_function(feature.enabled):
        return "its predicate is not a module-level function"
    known = recorded_digests()
    for p in patches:
        if p.target not in known:
            return f"no recorded digest of {p.target} (patch {p.name})"
        if p.enabled is not None and not _plain_function(p.enabled):
            return f"patch {p.name}'s predicate is not a module-level function"
    return None


def exportable_features() -> list[features_mod.Feature]:
    return [f for f in features_mod.load() if exportability(f) is None]


@dataclasses.dataclass
class _Destination:
    module: str
    relative: str
    inliner: Inliner
    generated: list[str] = dataclasses.field(default_factory=list)  # after the inlined code
    roots: dict[str, Origin] = dataclasses.field(default_factory=dict)  # key -> origin


class FeaturePlan:
    """The regions exporting ``feature`` onto ``tree`` inserts; :class:`ExportRefused` when a
    target moved or changed (the message names the symbol)."""

    def __init__(self, feature: features_mod.Feature, tree: SourceTree):
        reason = exportability(feature)
        if reason is not None:
            raise ExportRefused(f"{feature.name} is not exportable: {reason}")
        self.feature, self.tree = feature, tree
        self.destinations: dict[str, _Destination] = {}
        self.calls: list[Region] = []
        self._collect()

    def _destination(self, module: str) -> _Destination:
        if module not in self.destinations:
            relative = self.tree.module_path(module)
            if relative is None:
                raise ExportRefused(f"{module}: the module is missing")
            parsed = self.tree.parse(relative)
            self.destinations[module] = _Destination(
                module, relative, Inliner(self.feature.name, module, parsed)
            )
        return self.destinations[module]

    def _root(self, module: str, key: str, fn) -> None:
        destination = self._destination(module)
        destination.roots[key] = destination.inliner.add(fn)

    def _collect(self) -> None:
        feature, known = self.feature, recorded_digests()
        self._patches = []
        for p in feature_patches(feature):
            symbol = find_symbol(self.tree, p.target)
            if digest(symbol) != known[p.target]:
                raise ExportRefused(
                    f"{p.target} changed since the patch {p.name} was written (its source differs "
                    "from megatron-core 0.19.2's): the feature cannot be exported onto this tree"
                )
            self._root(symbol.module, f"factory:{p.name}", p.factory)
            predicate = p.enabled or feature.enabled
            self._root(ARGUMENTS, f"predicate:{p.name}", predicate)
            self._patches.append((p, symbol))
        if feature.add_arguments is not None:
            self._root(ARGUMENTS, "flags", feature.add_arguments)
        self._layout = [r for r in feature.rules if r.phase == "layout"]
        self._combination = [r for r in feature.rules if r.phase == "combination"]
        for r in self._layout:
            self._root(ARGUMENTS, f"rule:{r.name}", r.check)
        for r in self._combination:
            self._root(ARGUMENT_UTILS, f"rule:{r.name}", r.check)
        # the rules run for the feature's users only: a run without its flags is upstream's
        if self._layout:
            self._root(ARGUMENTS, "predicate:rules", feature.enabled)
        if self._combination:
            self._root(ARGUMENT_UTILS, "predicate:rules", feature.enabled)
        if feature.configure_config is not None:
            self._root(ARGUMENT_UTILS, "configure", feature.configure_config)
        for anchor in ("add_megatron_arguments", "validate_args"):
            self._check_function(ARGUMENTS, anchor)
        if self._combination or feature.configure_config is not None:
            self._check_function(ARGUMENT_UTILS, "core_transformer_config_from_args")

    def _check_function(self, module: str, name: str) -> None:
        find_symbol(self.tree, f"{module}.{name}")

    # -- rendering ----------------------------------------------------------------------

    def names(self) -> dict[str, dict[str, Origin]]:
        """``{destination: {name: origin}}`` of the module-level names the feature adds."""
        out: dict[str, dict[str, Origin]] = {}
        for module, destination in self.destinations.items():
            for origin, names in destination.inliner.names().items():
                for name in names:
                    out.setdefault(module, {})[name] = origin
        return out

    def homes(self) -> dict[Origin, str]:
        """The module that defines each statement of the fork that several destinations use: the
        first destination (patch targets in the order of the patches, then the flags' and rules'
        modules) whose loading does not load another of them, so that the others can import it
        at their top level without a circular import."""
        users: dict[Origin, list[str]] = {}
        ordered = sorted(self.destinations, key=lambda m: m in (ARGUMENTS, ARGUMENT_UTILS))
        for module in ordered:
            destination = self.destinations[module]
            for origin in destination.inliner.order:
                users.setdefault(origin, []).append(module)
        homes = {}
        for origin, modules in users.items():
            if len(modules) < 2:
                continue
            home = next(
                (
                    m
                    for m in modules
                    if not any(self.tree.loads(m, other) for other in modules if other != m)
                ),
                None,
            )
            if home is None:
                raise ExportRefused(
                    f"{origin.module} (line {origin.line}) is used by {', '.join(modules)}, "
                    "which load each other: none of them can define it for the others"
                )
            homes[origin] = home
        return homes

    def regions(self, reserved: dict[str, dict[str, Origin]] | None = None) -> list[Region]:
        feature, name = self.feature, self.feature.name
        homes = self.homes()
        final_names = assign_names([d.inliner for d in self.destinations.values()], reserved)
        rendered: dict[str, tuple[str, dict[Origin, str]]] = {
            module: d.inliner.render(final_names, homes, set(d.roots.values()))
            for module, d in self.destinations.items()
        }

        def final(module: str, key: str) -> str:
            return rendered[module][1][self.destinations[module].roots[key]]

        generated: dict[str, list[str]] = {m: [] for m in self.destinations}
        calls: list[Region] = []
        arguments = self.destinations[ARGUMENTS].relative if ARGUMENTS in self.destinations else ""

        # patches: an _enable_<patch>() next to each target, called from validate_args
        by_predicate: dict[str, list[tuple[str, str]]] = {}
        for p, symbol in self._patches:
            enable = "_enable_" + p.name.replace(".", "_")
            factory = final(symbol.module, f"factory:{p.name}")
            generated[symbol.module].append(_enable_function(enable, factory, p, symbol))
            predicate = final(ARGUMENTS, f"predicate:{p.name}")
            by_predicate.setdefault(predicate, []).append((symbol.module, enable))
        if by_predicate:
            body = []
            for predicate, enables in by_predicate.items():
                body.append(f"    if {predicate}(args):")
                for module, enable in enables:
                    body.append(f"        from {module} import {enable}")
                    body.append(f"        {enable}()")
            generated[ARGUMENTS].append(
                f"def _enable_{name}(args):\n"
                f'    """Install the changes of {feature.title} when the flags ask for them."""\n'
                + "\n".join(body)
            )
            calls.append(Region(arguments, "return:validate_args", name, f"_enable_{name}(args)"))
        if feature.add_arguments is not None:
            generated[ARGUMENTS].append(
                f"def _add_{name}_args(parser):\n"
                f"    group = parser.add_argument_group(title={feature.title!r})\n"
                f"    {final(ARGUMENTS, 'flags')}(group)\n"
                "    return parser"
            )
            calls.append(
                Region(
                    arguments,
                    "return:add_megatron_arguments",
                    name,
                    f"parser = _add_{name}_args(parser)",
                )
            )
        if self._layout:
            generated[ARGUMENTS].append(
                _rules_function(
                    f"_validate_{name}_args",
                    "args",
                    feature.title,
                    [(r.name, final(ARGUMENTS, f"rule:{r.name}")) for r in self._layout],
                    _gate(final(ARGUMENTS, "predicate:rules"), _own_flags(feature)),
                )
            )
            calls.append(
                Region(arguments, "start:validate_args", name, f"_validate_{name}_args(args)")
            )
        if self._combination or feature.configure_config is not None:
            utils = self.destinations[ARGUMENT_UTILS]
            checks = [(r.name, final(ARGUMENT_UTILS, f"rule:{r.name}")) for r in self._combination]
            gate = None
            if checks:
                gate = _gate(final(ARGUMENT_UTILS, "predicate:rules"), _own_flags(feature))
            text = _rules_function(
                f"_configure_{name}", "args, config", feature.title, checks, gate
            )
            if feature.configure_config is not None:
                text += f"\n    {final(ARGUMENT_UTILS, 'configure')}(args, config)"
            generated[ARGUMENT_UTILS].append(text)
            calls.append(
                Region(
                    utils.relative,
                    "return:core_transformer_config_from_args",
                    name,
                    f"_configure_{name}(args, config)",
                )
            )
        regions = []
        for module, destination in self.destinations.items():
            text = "\n\n\n".join([rendered[module][0], *generated[module]])
            regions.append(Region(destination.relative, "end", name, text))
        return regions + calls


def _own_flags(feature: features_mod.Feature) -> list[tuple[str, object]]:
    """(dest, default) of each flag the feature adds."""
    if feature.add_arguments is None:
        return []
    parser = argparse.ArgumentParser(add_help=False)
    feature.add_arguments(parser.add_argument_group(feature.name))
    return [(a.dest, a.default) for a in parser._actions]


def _gate(predicate: str, flags: list[tuple[str, object]]) -> str:
    """The condition under which a feature's rules run: its predicate holds, or one of its own
    flags is set. A run with neither is upstream's and is checked as upstream checks it."""
    if not flags:
        return f"{predicate}(args)"
    pairs = ", ".join(f"({dest!r}, {default!r})" for dest, default in flags)
    return f"{predicate}(args) or any(\n        getattr(args, d) != v for d, v in ({pairs},)\n    )"


def _rules_function(
    name: str, params: str, title: str, checks: list[tuple[str, str]], gate: str | None = None
) -> str:
    """The function that runs ``checks`` when ``gate`` holds (the feature is asked for)."""
    lines = [
        f"def {name}({params}):",
        f'    """Flag combinations that {title} cannot run; raises ValueError naming each."""',
    ]
    if checks:
        body = ["failures = []", "for name, check in ("]
        body += [f"    ({rule!r}, {fn})," for rule, fn in checks]
        body += [
            "):",
            f"    message = check({params})",
            "    if message:",
            '        failures.append(f"[{name}] {message}")',
            "if failures:",
            "    raise ValueError(",
            '        f"{len(failures)} invalid flag combination(s):\\n  "',
            '        + "\\n  ".join(failures)',
            "    )",
        ]
        indent = "    "
        if gate:
            lines.append(f"    asked = {gate}")
            lines.append("    if asked:")
            indent = "        "
        lines += [indent + line for line in body]
    return "\n".join(lines)


def _enable_function(enable: str, factory: str, p: registry.Patch, symbol) -> str:
    path = symbol.path
    reason = textwrap.fill(p.reason, 88, subsequent_indent="    ")
    head = [f"def {enable}():", f'    """{reason}"""']
    if len(path) == 1:
        head.append(f"    global {path[0]}")
        rebind = f"{path[0]} = {factory}({path[0]})"
    else:
        owner, attr = ".".join(path[:-1]), path[-1]
        if "staticmethod" in symbol.decorators:
            rebind = f"{owner}.{attr} = staticmethod({factory}({owner}.{attr}))"
        elif "classmethod" in symbol.decorators:
            rebind = f"{owner}.{attr} = classmethod({factory}({owner}.__dict__[{attr!r}].__func__))"
        else:
            rebind = f"{owner}.{attr} = {factory}({owner}.{attr})"
    return "\n".join(
        head
        + [
            f"    if {enable}.enabled:",
            "        return",
            f"    {rebind}",
            f"    {enable}.enabled = True",
            "",
            "",
            f"{enable}.enabled = False",
        ]
    )


def plan(selected: list[features_mod.Feature], tree: SourceTree) -> dict[str, list[Region]]:
    """``{feature: regions}`` for ``selected`` (each refused feature raises). Names that two
    exportable features would both bring into one module are renamed the same way whichever
    features are selected."""
    plans = {f.name: FeaturePlan(f, tree) for f in selected}
    others: dict[str, FeaturePlan] = dict(plans)
    for feature in exportable_features():
        if feature.name not in others:
            try:
                others[feature.name] = FeaturePlan(feature, tree)
            except ExportRefused:
                continue
    out = {}
    for name, feature_plan in plans.items():
        reserved: dict[str, dict[str, Origin]] = {}
        for other_name, other in others.items():
            if other_name == name:
                continue
            for module, names in other.names().items():
                reserved.setdefault(module, {}).update(names)
        out[name] = feature_plan.regions(reserved)
    return out
