# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_weighted_swiglu_triton import available, weighted_swiglu
from megatron.core.transformer.transformer_config import TransformerConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _reference(y, probs, grad):
    """weighted_swiglu and weighted_swiglu_back of fused_bias_swiglu.py, written out in fp64."""
    a, b = y.double().chunk(2, -1)
    p, g = probs.double(), grad.double()
    sig = torch.sigmoid(a)
    out = a * sig * b * p
    dy = torch.cat((g * p * sig * (1 + a * (1 - sig)) * b, g * p * a * sig), -1)
    return out, dy, (a * sig * b * g).sum(-1, keepdim=True)


def _forward_backward(y, probs, grad):
    y, probs = y.clone().requires_grad_(), probs.clone().requires_grad_()
    out = weighted_swiglu(y, probs)
    out.backward(grad)
    return out, y.grad, probs.grad


@pytest.mark.skipif(
    not available(DEVICE), reason="needs a CUDA device with Triton, or TRITON_INTERPRET=1"
)
class TestTritonWeightedSwiGLU:
    """The Triton kernels against the weighted SwiGLU's formulas, and rows that keep their bits."""

    @staticmethod
    def _inputs(rows, dtype, ffn=300):  # two column blocks per row, the second partial
        torch.manual_seed(0)
        y = (2 * torch.randn(rows, 2 * ffn, device=DEVICE)).to(dtype)
        probs = torch.rand(rows, 1, device=DEVICE)
        return y, probs, torch.randn(rows, ffn, device=DEVICE).to(dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_output_and_grads_match_the_formulas(self, dtype):
        y, probs, grad = self._inputs(37, dtype)
        out, dy, dp = _forward_backward(y, probs, grad)
        ref_out, ref_dy, ref_dp = _reference(y, probs, grad)
        assert out.dtype == dy.dtype == dtype and dp.dtype == torch.float32
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
        torch.testing.assert_close(out, ref_out.to(dtype), **tolerance)
        torch.testing.assert_close(dy, ref_dy.to(dtype), **tolerance)
        torch.testing.assert_close(dp, ref_dp.float(), rtol=1e-4, atol=1e-3)

    def test_a_row_keeps_its_bits_among_more_rows(self):
        y, probs, grad = self._inputs(64, torch.bfloat16)
        alone = _forward_backward(y[:21], probs[:21], grad[:21])
        among = _forward_backward(y, probs, grad)
        for ours, reference in zip(among, alone):
            assert torch.equal(ours[:21], reference)

    def test_shapes_other_than_rows_by_two_halves_are_refused(self):
        with pytest.raises(ValueError, match="rows x 2F"):
            weighted_swiglu(torch.zeros(4, 5, device=DEVICE), torch.zeros(4, device=DEVICE))


class TestMoeSwigluTritonConfig:
    """moe_swiglu_triton in the config."""

    @staticmethod
    def _config(**kwargs):
        base = dict(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=4,
            num_moe_experts=2,
            moe_swiglu_triton=True,
            gated_linear_unit=True,
            activation_func=F.silu,
            bias_activation_fusion=True,
            add_bias_linear=False,
        )
        return TransformerConfig(**{**base, **kwargs})

    def test_a_swiglu_without_bias_is_accepted(self):
        assert self._config().moe_swiglu_triton

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(gated_linear_unit=False),
            dict(bias_activation_fusion=False),
            dict(add_bias_linear=True),
            dict(moe_apply_probs_on_input=True),
            dict(activation_func_clamp_value=7.0),
            dict(use_transformer_engine_op_fuser=True),
        ],
    )
    def test_what_the_kernels_do_not_cover_is_refused(self, kwargs):
        with pytest.raises(ValueError, match="moe_swiglu_triton"):
            self._config(**kwargs)
