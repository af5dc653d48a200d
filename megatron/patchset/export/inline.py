"""The fork's own code, made self-contained for one upstream module.

An :class:`Inliner` starts from some of the fork's functions (a patch factory, a rule, a flag
function) and collects everything they use from the fork's modules: module-level functions,
classes and constants, followed through the fork's imports (``from .flags import X``,
``fsdp_hooks.mark_hook``), in an order where each definition comes after what it needs. What they
use from outside the fork (torch, the standard library, megatron itself) becomes an import in the
destination module, or the destination's own name when it is defined there. The result imports
nothing of ``megatron.patchset``; the overlay's registry (``@patch``, ``@rule``) is left out.

Annotations of functions are dropped (the destination may not postpone their evaluation), class
bodies keep theirs (dataclass fields need them), and so do functions a decorator named ``jit``
compiles (``triton.jit`` reads ``tl.constexpr`` from them). Docstrings stay; comments do not survive
``ast.unparse``. A name that would clash with one the destination defines, or with a different
definition another feature brings into the same module, is prefixed with the feature's name.

A statement that several destinations of one feature collect is defined in one of them (its home,
chosen by the plan) and imported into the others under the same name (:func:`assign_names`), so
that each class, function and piece of module state exists once.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import importlib
import importlib.util
import inspect
import symtable
import sys

from megatron.patchset.export.source import ExportRefused, bound_names, top_level_bindings

FORK = "megatron.patchset"
# The overlay's machinery: never part of an export.
_MACHINERY = ("megatron.patchset.core.registry", "megatron.patchset.core.features")
_RULES = "megatron.patchset.core.rules"
_RULE_HELPERS = ("listed",)
_MODULE_NAMES = {"__name__", "__file__", "__doc__", "__spec__", "__package__"}


def _from_import(module: str, names: list[str]) -> str:
    line = f"from {module} import {', '.join(names)}"
    if len(line) <= 100:
        return line
    return f"from {module} import (\n" + "".join(f"    {n},\n" for n in names) + ")"


def is_fork(module: str) -> bool:
    return module == FORK or module.startswith(FORK + ".")


@dataclasses.dataclass(frozen=True)
class Origin:
    """A module-level statement of the fork (``key``: its module and first line)."""

    module: str
    line: int


@dataclasses.dataclass(frozen=True)
class External:
    """``from module import attr`` (``attr`` None: ``import module``)."""

    module: str
    attr: str | None


@dataclasses.dataclass(frozen=True)
class ForkModule:
    module: str


_BUILTIN = "builtin"


class _ForkSources:
    """Parsed source of the fork's modules, by module name."""

    def __init__(self):
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            self._trees[module] = ast.parse(inspect.getsource(importlib.import_module(module)))
        return self._trees[module]

    def bindings(self, module: str) -> dict[str, ast.stmt]:
        return top_level_bindings(self.tree(module))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if _is_package(module) else module.rpartition(".")[0]
    return importlib.util.resolve_name("." * node.level + (node.module or ""), package)


def _is_package(module: str) -> bool:
    return hasattr(sys.modules.get(module) or importlib.import_module(module), "__path__")


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def free_names(source: str) -> set[str]:
    """Names ``source`` (module-level statements) reads or declares global without binding."""
    table = symtable.symtable(source, "<export>", "exec")
    names: set[str] = set()

    def walk(tab, top):
        for sym in tab.get_symbols():
            if top:
                if sym.is_referenced() and not (sym.is_assigned() or sym.is_imported()):
                    names.add(sym.get_name())
            elif sym.is_global() and (sym.is_referenced() or sym.is_assigned()):
                names.add(sym.get_name())
        for child in tab.get_children():
            walk(child, False)

    walk(table, True)
    return names


def _read_by_a_jit(node) -> bool:
    """Whether a decorator named ``jit`` (``triton.jit``) compiles the function: it reads the
    parameters' annotations (``tl.constexpr``), so they stay."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == "jit":
            return True
    return False


class _StripAnnotations(ast.NodeTransformer):
    """Drop annotations outside class bodies (dataclass fields keep theirs)."""

    def __init__(self):
        self.in_class = [False]

    def _function(self, node):
        if not _read_by_a_jit(node):
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                arg.annotation = None
            for arg in (node.args.vararg, node.args.kwarg):
                if arg is not None:
                    arg.annotation = None
            node.returns = None
        self.in_class.append(False)
        self.generic_visit(node)
        self.in_class.pop()
        if not node.body:
            node.body = [ast.Pass()]
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node):
        self.in_class.append(True)
        self.generic_visit(node)
        self.in_class.pop()
        return node

    def visit_AnnAssign(self, node):
        if self.in_class[-1]:
            return node
        if node.value is None or not isinstance(node.target, ast.Name):
            return None if node.value is None else ast.Assign([node.target], node.value)
        return ast.Assign(targets=[node.target], value=node.value)


class _LiftForkImports(ast.NodeTransformer):
    """Remove ``from megatron.patchset... import x`` inside functions; record what they bound."""

    def __init__(self, module: str):
        self.module = module
        self.lifted: dict[str, tuple[str, str]] = {}
        self.depth = 0

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
        if not node.body:
            node.body = [ast.Pass()]
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ImportFrom(self, node):
        source = _absolute(self.module, node)
        if self.depth == 0 or not is_fork(source):
            return node
        for alias in node.names:
            self.lifted[alias.asname or alias.name] = (source, alias.name)
        return None

    def visit_Import(self, node):
        if self.depth and any(is_fork(a.name) for a in node.names):
            raise ExportRefused(f"{self.module}: 'import {node.names[0].name}' inside a function")
        return node


class _Rename(ast.NodeTransformer):
    """Rename names and rewrite ``fork_module.attr`` to a plain name."""

    def __init__(self, names: dict[str, str], attributes: dict[tuple[str, str], str]):
        self.names, self.attributes = names, attributes

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and (node.value.id, node.attr) in self.attributes:
            return ast.copy_location(
                ast.Name(self.attributes[node.value.id, node.attr], node.ctx), node
            )
        self.generic_visit(node)
        return node

    def visit_Name(self, node):
        node.id = self.names.get(node.id, node.id)
        return node

    def visit_arg(self, node):
        node.arg = self.names.get(node.arg, node.arg)
        self.generic_visit(node)
        return node

    def _named(self, node):
        node.name = self.names.get(node.name, node.name)
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _named

    def visit_Global(self, node):
        node.names = [self.names.get(n, n) for n in node.names]
        return node

    visit_Nonlocal = visit_Global


@dataclasses.dataclass
class _Unit:
    origin: Origin
    node: ast.stmt
    names: list[str]  # what it binds
    uses: dict[str, object]  # free name -> Origin/External/ForkModule/_BUILTIN
    attributes: dict[tuple[str, str], Origin]  # (fork module alias, attr) -> origin


class Inliner:
    """Collects fork code for one destination module (``destination``: its dotted name and
    module-level bindings, from the upstream source)."""

    def __init__(
        self,
        feature: str,
        destination: str,
        destination_tree: ast.Module,
        sources: _ForkSources | None = None,
    ):
        self.feature = feature
        self.destination = destination
        self.taken = top_level_bindings(destination_tree)
        self.sources = sources or _ForkSources()
        self.units: dict[Origin, _Unit] = {}
        self.order: list[Origin] = []
        self._visiting: set[Origin] = set()

    # -- resolving names of the fork ----------------------------------------------------

    def _resolve(self, module: str, name: str, lifted: dict | None = None):
        if lifted and name in lifted:
            source, attr = lifted[name]
            return self._resolve_from(source, attr, module)
        stmt = self.sources.bindings(module).get(name)
        if stmt is None:
            if name in _MODULE_NAMES or hasattr(builtins, name):
                return _BUILTIN
            raise ExportRefused(f"{module}: cannot find what {name!r} is")
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    target = alias.name if alias.asname else alias.name.split(".")[0]
                    return ForkModule(target) if is_fork(target) else External(target, None)
        if isinstance(stmt, ast.ImportFrom):
            source = _absolute(module, stmt)
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    return self._resolve_from(source, alias.name, module)
        return Origin(module, stmt.lineno)

    def _resolve_from(self, source: str, attr: str, user: str):
        if not is_fork(source):
            return External(source, attr)
        if _is_module(f"{source}.{attr}"):
            return ForkModule(f"{source}.{attr}")
        machinery = source in _MACHINERY or (source == _RULES and attr not in _RULE_HELPERS)
        if machinery and not isinstance(self.sources.bindings(source).get(attr), ast.ImportFrom):
            raise ExportRefused(f"{user} uses the overlay's {source}.{attr}")
        return self._resolve(source, attr)

    def _statement(self, origin: Origin) -> ast.stmt:
        for stmt in self.sources.tree(origin.module).body:
            if stmt.lineno == origin.line:
                return stmt
        raise AssertionError(origin)

    # -- collecting ---------------------------------------------------------------------

    def add(self, obj) -> Origin:
        """Add a module-level function or class of the fork (and what it uses)."""
        module, name = getattr(obj, "__module__", None), getattr(obj, "__name__", None)
        if not module or not is_fork(module) or name == "<lambda>":
            raise ExportRefused(f"{obj!r} is not a module-level function or class of the fork")
        found = self._resolve(module, name)
        if (
            not isinstance(found, Origin)
            or getattr(importlib.import_module(module), name) is not obj
        ):
            raise ExportRefused(f"{module}.{name} is not defined at the top of its module")
        self._visit(found)
        return found

    def _strip_machinery_decorators(self, module: str, node: ast.stmt) -> None:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        kept = []
        for decorator in node.decorator_list:
            head = decorator.func if isinstance(decorator, ast.Call) else decorator
            if isinstance(head, ast.Name):
                try:
                    self._resolve(module, head.id)
                except ExportRefused:
                    continue  # @patch(...) / @rule(...): the overlay's machinery
            kept.append(decorator)
        node.decorator_list = kept

    def _visit(self, origin: Origin) -> None:
        if origin in self.units or origin in self._visiting:
            return
        self._visiting.add(origin)
        node = copy.deepcopy(self._statement(origin))
        self._strip_machinery_decorators(origin.module, node)
        node = _StripAnnotations().visit(node)
        lifter = _LiftForkImports(origin.module)
        node = lifter.visit(node)
        ast.fix_missing_locations(node)
        uses: dict[str, object] = {}
        attributes: dict[tuple[str, str], Origin] = {}
        for name in sorted(free_names(ast.unparse(node))):
            found = self._resolve(origin.module, name, lifter.lifted)
            if isinstance(found, ForkModule):
                for attr in sorted(self._attributes_of(node, name, origin)):
                    target = self._resolve(found.module, attr)
                    if not isinstance(target, Origin):
                        raise ExportRefused(
                            f"{origin.module}: {name}.{attr} is not defined in {found.module}"
                        )
                    attributes[name, attr] = target
                    self._visit(target)
            elif isinstance(found, Origin):
                self._visit(found)
            uses[name] = found
        self._visiting.discard(origin)
        self.units[origin] = _Unit(origin, node, bound_names(node), uses, attributes)
        self.order.append(origin)

    @staticmethod
    def _attributes_of(node: ast.AST, alias: str, origin: Origin) -> set[str]:
        used, bare = set(), 0
        parents = {
            child: parent for parent in ast.walk(node) for child in ast.iter_child_nodes(parent)
        }
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id == alias:
                parent = parents.get(sub)
                if isinstance(parent, ast.Attribute) and parent.value is sub:
                    used.add(parent.attr)
                else:
                    bare += 1
        if bare:
            raise ExportRefused(f"{origin.module}: the fork module {alias!r} is used as a value")
        return used

    # -- emitting -----------------------------------------------------------------------

    def names(self) -> dict[Origin, dict[str, str]]:
        """The module-level names each collected statement binds (before renaming)."""
        return {o: {n: n for n in self.units[o].names} for o in self.order}

    def render(
        self,
        final: dict[tuple[Origin, str], str],
        homes: dict[Origin, str] | None = None,
        roots: set[Origin] | frozenset[Origin] = frozenset(),
    ) -> tuple[str, dict[Origin, str]]:
        """The source to add to the destination (imports, then definitions in dependency order)
        and each collected statement's final name (``final``: see :func:`assign_names`).

        ``homes``: the module that defines each statement the feature shares between modules;
        the others import it from there (what ``roots`` -- the statements the generated code
        calls -- and the statements defined here use)."""
        homes = homes or {}
        here = [o for o in self.order if homes.get(o, self.destination) == self.destination]
        seen = {final[o, n] for o in self.order for n in self.units[o].names}
        needed = set(roots)
        for origin in here:
            unit = self.units[origin]
            needed.update(u for u in unit.uses.values() if isinstance(u, Origin))
            needed.update(unit.attributes.values())
        shared: dict[str, set[str]] = {}
        for origin in self.order:
            if origin in needed and homes.get(origin, self.destination) != self.destination:
                names = {final[origin, n] for n in self.units[origin].names}
                shared.setdefault(homes[origin], set()).update(names)
        imports: dict[External, str] = {}
        for origin in here:
            for name, used in self.units[origin].uses.items():
                if isinstance(used, External) and used not in imports:
                    imports[used] = self._import_name(name, used, seen)
        blocks = []
        lines = sorted(
            self._import_line(external, local)
            for external, local in imports.items()
            if self._import_line(external, local)
        ) + [_from_import(module, sorted(names)) for module, names in sorted(shared.items())]
        if lines:
            blocks.append("\n".join(lines))
        for origin in here:
            unit = self.units[origin]
            mapping = {n: final[origin, n] for n in unit.names}
            for name, used in unit.uses.items():
                if isinstance(used, Origin):
                    mapping[name] = self._final_of(used, name, final)
                elif isinstance(used, External):
                    mapping[name] = imports[used]
            attributes = {
                key: self._final_of(target, key[1], final)
                for key, target in unit.attributes.items()
            }
            node = _Rename({k: v for k, v in mapping.items() if k != v}, attributes).visit(
                copy.deepcopy(unit.node)
            )
            blocks.append(ast.unparse(ast.fix_missing_locations(node)))
        names = {o: final[o, self.units[o].names[0]] for o in self.order if self.units[o].names}
        return "\n\n\n".join(blocks), names

    def _final_of(self, origin: Origin, used_as: str, final) -> str:
        unit = self.units[origin]
        if (origin, used_as) in final:
            return final[origin, used_as]
        # imported under another name (``from .flags import FLAG as X``): the statement binds
        # one name only in that case
        return final[origin, unit.names[0]] if len(unit.names) == 1 else used_as

    def _import_name(self, name: str, external: External, seen: set[str]) -> str:
        if external.module == self.destination and external.attr is not None:
            if external.attr not in self.taken:
                raise ExportRefused(f"{self.destination} no longer defines {external.attr!r}")
            return external.attr
        stmt = self.taken.get(name)
        if stmt is None and name not in seen:
            return name
        if stmt is not None and self._binds(stmt, name) == external:
            return name
        return f"_{self.feature}_{name.lstrip('_')}"

    def _binds(self, stmt: ast.stmt, name: str) -> External | None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return External(alias.name if alias.asname else name, None)
        if isinstance(stmt, ast.ImportFrom):
            source = stmt.module if not stmt.level else "." * stmt.level + (stmt.module or "")
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    return External(source, alias.name)
        return None

    def _import_line(self, external: External, local: str) -> str:
        if external.module == self.destination:
            return ""
        stmt = self.taken.get(local)
        if stmt is not None and self._binds(stmt, local) == external:
            return ""
        if external.attr is None:
            if local == external.module.split(".")[0] and "." not in external.module:
                return f"import {external.module}"
            return f"import {external.module} as {local}"
        if local == external.attr:
            return f"from {external.module} import {external.attr}"
        return f"from {external.module} import {external.attr} as {local}"


def assign_names(
    inliners: list[Inliner], reserved: dict[str, dict[str, Origin]] | None = None
) -> dict[tuple[Origin, str], str]:
    """``{(statement, name it binds): final name}`` for the statements of one feature's
    inliners. A statement that several destinations use keeps one name in all of them (it is
    defined in one and imported into the others): its own, or -- where that would clash in any
    of them with a name the module defines, another statement of the fork or one that another
    feature brings in (``reserved``: ``{module: {name: origin}}``) -- prefixed with the
    feature's name."""
    reserved = reserved or {}
    final: dict[tuple[Origin, str], str] = {}
    seen: dict[str, dict[str, Origin]] = {i.destination: {} for i in inliners}
    named: set[Origin] = set()
    for inliner in inliners:
        for origin in inliner.order:
            if origin in named:
                continue
            named.add(origin)
            users = [i for i in inliners if origin in i.units]
            for name in inliner.units[origin].names:
                clash = any(
                    name in user.taken
                    or reserved.get(user.destination, {}).get(name, origin) != origin
                    or seen[user.destination].get(name, origin) != origin
                    for user in users
                )
                chosen = f"_{inliner.feature}_{name.lstrip('_')}" if clash else name
                final[origin, name] = chosen
                for user in users:
                    seen[user.destination][chosen] = origin
    return final
