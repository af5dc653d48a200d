"""The TE spec's attention block as torch code while compiling.

megatron's TE wrappers (QKV ``LayerNormLinear``, output ``Linear``, ``DotProductAttention``)
call TE forwards that TE wraps in ``torch.compiler.disable``. Each is a graph break, and since
it sits three calls deep (layer -> attention -> linear), dynamo splits every enclosing frame
there: the profile at 1x4096 showed the compiled attention block costing as much host time as
the eager one. In the plain bf16 case -- one tensor-parallel rank, no FP8/FP4 (by config or by
an enclosing autocast), no TE weight-grad fusion or delay, no parameter splits, no CPU
offloading -- these modules compute a norm, a GEMM and a causal softmax attention, which torch
ops give as well: while dynamo traces a compiled layer, the wrapped forwards below run them as
``traceable_norm`` + ``F.linear`` and ``F.scaled_dot_product_attention``. Anything else (and
every eager call) goes to upstream's forward. The patches wrap the classes' ``forward`` in
place (not subclasses: megatron's MLA compares its spec's linear classes by identity).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch, patched_by
from megatron.patchset.features.torch_compile.flags import (
    FLAG,
    TE_KERNELS_FLAG,
    te_attention_block_substitutes,
)
from megatron.patchset.features.torch_compile.te_kernels import traceable_norm
from megatron.patchset.features.torch_compile.tracing import TE_CONTEXT_PLAIN, tracing

_TE_WRAPPERS = "megatron.core.extensions.transformer_engine"


def plain_bf16_linear(module) -> bool:
    """``module`` (a megatron TE linear) is a single-rank, unquantised GEMM whose weight gradient
    TE would return as ``.grad`` (no fused accumulation into ``main_grad``, no delayed wgrad).
    Attributes are read strictly: a TE that renamed one is a clear error, not a silent yes."""
    config = module.config
    return (
        module.tp_size == 1
        and not module.fuse_wgrad_accumulation
        and list(module.weight_names) == ["weight"]
        and module.te_quant_params is None
        and config.fp8 is None
        and config.fp4 is None
        and not config.delay_wgrad_compute
        and getattr(module.weight, "gtp_remat_size", None) is None
        and not getattr(module, "return_layernorm_output", False)
    )


def _bias_of(module):
    """(bias added in the GEMM, bias returned to the caller): TE's ``return_bias`` contract."""
    bias = getattr(module, "bias", None)
    if not module.use_bias or bias is None or bias.numel() == 0:
        return None, None
    # megatron's wrappers: te_return_bias (skip_bias_add and bias); TE's own modules: return_bias
    returned = module.te_return_bias if hasattr(module, "te_return_bias") else module.return_bias
    return (None, bias) if returned else (bias, None)


def traceable_linear(module, x):
    """megatron's ``TELinear.forward`` in torch ops: ``(x W^T [+ b], returned bias)``."""
    import torch

    added, returned = _bias_of(module)
    return torch.nn.functional.linear(x, module.weight, added), returned


def traceable_layernorm_linear(module, x):
    """megatron's ``TELayerNormColumnParallelLinear.forward`` in torch ops: the norm as TE
    computes it (:func:`traceable_norm`), then the GEMM."""
    import torch

    normed = traceable_norm(
        x,
        module.layer_norm_weight,
        getattr(module, "layer_norm_bias", None),
        float(module.eps),
        bool(module.zero_centered_gamma),
        module.normalization == "RMSNorm",
    )
    added, returned = _bias_of(module)
    return torch.nn.functional.linear(normed, module.weight, added), returned


def _te_method(original, name: str) -> Callable:
    if not inspect.isfunction(original):
        raise PatchsetError(
            f"{FLAG}: megatron's {name} is {original!r} here, not a function: TransformerEngine is "
            f"not installed (run with {TE_KERNELS_FLAG}, or --transformer-impl local)"
        )
    return original


def traceable_forward(original, traceable: Callable, name: str) -> Callable:
    """The linear's ``forward``: ``traceable(self, x)`` while a compiled layer traces a plain
    bf16 call on one TP rank (:func:`plain_bf16_linear`), upstream's ``original`` otherwise."""
    original = _te_method(original, name)

    # updated=(): not the original's __dict__, which would carry a torch.compiler.disable mark
    @functools.wraps(original, updated=())
    def forward(self, x, *args, **kwargs):
        if (
            not args
            and not kwargs
            and tracing()
            and TE_CONTEXT_PLAIN[0]
            and plain_bf16_linear(self)
        ):
            return traceable(self, x)
        return original(self, x, *args, **kwargs)

    return forward


@patch(
    "torch_compile.te_layernorm_linear_traceable",
    f"{_TE_WRAPPERS}.TELayerNormColumnParallelLinear.forward",
    reason="the fused input norm + QKV GEMM is TE's LayerNormLinear, whose forward TE wraps in "
    "torch.compiler.disable (a graph break in every enclosing frame): while compiling, in plain "
    "bf16 on one TP rank, the same norm and GEMM in torch ops",
    enabled=te_attention_block_substitutes,
)
def _te_layernorm_linear_factory(original):
    return traceable_forward(
        original, traceable_layernorm_linear, "TELayerNormColumnParallelLinear.forward"
    )


@patch(
    "torch_compile.te_linear_traceable",
    f"{_TE_WRAPPERS}.TELinear.forward",
    reason="TE's Linear (attention output projection; the column/row/duplicated linears inherit "
    "this forward) is compile-disabled by TE, a graph break in every enclosing frame: while "
    "compiling, in plain bf16 on one TP rank, F.linear",
    enabled=te_attention_block_substitutes,
)
def _te_linear_factory(original):
    return traceable_forward(original, traceable_linear, "TELinear.forward")


LINEAR_PATCHES = (
    "torch_compile.te_layernorm_linear_traceable",
    "torch_compile.te_linear_traceable",
)


def sdpa_module_eligible(module) -> bool:
    """The module side of :func:`sdpa_eligible` (its configuration, not the call): sbhd layout,
    one context-parallel rank, no dropout in training, no window, FP8, softmax variants,
    max-logit output or deterministic mode."""
    config = module.config
    cp_group = module.cp_group
    return (
        module.qkv_format == "sbhd"
        and getattr(module, "num_splits", None) is None
        and module.window_size in (None, (-1, 0), (-1, -1))
        and (not module.training or float(module.attention_dropout) == 0.0)
        and module.softmax_type == "vanilla"
        and not module.softcap
        and not module.return_max_logit
        and not module.deterministic
        # hierarchical CP (a2a+p2p) passes a list of groups
        and (cp_group is None or (not isinstance(cp_group, (list, tuple)) and cp_group.size() == 1))
        and config.fp8 is None
        and config.fp4 is None
        and not getattr(config, "qk_clip", False)
        and not getattr(config, "log_max_attention_logit", False)
    )


def sdpa_eligible(
    module,
    query,
    key,
    value,
    attention_mask,
    attn_mask_type,
    attention_bias=None,
    packed_seq_params=None,
    num_splits=None,
) -> bool:
    """TE's ``DotProductAttention`` call is plain causal (or unmasked) softmax attention without
    bias or packing, by a module that :func:`sdpa_module_eligible` accepts: what
    ``F.scaled_dot_product_attention`` computes."""
    mask = getattr(attn_mask_type, "name", attn_mask_type)
    return (
        packed_seq_params is None
        and attention_bias is None
        and num_splits is None
        and (mask == "causal" or (mask == "no_mask" and attention_mask is None))
        and query.dim() == 4
        and query.shape[0] == key.shape[0]
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
        and key.shape[2] == value.shape[2]
        and query.shape[2] % key.shape[2] == 0
        and sdpa_module_eligible(module)
    )


def traceable_attention(query, key, value, causal: bool, scale: float):
    """TE's sbhd attention output ``[s, b, heads * dim]`` through SDPA. Grouped-query heads
    without copies (``enable_gqa``): query head i reads key/value head i // (heads / groups), the
    order megatron's QKV split gives them."""
    import torch

    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    s, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@patch(
    "torch_compile.te_attention_traceable",
    f"{_TE_WRAPPERS}.TEDotProductAttention.forward",
    reason="TE's DotProductAttention forward is compile-disabled by TE (a graph break in every "
    "enclosing frame): while compiling, plain causal bf16 attention (no dropout, window, packing, "
    "CP or FP8) as F.scaled_dot_product_attention",
    enabled=te_attention_block_substitutes,
)
def _te_attention_factory(original):
    original = _te_method(original, "TEDotProductAttention.forward")

    @functools.wraps(original, updated=())
    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type,
        attention_bias=None,
        packed_seq_params=None,
        num_splits=None,
    ):
        if (
            tracing()
            and TE_CONTEXT_PLAIN[0]
            and sdpa_eligible(
                self,
                query,
                key,
                value,
                attention_mask,
                attn_mask_type,
                attention_bias,
                packed_seq_params,
                num_splits,
            )
        ):
            return traceable_attention(
                query,
                key,
                value,
                getattr(attn_mask_type, "name", attn_mask_type) == "causal",
                float(self.softmax_scale),
            )
        return original(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            num_splits=num_splits,
        )

    return forward


def attention_block_report(model_chunks: list) -> str:
    """How many TE linears and attentions of the model can trace (:func:`plain_bf16_linear`,
    :func:`sdpa_module_eligible`; the call-time conditions -- masks, FP8 autocast -- are checked
    while tracing)."""
    linears = attentions = linears_ok = attentions_ok = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            patch = patched_by(getattr(type(module), "forward", None))
            if patch in LINEAR_PATCHES:
                linears += 1
                linears_ok += plain_bf16_linear(module)
            elif patch == "torch_compile.te_attention_traceable":
                attentions += 1
                attentions_ok += sdpa_module_eligible(module)
    text = (
        f"TE linears {linears_ok} of {linears}, TE attentions {attentions_ok} of {attentions} "
        "trace as torch ops"
    )
    if linears_ok < linears:
        text += (
            " (TE keeps the others: tensor parallelism, FP8/FP4, gradient-accumulation fusion -- "
            "--no-gradient-accumulation-fusion lets those trace -- or a delayed wgrad)"
        )
    if attentions_ok < attentions:
        text += (
            " (attention dropout > 0, a sliding window, context parallelism, FP8, another format "
            "or deterministic mode keeps TE's attention)"
        )
    return text


ATTENTION_BLOCK_PATCHES = LINEAR_PATCHES + ("torch_compile.te_attention_traceable",)
