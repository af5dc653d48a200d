"""Each launcher runs its named recipe: for the same knobs, the flags a launcher would launch with
(its DRY_RUN=1 command) carry every flag of the recipe with the recipe's value, so no copy of a
recipe in a launcher can drift; the Slurm form of a recipe launches the same recipe flags as the
local one."""

import pytest

from megatron.patchset import recipes

# launcher -> (recipe, knob settings to try besides the defaults, the launcher's own knob defaults
# that it passes to the recipe)
LAUNCHERS = {
    "examples/pretrain_moe_small_batch.sh": (
        "small_batch",
        {"EP": "2", "NGPUS": "2", "MEMORY": "80G"},
        {},
    ),
    "examples/slurm/pretrain_moe_small_batch.sbatch": (
        "small_batch",
        {"GRAPHS": "layer", "KERNELS": "0", "MEMORY": "80G"},
        {"DIST_OPT": "1"},
    ),
    "examples/pretrain_moe_fsdp_cuda_graphs.sh": ("fsdp_cuda_graphs", {"SCOPES": "attn"}, {}),
    "examples/slurm/pretrain_moe_fsdp_cuda_graphs.sbatch": (
        "fsdp_cuda_graphs",
        {"GRAPHS": "0"},
        {"EP": "8"},
    ),
    "examples/pretrain_moe_compile.sh": ("compile", {"MODE": "max-autotune"}, {"EP": "1"}),
    "examples/pretrain_moe_p2p_overlap.sh": ("p2p_overlap", {"TL_WGRAD": "0"}, {}),
    "examples/slurm/pretrain_moe_p2p_overlap.sbatch": ("p2p_overlap", {"DELAYED_LAYERS": "1"}, {}),
    "examples/pretrain_moe_deepep.sh": ("flex_dispatch", {"BACKEND": "ncclep"}, {"EP": "2"}),
    "examples/pretrain_moe_paged_stash.sh": ("paged_stash", {"BACKEND": "hybridep"}, {}),
}


def final_values(argv):
    """flag -> the values of its last occurrence (megatron's parser keeps the last)."""
    values, flag = {}, None
    for word in argv:
        if word.startswith("--"):
            flag = word
            values[flag] = []
        elif flag is not None:
            values[flag].append(word)
    return values


def recipe_flags_in(launched, recipe_flags):
    launched, wanted = final_values(launched), final_values(recipe_flags)
    return {
        flag: (value, launched.get(flag))
        for flag, value in wanted.items()
        if launched.get(flag) != value
    }


@pytest.mark.parametrize("script", sorted(LAUNCHERS))
@pytest.mark.parametrize("tried", ["defaults", "knobs"])
def test_a_launcher_launches_its_recipes_flags(script, tried, launched_flags):
    name, knobs, own = LAUNCHERS[script]
    knobs = knobs if tried == "knobs" else {}
    launched = launched_flags(script, **knobs)
    recipe = recipes.get(name)
    settings = {k: v for k, v in {**own, **knobs}.items() if k in {x.name for x in recipe.knobs}}
    differ = recipe_flags_in(launched, recipe.flags(settings))
    assert not differ, f"{script} differs from recipe {name} (flag: (recipe, launcher)): {differ}"


def test_the_check_catches_a_launcher_that_overrides_its_recipe():
    flags = recipes.flags("small_batch")
    assert recipe_flags_in(flags + ["--cuda-graph-impl", "local"], flags) == {
        "--cuda-graph-impl": (["full_iteration"], ["local"])
    }
    assert recipe_flags_in(flags[1:], flags) == {"--manual-gc": ([], None)}


@pytest.mark.parametrize(
    "knobs", [{}, {"EP": "8", "GRAPHS": "full", "MEMORY": "80G"}, {"GRAPHS": "layer"}]
)
def test_the_slurm_form_launches_the_local_forms_recipe_flags(knobs, launched_flags):
    local = final_values(
        launched_flags("examples/pretrain_moe_small_batch.sh", DIST_OPT="1", **knobs)
    )
    slurm = final_values(launched_flags("examples/slurm/pretrain_moe_small_batch.sbatch", **knobs))
    recipe = final_values(recipes.flags("small_batch", DIST_OPT=1, **knobs))
    assert {f: local[f] for f in recipe} == {f: slurm[f] for f in recipe} == recipe


@pytest.mark.parametrize(
    "knobs",
    [{}, {"EP": "8", "GRAPHS": "full", "MEMORY": "80G"}, {"EP": "8", "A2A_CHUNKS": "2"}],
)
def test_the_slurm_form_starts_with_the_local_forms_recipe_environment(knobs, launched_env):
    """The recipe's environment defaults (the hardware queues, the allocator, cuDNN's norms)
    reach the training processes of both forms with the recipe's values: no line of either form
    overrides them."""
    built = recipes.get("small_batch")({"DIST_OPT": "1", **knobs})
    assert built.env, "the recipe sets no environment to compare"
    local = launched_env("examples/pretrain_moe_small_batch.sh", DIST_OPT="1", **knobs)
    slurm = launched_env("examples/slurm/pretrain_moe_small_batch.sbatch", **knobs)
    for var, value in built.env:
        assert (local.get(var), slurm.get(var)) == (value, value), var
