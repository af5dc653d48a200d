"""--cross-entropy-triton on one GPU.

* The kernels against megatron-core's native fused cross entropy at the reference config's
  vocabulary (151,936) in bf16: the same losses within fp32 rounding, the same gradients within
  bf16 rounding.
* Training (the full-iteration recipe, the loss fused): with the kernels the run trains like
  megatron's fused loss.
"""

import pytest
import torch

from tests.gpu.conftest import (
    FULL_ITERATION_RECIPE,
    assert_trains_alike,
    launch_variants,
)

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

ITERS = 20
RECIPE = FULL_ITERATION_RECIPE + ("--cross-entropy-loss-fusion",)


def test_the_kernels_give_megatrons_fused_loss_and_gradient(one_rank_group):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    from megatron.patchset.features.triton_cross_entropy import kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(1024, 2, 151936, generator=gen, device="cuda")).to(torch.bfloat16)
    target = torch.randint(0, 151936, (1024, 2), generator=gen, device="cuda")
    grad = torch.rand(1024, 2, generator=gen, device="cuda")
    ours_x = logits.clone().requires_grad_()
    ref_x = logits.clone().requires_grad_()
    ours = kernels.triton_cross_entropy(ours_x, target)
    ref = fused_vocab_parallel_cross_entropy(ref_x, target, one_rank_group)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    ours.backward(grad)
    ref.backward(grad)
    assert ours_x.grad.dtype == ref_x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours_x.grad.float(), ref_x.grad.float(), rtol=1.6e-2, atol=1e-7)
    same = torch.equal(ours_x.grad, ref_x.grad)
    print(f"loss max |diff| {(ours - ref).abs().max().item():.2e}; gradients bitwise equal: {same}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton_cross_entropy")
    variants = {"megatron": RECIPE, "triton": RECIPE + ("--cross-entropy-triton",)}
    return launch_variants(tmp, variants, ITERS)


def test_training_with_the_kernels_is_training_with_megatrons_fused_loss(runs):
    assert_trains_alike(
        runs["triton"],
        runs["megatron"],
        "triton cross entropy vs megatron's fused, full-iteration graph",
        iters=ITERS,
        loss_atol=2e-2,
        grad_norm_rtol=5e-2,
    )
