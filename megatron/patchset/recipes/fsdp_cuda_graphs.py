"""TransformerEngine per-layer CUDA graphs with Megatron-FSDP.

Megatron-FSDP shards parameters, gradients and optimizer state (``optim_grads_params``) with a
double buffer whose addresses stay fixed (what the graphs replay on) and no dynamic fallback
buffer during a replay; TE graphs cover each ``--cuda-graph-modules`` scope after
``WARMUP_STEPS`` eager steps. Megatron-FSDP needs the ``fsdp_dtensor`` checkpoint format and
overlaps its all-gathers and reduce-scatters with compute, so it refuses
``CUDA_DEVICE_MAX_CONNECTIONS=1``.
"""

from megatron.patchset.recipes import recipe as r

FSDP = (
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--ckpt-format",
    "fsdp_dtensor",
)


def _build(k) -> r.Built:
    flags = ["--expert-model-parallel-size", str(k.ep), *FSDP]
    flags += ["--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail"]
    if k.graphs:
        flags += ["--cuda-graph-impl", "transformer_engine"]
        flags += ["--cuda-graph-warmup-steps", str(k.warmup_steps), "--cuda-graph-modules"]
        flags += k.scopes
    return r.Built(tuple(flags), env=(("CUDA_DEVICE_MAX_CONNECTIONS", "8"),))


RECIPE = r.Recipe(
    name="fsdp_cuda_graphs",
    summary="Megatron-FSDP (optim_grads_params) with TE per-layer CUDA graphs",
    knobs=(
        r.whole("EP", 1, "expert-parallel size"),
        r.switch("GRAPHS", True, "0: eager Megatron-FSDP"),
        r.words("SCOPES", "attn moe_router moe_preprocess", "--cuda-graph-modules"),
        r.whole("WARMUP_STEPS", 3, "eager steps before the capture", minimum=0),
    ),
    build=_build,
)
