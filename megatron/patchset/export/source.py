"""A Megatron-LM checkout (or megatron-core's installed source) read as files, never imported.

:class:`SourceTree` finds the file of a dotted module path, parses it, and finds a symbol in it.
:func:`digest` fingerprints a symbol's definition (formatting and comments ignored), so that a
patch written against one version of upstream can tell whether the symbol changed since.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import os
import warnings

from megatron.patchset.core.errors import PatchsetError


class ExportRefused(PatchsetError):
    """A feature cannot be exported onto the given source; the message names the symbol."""


class SourceTree:
    """The ``megatron/`` package of a checkout: ``root`` is the folder that contains it."""

    def __init__(self, path: str):
        path = os.path.abspath(path)
        if os.path.basename(path) == "megatron" and os.path.isdir(os.path.join(path, "core")):
            path = os.path.dirname(path)
        if not os.path.isfile(os.path.join(path, "megatron", "training", "arguments.py")):
            raise PatchsetError(
                f"{path} is not a Megatron-LM checkout or megatron-core's installed source: "
                "megatron/training/arguments.py is missing"
            )
        self.root = path
        self._texts: dict[str, str] = {}
        self._imports: dict[str, frozenset[str]] = {}
        self._trees: dict[str, ast.Module] = {}

    def module_path(self, module: str) -> str | None:
        """Path relative to :attr:`root` of ``module``'s file (a package's ``__init__.py``)."""
        base = module.replace(".", "/")
        for relative in (base + ".py", base + "/__init__.py"):
            if os.path.isfile(os.path.join(self.root, relative)):
                return relative
        return None

    def read(self, relative: str) -> str:
        """The file's text without the regions an earlier export inserted: an exported tree
        reads as the upstream source it was exported from."""
        if relative not in self._texts:
            from megatron.patchset.core.provided import features_in
            from megatron.patchset.export.edit import strip

            with open(os.path.join(self.root, relative), encoding="utf-8") as handle:
                text = handle.read()
            self._texts[relative] = strip(text, set(features_in(text)))
        return self._texts[relative]

    def parse(self, relative: str) -> ast.Module:
        """The syntax tree of :meth:`read`'s text (shared: callers do not change it)."""
        if relative not in self._trees:
            with warnings.catch_warnings():  # invalid escape sequences in upstream's files
                warnings.simplefilter("ignore", SyntaxWarning)
                self._trees[relative] = ast.parse(self.read(relative))
        return self._trees[relative]

    def imports(self, module: str) -> frozenset[str]:
        """The modules of ``megatron`` that loading ``module``'s file imports at its top level
        (inside module-level ``if``/``try``/``with`` too, not under ``if TYPE_CHECKING``), with
        the packages above each."""
        if module not in self._imports:
            relative = self.module_path(module)
            found: set[str] = set()
            if relative is not None:
                package = module if relative.endswith("__init__.py") else module.rpartition(".")[0]
                for name in _top_level_imports(self.parse(relative).body, package):
                    if name.partition(".")[0] != "megatron":
                        continue
                    parts = name.split(".")
                    for i in range(1, len(parts) + 1):
                        if self.module_path(".".join(parts[:i])) is not None:
                            found.add(".".join(parts[:i]))
            found.discard(module)
            self._imports[module] = frozenset(found)
        return self._imports[module]

    def loads(self, module: str, other: str) -> bool:
        """Whether loading ``module`` may load ``other`` on the way, through top-level imports
        (the packages above ``module`` are loaded before it and do not count)."""
        parts = module.split(".")
        loaded = {".".join(parts[:i]) for i in range(1, len(parts))}
        seen, todo = set(), [module]
        while todo:
            for name in self.imports(todo.pop()):
                if name == other:
                    return True
                if name not in seen and name not in loaded:
                    seen.add(name)
                    todo.append(name)
        return False

    def split(self, dotted: str) -> tuple[str, str, list[str]]:
        """``pkg.mod.Class.attr`` -> (module, its file, ``[Class, attr]``); the longest prefix
        that is a file of the tree is the module."""
        parts = dotted.split(".")
        for i in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:i])
            relative = self.module_path(module)
            if relative is not None:
                return module, relative, parts[i:]
        raise ExportRefused(f"{dotted}: no module of it exists in {self.root}")


@dataclasses.dataclass(frozen=True)
class Symbol:
    """Where a dotted symbol is defined in a module's syntax tree.

    ``node`` is what defines it (a def, class, assignment or import); ``owner_kind`` tells how
    the last name is bound: ``module`` (a module-level name), ``class`` (in the body of a class of
    the module), ``inherited`` (a class of the module that does not define it itself) or
    ``imported`` (an attribute of a class imported into the module); ``decorators`` names the
    decorators of a method (``staticmethod``, ``classmethod``)."""

    module: str
    relative: str
    path: list[str]
    node: ast.AST
    owner_kind: str
    decorators: tuple[str, ...] = ()


def top_level_bindings(tree: ast.Module) -> dict[str, ast.stmt]:
    """Module-level names and the statement that binds each (the last one wins)."""
    found: dict[str, ast.stmt] = {}
    for stmt in tree.body:
        for name in bound_names(stmt):
            found[name] = stmt
    return found


def bound_names(stmt: ast.stmt) -> list[str]:
    """Names a module-level statement binds (including inside ``if``/``try`` blocks)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"]
    if isinstance(stmt, ast.Assign):
        return [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return [stmt.target.id] if isinstance(stmt.target, ast.Name) else []
    if isinstance(stmt, (ast.If, ast.Try, ast.With)):
        inner = list(stmt.body) + list(getattr(stmt, "orelse", []))
        inner += list(getattr(stmt, "finalbody", []))
        for handler in getattr(stmt, "handlers", []):
            inner += handler.body
        return [name for s in inner for name in bound_names(s)]
    return []


def _top_level_imports(body: list[ast.stmt], package: str) -> list[str]:
    """Dotted names the statements import when the module loads (``from a import b``: ``a`` and
    ``a.b``, which may be a module)."""
    names: list[str] = []
    for stmt in body:
        if isinstance(stmt, ast.Import):
            names += [alias.name for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (stmt.level - 1)]
                base = ".".join(parts + ([stmt.module] if stmt.module else []))
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in stmt.names if alias.name != "*"]
        elif isinstance(stmt, ast.If):
            checking = "TYPE_CHECKING" in ast.unparse(stmt.test)
            names += _top_level_imports(([] if checking else stmt.body) + stmt.orelse, package)
        elif isinstance(stmt, ast.Try):
            inner = stmt.body + stmt.orelse + stmt.finalbody
            for handler in stmt.handlers:
                inner += handler.body
            names += _top_level_imports(inner, package)
        elif isinstance(stmt, ast.With):
            names += _top_level_imports(stmt.body, package)
    return names


def find_symbol(tree_: SourceTree, dotted: str) -> Symbol:
    """Locate ``dotted`` in the source tree; :class:`ExportRefused` names it when it is gone."""
    module, relative, path = tree_.split(dotted)
    tree = tree_.parse(relative)
    first = top_level_bindings(tree).get(path[0])
    if first is None:
        raise ExportRefused(f"{dotted}: {module} no longer defines {path[0]!r}")
    if len(path) == 1:
        return Symbol(module, relative, path, first, "module")
    if not isinstance(first, ast.ClassDef):
        return Symbol(module, relative, path, first, "imported")
    owner = first
    for i, name in enumerate(path[1:], start=1):
        member = next(
            (
                s
                for s in owner.body
                if (isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
                and s.name == name
                or isinstance(s, (ast.Assign, ast.AnnAssign))
                and name in bound_names(s)
            ),
            None,
        )
        last = i == len(path) - 1
        if member is None:
            if last:
                return Symbol(module, relative, path, owner, "inherited")
            raise ExportRefused(f"{dotted}: class {owner.name} no longer defines {name!r}")
        if last:
            decorators = tuple(
                d.id for d in getattr(member, "decorator_list", []) if isinstance(d, ast.Name)
            )
            return Symbol(module, relative, path, member, "class", decorators)
        if not isinstance(member, ast.ClassDef):
            raise ExportRefused(f"{dotted}: {name} in {module} is no longer a class")
        owner = member
    raise AssertionError("unreachable")


def canonical(node: ast.AST) -> str:
    """A dump of ``node`` without positions, empty fields or docstring formatting: equal for
    sources that differ in layout and comments only, on every Python >= 3.12."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            fields.append(f"{name}={canonical(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(canonical(v) for v in node) + "]"
    return repr(node)


def digest(symbol: Symbol) -> str:
    """sha256 of the symbol's definition: the def/class/assignment/import that binds it; for an
    inherited attribute, the owner class's name and bases and the attribute's name."""
    node = symbol.node
    if symbol.owner_kind == "inherited":
        text = canonical(ast.Tuple(elts=list(node.bases), ctx=ast.Load()))
        text = f"{node.name}:{text}:{symbol.path[-1]}"
    elif symbol.owner_kind == "imported":
        text = canonical(node) + ":" + ".".join(symbol.path[1:])
    else:
        text = canonical(node)
    return hashlib.sha256(text.encode()).hexdigest()
