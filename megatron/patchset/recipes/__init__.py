"""Named recipes: the flags of each training technique, defined once.

``python -m megatron.patchset recipe --list`` prints them with their knobs;
``python -m megatron.patchset recipe NAME [KNOB=VALUE ...]`` prints one recipe's flags. The
launchers in ``examples/``, ``tools/bench/bench.py --recipe``, the tests and ``docs/recipes.md``
read them from here by name. :data:`ORDER` lists every recipe module; each defines ``RECIPE``.
"""

from __future__ import annotations

import importlib

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.recipes.recipe import Built, Knob, KnobError, Recipe

ORDER = (
    "small_batch",
    "upstream_best",
    "fsdp_cuda_graphs",
    "compile",
    "p2p_overlap",
    "flex_dispatch",
    "paged_stash",
)

__all__ = ["ORDER", "Built", "Knob", "KnobError", "Recipe", "all_recipes", "flags", "get"]


def all_recipes() -> list[Recipe]:
    """Every recipe, in :data:`ORDER`."""
    recipes = []
    for name in ORDER:
        recipe = importlib.import_module(f"{__name__}.{name}").RECIPE
        if recipe.name != name:
            raise PatchsetError(f"recipes/{name}.py defines a recipe named {recipe.name!r}")
        recipes.append(recipe)
    return recipes


def get(name: str) -> Recipe:
    """The recipe called ``name``; an unknown name raises :class:`KnobError` listing the known."""
    if name not in ORDER:
        raise KnobError(f"no recipe named {name!r}; known: {', '.join(ORDER)}")
    return importlib.import_module(f"{__name__}.{name}").RECIPE


def flags(name: str, **knobs) -> list[str]:
    """The flags of recipe ``name`` with the given knobs (``flags("small_batch", EP=8)``)."""
    return get(name).flags(**knobs)
