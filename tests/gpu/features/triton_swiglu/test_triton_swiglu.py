"""--moe-swiglu-triton on GPUs.

* The kernels against megatron-core's compiled weighted SwiGLU at the Qwen3-30B-A3B experts' width
  (2 x 768) in bf16: the same outputs and input gradients within bf16 rounding, the same
  probability gradients within fp32 rounding.
* A row's output and gradients have the same bits whether it is computed among 7,993 rows, among
  16,384 rows whose rest are zeros (a capacity-padded buffer) or among 40,960 rows.
* Training (the full-iteration recipe on one GPU): with the kernels the run trains like megatron's
  compiled activation. At EP = 2, the static dispatch against megatron's all-to-all bit for bit is
  in tests/gpu/features/static_dispatch/test_static_dispatch.py.
"""

import pytest
import torch

from tests.gpu.conftest import (
    FULL_ITERATION_RECIPE,
    assert_trains_alike,
    launch_variants,
)

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

FFN = 768
ITERS = 20
RECIPE = FULL_ITERATION_RECIPE


def inputs(rows, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    y = (2 * torch.randn(rows, 2 * FFN, generator=gen, device="cuda")).to(torch.bfloat16)
    probs = torch.rand(rows, 1, generator=gen, device="cuda")
    grad = torch.randn(rows, FFN, generator=gen, device="cuda").to(torch.bfloat16)
    return y, probs, grad


def forward_backward(fn, y, probs, grad):
    y, probs = y.clone().requires_grad_(), probs.clone().requires_grad_()
    out = fn(y, probs)
    out.backward(grad)
    return out, y.grad, probs.grad


def test_the_kernels_give_megatrons_weighted_swiglu():
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    from megatron.patchset.features.triton_swiglu import kernels

    y, probs, grad = inputs(32768)
    ours = forward_backward(kernels.weighted_swiglu, y, probs, grad)
    ref = forward_backward(lambda a, p: weighted_bias_swiglu_impl(a, None, p), y, probs, grad)
    for name, a, b in zip(("output", "input gradient"), ours[:2], ref[:2]):
        assert a.dtype == b.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-5, msg=name)
    assert ours[2].dtype == ref[2].dtype == torch.float32
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-4, atol=1e-4)
    print(
        f"probability gradients max |diff| {(ours[2] - ref[2]).abs().max().item():.2e}; outputs "
        f"bitwise equal: {torch.equal(ours[0], ref[0])}"
    )


def test_a_row_has_the_same_bits_among_any_number_of_rows():
    from megatron.patchset.features.triton_swiglu import kernels

    y, probs, grad = inputs(40960)
    rows = 7993
    alone = forward_backward(kernels.weighted_swiglu, y[:rows], probs[:rows], grad[:rows])
    padded = [torch.zeros(16384, *t.shape[1:], dtype=t.dtype, device="cuda") for t in (y, grad)]
    padded[0][:rows], padded[1][:rows] = y[:rows], grad[:rows]
    for label, (y_rows, probs_rows, grad_rows) in {
        "16,384 rows, the rest zeros": (padded[0], probs[:16384], padded[1]),
        "40,960 rows": (y, probs, grad),
    }.items():
        among = forward_backward(kernels.weighted_swiglu, y_rows, probs_rows, grad_rows)
        for name, a, b in zip(("output", "input gradient", "probability gradient"), among, alone):
            assert torch.equal(a[:rows], b), f"{name} of the first {rows} rows among {label}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton_swiglu")
    variants = {"megatron": RECIPE, "triton": RECIPE + ("--moe-swiglu-triton",)}
    return launch_variants(tmp, variants, ITERS)


def test_training_with_the_kernels_is_training_with_megatrons_activation(runs):
    assert "triton_swiglu.grouped_experts" in runs["triton"].log_text()
    assert_trains_alike(
        runs["triton"],
        runs["megatron"],
        "triton weighted SwiGLU vs megatron's compiled, full-iteration graph",
        iters=ITERS,
        loss_atol=2e-2,
        grad_norm_rtol=5e-2,
    )
