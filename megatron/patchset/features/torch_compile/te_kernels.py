"""Traceable substitutes for TransformerEngine's kernels, while compiling.

Inside a compiled layer every call into a TE pybind kernel (RMSNorm, fused RoPE, the router's
fused top-k / aux-loss scores, the router's gating GEMM) is a graph break: the layer is cut
into many small graphs, each with its own guards and autograd wrapper, and the host work of
the breaks outweighs what inductor saves (measured 0.87x of eager with them). While dynamo
traces, these patches route the same math through megatron's own unfused torch code (or an
equivalent torch expression), which inductor fuses with its neighbours. Eager calls -- the
layers' eager MoE regions, modules outside the compiled layers, every call without
compilation -- still run TE's kernels. ``--compile-transformer-layers-te-kernels`` keeps TE's
kernels inside the compiled layers too.
"""

from __future__ import annotations

import functools

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch
from megatron.patchset.features.torch_compile.flags import (
    FLAG,
    TE_KERNELS_FLAG,
    traceable_router,
    traceable_substitutes,
)
from megatron.patchset.features.torch_compile.tracing import tracing

_ROUTER = "megatron.core.transformer.moe.router"


def unfused_while_compiling(original):
    """``router.<function>(..., fused=...)`` called with ``fused=False`` while compiling."""

    @functools.wraps(original)
    def routing_function(*args, **kwargs):
        # Upstream's fused top-k ignores router replay, the unfused one honours it: keep the
        # fused kernel (a graph break) there, so compiled and eager routing stay the same.
        if kwargs.get("fused") and kwargs.get("router_replay") is None and tracing():
            kwargs["fused"] = False
        return original(*args, **kwargs)

    return routing_function


@patch(
    "torch_compile.router_topk_traceable",
    f"{_ROUTER}.topk_routing_with_score_function",
    reason="--moe-router-fusion's TE top-k kernel is two graph breaks per compiled layer "
    "(pybind call, int() of a pybind enum): while compiling, megatron's unfused top-k, which "
    "inductor fuses",
    enabled=traceable_router,
    flags=(FLAG, "--moe-router-fusion"),
)
def _router_topk_factory(original):
    return unfused_while_compiling(original)


@patch(
    "torch_compile.router_aux_scores_traceable",
    f"{_ROUTER}.compute_routing_scores_for_aux_loss",
    reason="--moe-router-fusion's TE aux-loss score kernel is two graph breaks per compiled layer: "
    "while compiling, megatron's unfused scores",
    enabled=traceable_router,
    flags=(FLAG, "--moe-router-fusion"),
)
def _router_aux_scores_factory(original):
    return unfused_while_compiling(original)


@patch(
    "torch_compile.router_aux_loss_traceable",
    f"{_ROUTER}.switch_load_balancing_loss_func",
    reason="--moe-router-fusion's TE aux-loss kernel is a graph break per compiled layer: while "
    "compiling, megatron's unfused loss",
    enabled=traceable_router,
    flags=(FLAG, "--moe-router-fusion"),
)
def _router_aux_loss_factory(original):
    return unfused_while_compiling(original)


def gating_linear_function():
    """The router's gating GEMM in torch ops, as an autograd function (what upstream's
    ``RouterGatingLinearFunction`` computes without TE): logits in ``router_dtype`` from the bf16
    input and weight; saves the bf16 tensors, not up-cast copies; gradients in the input's and the
    weight's dtypes. Built when the patch is applied (dynamo cannot trace a class definition)."""
    import torch

    class GatingLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, weight, bias, router_dtype):
            ctx.save_for_backward(inp, weight)
            ctx.router_dtype = router_dtype
            ctx.has_bias = bias is not None
            flat = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
            out = flat @ weight.to(router_dtype).t()
            if bias is not None:
                out = out + bias.to(router_dtype)
            return out.view(*inp.shape[:-1], out.shape[-1])

        @staticmethod
        def backward(ctx, grad):
            inp, weight = ctx.saved_tensors
            grad = grad.reshape(-1, grad.shape[-1])
            flat = inp.reshape(-1, inp.shape[-1]).to(ctx.router_dtype)
            grad_inp = (grad @ weight.to(ctx.router_dtype)).to(inp.dtype).view(inp.shape)
            grad_weight = (grad.t() @ flat).to(weight.dtype)
            grad_bias = grad.sum(dim=0).to(weight.dtype) if ctx.has_bias else None
            return grad_inp, grad_weight, grad_bias, None

    return GatingLinear


@patch(
    "torch_compile.router_gating_traceable",
    f"{_ROUTER}.router_gating_linear",
    reason="the router's gating GEMM goes through TE's general_gemm pybind (a graph break per "
    "compiled layer): while compiling, the same GEMM in torch ops",
    enabled=traceable_substitutes,
)
def _router_gating_factory(original):
    import torch

    function = gating_linear_function()

    @functools.wraps(original)
    def router_gating_linear(inp, weight, bias, router_dtype):
        if tracing() and router_dtype != torch.float64:
            return function.apply(inp, weight, bias, router_dtype)
        return original(inp, weight, bias, router_dtype)

    return router_gating_linear


@patch(
    "torch_compile.rope_traceable",
    "megatron.core.transformer.attention.apply_rotary_pos_emb",
    reason="TE's fused RoPE (apply_rope_fusion, on by default) is a pybind call, a graph break "
    "per query and key in each compiled layer: while compiling, megatron's unfused bshd RoPE",
    enabled=traceable_substitutes,
)
def _rope_factory(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(
        t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, mla_rotary_interleaved=False
    ):
        # Upstream's fused path is taken only without mRoPE, mscale and MLA interleaving; the
        # others already run unfused (and traceable) there.
        if (
            config.apply_rope_fusion
            and cu_seqlens is None
            and mscale == 1.0
            and getattr(config, "mrope_section", None) is None
            and not mla_rotary_interleaved
            and tracing()
        ):
            from megatron.core.models.common.embeddings import rope_utils

            # In fp32, as TE's fused kernel computes (upstream's unfused path rounds cos/sin to
            # the input's dtype): inductor fuses the casts.
            return rope_utils._apply_rotary_pos_emb_bshd(
                t.float(), freqs, rotary_interleaved=config.rotary_interleaved
            ).to(t.dtype)
        return original(
            t,
            freqs,
            config,
            cu_seqlens=cu_seqlens,
            mscale=mscale,
            cp_group=cp_group,
            mla_rotary_interleaved=mla_rotary_interleaved,
        )

    return apply_rotary_pos_emb


def traceable_norm(x, weight, bias, eps: float, zero_centered_gamma: bool, rms: bool):
    """RMSNorm / LayerNorm as TE computes them: the input cast to the autocast dtype (else the
    weight's dtype), the norm in fp32, the output in that dtype. (An fp32 residual stream with
    bf16 weights, ``--fp32-residual-connection``, gives bf16 outputs, as TE's kernels do.)"""
    import torch

    dtype = (
        torch.get_autocast_dtype(x.device.type)
        if torch.is_autocast_enabled(x.device.type)
        else weight.dtype
    )
    x32 = x.to(dtype).float()
    scale = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    if rms:
        y = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps) * scale
    else:
        y = torch.nn.functional.layer_norm(
            x32, (x.shape[-1],), scale, None if bias is None else bias.float(), eps
        )
    return y.to(dtype)


def _norm_forward(self, inp):
    """Instance ``forward`` of a TE norm built through the TE spec: traceable while compiling."""
    if tracing():
        return traceable_norm(
            inp,
            self.weight,
            getattr(self, "bias", None),
            float(self.eps),
            bool(self.zero_centered_gamma),
            self.__megatron_patchset_rms__,
        )
    return type(self).forward(self, inp)


def te_norm_classes() -> tuple:
    """TE's ``RMSNorm`` and ``LayerNorm`` (exact types; subclasses such as the fused-residual
    RMSNorm have other forward signatures and are left alone)."""
    import transformer_engine.pytorch as te

    return te.RMSNorm, te.LayerNorm


def make_norm_traceable(norm, classes: tuple | None = None):
    """Give ``norm`` (an exact TE ``RMSNorm`` / ``LayerNorm``) the traceable instance forward;
    other modules (the fused-residual RMSNorm, apex, torch norms) are returned unchanged."""
    import types

    rms_class, ln_class = classes if classes is not None else te_norm_classes()
    if type(norm) not in (rms_class, ln_class):
        return norm
    missing = [a for a in ("eps", "zero_centered_gamma", "weight") if not hasattr(norm, a)]
    if missing:
        raise PatchsetError(
            f"{FLAG}: {type(norm).__qualname__} has no {', '.join(missing)}; this "
            f"TransformerEngine moved them. Run with {TE_KERNELS_FLAG} to keep TE's norm kernels "
            "inside compiled layers."
        )
    norm.__megatron_patchset_rms__ = type(norm) is rms_class
    norm.forward = types.MethodType(_norm_forward, norm)
    return norm


@patch(
    "torch_compile.te_norm_traceable",
    "megatron.core.extensions.transformer_engine_spec_provider.TENorm",
    reason="the TE spec's q/k and pre-MLP norms are TE RMSNorm/LayerNorm modules whose kernels "
    "are pybind calls, a graph break each in every compiled layer: while compiling, the same norm "
    "in torch ops (fp32, as TE computes it)",
    enabled=traceable_substitutes,
)
def _te_norm_factory(original):
    class TENorm(original):
        """Builds upstream's TE norm, with a forward that is traceable while compiling."""

        def __new__(cls, *args, **kwargs):
            return make_norm_traceable(original(*args, **kwargs))

    TENorm.__qualname__ = TENorm.__name__ = original.__name__
    return TENorm


# Applied with every compilation unless --compile-transformer-layers-te-kernels (the router
# fusion ones, ``torch_compile.router_*_traceable``, only with --moe-router-fusion).
TRACEABLE_PATCHES = (
    "torch_compile.router_gating_traceable",
    "torch_compile.rope_traceable",
    "torch_compile.te_norm_traceable",
)
