"""The recipe registry: every recipe module is registered, knobs parse and refuse as the launchers
do, the command line prints flags and one-line errors, and docs/recipes.md is the generated page."""

import os
import pkgutil
import shlex
import subprocess
import sys

import pytest

from megatron.patchset import recipes
from megatron.patchset.recipes import cli
from megatron.patchset.recipes.recipe import KnobError, Recipe, choice, switch, whole
from tests.unit.conftest import ROOT

# the small_batch recipe's default: TransformerEngine's norms through cuDNN
CUDNN = {"NVTE_NORM_FWD_USE_CUDNN": "1", "NVTE_NORM_BWD_USE_CUDNN": "1"}
ONE_QUEUE = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # small_batch's default, unless chunked
# what every MEMORY but max sets
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

SUPPORT = {"recipe", "cli"}


def test_every_recipe_module_is_registered_and_named_after_its_file():
    modules = {m.name for m in pkgutil.iter_modules(recipes.__path__)} - SUPPORT
    assert modules == set(recipes.ORDER)
    assert [r.name for r in recipes.all_recipes()] == list(recipes.ORDER)


@pytest.mark.parametrize("name", recipes.ORDER)
def test_every_recipe_builds_its_defaults_and_documents_itself(name):
    recipe = recipes.get(name)
    built = recipe()
    assert built.flags and all(isinstance(f, str) for f in built.flags)
    assert built.flags[0].startswith("--")
    assert sys.modules[recipe.build.__module__].__doc__.strip()
    assert all(knob.help for knob in recipe.knobs)


@pytest.mark.parametrize(
    "knob, text, message",
    [
        (whole("EP", 1, "x"), "0", "EP must be a whole number >= 1 (got '0')"),
        (whole("EP", 1, "x"), "1.5", "EP must be a whole number >= 1 (got '1.5')"),
        (switch("KERNELS", True, "x"), "yes", "KERNELS must be 0 or 1 (got 'yes')"),
        (
            choice("GRAPHS", "full", ("full", "layer", "none"), "x"),
            "foo",
            "GRAPHS must be full, layer or none (got 'foo')",
        ),
        (recipes.get("small_batch").knob("CAPACITY_FACTOR"), "inf", "must be a number >= 0"),
        (recipes.get("small_batch").knob("CAPACITY_FACTOR"), "nan", "must be a number >= 0"),
        (recipes.get("small_batch").knob("CAPACITY_FACTOR"), "1e400", "must be a number >= 0"),
    ],
)
def test_a_bad_value_is_refused_with_the_knob_named(knob, text, message):
    with pytest.raises(KnobError, match=message.replace("(", r"\(").replace(")", r"\)")):
        knob.parse(text)


def test_an_unknown_recipe_or_knob_names_what_exists():
    with pytest.raises(KnobError, match="no recipe named 'fast'; known: small_batch, "):
        recipes.get("fast")
    with pytest.raises(KnobError, match="recipe small_batch has no knob EPP; its knobs: GRAPHS"):
        recipes.get("small_batch")(EPP=2)


def test_a_recipe_refuses_a_knob_declared_twice():
    with pytest.raises(Exception, match="declared twice"):
        Recipe("x", "x", (whole("EP", 1, "a"), whole("EP", 2, "b")), build=lambda k: ())


def test_small_batch_follows_its_knobs():
    flags = recipes.flags("small_batch")
    assert "--cuda-graph-impl" in flags and flags[flags.index("--cuda-graph-impl") + 1] == (
        "full_iteration"
    )
    assert {"--adam-impl", "--cross-entropy-triton", "--optimizer-cuda-graph"} <= set(flags)
    assert "--moe-static-dispatch" not in flags
    at_ep8 = recipes.flags("small_batch", EP=8, CAPACITY_FACTOR=1.5)
    assert at_ep8[at_ep8.index("--moe-static-dispatch-capacity-factor") + 1] == "1.5"
    assert at_ep8[at_ep8.index("--expert-model-parallel-size") + 1] == "8"
    layer = recipes.flags("small_batch", GRAPHS="layer")
    assert layer[layer.index("--cuda-graph-impl") + 1] == "transformer_engine"
    assert "--moe-expert-splits-on-device" not in layer and "--adam-impl" not in layer
    plain = recipes.flags("small_batch", KERNELS=0, OPTIMIZER_GRAPH=0)
    assert not {"--adam-impl", "--cross-entropy-triton", "--optimizer-cuda-graph"} & set(plain)
    assert "--moe-static-dispatch-chunks" not in at_ep8
    # one slot per token and peer unless DEDUP=0; nothing of the static dispatch at EP 1
    assert "--moe-static-dispatch-dedup" in at_ep8
    assert "--moe-static-dispatch-dedup" not in recipes.flags("small_batch", EP=8, DEDUP=0)
    assert "--moe-static-dispatch-dedup" not in flags
    chunked = recipes.get("small_batch")(EP=8, A2A_CHUNKS=2, MEMORY="80G")
    flags = list(chunked.flags)
    assert flags[flags.index("--moe-static-dispatch-chunks") + 1] == "2"
    # the two streams need hardware queues of their own
    assert dict(chunked.env) == {
        **EXPANDABLE,
        **CUDNN,
        "CUDA_DEVICE_MAX_CONNECTIONS": "32",
    }
    assert dict(recipes.get("small_batch")(EP=8).env) == {**CUDNN, **ONE_QUEUE}
    assert "--moe-static-dispatch-chunks" not in recipes.flags("small_batch", A2A_CHUNKS=2)


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"DIST_OPT": "1"},
        {"DIST_OPT": "1", "KERNELS": "0"},
        {"KERNELS": "0"},
        {"GRAPHS": "layer", "DIST_OPT": "1"},
        {"EP": "2", "DIST_OPT": "1"},
    ],
)
@pytest.mark.parametrize("memory", ["80G", "141G", "79.5G"])
def test_small_batch_memory_budget_passes_megatrons_and_the_forks_checks(knobs, memory):
    """MEMORY=<N>G passes --memory-budget (the levers are chosen after megatron's validation,
    tests/unit/features/memory_budget) and sets expandable segments; no lever flag of its own."""
    from tests.unit.conftest import combination_failures, failures, tiny_argv, validated

    built = recipes.get("small_batch")(MEMORY=memory, **knobs)
    flags = list(built.flags)
    assert dict(built.env) == {**EXPANDABLE, **CUDNN, **ONE_QUEUE}
    assert dict(recipes.get("small_batch")(**knobs).env) == {**CUDNN, **ONE_QUEUE}
    assert flags[flags.index("--memory-budget") + 1] == memory
    assert [f for f in flags if f != "--memory-budget" and f != memory] == recipes.flags(
        "small_batch", **knobs
    )
    world = int(knobs.get("EP", 1))
    args = validated(tiny_argv(*flags), world_size=world)
    assert args.memory_budget == memory and args.recompute_granularity is None
    assert not failures(tiny_argv(*flags), world)
    assert not combination_failures(tiny_argv(*flags), world)


def test_small_batch_cudnn_norms_sets_transformer_engines_norm_backend():
    """CUDNN_NORMS (on by default) asks TransformerEngine for cuDNN's norm kernels, forward and
    backward, as environment defaults; CUDNN_NORMS=0 leaves them to TransformerEngine."""
    on = recipes.get("small_batch")(EP=8, MEMORY="80G")
    off = recipes.get("small_batch")(EP=8, MEMORY="80G", CUDNN_NORMS=0)
    assert dict(on.env) == {**EXPANDABLE, **CUDNN, **ONE_QUEUE}
    assert dict(off.env) == {**EXPANDABLE, **ONE_QUEUE}
    assert on.flags == off.flags
    assert dict(recipes.get("small_batch")(CUDNN_NORMS=0).env) == ONE_QUEUE


@pytest.mark.parametrize("graphs", ["full", "layer", "none"])
def test_small_batch_swiglu_kernels_pass_the_triton_swiglu_and_validate(graphs):
    """SWIGLU_KERNELS (on by default, in every graph mode) adds --moe-swiglu-triton, which the
    tiny SwiGLU model validates; SWIGLU_KERNELS=0 leaves megatron's activation."""
    from tests.unit.conftest import failures, tiny_argv

    on = recipes.get("small_batch")(GRAPHS=graphs)
    off = recipes.get("small_batch")(GRAPHS=graphs, SWIGLU_KERNELS=0)
    assert "--moe-swiglu-triton" in on.flags and "--moe-swiglu-triton" not in off.flags
    assert [f for f in on.flags if f != "--moe-swiglu-triton"] == list(off.flags)
    assert not failures(tiny_argv(*on.flags))
    without_swiglu = [a for a in tiny_argv(*on.flags) if a != "--swiglu"]
    assert "--swiglu (" in failures(without_swiglu)["moe-swiglu-triton-requirements"]
    assert "moe-swiglu-triton-requirements" not in failures(
        [a for a in tiny_argv(*off.flags) if a != "--swiglu"]
    )


@pytest.mark.parametrize("memory", ["80", "80g", "G", "max80G", "0.5.1G"])
def test_small_batch_memory_takes_max_moments_or_a_budget(memory):
    with pytest.raises(KnobError, match=r"MEMORY must be max, moments or <N>G \(got "):
        recipes.get("small_batch")(MEMORY=memory)


def test_small_batch_dist_opt_auto_shards_where_the_optimizer_graph_needs_it():
    """DIST_OPT=auto: the distributed optimizer at EP > 1 with the optimizer graph, where the layout
    rule refuses the unsharded one; not at EP 1 nor without the optimizer graph; 0 and 1 win."""
    from tests.unit.conftest import failures, tiny_argv

    def sharded(**knobs):
        return "--use-distributed-optimizer" in recipes.flags("small_batch", **knobs)

    assert sharded(EP=2) and sharded(EP=8, GRAPHS="full")
    assert (
        not sharded() and not sharded(EP=2, OPTIMIZER_GRAPH=0) and not sharded(EP=2, GRAPHS="layer")
    )
    assert sharded(DIST_OPT=1) and not sharded(EP=2, DIST_OPT=0)
    rule = "optimizer-graph-needs-one-norm-group"
    assert rule not in failures(tiny_argv(*recipes.flags("small_batch", EP=2)), 2)
    assert rule in failures(tiny_argv(*recipes.flags("small_batch", EP=2, DIST_OPT=0)), 2)


@pytest.mark.parametrize("knobs", [{}, {"EP": "2"}, {"KERNELS": "0", "DIST_OPT": "1"}])
def test_small_batch_memory_moments_asks_for_bf16_moments_alone(knobs):
    """MEMORY=moments: bf16 moments and expandable segments, no recomputation, no budget."""
    import torch

    from tests.unit.conftest import combination_failures, tiny_argv, validated

    moments = recipes.get("small_batch")(MEMORY="moments", **knobs)
    assert dict(moments.env) == {**EXPANDABLE, **CUDNN, **ONE_QUEUE}
    assert not {"--recompute-granularity", "--memory-budget"} & set(moments.flags)
    assert {"--adam-moments-dtype", "--exp-avg-dtype"} & set(moments.flags)
    world = int(knobs.get("EP", 1))
    args = validated(tiny_argv(*moments.flags), world_size=world)
    assert args.adam_moments_dtype == "bf16" or args.exp_avg_sq_dtype == torch.bfloat16
    assert not combination_failures(tiny_argv(*moments.flags), world)


def recipe_command(*words):
    """``python -m megatron.patchset recipe WORDS`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "megatron.patchset", "recipe", *words],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": ROOT},
    )


def test_the_command_line_prints_flags_env_and_one_line_errors():
    assert cli.main(["small_batch", "EP=4"]) == 0
    out = recipe_command("small_batch", "EP=4")
    assert out.returncode == 0
    assert shlex.split(out.stdout) == recipes.flags("small_batch", EP=4)
    lines = recipe_command("--lines", "fsdp_cuda_graphs")
    assert lines.returncode == 0
    lines = lines.stdout.splitlines()
    assert lines[0] == "env CUDA_DEVICE_MAX_CONNECTIONS=8"
    assert lines[1:] == recipes.flags("fsdp_cuda_graphs")
    bad = recipe_command("small_batch", "GRAPHS=foo")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "GRAPHS must be full, layer or none (got 'foo')\n"


def test_the_recipes_page_is_the_generated_one():
    with open(os.path.join(ROOT, "docs", "recipes.md")) as handle:
        page = handle.read()
    assert page == cli.markdown(), (
        "docs/recipes.md is stale: python -m megatron.patchset recipe --markdown > docs/recipes.md"
    )


def test_small_batch_dp_overlap_passes_megatrons_data_parallel_overlap():
    """DP_OVERLAP=1 adds megatron's --overlap-grad-reduce, and --overlap-param-gather with the
    distributed optimizer; the flags validate at EP 2, and the weight-gradient overlap's rule
    refuses the combination with WGRAD_OVERLAP=1."""
    from tests.unit.conftest import combination_failures, failures, tiny_argv, validated

    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    on = recipes.flags("small_batch", EP=2, DIST_OPT=1, DP_OVERLAP=1)
    off = recipes.flags("small_batch", EP=2, DIST_OPT=1)
    assert set(overlap) <= set(on) and not set(overlap) & set(off)
    assert [f for f in on if f not in overlap] == off
    without_dist_opt = recipes.flags("small_batch", DIST_OPT=0, DP_OVERLAP=1)
    assert "--overlap-grad-reduce" in without_dist_opt
    assert "--overlap-param-gather" not in without_dist_opt
    args = validated(tiny_argv(*on), world_size=2)
    assert args.overlap_grad_reduce and args.overlap_param_gather
    assert not failures(tiny_argv(*on), 2)
    assert not combination_failures(tiny_argv(*on), 2)
    both = recipes.flags("small_batch", EP=2, DIST_OPT=1, DP_OVERLAP=1, WGRAD_OVERLAP=1)
    refused = failures(tiny_argv(*both), 2)["moe-grouped-gemm-impl-torch-requirements"]
    assert "--overlap-grad-reduce" in refused


def test_small_batch_wgrad_sms_leaves_sms_to_the_all_to_all():
    """WGRAD_SMS=N passes --moe-wgrad-sm-carveout N, which validates with WGRAD_OVERLAP=1 at EP 2;
    without WGRAD_OVERLAP=1 or at EP 1 (where the recipe drops the overlap) the recipe refuses the
    knob, naming both."""
    from tests.unit.conftest import failures, tiny_argv, validated

    on = recipes.flags("small_batch", EP=2, DIST_OPT=1, WGRAD_OVERLAP=1, WGRAD_SMS=24)
    off = recipes.flags("small_batch", EP=2, DIST_OPT=1, WGRAD_OVERLAP=1)
    assert on[on.index("--moe-wgrad-sm-carveout") + 1] == "24"
    assert [f for f in on if f not in ("--moe-wgrad-sm-carveout", "24")] == off
    assert validated(tiny_argv(*on), world_size=2).moe_wgrad_sm_carveout == 24
    assert not failures(tiny_argv(*on), 2)
    for knobs, got in (
        (dict(EP=2, WGRAD_SMS=24), "(got WGRAD_OVERLAP=0, EP=2)"),
        (dict(EP=1, WGRAD_OVERLAP=1, WGRAD_SMS=24), "(got WGRAD_OVERLAP=1, EP=1)"),
    ):
        with pytest.raises(recipes.KnobError) as refused:
            recipes.flags("small_batch", **knobs)
        assert "only with WGRAD_OVERLAP=1 and EP > 1" in str(refused.value)
        assert str(refused.value).endswith(got)
