"""The patch that puts the Triton weighted SwiGLU in the place of megatron-core's compiled one in
the grouped experts."""

from __future__ import annotations

from megatron.patchset.core.registry import patch
from megatron.patchset.features.triton_swiglu import flags, kernels


def triton_for_weighted(original):
    """The replacement of ``weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store)``:
    the kernels where they run; megatron's function for a bias (refused by the flag's rule before a
    run), for ``TransformerConfig.activation_func_fp8_input_store`` (no command-line flag) and on
    a device without Triton."""

    def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False):
        if bias is not None or fp8_input_store or not kernels.available(input.device):
            return original(input, bias, weights, fp8_input_store)
        shape = input.shape
        if len(shape) not in (2, 3):
            raise ValueError(
                f"weighted SwiGLU: the input is {tuple(shape)}; megatron's interface takes 2 or "
                "3 dimensions"
            )
        output = kernels.weighted_swiglu(input.reshape(-1, shape[-1]), weights)
        return output if len(shape) == 2 else output.view(shape[0], shape[1], -1)

    return weighted_bias_swiglu_impl


@patch(
    "triton_swiglu.grouped_experts",
    "megatron.core.transformer.moe.experts.weighted_bias_swiglu_impl",
    reason="megatron-core's weighted SwiGLU is torch.compile'd: inductor generates the backward's "
    "row sum (the routing probabilities' gradient) for the row count it compiles for, so "
    "capacity-padded and exact expert inputs give other bits; two Triton kernels sum every row "
    "in the same order whatever the number of rows",
    flags=(flags.FLAG,),
    enabled=flags.requested,
)
def triton_weighted_swiglu(original):
    return triton_for_weighted(original)
