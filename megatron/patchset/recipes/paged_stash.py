"""MoE paged stashing on Hopper in bf16.

The flex dispatcher (NCCL EP or HybridEP) receives into a static per-rank budget of ``CAPACITY``
times the balanced share; megatron's paged stash keeps the experts' activations in pages of
``PAGE_SIZE`` tokens, ``CUDA_FACTOR`` times the expected tokens on the GPU and ``CPU_FACTOR`` in
pinned host memory. Megatron pages only TE's op-fuser expert MLP, which it admits for SwiGLU
experts only with ``NVTE_CUTEDSL_FUSED_GROUPED_MLP=1`` (on Hopper TE still runs its basic
grouped-linear/SwiGLU ops). NCCL EP traps when a rank receives more than its budget, so its
default capacity is generous; HybridEP drops over-budget tokens and megatron re-runs the step.
"""

from megatron.patchset.recipes import recipe as r

_DEFAULT_CAPACITY = {"ncclep": 2.0, "hybridep": 1.5}


def _build(k) -> r.Built:
    capacity = k.capacity if k.capacity > 0 else _DEFAULT_CAPACITY[k.backend]
    flags = ["--expert-model-parallel-size", str(k.ep)]
    flags += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", k.backend]
    flags += ["--use-transformer-engine-op-fuser"]
    flags += ["--moe-expert-rank-capacity-factor", f"{capacity:g}"]
    if k.backend == "hybridep":
        flags += ["--moe-router-dtype", "fp32"]  # HybridEP takes fp32 probabilities
    else:
        flags += ["--moe-ncclep-static-shape"]  # experts take the static receive buffer
    if k.stash:
        flags += ["--moe-paged-stash", "--moe-paged-stash-page-size", str(k.page_size)]
        flags += ["--moe-paged-stash-buffer-size-factor-cuda", f"{k.cuda_factor:g}"]
        flags += ["--moe-paged-stash-buffer-size-factor-cpu", f"{k.cpu_factor:g}"]
    if k.graphs:
        flags += ["--cuda-graph-impl", "transformer_engine"]
        flags += ["--cuda-graph-modules", "attn", "moe_router", "moe_preprocess"]
        flags += ["--cuda-graph-warmup-steps", "2"]
    return r.Built(tuple(flags), env=(("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1"),))


RECIPE = r.Recipe(
    name="paged_stash",
    summary="NCCL EP or HybridEP with a static receive budget and megatron's paged stash",
    knobs=(
        r.whole("EP", 2, "expert-parallel size"),
        r.choice("BACKEND", "ncclep", ("ncclep", "hybridep"), "flex dispatcher backend"),
        r.number(
            "CAPACITY", 0, "--moe-expert-rank-capacity-factor (0: 2.0 for ncclep, 1.5 for hybridep)"
        ),
        r.switch("STASH", True, "--moe-paged-stash"),
        r.whole("PAGE_SIZE", 64, "tokens per page"),
        r.number("CUDA_FACTOR", 1.1, "GPU stash size relative to the expected tokens"),
        r.number("CPU_FACTOR", 0.0, "pinned host pages (0: none)"),
        r.switch("GRAPHS", True, "TE graphs of attention, router and preprocessing"),
    ),
    build=_build,
)
