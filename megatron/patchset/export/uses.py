"""The upstream names an exported feature's code uses, checked in the destination checkout.

The digests (:mod:`.digests`) fingerprint what a feature's patches replace. The exported code also
calls upstream: it imports megatron names, and it calls methods of upstream classes it imports
(``layer.get_low_precision_context()`` on a ``TransformerLayerSchedulePlan``). Either may be
missing from another megatron-core version. :func:`missing` reads the feature's exported code and
finds, in the destination tree:

* every ``from megatron... import name`` (at any depth of the code) must name a module of the
  tree that binds ``name`` at its top level;
* every attribute the code reads whose name an imported upstream class defines in the installed
  megatron-core (the version the fork is written against), directly or through its bases, must
  be defined by the tree's class of the same name too.

An attribute that the installed class does not define, or a class whose bases leave megatron,
is not checked; what is reported is certain to be missing.
"""

from __future__ import annotations

import ast
import os

from megatron.patchset.export.edits import module_name
from megatron.patchset.export.source import SourceTree, bound_names

_DEPTH = 8  # base classes followed


def _imports(code: str) -> list[tuple[str, str]]:
    """(module, name) of every absolute ``from megatron... import name`` in ``code``."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "megatron":
                found += [(node.module, alias.name) for alias in node.names]
    return found


def _attributes(code: str) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Attribute)}


def _module_tree(tree: SourceTree, module: str) -> ast.Module | None:
    relative = tree.module_path(module)
    return None if relative is None else tree.parse(relative)


def binds(tree: SourceTree, module: str, name: str) -> bool:
    """Whether ``module`` of ``tree`` binds ``name`` at its top level (or is a package with a
    submodule ``name``)."""
    if tree.module_path(f"{module}.{name}") is not None:
        return True
    parsed = _module_tree(tree, module)
    return parsed is not None and any(name in bound_names(stmt) for stmt in parsed.body)


def _class(tree: SourceTree, module: str, name: str, depth: int = 0):
    """(module, ClassDef) of class ``name`` as ``module`` of ``tree`` binds it, or None."""
    parsed = _module_tree(tree, module)
    if parsed is None or depth > _DEPTH:
        return None
    for node in parsed.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in ast.walk(parsed):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name and node.module.startswith("megatron"):
                    return _class(tree, node.module, alias.name, depth + 1)
    return None


def defines(tree: SourceTree, module: str, cls: str, attr: str, depth: int = 0) -> bool | None:
    """Whether class ``cls`` (as ``module`` binds it) defines ``attr``, through its bases too:
    True, False, or None where a base leaves megatron (unknown)."""
    found = _class(tree, module, cls)
    if found is None or depth > _DEPTH:
        return None
    home, node = found
    if any(attr in bound_names(stmt) for stmt in node.body):
        return True
    unknown = False
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else None
        if name is None or name == "object":
            unknown = unknown or name is None
            continue
        answer = defines(tree, home, name, attr, depth + 1)
        if answer:
            return True
        unknown = unknown or answer is None
    return None if unknown else False


def installed_tree() -> SourceTree:
    import megatron.core

    return SourceTree(os.path.dirname(os.path.dirname(os.path.dirname(megatron.core.__file__))))


def bound_by(relative: str, code: str) -> set[tuple[str, str]]:
    """(module, name) of each name ``code`` (exported into file ``relative``) binds at its top
    level."""
    module = module_name(relative).removesuffix(".__init__")
    return {(module, name) for stmt in ast.parse(code).body for name in bound_names(stmt)}


def missing(
    code: str, tree: SourceTree, installed: SourceTree, exported: set[tuple[str, str]] = frozenset()
) -> list[str]:
    """What ``code`` uses of upstream that ``tree`` lacks, one line each; ``exported`` holds the
    (module, name) pairs the export itself adds."""
    problems = []
    imported = _imports(code)
    for module, name in imported:
        if (module, name) not in exported and not binds(tree, module, name):
            problems.append(f"{module}.{name} (imported) is not in this checkout")
    attributes = _attributes(code)
    for module, name in imported:
        if _class(installed, module, name) is None:
            continue
        for attr in sorted(attributes):
            here = defines(tree, module, name, attr)
            if here is False and defines(installed, module, name, attr):
                problems.append(
                    f"{name}.{attr} ({module}), which the exported code calls, is not defined "
                    "by this checkout's class"
                )
    return list(dict.fromkeys(problems))
