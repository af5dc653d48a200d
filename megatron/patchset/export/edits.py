"""Changes to upstream code written once, as text edits anchored on named definitions.

An edit names an upstream file (``megatron/training/argument_utils.py``) and a definition in it by
its qualified name (``ArgumentGroupFactory._build_argparse_kwargs_from_field``), never a line
number:

* :class:`Replace` swaps one exact piece of text that occurs once inside the definition;
* :class:`InsertAfter` adds text after the definition's last line (a new method after a named
  one, a new test class after a named class);
* :class:`NewFile` adds a file whose text is a module of this package's, under upstream's
  copyright header (the overlay runs the same module);
* :class:`OneOf` is one change written for each form a definition takes in upstream's releases
  (a line that differs between a release branch and main): the first that fits is applied.

A ``definition`` of ``""`` is the module's top level (an import line, found once in the file).

The same edit serves both uses. The export applies it to a checkout's file
(:func:`apply_to_source`), so the diff a reviewer reads is the edit itself, with upstream's
comments, annotations and layout around it. The overlay applies a :class:`Replace` to the
installed module's source of that function at import time (:func:`edited_function`), so the
patched function is the exported one. Each edit also knows whether a source already holds it
(:func:`status`): a tree with the change applied is told apart from one where upstream rewrote
the code, which refuses the edit by name.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import textwrap

from megatron.patchset.core.errors import PatchsetError

APPLIES, APPLIED, DRIFTED = "applies", "applied", "drifted"
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # megatron/patchset


class EditError(PatchsetError):
    """An edit does not fit the source: the definition is missing, or its text changed."""


@dataclasses.dataclass(frozen=True)
class Replace:
    """Replace ``old`` with ``new`` inside ``definition`` of ``path``; ``old`` occurs there once."""

    path: str
    definition: str
    old: str
    new: str


@dataclasses.dataclass(frozen=True)
class InsertAfter:
    """Insert ``text`` (whole lines, indented as they will stand) after ``definition`` of
    ``path``, separated by the blank lines given at its start."""

    path: str
    definition: str
    text: str


@dataclasses.dataclass(frozen=True)
class NewFile:
    """A new upstream file ``path``: ``header``, then the text of file ``source`` of this package
    (a path relative to ``megatron/patchset/``: the module the overlay runs, or an upstream test
    kept beside its feature)."""

    path: str
    source: str
    header: str = ""
    definition: str = ""

    def text(self) -> str:
        with open(os.path.join(PACKAGE, self.source)) as handle:
            return self.header + handle.read()


@dataclasses.dataclass(frozen=True)
class OneOf:
    """One change written for each form of upstream's code: the first of ``alternatives`` (edits
    of one file) that fits is applied; the source holds the change when it holds any of them."""

    alternatives: tuple

    def __post_init__(self):
        if not self.alternatives or len({edit.path for edit in self.alternatives}) != 1:
            raise EditError("OneOf: alternative edits of one file are needed")

    @property
    def path(self) -> str:
        return self.alternatives[0].path

    @property
    def definition(self) -> str:
        return self.alternatives[0].definition


def module_name(path: str) -> str:
    """``megatron/training/argument_utils.py`` -> ``megatron.training.argument_utils``."""
    if not path.endswith(".py"):
        raise EditError(f"{path}: an edit names a Python file")
    return path[: -len(".py")].replace("/", ".")


def _node(tree: ast.Module, qualname: str) -> ast.AST | None:
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        body = node.body
    return node


def definition_lines(source: str, qualname: str, path: str = "<source>") -> tuple[int, int]:
    """The 0-based [first, last) line range of ``qualname`` in ``source``, decorators included
    (``""``: the whole file)."""
    if not qualname:
        return 0, len(source.splitlines())
    node = _node(ast.parse(source), qualname)
    if node is None:
        raise EditError(f"{path}: no definition named {qualname} (upstream moved or renamed it)")
    first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    return first, node.end_lineno


def _split(source: str, edit, path: str) -> tuple[str, str, str]:
    first, last = definition_lines(source, edit.definition, path)
    lines = source.splitlines(keepends=True)
    return "".join(lines[:first]), "".join(lines[first:last]), "".join(lines[last:])


def status(source: str | None, edit) -> str:
    """:data:`APPLIES` (the edit fits), :data:`APPLIED` (the source already holds it) or
    :data:`DRIFTED` (the definition's text is neither upstream's nor the edited one). ``source``
    is None for a file that does not exist."""
    if isinstance(edit, OneOf):
        states = [status(source, alternative) for alternative in edit.alternatives]
        return next((s for s in (APPLIED, APPLIES) if s in states), DRIFTED)
    if isinstance(edit, NewFile):
        if source is None:
            return APPLIES
        return APPLIED if source == edit.text() else DRIFTED
    if source is None:
        return DRIFTED
    try:
        _, body, after = _split(source, edit, edit.path)
    except EditError:
        return DRIFTED
    if isinstance(edit, InsertAfter):
        return APPLIED if after.startswith(edit.text) else APPLIES
    # the edited text first: an edit may keep the old text inside the new (an added branch)
    if body.count(edit.new) == 1 and body.count(edit.old) == edit.new.count(edit.old):
        return APPLIED
    if body.count(edit.old) == 1:
        return APPLIES
    return DRIFTED


def apply_to_source(source: str | None, edit) -> str:
    """``source`` with ``edit`` applied; :class:`EditError` names the definition if it does not
    fit."""
    if isinstance(edit, OneOf):
        for alternative in edit.alternatives:
            if status(source, alternative) == APPLIES:
                return apply_to_source(source, alternative)
        return apply_to_source(source, edit.alternatives[0])  # raises, naming the first
    if isinstance(edit, NewFile):
        if source is not None:
            raise EditError(f"{edit.path}: the file exists already")
        return edit.text()
    if source is None:
        raise EditError(f"{edit.path}: not in this checkout")
    before, body, after = _split(source, edit, edit.path)
    if isinstance(edit, InsertAfter):
        return before + body + edit.text + after
    count = body.count(edit.old)
    if count != 1:
        first = edit.old.strip().splitlines()[0]
        raise EditError(
            f"{edit.path}: {edit.definition} holds the text this edit replaces {count} times, "
            f"not once (upstream changed it; first line: {first!r})"
        )
    return before + body.replace(edit.old, edit.new, 1) + after


def edited_function(original, edit: Replace):
    """The installed function ``original`` recompiled from its module's source with ``edit``
    applied, in the module's globals; its ``__wrapped__`` is ``original``. Line numbers in
    tracebacks are those of the installed file."""
    module = importlib.import_module(module_name(edit.path))
    path = inspect.getsourcefile(module)
    with open(path) as handle:
        source = handle.read()
    first, _ = definition_lines(source, edit.definition, edit.path)
    _, body, _ = _split(source, edit, edit.path)
    if status(source, edit) != APPLIES:
        raise EditError(
            f"{edit.path}: {edit.definition} in the installed megatron-core does not hold the "
            "text this edit replaces"
        )
    if "super()" in body:
        raise EditError(f"{edit.definition}: a method that calls super() cannot be recompiled")
    tree = ast.parse(textwrap.dedent(body.replace(edit.old, edit.new, 1)))
    ast.increment_lineno(tree, first)
    scope: dict = {}
    exec(compile(tree, path, "exec"), vars(module), scope)  # noqa: S102 - upstream's own source
    name = edit.definition.rsplit(".", 1)[-1]
    function = scope[name]
    function.__qualname__ = edit.definition
    function.__wrapped__ = original
    return function
