"""The small-micro-batch recipe: MoE training out of the host-overhead regime.

The experts run as one grouped GEMM each for forward, dgrad and wgrad with the per-expert token
counts kept on the GPU; at EP > 1 the all-to-all moves tokens in fixed-size slots
(``--moe-static-dispatch``, by default with ``--moe-static-dispatch-dedup``: a token crosses once
to each peer that hosts one of its experts, ``DEDUP=0`` sends one row per routed expert;
``A2A_CHUNKS=N`` splits each MoE layer into N token chunks whose all-to-alls overlap the experts of
another chunk; ``WGRAD_OVERLAP=1`` computes the experts' weight gradients beside the dispatch's
backward all-to-all, and ``WGRAD_SMS=N`` leaves N SMs out of those GEMMs for the all-to-all;
``DP_OVERLAP=1`` passes megatron's data-parallel overlap flags). With
``GRAPHS=full`` megatron replays the whole forward and backward as one CUDA graph
(``--cuda-graph-impl full_iteration``) and the optimizer step as a second
(``--optimizer-cuda-graph``); ``KERNELS=1`` adds the one-kernel Adam and the Triton cross entropy.
DDP's ``1 / data-parallel size`` is applied to the loss gradient instead of the whole gradient
buffer (``--ddp-scale-grads-in-loss``). Megatron's NaN check and its level-1/2 timers synchronise
inside the step, so they are off under the capture (the fork's rules refuse them otherwise).

``MEMORY`` trades a little speed for memory. ``MEMORY=<N>G`` names the GPU's memory (``80G`` for
an 80 GB H100, ``141G`` for an H200) and passes ``--memory-budget``: after megatron's argument
validation the fork estimates each rank's peak for the layout, micro-batch and model and takes the
fastest combination of levers whose estimate fits 90% of it, none where the run fits as it is, or
refuses the launch when nothing fits (docs/features/memory_budget.md). The levers are bf16 Adam
moments (the one-kernel Adam's ``--adam-moments-dtype bf16``; with ``KERNELS=0`` megatron's
precision-aware distributed optimizer) and megatron's selective recomputation of the experts'
activation function, then of the layer norms, which replays inside the captured backward.
``MEMORY=moments`` asks for the bf16 moments alone, whatever the budget. Both set
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` where the environment does not set it, since
without it the caching allocator's reserve on an 80 GB card runs out before the allocated peak
does. ``CUDNN_NORMS=1`` (the default) runs TransformerEngine's layer norms through cuDNN.
``SWIGLU_KERNELS=1`` (the default) runs the experts' SwiGLU as Triton kernels
(``--moe-swiglu-triton``), which needs a model with ``--swiglu``; ``SWIGLU_KERNELS=0`` is for other
activations.
"""

from megatron.patchset.features.memory_budget import flags as memory_budget
from megatron.patchset.recipes import recipe as r

# TransformerEngine's RMSNorm and LayerNorm forward and backward through cuDNN instead of its own
# kernels: 1.7% off the step of an emulated Qwen3-30B-A3B rank at EP 8 (docs/benchmarks.md)
CUDNN_NORMS = (("NVTE_NORM_FWD_USE_CUDNN", "1"), ("NVTE_NORM_BWD_USE_CUDNN", "1"))

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
    # DDP's 1/DP in the loss gradient: no pass over the fp32 gradient buffer (a no-op at DP 1)
    flags += ["--ddp-scale-grads-in-loss"]
    if k.graphs == "full":
        # the counts stay on the device; megatron's unfused permutation would read them on the host
        flags += ["--moe-permute-fusion", "--moe-expert-splits-on-device"]
        if k.ep > 1:
            flags += ["--moe-static-dispatch"]
            flags += ["--moe-static-dispatch-capacity-factor", f"{k.capacity_factor:g}"]
            if k.a2a_chunks > 1:
                flags += ["--moe-static-dispatch-chunks", str(k.a2a_chunks)]
            if k.dedup:
                flags += ["--moe-static-dispatch-dedup"]
        flags += ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2"]
        flags += ["--no-check-for-nan-in-loss-and-grad", "--timing-log-level", "0"]
        if k.optimizer_graph:
            flags += ["--optimizer-cuda-graph"]
        if k.kernels:
            flags += ["--adam-impl", "triton", "--cross-entropy-triton"]
    elif k.graphs == "layer":
        flags += list(_LAYER_GRAPHS)
    if k.dp_overlap:
        # megatron's data-parallel overlap: each gradient bucket's reduction starts in the backward
        # pass and, under the distributed optimizer, each parameter bucket's gather in the forward
        flags += ["--overlap-grad-reduce"]
        if dist_opt:
            flags += ["--overlap-param-gather"]
    if k.wgrad_overlap and k.ep > 1:
        # the experts' weight gradients beside the dispatch's backward all-to-all
        flags += ["--overlap-dispatch-backward-with-experts-wgrad"]
    if k.wgrad_sms:
        if not (k.wgrad_overlap and k.ep > 1):
            raise r.KnobError(
                f"WGRAD_SMS={k.wgrad_sms} leaves SMs to the dispatch's backward all-to-all beside "
                "the experts' weight-gradient GEMMs, which run beside it only with "
                f"WGRAD_OVERLAP=1 and EP > 1 (got WGRAD_OVERLAP={int(k.wgrad_overlap)}, "
                f"EP={k.ep})"
            )
        # NCCL's thread blocks cannot share an SM with the grouped GEMM's
        flags += ["--moe-wgrad-sm-carveout", str(k.wgrad_sms)]
    if k.swiglu_kernels:
        # the experts' weighted SwiGLU as Triton kernels: 1.7% off the step of an emulated
        # Qwen3-30B-A3B rank at EP 8, and the same bits for capacity-padded and exact inputs
        flags += ["--moe-swiglu-triton"]
    env = ()
    if k.memory != "max":
        env = (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
    if k.cudnn_norms:
        env += CUDNN_NORMS
    if k.graphs == "full" and k.ep > 1 and k.a2a_chunks > 1:
        # the all-to-all stream and the experts' stream run at once only on separate hardware
        # queues (one queue, megatron's usual CUDA_DEVICE_MAX_CONNECTIONS=1, serialises them)
        env += (("CUDA_DEVICE_MAX_CONNECTIONS", "32"),)
    else:  # megatron's usual one queue, as the recipe's benchmarks ran it (tools/bench/bench.py)
        env += (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)
    if k.memory == "moments":
        if k.graphs == "full" and k.kernels:
            flags += ["--adam-moments-dtype", "bf16"]
        elif dist_opt:
            flags += ["--use-precision-aware-optimizer"]
            flags += ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    elif k.memory != "max":
        flags += [memory_budget.FLAG, k.memory]
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
        r.whole(
            "A2A_CHUNKS",
            1,
            "token chunks per MoE layer whose all-to-alls overlap the experts of another chunk "
            "(EP > 1 with GRAPHS=full; sets CUDA_DEVICE_MAX_CONNECTIONS=32); 1: none",
        ),
        r.switch(
            "DEDUP",
            True,
            "each token crosses to an expert-parallel peer once, not once per expert it picked "
            "there (EP > 1 with GRAPHS=full); 0: one row per routed expert",
        ),
        r.switch(
            "WGRAD_OVERLAP",
            False,
            "the experts' weight gradients on a side stream beside the dispatch's backward "
            "all-to-all (--overlap-dispatch-backward-with-experts-wgrad; EP > 1)",
        ),
        r.whole(
            "WGRAD_SMS",
            0,
            "with WGRAD_OVERLAP=1 and EP > 1: SMs the experts' weight-gradient GEMMs leave to the "
            "all-to-all (--moe-wgrad-sm-carveout); 0: all SMs to the GEMMs",
            minimum=0,
        ),
        r.switch(
            "DP_OVERLAP",
            False,
            "megatron's --overlap-grad-reduce, and --overlap-param-gather with the distributed "
            "optimizer: the data-parallel gradient reduction runs during the backward pass and the "
            "parameter gather during the forward (not with WGRAD_OVERLAP=1)",
        ),
        r.switch(
            "CUDNN_NORMS",
            True,
            "TransformerEngine's layer norms through cuDNN (NVTE_NORM_FWD_USE_CUDNN=1, "
            "NVTE_NORM_BWD_USE_CUDNN=1)",
        ),
        r.switch(
            "SWIGLU_KERNELS",
            True,
            "the experts' probability-weighted SwiGLU as two Triton kernels (--moe-swiglu-triton; "
            "models with --swiglu); 0: megatron's compiled one, for other activations",
        ),
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
            ("max", "moments"),
            "max: no memory levers; moments: bf16 Adam moments and the allocator's expandable "
            "segments; <N>G (80G, 141G): the GPU's memory, --memory-budget: the fastest levers "
            "whose estimated peak fits it, and expandable segments",
            pattern=memory_budget.PATTERN,
            pattern_name="<N>G",
        ),
    ),
    build=_build,
)
