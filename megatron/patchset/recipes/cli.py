"""``python -m megatron.patchset recipe``: print a recipe's flags, its knobs, or every recipe.

    python -m megatron.patchset recipe --list
    python -m megatron.patchset recipe small_batch EP=8 DIST_OPT=1
    torchrun ... pretrain_gpt.py $(grep -v '^ *#' examples/configs/reference_moe.args) \\
        $(python -m megatron.patchset recipe small_batch)

A bad knob or an unknown recipe prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from megatron.patchset import recipes
from megatron.patchset.recipes.recipe import KnobError, Recipe

ENV_PREFIX = "env "
_INTRO = """
# Recipes

A recipe is the set of megatron flags that makes one training technique, defined once in
`megatron/patchset/recipes/` and read by name by the launchers in `examples/`,
`tools/bench/bench.py --recipe`, the tests and these docs. Model, data, batch sizes and the
job's size come from the flag file and the launcher. Print a recipe's flags for any knob
settings, or pass them to `pretrain_gpt.py` directly:

```bash
python -m megatron.patchset recipe --list
python -m megatron.patchset recipe small_batch EP=8 DIST_OPT=1
torchrun --nproc-per-node 8 pretrain_gpt.py \\
    $(grep -v '^ *#' examples/configs/reference_moe.args) \\
    $(python -m megatron.patchset recipe small_batch EP=8)
```

A launcher takes the same knobs as environment variables
(`EP=8 bash examples/pretrain_moe_small_batch.sh`). This page is generated:
`python -m megatron.patchset recipe --markdown > docs/recipes.md`.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.patchset recipe",
        description="The flags of a named recipe (one line, shell-quoted), for KNOB=VALUE "
        "settings over its defaults. docs/recipes.md lists every recipe.",
    )
    parser.add_argument("name", nargs="?", help="the recipe, e.g. small_batch")
    parser.add_argument("settings", nargs="*", metavar="KNOB=VALUE", help="knob settings")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--list", action="store_true", help="every recipe with its knobs")
    form.add_argument(
        "--lines",
        action="store_true",
        help="one flag a line, after the environment defaults as 'env NAME=VALUE' lines",
    )
    form.add_argument("--knobs", action="store_true", help="the recipe's knob names, one a line")
    form.add_argument("--markdown", action="store_true", help="every recipe as docs/recipes.md")
    return parser


def _settings(recipe: Recipe, pairs: list[str]) -> dict[str, str]:
    settings = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise KnobError(
                f"{pair!r}: expected KNOB=VALUE (knobs of {recipe.name}: "
                + ", ".join(k.name for k in recipe.knobs)
                + ")"
            )
        recipe.knob(name)
        settings[name] = value
    return settings


def listing() -> str:
    lines = []
    for recipe in recipes.all_recipes():
        lines.append(f"{recipe.name}: {recipe.summary}")
        lines += [f"    {knob.describe()}" for knob in recipe.knobs]
    return "\n".join(lines)


def markdown() -> str:
    """docs/recipes.md: every recipe's purpose, knobs and default flags."""
    out = [_INTRO.strip()]
    for recipe in recipes.all_recipes():
        doc = (sys.modules[recipe.build.__module__].__doc__ or "").strip().replace("``", "`")
        built = recipe()
        out += ["", f"## {recipe.name}", "", doc, "", "| knob | default | values | what |"]
        out += ["|---|---|---|---|"]
        for knob in recipe.knobs:
            values = "\\|".join(knob.values_text) if knob.choices else knob.kind
            out.append(f"| `{knob.name}` | `{knob.default}` | {values} | {knob.help} |")
        out += ["", "Default flags:", "", "```", _wrap(shlex.join(built.flags)), "```"]
        if built.env:
            out += [
                "",
                "Environment (a value already set wins): "
                + ", ".join(f"`{name}={value}`" for name, value in built.env),
            ]
    return "\n".join(out) + "\n"


def _wrap(text: str, width: int = 96) -> str:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line + " \\")
            line = "    " + word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join(lines + [line])


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    try:
        if opts.list:
            print(listing())
            return 0
        if opts.markdown:
            sys.stdout.write(markdown())
            return 0
        if opts.name is None:
            raise KnobError("name a recipe (python -m megatron.patchset recipe --list)")
        recipe = recipes.get(opts.name)
        if opts.knobs:
            print("\n".join(k.name for k in recipe.knobs))
            return 0
        built = recipe(_settings(recipe, opts.settings))
    except KnobError as exc:
        print(exc, file=sys.stderr)
        return 2
    if opts.lines:
        print("\n".join([f"{ENV_PREFIX}{n}={v}" for n, v in built.env] + list(built.flags)))
    else:
        print(shlex.join(built.flags))
    return 0
