"""Rule for ``--moe-swiglu-triton``: the activation it replaces and what it does not cover."""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.torch_compile.flags import FLAG as COMPILE_FLAG
from megatron.patchset.features.triton_swiglu.flags import FLAG, requested


@rule(
    "moe-swiglu-triton-requirements",
    phase="layout",
    flags=(
        FLAG,
        "--num-experts",
        "--moe-grouped-gemm",
        "--swiglu",
        "--no-bias-swiglu-fusion",
        "--disable-bias-linear",
        "--use-te-activation-func",
        "--moe-apply-probs-on-input",
        "--use-transformer-engine-op-fuser",
        COMPILE_FLAG,
    ),
)
def _moe_swiglu_triton(args):
    """The kernels replace megatron's fused weighted SwiGLU of the grouped experts, which takes no
    bias."""
    if not requested(args):
        return None
    problems = []
    if not args.num_experts or not getattr(args, "moe_grouped_gemm", False):
        problems.append("an MoE model with --moe-grouped-gemm (the grouped experts' activation)")
    if not getattr(args, "swiglu", False):
        problems.append("--swiglu (the kernels are the SwiGLU)")
    if not getattr(args, "bias_swiglu_fusion", True):
        problems.append(
            "the bias-SwiGLU fusion (drop --no-bias-swiglu-fusion: the kernels replace it)"
        )
    if getattr(args, "add_bias_linear", False):
        problems.append("--disable-bias-linear (megatron's weighted SwiGLU takes no bias)")
    if getattr(args, "use_te_activation_func", False):
        problems.append("no --use-te-activation-func (TE's activation bypasses the fused one)")
    if getattr(args, "moe_apply_probs_on_input", False):
        problems.append(
            "no --moe-apply-probs-on-input (the probabilities then scale the input, not the "
            "activation)"
        )
    if getattr(args, "use_transformer_engine_op_fuser", False):
        problems.append(
            "no --use-transformer-engine-op-fuser (TE's fused grouped MLP computes the activation "
            "itself)"
        )
    if getattr(args, "compile_transformer_layers", False):
        problems.append(
            f"no {COMPILE_FLAG} (the compiled layers run megatron's activation; the kernels are "
            "not traced)"
        )
    return listed(f"{FLAG} needs: ", problems)
