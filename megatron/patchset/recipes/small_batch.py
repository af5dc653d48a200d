"""The small-micro-batch recipe: MoE training out of the host-overhead regime.

The experts run as one grouped GEMM each for forward, dgrad and wgrad with the per-expert token
counts kept on the GPU; at EP > 1 the all-to-all moves tokens in fixed-size slots
(``--moe-static-dispatch``). With ``GRAPHS=full`` megatron replays the whole forward and backward
as one CUDA graph (``--cuda-graph-impl full_iteration``) and the optimizer step as a second
(``--optimizer-cuda-graph``); ``KERNELS=1`` adds the one-kernel Adam and the Triton cross entropy.
Megatron's NaN check and its level-1/2 timers synchronise inside the step, so they are off under
the capture (the fork's rules refuse them otherwise).

``MEMORY=moments`` and ``MEMORY=80G`` trade a little speed for the memory an 80 GB H100 lacks at
the per-rank shapes of docs/benchmarks.md. ``moments`` keeps both Adam moments in bf16 (the
one-kernel Adam's ``--adam-moments-dtype bf16``; with ``KERNELS=0`` megatron's precision-aware
distributed optimizer); ``80G`` adds megatron's selective recomputation of the experts' activation
function, which replays inside the captured backward. Both set
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` where the environment does not set it, since
without it the caching allocator's reserve on an 80 GB card runs out before the allocated peak
does.
"""

from megatron.patchset.recipes import recipe as r

_LAYER_GRAPHS = (
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-modules",
    "attn",
    "moe_router",
    "moe_preprocess",
    "--cuda-graph-warmup-steps",
    "2",
)


def _dist_opt(k) -> bool:
    """DIST_OPT=auto: the distributed optimizer where the optimizer graph needs it (EP > 1, where
    megatron's dense and expert optimizers would otherwise sum their norms on the host)."""
    if k.dist_opt == "auto":
        return k.ep > 1 and k.graphs == "full" and k.optimizer_graph
    return k.dist_opt == "1"


def _build(k) -> r.Built:
    flags = ["--manual-gc", "--cross-entropy-loss-fusion"]
    flags += ["--expert-model-parallel-size", str(k.ep), "--moe-grouped-gemm-impl", "torch"]
    dist_opt = _dist_opt(k)
    if dist_opt:
        flags += ["--use-distributed-optimizer"]
    if k.graphs == "full":
        # the counts stay on the device; megatron's unfused permutation would read them on the host
        flags += ["--moe-permute-fusion", "--moe-expert-splits-on-device"]
        if k.ep > 1:
            flags += ["--moe-static-dispatch"]
            flags += ["--moe-static-dispatch-capacity-factor", f"{k.capacity_factor:g}"]
        flags += ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2"]
        flags += ["--no-check-for-nan-in-loss-and-grad", "--timing-log-level", "0"]
        if k.optimizer_graph:
            flags += ["--optimizer-cuda-graph"]
        if k.kernels:
            flags += ["--adam-impl", "triton", "--cross-entropy-triton"]
    elif k.graphs == "layer":
        flags += list(_LAYER_GRAPHS)
    env = ()
    if k.memory != "max":
        env = (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
        if k.memory == "80G":
            flags += ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"]
        if k.graphs == "full" and k.kernels:
            flags += ["--adam-moments-dtype", "bf16"]
        elif dist_opt:
            flags += ["--use-precision-aware-optimizer"]
            flags += ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    return r.Built(tuple(flags), env)


RECIPE = r.Recipe(
    name="small_batch",
    summary="experts as grouped GEMMs with device-side counts, the whole step as CUDA graphs, "
    "Triton Adam and cross entropy",
    knobs=(
        r.choice(
            "GRAPHS",
            "full",
            ("full", "layer", "none"),
            "full: forward and backward as one graph; layer: TE graphs of attention, router and "
            "preprocessing; none: eager",
        ),
        r.whole("EP", 1, "expert-parallel size; > 1 uses the static all-to-all with GRAPHS=full"),
        r.number("CAPACITY_FACTOR", 2.0, "per-peer slots of the static all-to-all (EP > 1)"),
        r.switch("OPTIMIZER_GRAPH", True, "the optimizer step as a CUDA graph (GRAPHS=full)"),
        r.switch(
            "KERNELS",
            True,
            "the one-kernel Adam and the Triton cross entropy (GRAPHS=full)",
        ),
        r.choice(
            "DIST_OPT",
            "auto",
            ("auto", "0", "1"),
            "megatron's distributed optimizer: each data-parallel rank steps its shard; auto: on "
            "at EP > 1 with the optimizer graph (GRAPHS=full), which needs it there",
        ),
        r.choice(
            "MEMORY",
            "max",
            ("max", "moments", "80G"),
            "max: no memory levers; moments: bf16 Adam moments and the allocator's expandable "
            "segments; 80G: those and the experts' activation recomputed in the backward",
        ),
    ),
    build=_build,
)
