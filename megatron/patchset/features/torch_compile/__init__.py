"""Per-layer ``torch.compile`` (docs/features/torch_compile.md).

Each TransformerLayer's forward is compiled in place before DDP/Megatron-FSDP wrap the model
(:mod:`.layers`, a patch of megatron's model builder); the MoE layer's dispatch, experts and
combine run eagerly (:mod:`.eager_regions`); while dynamo traces, TE's norms, RoPE, router,
attention block and the dropless permutation run as torch code that inductor fuses
(:mod:`.te_kernels`, :mod:`.attention_block`, :mod:`.permutation`).
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.torch_compile import flags

FEATURE = Feature(
    name="torch_compile",
    title="Per-layer torch.compile",
    switches=(flags.FLAG,),
    enabled=flags.requested,
    upstream_pr="fork-only (per-layer torch.compile)",
    status="not yet verified on 2 GPUs",
    modules=tuple(
        f"{__name__}.{m}"
        for m in (
            "rules",
            "eager_regions",
            "te_kernels",
            "attention_block",
            "permutation",
            "layers",
        )
    ),
    flags=flags.FLAGS,
    add_arguments=flags.add_arguments,
    in_use=lambda args: [flags.FLAG] + flags.flags_given(args),
)
