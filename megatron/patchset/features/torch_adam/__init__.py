"""megatron-core's Adam as torch's fused AdamW (docs/features/torch_adam.md).

``--adam-impl torch`` rebinds the Adam class megatron-core builds its optimizer from
(:mod:`.optimizer`), lets that kernel apply megatron's gradient clipping as it reads the gradients
(:mod:`.clipping`), and copies the fp32 main parameters back to bf16 in multi-tensor kernels
(:mod:`.param_copy`); megatron's mixed-precision optimizer around them (fp32 main parameters and
gradients, the gradient norm, checkpoints) stays upstream's. ``--adam-impl triton`` keeps the same
optimizer class and state and steps it with one Triton kernel that also applies the clip and writes
the bf16 model parameters (:mod:`.triton_step`). Under ``--use-distributed-optimizer`` each
data-parallel rank steps its shard of the fp32 main parameters and megatron all-gathers the bf16
parameters (:mod:`.distributed`).
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.torch_adam import flags

FEATURE = Feature(
    name="torch_adam",
    title="Adam as torch's fused AdamW (capturable under --optimizer-cuda-graph)",
    switches=(f"{flags.FLAG} torch", f"{flags.FLAG} triton"),
    enabled=flags.requested,
    upstream_pr="proposed (megatron-core 0.19.2 takes torch's AdamW only when neither "
    "TransformerEngine nor apex is installed)",
    status="experimental",
    modules=(
        f"{__name__}.rules",
        f"{__name__}.optimizer",
        f"{__name__}.clipping",
        f"{__name__}.param_copy",
        f"{__name__}.triton_step",
        f"{__name__}.distributed",
    ),
    flags=(flags.FLAG, flags.MOMENTS_FLAG),
    add_arguments=flags.add_arguments,
    in_use=lambda args: (
        [f"{flags.FLAG} {flags.impl(args)}"]
        + ([f"{flags.MOMENTS_FLAG} bf16"] if flags.moments_dtype(args) == "bf16" else [])
    ),
)
