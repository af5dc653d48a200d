# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core.fusions.fused_cross_entropy_triton import available, triton_cross_entropy
from megatron.core.model_parallel_config import ModelParallelConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(
    not available(DEVICE), reason="needs a CUDA device with Triton, or TRITON_INTERPRET=1"
)
class TestTritonCrossEntropy:
    """The Triton kernels against torch's cross entropy in fp32."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_loss_and_grad_match_torch(self, dtype):
        torch.manual_seed(0)
        seq, batch, vocab = 2, 2, 5000  # two blocks of the kernel per row
        logits = torch.randn(seq, batch, vocab, device=DEVICE).to(dtype).requires_grad_()
        target = torch.randint(0, vocab, (seq, batch), device=DEVICE)
        reference = logits.detach().float().requires_grad_()

        loss = triton_cross_entropy(logits, target)
        expected = torch.nn.functional.cross_entropy(
            reference.view(-1, vocab), target.view(-1), reduction="none"
        ).view(seq, batch)
        grad = torch.rand_like(expected)
        loss.backward(grad)
        expected.backward(grad)

        assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
        torch.testing.assert_close(logits.grad, reference.grad.to(dtype), **tolerance)

    def test_shape_mismatch_is_refused(self):
        logits = torch.zeros(3, 2, 5, device=DEVICE)
        with pytest.raises(ValueError, match="do not match target"):
            triton_cross_entropy(logits, torch.zeros(3, dtype=torch.long, device=DEVICE))


class TestTritonCrossEntropyConfig:
    """cross_entropy_fusion_impl="triton" in the config."""

    def test_triton_is_accepted_on_one_tensor_parallel_rank(self):
        config = ModelParallelConfig(
            cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="triton"
        )
        assert config.cross_entropy_fusion_impl == "triton"

    def test_triton_needs_one_tensor_parallel_rank(self):
        with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
            ModelParallelConfig(
                tensor_model_parallel_size=2,
                cross_entropy_loss_fusion=True,
                cross_entropy_fusion_impl="triton",
            )
