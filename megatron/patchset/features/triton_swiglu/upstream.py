"""The upstream change of this feature, as ``export --series`` writes it.

Upstream's form of the flag is a field of megatron-core's ``TransformerConfig``,
``moe_swiglu_triton`` (megatron's argument utilities make it ``--moe-swiglu-triton``, the flag
the overlay adds), checked in ``TransformerConfig.__post_init__`` and read where
``TEGroupedMLP.forward`` applies its weighted SwiGLU. The kernels' file is this feature's
:mod:`.kernels`, as the overlay runs it; the tests are
``upstream/test_fused_weighted_swiglu_triton.py`` beside this module.
"""

from megatron.patchset.export.changes import UpstreamChange
from megatron.patchset.export.edits import NewFile, OneOf, Replace

HEADER = "# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.\n\n"
CONFIG = "megatron/core/transformer/transformer_config.py"
EXPERTS = "megatron/core/transformer/moe/experts.py"

_CALL = """\
                    # dtype is handled inside the fused kernel
                    intermediate_parallel = weighted_bias_swiglu_impl(
                        intermediate_parallel,
                        bias_parallel,
                        permuted_probs,
                        self.config.activation_func_fp8_input_store,{clamp}
                    )
"""
_TRITON_CALL = """\
                    # dtype is handled inside the fused kernel
                    if self.config.moe_swiglu_triton:
                        intermediate_parallel = weighted_swiglu_triton(
                            intermediate_parallel, permuted_probs
                        )
                    else:
                        intermediate_parallel = weighted_bias_swiglu_impl(
                            intermediate_parallel,
                            bias_parallel,
                            permuted_probs,
                            self.config.activation_func_fp8_input_store,{clamp}
                        )
"""
# core_r0.19.0 passes four arguments; main adds the activation's clamp value
_FORMS = ("", "\n                        self.config.activation_func_clamp_value,")

CHANGE = UpstreamChange(
    name="triton_swiglu",
    subject="moe: weighted SwiGLU of the grouped experts as Triton kernels (moe_swiglu_triton)",
    motivation="""
        TEGroupedMLP applies the routing probabilities inside its SwiGLU
        (weighted_bias_swiglu_impl), whose functions are compiled with torch.compile. Inductor
        generates the backward's row sum, the probabilities' gradient, for the row count it
        compiles for (or for the hint of a dynamic one), and the threads that sum a row, with
        them the order of the sum, differ between such kernels. The same rows then get other
        bits when the expert input has another number of rows around them: on one H200 the
        kernel compiled for 16,384 rows gave 5,960 of 7,993 leading rows other probability
        gradients than the kernel compiled for 7,993 rows. Under --deterministic-mode a run
        whose experts see capacity-padded inputs therefore leaves one with exact inputs at its
        third iteration.""",
    design="""
        Two Triton kernels in megatron/core/fusions/fused_weighted_swiglu_triton.py. Forward
        writes silu(a) * b * p for blocks of 16 rows and up to 256 columns. Backward takes 16
        rows per program and walks their F columns in blocks of min(256, next power of two of
        F): each lane writes the input gradient of its columns and accumulates its products
        for the probability gradient, and the lanes are summed at the end. The order of every
        sum depends on F only, and the kernels are not specialised on the row count, so a row
        gets the same bits whatever the number of rows. All arithmetic is fp32; the output and
        the input gradient take the input's dtype, the probability gradient the
        probabilities'.

        TransformerConfig.moe_swiglu_triton (default False) selects the kernels where
        TEGroupedMLP.forward calls weighted_bias_swiglu_impl; __post_init__ refuses it without
        bias_activation_fusion and a SwiGLU, with bias, an fp8 input store, a clamp value,
        moe_apply_probs_on_input, or use_transformer_engine_op_fuser (whose fused grouped MLP
        computes the activation itself).""",
    figures="""
        One H200, torch 2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28. Forward and backward
        over 32,768 rows of 2 x 768 (4096 tokens at top-8), replayed as a CUDA graph: 0.121 ms
        against 0.188 ms for the compiled functions; probability gradients within 6.1e-5 of
        them. One rank of a Qwen3-30B-A3B layout of 32 GPUs at EP 8 run on one GPU with the
        communication skipped (--fake-process-group), 8 micro-batches of 4096 tokens: step
        2169.8 -> 2133.2 ms (1.7%), same peak memory. Two H200s, EP 2, a small MoE model under
        --deterministic-mode: an all-to-all of capacity-padded slots and megatron's all-to-all
        give the same losses and gradient norms to the bit over 20 iterations with the kernels,
        and differ from the third iteration without them.""",
    test_plan="""
        $ pytest tests/unit_tests/fusions/test_fused_weighted_swiglu_triton.py
        $ TRITON_INTERPRET=1 pytest tests/unit_tests/fusions/test_fused_weighted_swiglu_triton.py

        The kernel tests compare the output and both gradients with the weighted SwiGLU's
        formulas in fp32 and bf16 and check that a row keeps its bits among more rows (on a
        GPU, or on CPU under Triton's interpreter); the config tests run on CPU.""",
    edits=(
        NewFile(
            "megatron/core/fusions/fused_weighted_swiglu_triton.py",
            "features/triton_swiglu/kernels.py",
            header=HEADER,
        ),
        Replace(
            CONFIG,
            "TransformerConfig",
            old='''\
    moe_apply_probs_on_input: bool = False
    """Apply probs on input of experts instead of applying after activation and glu."""
''',
            new='''\
    moe_apply_probs_on_input: bool = False
    """Apply probs on input of experts instead of applying after activation and glu."""

    moe_swiglu_triton: bool = False
    """Compute the grouped experts' probability-weighted SwiGLU with the Triton kernels of
    fused_weighted_swiglu_triton.py instead of the compiled functions of fused_bias_swiglu.py.
    A row's output and gradients, the probability's included, then have the same bits whatever
    the number of rows around it (capacity-padded or exact expert inputs). Needs
    bias_activation_fusion, a SwiGLU and no bias."""
''',
        ),
        Replace(
            CONFIG,
            "TransformerConfig.__post_init__",
            old="""\
        if self.fused_residual_rmsnorm:
""",
            new="""\
        if self.moe_swiglu_triton and not (
            self.bias_activation_fusion
            and self.activation_func == F.silu
            and self.gated_linear_unit
            and not self.add_bias_linear
            and not self.activation_func_fp8_input_store
            and self.activation_func_clamp_value is None
            and not self.moe_apply_probs_on_input
            and not self.use_transformer_engine_op_fuser
        ):
            raise ValueError(
                "moe_swiglu_triton replaces the fused weighted SwiGLU of the grouped experts: it "
                "needs bias_activation_fusion, activation_func=F.silu with gated_linear_unit, and "
                "no add_bias_linear, activation_func_fp8_input_store, "
                "activation_func_clamp_value, moe_apply_probs_on_input or "
                "use_transformer_engine_op_fuser."
            )

        if self.fused_residual_rmsnorm:
""",
        ),
        Replace(
            EXPERTS,
            "",
            old="""\
from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
""",
            new="""\
from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from megatron.core.fusions.fused_weighted_swiglu_triton import (
    weighted_swiglu as weighted_swiglu_triton,
)
""",
        ),
        OneOf(
            tuple(
                Replace(
                    EXPERTS,
                    "TEGroupedMLP.forward",
                    old=_CALL.format(clamp=clamp),
                    new=_TRITON_CALL.format(clamp=clamp.replace("\n", "\n    ")),
                )
                for clamp in _FORMS
            )
        ),
        NewFile(
            "tests/unit_tests/fusions/test_fused_weighted_swiglu_triton.py",
            "features/triton_swiglu/upstream/test_fused_weighted_swiglu_triton.py",
        ),
    ),
)
