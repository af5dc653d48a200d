"""Per-layer ``torch.compile`` of the transformer layers.

Each TransformerLayer's forward is compiled after ``WARMUP`` eager iterations. With ``FSDP=1``
Megatron-FSDP's hooks sit on whole layers (its unit modules), outside the compiled forward; it
needs the ``fsdp_dtensor`` checkpoint format and more than one CUDA connection, and megatron's
gradient-accumulation fusion is off there.
"""

from megatron.patchset.recipes import recipe as r
from megatron.patchset.recipes.fsdp_cuda_graphs import FSDP


def _build(k) -> r.Built:
    flags = ["--expert-model-parallel-size", str(k.ep)]
    env = ()
    if k.fsdp:
        flags += [*FSDP, "--no-gradient-accumulation-fusion"]
        env = (("CUDA_DEVICE_MAX_CONNECTIONS", "8"),)
    if k.compile:
        flags += ["--compile-transformer-layers", "--compile-transformer-layers-mode", k.mode]
        flags += ["--compile-transformer-layers-warmup-iters", str(k.warmup)]
    return r.Built(tuple(flags), env=env)


RECIPE = r.Recipe(
    name="compile",
    summary="per-layer torch.compile, optionally under Megatron-FSDP",
    knobs=(
        r.whole("EP", 1, "expert-parallel size (1 with FSDP=1)"),
        r.switch("FSDP", False, "Megatron-FSDP (optim_grads_params)"),
        r.switch("COMPILE", True, "0: eager, for comparison"),
        r.choice(
            "MODE",
            "default",
            ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"),
            "--compile-transformer-layers-mode",
        ),
        r.whole("WARMUP", 2, "--compile-transformer-layers-warmup-iters", minimum=0),
    ),
    build=_build,
)
