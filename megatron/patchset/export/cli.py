"""``python -m megatron.patchset export --megatron-lm PATH --out DIR [--feature NAME ...]``."""

from __future__ import annotations

import argparse
import os
import sys

from megatron.patchset.core.errors import PatchsetError


def _out_problem(out: str) -> str | None:
    """Why ``out`` cannot be the output folder (it or a folder above it is a file), or None."""
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return "is a file, not a folder" if path == os.path.abspath(out) else f"{path} is a file"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.patchset export",
        description="Write a copy of a Megatron-LM checkout's megatron/ package with the fork's "
        "features edited into upstream's files, and one git format-patch file per feature "
        "under DIR/patches/. --list shows which features can be exported.",
    )
    parser.add_argument(
        "--megatron-lm",
        required=True,
        metavar="PATH",
        help="A Megatron-LM checkout, or megatron-core's installed source (the folder holding "
        "megatron/).",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="Output folder.")
    parser.add_argument(
        "--feature",
        action="append",
        metavar="NAME",
        help="A feature to export (repeatable). Default: every exportable feature.",
    )
    parser.add_argument(
        "--record-digests",
        action="store_true",
        help="Instead of exporting, record the digests of the patch targets in PATH (after the "
        "patches were updated for a new upstream version).",
    )
    series = parser.add_argument_group(
        "series",
        "--series writes the upstream changes declared as edits of named upstream functions "
        "(megatron/patchset/export/changes.py) as a patch series for `git am -3`: one commit "
        "each onto PATH's HEAD, made by git in a scratch clone, written by git format-patch "
        "into DIR. Changes PATH already holds are skipped.",
    )
    series.add_argument(
        "--series",
        action="store_true",
        help="Write the patch series (PATH must be the top of a git checkout with no "
        "uncommitted changes). --feature then names changes of the series.",
    )
    series.add_argument(
        "--author",
        metavar="'NAME <EMAIL>'",
        default=None,
        help="With --series: the commits' author. Default: PATH's git user.name and user.email.",
    )
    series.add_argument(
        "--date",
        default=None,
        help="With --series: the commits' date, in a form git takes (e.g. "
        "2026-11-27T12:00:00+00:00). Default: now.",
    )
    opts = parser.parse_args(argv)
    if (opts.author or opts.date) and not opts.series:
        print(f"{parser.prog}: --author and --date go with --series", file=sys.stderr)
        return 2
    problem = _out_problem(opts.out)
    if problem and not opts.record_digests:
        print(f"{parser.prog}: --out {opts.out}: {problem}", file=sys.stderr)
        return 2
    from megatron.patchset.export import digests, run
    from megatron.patchset.export.source import SourceTree

    if opts.series:
        return _series(opts)
    try:
        if opts.record_digests:
            recorded = digests.record(SourceTree(opts.megatron_lm))
            print(f"recorded {len(recorded)} target digests from {opts.megatron_lm}")
            return 0
        result = run.export(opts.megatron_lm, opts.out, opts.feature)
    except PatchsetError as exc:
        print(f"export refused: {exc}", file=sys.stderr)
        return 1
    for name, why in result.refused.items():
        print(f"refused {name}: {why}", file=sys.stderr)
    print(f"exported {', '.join(result.exported)} into {opts.out}")
    for relative in result.files:
        print(f"  edited  {relative}")
    for relative in result.patches:
        print(f"  patch   {relative}")
    return 2 if result.refused else 0


def _series(opts) -> int:
    from megatron.patchset.export import changes, series

    try:
        result = series.write_series(
            opts.megatron_lm, opts.out, changes.select(opts.feature), opts.author, opts.date
        )
    except PatchsetError as exc:
        print(f"export refused: {exc}", file=sys.stderr)
        return 1
    for name, why in result.skipped.items():
        print(f"skipped {name}: {why}")
    for name, why in result.refused.items():
        print(f"refused {name}: {why}", file=sys.stderr)
    for path in result.patches:
        print(f"  patch   {path}")
    if not result.patches and not result.refused:
        print("nothing to export: the checkout holds every change of the series")
    return 2 if result.refused else 0
