"""Traceable substitutes for TransformerEngine kernels inside compiled layers
(features/torch_compile).

While dynamo traces a compiled layer, TE's norm, RoPE, router-gating and fused-router kernels
(pybind calls, a graph break each) are replaced by torch code computing the same thing; eager
calls keep upstream's path. On the CPU there is no TE, so the checks use upstream's torch paths
as the reference and stand-in "kernels" (compile-disabled functions that count their calls) where
TE would be called, and count dynamo's graph breaks."""

import pytest
import torch
import torch._dynamo

from megatron.patchset.core import registry, rules
from megatron.patchset.features.torch_compile import flags as compile_flags
from megatron.patchset.features.torch_compile import layers, te_kernels, tracing
from tests.unit.conftest import parse, tiny_argv
from tests.unit.features.torch_compile.conftest import breaks


def test_patches_wanted_with_compile_unless_te_kernels():
    def wanted(*extra):
        return {p.name for p in registry.wanted(parse(tiny_argv(*extra)))} & set(
            te_kernels.TRACEABLE_PATCHES
            + (
                "torch_compile.router_topk_traceable",
                "torch_compile.router_aux_scores_traceable",
                "torch_compile.router_aux_loss_traceable",
            )
        )

    assert wanted() == set()
    assert wanted("--compile-transformer-layers") == set(te_kernels.TRACEABLE_PATCHES)
    assert wanted("--compile-transformer-layers", "--moe-router-fusion") == set(
        te_kernels.TRACEABLE_PATCHES
    ) | {
        "torch_compile.router_topk_traceable",
        "torch_compile.router_aux_scores_traceable",
        "torch_compile.router_aux_loss_traceable",
    }
    assert (
        wanted(
            "--compile-transformer-layers",
            "--moe-router-fusion",
            "--compile-transformer-layers-te-kernels",
        )
        == set()
    )
    args = parse(
        tiny_argv("--compile-transformer-layers", "--compile-transformer-layers-te-kernels")
    )
    assert compile_flags.options_from_args(args).te_kernels is True


def test_te_kernels_flag_needs_compile():

    args = parse(tiny_argv("--compile-transformer-layers-te-kernels"))
    with pytest.raises(
        rules.PatchsetArgumentError, match="only act with --compile-transformer-layers"
    ):
        rules.validate(args, "layout")


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_traceable_norm_is_the_fp32_norm(rms, zero_centered):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64, dtype=torch.bfloat16) * 3
    weight = torch.randn(64, dtype=torch.bfloat16)
    bias = torch.randn(64, dtype=torch.bfloat16)
    gamma = weight.float() + 1 if zero_centered else weight.float()
    if rms:
        ref = torch.nn.functional.rms_norm(x.float(), (64,), gamma, eps=1e-6)
    else:
        ref = torch.nn.functional.layer_norm(x.float(), (64,), gamma, bias.float(), eps=1e-6)
    out = te_kernels.traceable_norm(x, weight, None if rms else bias, 1e-6, zero_centered, rms)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=0, atol=0.02)


def test_traceable_norm_output_dtype_follows_the_weight_as_te():
    """An fp32 residual stream (--fp32-residual-connection) into a bf16 norm: TE casts the input
    to the weight's dtype and returns that dtype; so must the substitute."""
    torch.manual_seed(0)
    x = torch.randn(4, 64) * 3
    weight = torch.randn(64, dtype=torch.bfloat16)
    out = te_kernels.traceable_norm(x, weight, None, 1e-6, False, True)
    assert out.dtype == torch.bfloat16
    ref = torch.nn.functional.rms_norm(
        x.to(torch.bfloat16).float(), (64,), weight.float(), eps=1e-6
    )
    assert torch.equal(out, ref.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.float16):
        assert te_kernels.traceable_norm(x, weight, None, 1e-6, False, True).dtype == torch.float16


class _Kernel:
    """A stand-in for a TE pybind kernel: dynamo must not trace it (a graph break), and it
    counts its calls."""

    def __init__(self):
        self.calls = 0

        @torch.compiler.disable
        def kernel(x, weight, eps):
            self.calls += 1
            return torch.nn.functional.rms_norm(
                x.float(), (x.shape[-1],), weight.float(), eps=eps
            ).to(x.dtype)

        self.kernel = kernel


def _stand_in_norm_classes(kernel):
    class RMSNorm(torch.nn.Module):
        def __init__(self, n, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(n))
            self.eps = eps
            self.zero_centered_gamma = False

        def forward(self, x):
            return kernel.kernel(x, self.weight, self.eps)

    class LayerNorm(RMSNorm):
        def __init__(self, n, eps=1e-6):
            super().__init__(n, eps)
            self.bias = torch.nn.Parameter(torch.randn(n))

        def forward(self, x):
            kernel.calls += 1
            return torch.nn.functional.layer_norm(
                x, (x.shape[-1],), self.weight, self.bias, self.eps
            )

    return RMSNorm, LayerNorm


def test_norm_traces_while_compiling_and_calls_the_kernel_eagerly(fresh_dynamo, in_compiled_layer):
    import copy

    kernel = _Kernel()
    rms_class, ln_class = _stand_in_norm_classes(kernel)
    norm = te_kernels.make_norm_traceable(rms_class(32), classes=(rms_class, ln_class))
    x = torch.randn(4, 32, requires_grad=True)

    eager = norm(x)
    assert kernel.calls == 1
    compiled = torch.compile(lambda t: norm(t) * 2, backend="aot_eager")(x)
    assert kernel.calls == 1 and breaks(fresh_dynamo) == 0  # traced, not the kernel
    torch.testing.assert_close(compiled, eager * 2)
    compiled.sum().backward()
    assert norm.weight.grad is not None and x.grad is not None

    # The same module unpatched: the kernel is a graph break.
    plain = rms_class(32)
    torch.compile(lambda t: plain(t) * 2, backend="aot_eager")(x)
    assert kernel.calls == 2 and breaks(fresh_dynamo) >= 1

    # LayerNorm (with its bias) traced the same way.
    ln = te_kernels.make_norm_traceable(ln_class(32), classes=(rms_class, ln_class))
    calls = kernel.calls
    traced = torch.compile(lambda t: ln(t), backend="aot_eager")(x)
    assert kernel.calls == calls
    torch.testing.assert_close(
        traced, torch.nn.functional.layer_norm(x, (32,), ln.weight, ln.bias, 1e-6)
    )

    # Outside a compiled TransformerLayer (other torch.compile'd code) the kernel stays.
    tracing.IN_COMPILED_LAYER[0] = False
    torch.compile(lambda t: norm(t) + 1, backend="aot_eager")(x)
    assert kernel.calls == calls + 1
    tracing.IN_COMPILED_LAYER[0] = True

    # A deep copy keeps its own weight (the forward is bound to the copy, not to the original).
    twin = copy.deepcopy(norm)
    with torch.no_grad():
        twin.weight.mul_(0)
    assert torch.count_nonzero(twin(x)) == 0 and torch.count_nonzero(norm(x)) > 0

    # Other modules are left alone; a TE class without the expected attributes is a clear error.
    other = torch.nn.Linear(2, 2)
    assert (
        te_kernels.make_norm_traceable(other, classes=(rms_class, ln_class)) is other
        and "forward" not in other.__dict__
    )
    broken = rms_class(8)
    del broken.eps
    with pytest.raises(
        registry.PatchsetError, match="eps.*--compile-transformer-layers-te-kernels"
    ):
        te_kernels.make_norm_traceable(broken, classes=(rms_class, ln_class))


def test_te_norm_factory_builds_upstream_norm_and_makes_exact_te_norms_traceable(monkeypatch):
    """The patched spec-provider TENorm builds what upstream's builds; exact TE RMSNorm/LayerNorm
    instances get the traceable forward, anything else (the fused-residual RMSNorm, a subclass)
    is returned untouched."""
    kernel = _Kernel()
    rms_class, ln_class = _stand_in_norm_classes(kernel)

    class FusedResidual(rms_class):
        pass

    class UpstreamTENorm:
        def __new__(cls, config, hidden_size, eps=1e-5, has_residual=False):
            return (FusedResidual if has_residual else rms_class)(hidden_size, eps)

    monkeypatch.setattr(te_kernels, "te_norm_classes", lambda: (rms_class, ln_class))
    patched = te_kernels._te_norm_factory(UpstreamTENorm)
    assert patched.__name__ == "UpstreamTENorm" and issubclass(patched, UpstreamTENorm)
    plain = patched(None, 16, eps=1e-5)
    assert type(plain) is rms_class and "forward" in plain.__dict__ and plain.eps == 1e-5
    fused = patched(None, 16, has_residual=True)
    assert type(fused) is FusedResidual and "forward" not in fused.__dict__


def test_router_gating_matches_upstream_and_traces(fresh_dynamo, in_compiled_layer):
    """On the CPU (no TE) upstream's gating is its torch.mm path: the substitute must give the
    same logits and gradients, and trace without a break (upstream's calls TE's GEMM on GPUs)."""
    from megatron.core.transformer.moe import moe_utils

    names = registry.apply_patches([registry.get("torch_compile.router_gating_traceable")])
    try:
        from megatron.core.transformer.moe import router

        patched = router.router_gating_linear
        assert patched.__wrapped__ is moe_utils.router_gating_linear
        torch.manual_seed(0)
        for router_dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(6, 2, 16, dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
            ref = moe_utils.router_gating_linear(x, w, None, router_dtype)
            g = torch.randn_like(ref)
            ref_grads = torch.autograd.grad(ref, (x, w), g)
            out = torch.compile(patched, backend="aot_eager", fullgraph=True)(
                x, w, None, router_dtype
            )
            grads = torch.autograd.grad(out, (x, w), g)
            assert out.dtype == router_dtype and grads[0].dtype == grads[1].dtype == torch.bfloat16
            torch.testing.assert_close(out, ref)
            for mine, theirs in zip(grads, ref_grads):
                torch.testing.assert_close(mine, theirs)
        assert breaks(fresh_dynamo) == 0
    finally:
        registry.revert(names)


def test_rope_unfused_while_compiling(fresh_dynamo, in_compiled_layer):
    """With apply_rope_fusion on (TE's kernel, absent on the CPU: upstream's fused path would fail
    here), the compiled call takes megatron's unfused bshd path; eager calls still go to
    upstream."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    names = registry.apply_patches([registry.get("torch_compile.rope_traceable")])
    try:
        from megatron.core.transformer import attention

        patched = attention.apply_rotary_pos_emb
        config = SimpleNamespace(
            apply_rope_fusion=True,
            rotary_interleaved=False,
            multi_latent_attention=False,
            mrope_section=None,
        )
        t = torch.randn(16, 2, 4, 32, dtype=torch.bfloat16)
        freqs = torch.randn(16, 1, 1, 32)
        # In fp32, as TE's fused kernel: closer to the fp32 result than upstream's unfused bf16
        # path.
        exact = rope_utils._apply_rotary_pos_emb_bshd(t.float(), freqs, rotary_interleaved=False)
        out = torch.compile(
            lambda a, b: patched(a, b, config=config), backend="aot_eager", fullgraph=True
        )(t, freqs)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, exact.to(torch.bfloat16), rtol=0, atol=0)
        assert breaks(fresh_dynamo) == 0
        # Eagerly with fusion off, upstream's own result, also for MLA configs (whose attention
        # does not ask for MLA interleaving here: upstream's default is False).
        mla = SimpleNamespace(
            apply_rope_fusion=False,
            rotary_interleaved=False,
            multi_latent_attention=True,
            mrope_section=None,
        )
        torch.testing.assert_close(
            patched(t, freqs, config=mla, cp_group=object()),
            patched.__wrapped__(t, freqs, config=mla, cp_group=object()),
            rtol=0,
            atol=0,
        )
        # Eagerly the call goes to upstream's fused path (TE's kernel: not on the CPU).
        with pytest.raises(AssertionError, match="apply_rope_fusion is not available"):
            patched(t, freqs, config=config, cp_group=object())
    finally:
        registry.revert(names)


def test_router_fusion_is_dropped_only_while_compiling(fresh_dynamo, in_compiled_layer):
    names = registry.apply_patches(
        [
            registry.get(n)
            for n in (
                "torch_compile.router_topk_traceable",
                "torch_compile.router_aux_scores_traceable",
                "torch_compile.router_aux_loss_traceable",
            )
        ]
    )
    try:
        from megatron.core.transformer.moe import moe_utils, router

        logits = torch.randn(12, 8)
        ref_probs, ref_map = moe_utils.topk_routing_with_score_function(logits, 2, fused=False)

        def route(x):
            return router.topk_routing_with_score_function(x, 2, fused=True)

        probs, routing_map = torch.compile(route, backend="aot_eager")(logits)
        torch.testing.assert_close(probs, ref_probs)
        assert torch.equal(routing_map, ref_map)
        # Eagerly the fused request reaches upstream unchanged (no TE here: its kernel is missing),
        # and so does a traced one with router replay (upstream's fused kernel ignores replay).
        with pytest.raises(Exception, match="fused_topk_with_score_function is not available"):
            route(logits)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="fused_topk_with_score_function is not available"):
            torch.compile(
                lambda x: router.topk_routing_with_score_function(
                    x, 2, fused=True, router_replay=object()
                ),
                backend="aot_eager",
            )(logits)
        fresh_dynamo.clear()  # that failure is a graph break; the counts below are the others'
        scores_map, scores = torch.compile(
            lambda x: router.compute_routing_scores_for_aux_loss(x, 2, "softmax", fused=True),
            backend="aot_eager",
        )(logits)
        ref_scores_map, ref_scores = moe_utils.compute_routing_scores_for_aux_loss(
            logits, 2, "softmax", fused=False
        )
        torch.testing.assert_close(scores, ref_scores)
        assert torch.equal(scores_map, ref_scores_map)
        tokens = ref_map.sum(dim=0)
        loss = torch.compile(
            lambda p: router.switch_load_balancing_loss_func(p, tokens, 12, 2, 8, 1e-2, fused=True),
            backend="aot_eager",
        )(ref_scores)
        torch.testing.assert_close(
            loss, moe_utils.switch_load_balancing_loss_func(ref_scores, tokens, 12, 2, 8, 1e-2)
        )
        assert breaks(fresh_dynamo) == 0
    finally:
        registry.revert(names)


def test_skipping_a_patch_compilation_needs_names_the_skip(monkeypatch):
    monkeypatch.setenv(registry.SKIP_ENV, "torch_compile.moe_dispatch_eager")
    with pytest.raises(
        registry.PatchsetError,
        match="MEGATRON_PATCHSET_SKIP_PATCHES leaves out torch_compile.moe_dispatch_eager",
    ):
        layers.compile_transformer_layers([torch.nn.Linear(1, 1)], compile_flags.CompileOptions())
