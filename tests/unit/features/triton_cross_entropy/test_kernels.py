"""The Triton cross entropy, run by Triton's interpreter on the CPU: loss and gradient against
torch's cross entropy, rows over several blocks, -inf logits, targets outside the vocabulary, the
patch in megatron's language module, and its rule."""

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.features.triton_cross_entropy import kernels, patches
from tests.unit.conftest import failures, parse, tiny_argv, triton_interpreter

pytest.importorskip("triton")

FLAG = "--cross-entropy-triton"
RULE = "cross-entropy-triton-requirements"
VOCAB = kernels.BLOCK + 37  # two blocks, the second partial


@pytest.fixture
def interpreter(monkeypatch):
    yield from triton_interpreter(monkeypatch, kernels._kernels)


def logits_and_target(dtype=torch.float32, seq=3, batch=2, vocab=VOCAB, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(seq, batch, vocab, generator=gen)).to(dtype)
    target = torch.randint(0, vocab, (seq, batch), generator=gen)
    return logits, target


def reference(logits, target):
    """torch's cross entropy in fp32, per token, with its gradient for ``grad``."""
    x = logits.detach().float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(
        x.reshape(-1, x.shape[-1]), target.reshape(-1), reduction="none"
    ).view(target.shape)
    return x, loss


def test_loss_and_gradient_are_torchs_cross_entropy(interpreter):
    logits, target = logits_and_target()
    x = logits.clone().requires_grad_()
    loss = kernels.triton_cross_entropy(x, target)
    ref_x, ref_loss = reference(logits, target)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    grad = torch.randn(target.shape, generator=torch.Generator().manual_seed(1))
    loss.backward(grad)
    ref_loss.backward(grad)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-6)


def test_bf16_logits_give_an_fp32_loss_and_a_bf16_gradient(interpreter):
    logits, target = logits_and_target(torch.bfloat16)
    x = logits.clone().requires_grad_()
    loss = kernels.triton_cross_entropy(x, target)
    ref_x, ref_loss = reference(logits, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref_loss.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), ref_x.grad, rtol=1e-2, atol=1e-5)


def test_minus_infinity_logits_take_no_probability(interpreter):
    logits, target = logits_and_target()
    logits[..., : kernels.BLOCK] = float("-inf")  # a whole first block masked out
    target.clamp_(min=kernels.BLOCK)
    x = logits.clone().requires_grad_()
    loss = kernels.triton_cross_entropy(x, target)
    ref_x, ref_loss = reference(logits, target)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref_loss.sum().backward()
    assert torch.all(x.grad[..., : kernels.BLOCK] == 0)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-6)


def test_a_target_outside_the_vocabulary_counts_as_the_row_maximum(interpreter):
    """megatron-core's vocab-parallel loss on one rank masks such a target to the maximum."""
    logits, target = logits_and_target(seq=1, batch=2)
    target[0, 0] = VOCAB + 5
    target[0, 1] = -1
    loss = kernels.triton_cross_entropy(logits, target)
    expected = torch.logsumexp(logits, -1) - logits.amax(-1)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_mismatched_shapes_are_refused_with_both_named():
    with pytest.raises(ValueError, match=r"logits \(3, 2, 5\) do not match target \(3,\)"):
        kernels.triton_cross_entropy(torch.zeros(3, 2, 5), torch.zeros(3, dtype=torch.long))


class Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_the_replacement_uses_the_kernels_and_refuses_a_split_vocabulary(interpreter):
    calls = []
    replaced = patches.triton_for_fused(lambda *a: calls.append(a))
    logits, target = logits_and_target()
    torch.testing.assert_close(
        replaced(logits, target, Group(1)), reference(logits, target)[1], rtol=1e-5, atol=1e-5
    )
    assert calls == []
    with pytest.raises(PatchsetError, match="--tensor-model-parallel-size 1"):
        replaced(logits, target, Group(2))


def test_without_the_kernels_megatrons_function_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    replaced = patches.triton_for_fused(lambda *a: calls.append(a) or "megatron")
    assert replaced(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), Group(1)) == (
        "megatron"
    )
    assert len(calls) == 1


def test_the_patch_replaces_the_language_modules_name_only_when_asked():
    from megatron.core.models.common.language_module import language_module

    original = language_module.fused_vocab_parallel_cross_entropy
    fused = ("--cross-entropy-loss-fusion",)
    assert "triton_cross_entropy.fused_loss" not in {
        p.name for p in registry.selected(parse(tiny_argv(*fused)))
    }
    applied = registry.apply(parse(tiny_argv(*fused, FLAG)))
    try:
        assert "triton_cross_entropy.fused_loss" in applied
        replaced = language_module.fused_vocab_parallel_cross_entropy
        assert replaced is not original and replaced.__wrapped__ is original
    finally:
        registry.revert(applied)
    assert language_module.fused_vocab_parallel_cross_entropy is original


def test_the_rule_names_what_the_kernels_need():
    assert failures(tiny_argv("--cross-entropy-loss-fusion", FLAG)) == {}
    assert "--cross-entropy-loss-fusion" in failures(tiny_argv(FLAG)).get(RULE, "")
    got = failures(
        tiny_argv("--cross-entropy-loss-fusion", FLAG, "--tensor-model-parallel-size", "2")
    )
    assert "--tensor-model-parallel-size 1" in got.get(RULE, ""), got
    assert RULE not in failures(tiny_argv("--tensor-model-parallel-size", "2"))
