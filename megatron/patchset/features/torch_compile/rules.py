"""Rules for ``--compile-transformer-layers``.

--compile-transformer-layers compiles each TransformerLayer's forward. Refused: combinations
where the compiled forward would never run (the fine-grained EP-overlap schedule calls the
layer's parts directly), would be captured by megatron's CUDA graphs, or would have every
submodule's hook or checkpoint boundary traced inside it (a graph break at each).
"""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.torch_compile.flags import (
    BACKEND_FLAG,
    CUDA_GRAPH_MODES,
    FLAG,
    FLAGS,
    MODE_FLAG,
    WARMUP_FLAG,
    flags_given,
    requested,
)


@rule("compile-transformer-layers-options", phase="layout", flags=FLAGS)
def _compile_options(args):
    """Mode, backend and warm-up: only with the flag, no inductor CUDA-graph modes."""
    given = flags_given(args)
    if not requested(args):
        return f"{', '.join(given)} only act with {FLAG}: add it or drop them." if given else None
    problems = []
    mode, backend = args.compile_transformer_layers_mode, args.compile_transformer_layers_backend
    if mode in CUDA_GRAPH_MODES:
        problems.append(
            f"{MODE_FLAG} {mode} records inductor CUDA graph trees per compiled region, which this "
            "version does not support next to the eager MoE regions and megatron's own graphs "
            "(use default or max-autotune-no-cudagraphs; CUDA graphs: --cuda-graph-impl)"
        )
    if mode != "default" and backend != "inductor":
        problems.append(f"{MODE_FLAG} {mode} is an inductor mode, but {BACKEND_FLAG} is {backend}")
    if args.compile_transformer_layers_warmup_iters < 1:
        problems.append(
            f"{WARMUP_FLAG} {args.compile_transformer_layers_warmup_iters} (at least 1: the first "
            "iteration compiles)"
        )
    return listed("", problems)


@rule(
    "compile-transformer-layers-not-cuda-graphed",
    phase="layout",
    flags=(FLAG, "--cuda-graph-impl", "--overlap-moe-expert-parallel-comm"),
)
def _compile_not_graphed(args):
    """A compiled layer must run through its forward, not a CUDA graph or the fine-grained plan."""
    if not requested(args):
        return None
    problems = []
    if args.cuda_graph_impl != "none":
        problems.append(
            f"--cuda-graph-impl {args.cuda_graph_impl} (megatron's capture calls the layers "
            "outside and around their forward, and a capture of compiled code with eager MoE "
            "regions is untested)"
        )
    if args.overlap_moe_expert_parallel_comm:
        problems.append(
            "--overlap-moe-expert-parallel-comm (its schedule plan calls the layers' attention "
            "and MLP parts directly, so the compiled forward would never run)"
        )
    return listed(f"{FLAG} cannot be combined with: ", problems)


@rule(
    "compile-transformer-layers-hooks",
    phase="layout",
    flags=(
        FLAG,
        "--overlap-param-gather",
        "--megatron-fsdp-enable-fine-grained-param-gather",
        "--nvtx-ranges",
    ),
)
def _compile_hooks(args):
    """Hooks on every submodule would run inside the compiled layer, one graph break each."""
    if not requested(args):
        return None
    problems = []
    fsdp = getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False)
    if getattr(args, "overlap_param_gather", False) and not fsdp:
        problems.append(
            "--overlap-param-gather (DDP then waits for parameter all-gathers in a forward "
            "pre-hook on every submodule, inside the compiled layer; drop it, or use "
            "--use-megatron-fsdp, whose hooks sit on whole layers)"
        )
    if getattr(args, "megatron_fsdp_enable_fine_grained_param_gather", False):
        problems.append(
            "--megatron-fsdp-enable-fine-grained-param-gather (hooks on every submodule)"
        )
    if getattr(args, "nvtx_ranges", False):
        problems.append(
            "--nvtx-ranges (the ranges inspect Python frames inside the layer, and switching them "
            "on at --profile-step-start recompiles every layer after warm-up)"
        )
    return listed(f"{FLAG} cannot be combined with: ", problems)


@rule(
    "compile-transformer-layers-recompute",
    phase="combination",
    flags=(FLAG, "--recompute-granularity", "--recompute-modules"),
)
def _compile_recompute(args, config):
    """Checkpoints inside a compiled layer are graph breaks; around it (full) they work."""
    if not requested(args) or args.recompute_granularity != "selective":
        return None
    inside = [m for m in (args.recompute_modules or ["core_attn"]) if m != "moe_act"]
    if inside:
        return (
            f"{FLAG} with --recompute-granularity selective --recompute-modules "
            f"{' '.join(args.recompute_modules or ['core_attn'])}: {', '.join(inside)} checkpoint "
            "inside the compiled layer, a graph break at every boundary with the checkpointed "
            "part compiled twice. Use --recompute-granularity full (checkpoints around the "
            "compiled layer) or --recompute-modules moe_act (inside the eager expert region)."
        )
    return None


@rule(
    "compile-transformer-layers-router-force-biased",
    phase="layout",
    flags=(FLAG, "--moe-router-force-biased"),
)
def _compile_force_biased(args):
    """The biased random logits draw inside the RNG tracker's fork, with a per-layer cache."""
    if not requested(args) or getattr(args, "moe_router_force_biased", None) is None:
        return None
    return (
        f"{FLAG} with --moe-router-force-biased {args.moe_router_force_biased}: the router draws "
        "its random bias inside the RNG tracker's fork (CUDA RNG state reads that dynamo does not "
        "trace) within the MoE layer's try block, so dynamo would run the whole MoE body eagerly. "
        "Drop one of the two (--moe-router-force-load-balancing is supported)."
    )
