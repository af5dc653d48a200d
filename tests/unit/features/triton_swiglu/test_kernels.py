"""The Triton weighted SwiGLU, run by Triton's interpreter on the CPU: output and gradients against
megatron-core's formulas, bf16 inputs, rows that give the same bits whatever the rows around them,
the patch in megatron's grouped experts, and its rule."""

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.features.triton_swiglu import kernels, patches
from tests.unit.conftest import failures, parse, tiny_argv, triton_interpreter

pytest.importorskip("triton")

FLAG = "--moe-swiglu-triton"
RULE = "moe-swiglu-triton-requirements"
PATCH = "triton_swiglu.grouped_experts"
FFN = kernels.MAX_BLOCK_COLS + 44  # two column blocks, the second partial


@pytest.fixture
def interpreter(monkeypatch):
    yield from triton_interpreter(monkeypatch, kernels._kernels)


def inputs(rows=37, ffn=FFN, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = (2 * torch.randn(rows, 2 * ffn, generator=gen)).to(dtype)
    probs = torch.rand(rows, 1, generator=gen)
    grad = torch.randn(rows, ffn, generator=gen).to(dtype)
    return y, probs, grad


def reference(y, probs, grad):
    """megatron-core's weighted_swiglu and weighted_swiglu_back, written out in fp64."""
    a, b = y.double().chunk(2, -1)
    p, g = probs.double(), grad.double()
    sig = torch.sigmoid(a)
    out = a * sig * b * p
    dy = torch.cat((g * p * sig * (1 + a * (1 - sig)) * b, g * p * a * sig), -1)
    dp = (a * sig * b * g).sum(-1, keepdim=True)
    return out, dy, dp


def run(y, probs, grad):
    y, probs = y.clone().requires_grad_(), probs.clone().requires_grad_()
    out = kernels.weighted_swiglu(y, probs)
    out.backward(grad)
    return out, y.grad, probs.grad


def test_output_and_gradients_are_megatrons_formulas(interpreter):
    y, probs, grad = inputs()
    out, dy, dp = run(y, probs, grad)
    ref_out, ref_dy, ref_dp = reference(y, probs, grad)
    assert dp.shape == probs.shape and dp.dtype == probs.dtype
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dy.double(), ref_dy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dp.double(), ref_dp, rtol=1e-5, atol=1e-4)


def test_bf16_inputs_give_bf16_outputs_and_fp32_probability_gradients(interpreter):
    y, probs, grad = inputs(dtype=torch.bfloat16)
    out, dy, dp = run(y, probs, grad)
    assert out.dtype == dy.dtype == torch.bfloat16 and dp.dtype == torch.float32
    ref_out, ref_dy, ref_dp = reference(y, probs, grad)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dy.double(), ref_dy, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dp.double(), ref_dp, rtol=1e-4, atol=1e-3)


def test_a_row_gets_the_same_bits_whatever_the_rows_around_it(interpreter):
    y, probs, grad = inputs(rows=64, dtype=torch.bfloat16)
    first = [t[:21] for t in run(y[:21], probs[:21], grad[:21])]
    padded = torch.zeros_like(y)
    padded[:21] = y[:21]
    for rows, y_rows in ((64, y), (64, padded), (40, y[:40])):
        out, dy, dp = run(y_rows, probs[:rows], grad[:rows])
        for ours, alone in zip((out[:21], dy[:21], dp[:21]), first):
            assert torch.equal(ours, alone)


def test_no_rows_give_empty_outputs(interpreter):
    y, probs, grad = inputs(rows=0)
    out, dy, dp = run(y, probs, grad)
    assert out.shape == (0, FFN) and dy.shape == (0, 2 * FFN) and dp.shape == (0, 1)


def test_shapes_that_are_not_rows_by_two_halves_are_refused():
    with pytest.raises(ValueError, match=r"\(4, 5\); it needs rows x 2F"):
        kernels.weighted_swiglu(torch.zeros(4, 5), torch.zeros(4))
    with pytest.raises(ValueError, match="3 probabilities for 4 rows"):
        kernels.weighted_swiglu(torch.zeros(4, 6), torch.zeros(3))


def test_the_replacement_keeps_megatrons_shapes_and_falls_back_for_a_bias(interpreter):
    calls = []
    replaced = patches.triton_for_weighted(lambda *a: calls.append(a) or "megatron")
    y, probs, _ = inputs(rows=6)
    out = replaced(y.view(3, 2, -1), None, probs, False)
    assert out.shape == (3, 2, FFN) and calls == []
    ref = reference(y, probs, y[:, :FFN])[0]
    torch.testing.assert_close(out.view(6, -1).double(), ref, rtol=1e-5, atol=1e-5)
    assert replaced(y, torch.zeros(2 * FFN), probs) == "megatron"
    assert replaced(y, None, probs, True) == "megatron"
    assert len(calls) == 2


def test_without_the_kernels_megatrons_function_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    replaced = patches.triton_for_weighted(lambda *a: "megatron")
    assert replaced(torch.zeros(2, 4), None, torch.zeros(2, 1)) == "megatron"


def test_the_patch_replaces_the_experts_name_only_when_asked():
    from megatron.core.transformer.moe import experts

    original = experts.weighted_bias_swiglu_impl
    assert PATCH not in {p.name for p in registry.selected(parse(tiny_argv()))}
    applied = registry.apply(parse(tiny_argv(FLAG)))
    try:
        assert PATCH in applied
        replaced = experts.weighted_bias_swiglu_impl
        assert replaced is not original and replaced.__wrapped__ is original
    finally:
        registry.revert(applied)
    assert experts.weighted_bias_swiglu_impl is original


def test_the_rule_names_what_the_kernels_need():
    assert RULE not in failures(tiny_argv(FLAG))
    got = failures(tiny_argv(FLAG, "--no-bias-swiglu-fusion"))[RULE]
    assert got.startswith(f"{FLAG} needs: ") and "--no-bias-swiglu-fusion" in got
    argv = [a for a in tiny_argv(FLAG) if a not in ("--swiglu", "--disable-bias-linear")]
    got = failures(argv)[RULE]
    assert "--swiglu (" in got and "--disable-bias-linear (" in got
    got = failures(tiny_argv(FLAG, "--compile-transformer-layers"))
    assert "--compile-transformer-layers (" in got.get(RULE, ""), got
    got = failures(tiny_argv(FLAG, "--use-transformer-engine-op-fuser"))
    assert "--use-transformer-engine-op-fuser (" in got.get(RULE, ""), got
    assert RULE not in failures(tiny_argv("--no-bias-swiglu-fusion"))
