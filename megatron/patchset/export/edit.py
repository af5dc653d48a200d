"""Marked regions in upstream source files: strip the ones a file already has, insert new ones.

Every region the export inserts lies between ``# >>> megatron-patchset export: <feature>`` and
``# <<< megatron-patchset export: <feature>``, so that exporting onto an exported tree replaces
its regions instead of adding them twice. A region goes at one of three anchors: the end of the
module (``end``), the start of a module-level function's body after its docstring
(``start:<function>``) or just before the function's final ``return`` (``return:<function>``).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap

from megatron.patchset.core.provided import BEGIN, END
from megatron.patchset.export.source import ExportRefused


@dataclasses.dataclass(frozen=True)
class Region:
    relative: str  # file, relative to the tree's root
    anchor: str
    feature: str
    text: str  # code at column 0


def strip(text: str, features: set[str]) -> str:
    """``text`` without the regions of ``features`` (and the blank lines an end region adds)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    skipping = None
    pattern = re.compile(r"^([ \t]*)" + re.escape(BEGIN) + r"([A-Za-z0-9_]+)\b")
    for line in lines:
        if skipping is not None:
            if line.strip().startswith(END + skipping):
                skipping = None
            continue
        match = pattern.match(line)
        if match and match.group(2) in features:
            skipping = match.group(2)
            if not match.group(1):  # a module-level region: drop the two blank lines before it
                for _ in range(2):
                    if out and not out[-1].strip():
                        out.pop()
            continue
        out.append(line)
    if skipping is not None:
        raise ExportRefused(f"an export region of {skipping} has no end marker")
    return "".join(out)


def _function(tree: ast.Module, name: str, relative: str) -> ast.FunctionDef:
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            return stmt
    module = relative.removesuffix(".py").replace("/", ".")
    raise ExportRefused(f"{module}.{name}: the function is missing")


def insert(text: str, regions: list[Region]) -> str:
    """``text`` with ``regions`` inserted (they belong to one file), in the given order."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    at_line: dict[int, list[str]] = {}  # insert before this 0-based line
    tail: list[str] = []
    for region in regions:
        begin, end = f"{BEGIN}{region.feature}", f"{END}{region.feature}"
        if region.anchor == "end":
            tail.append(f"\n\n{begin}\n{region.text.rstrip()}\n{end}\n")
            continue
        kind, _, name = region.anchor.partition(":")
        function = _function(tree, name, region.relative)
        body = function.body
        if kind == "start":
            first = body[0]
            docstring = (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            )
            target = body[1] if docstring and len(body) > 1 else first
        elif kind == "return":
            target = body[-1]
            if not isinstance(target, ast.Return):
                raise ExportRefused(
                    f"{region.relative}: {name} no longer ends with a return statement"
                )
        else:
            raise ValueError(region.anchor)
        indent = " " * target.col_offset
        first_line = min(
            [target.lineno] + [d.lineno for d in getattr(target, "decorator_list", [])]
        )
        block = f"{begin}\n{region.text.rstrip()}\n{end}\n"
        at_line.setdefault(first_line - 1, []).append(textwrap.indent(block, indent))
    out = []
    for index, line in enumerate(lines):
        out.extend(at_line.get(index, []))
        out.append(line)
    result = "".join(out)
    if tail:
        result = result.rstrip("\n") + "\n" + "".join(tail)
    return result
