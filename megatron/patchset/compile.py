"""Per-TransformerLayer ``torch.compile`` (``--compile-transformer-layers``).

What it does, and why this way:

* **Per block, in place.** A pre-wrap model hook (:func:`pre_wrap_hook`, run by megatron's model
  builder on the built chunks before ``.cuda()``, ``Float16Module`` and DDP/Megatron-FSDP) replaces
  each ``TransformerLayer``'s *instance* ``forward`` with a compiled one. The module stays in the
  tree (state-dict keys and attribute walks unchanged) and ``nn.Module.__call__`` is not compiled,
  so the hooks that DDP and Megatron-FSDP register later on the layer (parameter all-gather,
  reshard, post-backward reduce-scatter; Megatron-FSDP's unit modules *are* the TransformerLayers)
  run eagerly around the compiled forward instead of breaking the graph inside it. Compilation is
  lazy (first call), so the later dtype and device moves are what gets traced. Megatron's full
  activation recompute checkpoints *around* the layer call, i.e. recompute(compile(layer)).
* **Eager regions as patches.** The MoE layer's middle -- ``dispatch`` (token all-to-all /
  all-gather / DeepEP / HybridEP / NCCL-EP dispatch), ``routed_experts_compute`` (host split sizes,
  data-dependent per-expert token counts, grouped GEMM) and ``combine`` -- runs under
  ``torch.compiler.disable``: these are three consecutive calls that are the same for every token
  dispatcher, so three regions cover every host synchronisation, device-to-host copy, collective and
  dynamic shape of all dispatchers; router, permutation 1 and unpermutation stay compiled. Two
  further patches make the aux-loss scaler's backward traceable and keep the local spec's
  tensor-parallel group look-up free of a rank-0-only warning. See :data:`EAGER_REGIONS`.
* **TE kernels as torch code while tracing.** TE's norms, fused RoPE, the router's gating GEMM
  and the fused router's kernels are pybind calls, a graph break each; inside the compiled layers
  (only there, only while dynamo traces) they run as torch code computing the same thing, which
  inductor fuses (``compile.*_traceable``; off with ``--compile-transformer-layers-te-kernels``).
  In plain bf16 on one tensor-parallel rank the same holds for the TE spec's attention block: the
  QKV ``LayerNormLinear`` and output ``Linear`` run as the norm and ``F.linear``, TE's
  ``DotProductAttention`` as ``F.scaled_dot_product_attention`` (``compile.te_*_traceable``,
  :data:`ATTENTION_BLOCK_PATCHES`). What still breaks a layer is the MoE layer's eager middle.
* **No silent eager fallback, no recompiles after warm-up.** Dynamo's recompile limit is a hard
  error (``fail_on_recompile_limit_hit``); per-layer integer attributes are not specialised
  (``allow_unspec_int_on_nn_module``), so all layers share one compiled variant. After
  ``--compile-transformer-layers-warmup-iters`` training iterations every call of a compiled layer in
  training mode runs under the ``fail_on_recompile`` stance: a recompile raises an error that names
  the guard that failed (the eager regions switch back to the default stance, so megatron's own
  ``jit_fuser`` kernels inside them may still specialise on token counts).
* **Report.** :class:`CompileMonitor` logs the first iteration's time (compile warm-up), dynamo's
  compile time, graphs and graph breaks (with reasons) at the end of warm-up and at exit, and
  writes them as ``{"compile": ...}`` lines into the metrics file (``MEGATRON_PATCHSET_METRICS``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import logging
import time
from typing import Any, Callable, Optional

from megatron.patchset.patches import PatchsetError, applied, patched_by, register

logger = logging.getLogger(__name__)

FLAG = "--compile-transformer-layers"
MODE_FLAG = FLAG + "-mode"
BACKEND_FLAG = FLAG + "-backend"
WARMUP_FLAG = FLAG + "-warmup-iters"
TE_KERNELS_FLAG = FLAG + "-te-kernels"
FLAGS = (FLAG, MODE_FLAG, BACKEND_FLAG, WARMUP_FLAG, TE_KERNELS_FLAG)

MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
# Modes whose inductor CUDA graph trees this version refuses (see the validation rule).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
BACKENDS = ("inductor", "aot_eager", "eager")
DEFAULTS = {
    "compile_transformer_layers": False,
    "compile_transformer_layers_mode": "default",
    "compile_transformer_layers_backend": "inductor",
    "compile_transformer_layers_warmup_iters": 2,
    "compile_transformer_layers_te_kernels": False,
}

_MOE_LAYER = "megatron.core.transformer.moe.moe_layer.MoELayer"
_AUX_SCALER = "megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler"


def requested(args: Any) -> bool:
    return bool(getattr(args, "compile_transformer_layers", False)) if args is not None else False


UPSTREAM_PR = "fork-only (per-layer torch.compile)"


def compile_patch(name: str, target: str, reason: str, *, enabled: Callable[[Any], bool] = requested,
                  flags: tuple = (FLAG,)) -> Callable:
    """``register`` for this area's patches: wrapping factories, turned on by the compile flag."""
    return register(name, target, reason=reason, upstream_pr=UPSTREAM_PR, flags=flags,
                    enabled=enabled, wraps=True)


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    mode: str = DEFAULTS["compile_transformer_layers_mode"]
    backend: str = DEFAULTS["compile_transformer_layers_backend"]
    warmup_iters: int = DEFAULTS["compile_transformer_layers_warmup_iters"]
    te_kernels: bool = DEFAULTS["compile_transformer_layers_te_kernels"]

    def compile_kwargs(self) -> dict:
        """``torch.compile`` keyword arguments (a mode only means something to inductor)."""
        kwargs: dict = {"backend": self.backend}
        if self.backend == "inductor" and self.mode != "default":
            kwargs["mode"] = self.mode
        return kwargs


def options_from_args(args: Any) -> CompileOptions:
    return CompileOptions(
        **{name[len("compile_transformer_layers_"):]: getattr(args, name, default)
           for name, default in DEFAULTS.items() if name != "compile_transformer_layers"}
    )


# ---------------------------------------------------------------------------------------
# Eager (compile-disabled) regions and traceability fixes, as registry patches
# ---------------------------------------------------------------------------------------


def eager_region(original: Callable, data_dependent_outputs: bool = False) -> Callable:
    """``original`` under ``torch.compiler.disable``, run with the default compile stance.

    The stance reset matters after warm-up, when compiled layers run under ``fail_on_recompile``:
    functions that megatron itself compiles (``jit_fuser``) and that are called eagerly in here,
    such as the experts' fused activation, may legitimately specialise on per-expert token
    counts; only the layer's own frames are held to "no recompiles".

    With ``data_dependent_outputs`` the first dimension of the returned tensors (the tokens this
    rank received from its expert-parallel peers) is marked unbacked before the compiled code
    resumes with it: otherwise the resumed frame guards on that size, and a rank that receives
    0 or 1 tokens after warm-up (0/1 specialisation) recompiles.
    """
    import torch
    from torch._dynamo.decorators import mark_unbacked

    @functools.wraps(original)
    def region(*args, **kwargs):
        with torch.compiler.set_stance("default"):
            result = original(*args, **kwargs)
        if data_dependent_outputs:
            for value in result if isinstance(result, tuple) else (result,):
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    mark_unbacked(value, 0)
        return result

    return torch.compiler.disable(region)


# name -> (target, reason, whether the outputs' token count is data-dependent). One line each; ``python -m megatron.patchset --list --reasons``.
EAGER_REGIONS = {
    "compile.moe_dispatch_eager": (
        f"{_MOE_LAYER}.dispatch",
        "token dispatch is a collective with host-side split sizes and side streams (all-to-all "
        "D2H copies and event syncs, all-gather, DeepEP/HybridEP/NCCL-EP fused dispatch): run eagerly",
        True,
    ),
    "compile.moe_experts_eager": (
        f"{_MOE_LAYER}.routed_experts_compute",
        "per-expert token counts are data-dependent (.tolist()/.item() split sizes, "
        "sort_chunks_by_idxs, masked_select, grouped GEMM with host splits): run eagerly",
        True,
    ),
    "compile.moe_combine_eager": (
        f"{_MOE_LAYER}.combine",
        "token combine is a collective with host-side split sizes (all-to-all, reduce-scatter, "
        "DeepEP/HybridEP/NCCL-EP fused combine): run eagerly",
        False,
    ),
}


def _register_eager_regions() -> None:
    for name, (target, reason, dynamic) in EAGER_REGIONS.items():
        compile_patch(name, target, reason)(functools.partial(eager_region, data_dependent_outputs=dynamic))


_register_eager_regions()


_AUX_GRAD_OP = None


def aux_loss_grad_op():
    """``megatron_patchset::aux_loss_grad(aux_loss, grad_output)``: upstream's aux-loss gradient
    (ones times ``MoEAuxLossAutoScaler.main_loss_backward_scale``, 1.0 until the schedule sets it)
    as a custom op, opaque to the compiler.

    Dynamo cannot trace upstream's backward (it reads a tensor class attribute: a graph break at
    every aux/z-loss in the router). Traced from a module-level tensor instead, the partitioner
    may compute ``ones * scale`` in the *forward* graph, i.e. with the scale of the previous
    micro-batch (measured: wrong router gradients). As an op that takes ``grad_output``, it runs
    in the backward and reads the scale when the backward runs, exactly as upstream does.
    """
    global _AUX_GRAD_OP
    if _AUX_GRAD_OP is None:
        import torch

        @torch.library.custom_op(
            "megatron_patchset::aux_loss_grad", mutates_args=(),
            schema="(Tensor aux_loss, Tensor grad_output) -> Tensor",
        )
        def aux_loss_grad(aux_loss: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler as scaler

            if scaler.main_loss_backward_scale is None:
                scaler.main_loss_backward_scale = torch.tensor(1.0, device=aux_loss.device)
            grad = torch.ones_like(aux_loss) * scaler.main_loss_backward_scale
            if grad.shape != aux_loss.shape:
                # The schedule sets a shape-[1] scale for a 0-d loss; upstream's broadcast gradient
                # is reduced back to the loss's shape by autograd. The op must return that shape
                # itself (its fake says so, and inductor checks it).
                grad = grad.sum_to_size(aux_loss.shape)
            return grad

        @aux_loss_grad.register_fake
        def _(aux_loss, grad_output):
            return torch.empty_like(aux_loss)

        _AUX_GRAD_OP = aux_loss_grad
    return _AUX_GRAD_OP


@compile_patch(
    "compile.aux_loss_backward_opaque",
    f"{_AUX_SCALER}.backward",
    "dynamo cannot trace the backward's class-attribute loss scale (a graph break at every "
    "aux/z-loss in the router): compute the same gradient in a custom op run at backward time",
)
def _aux_backward_factory(original):
    op = aux_loss_grad_op()

    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, op(aux_loss, grad_output)

    return backward


_RANDOM_LOGITS_OP = None


def random_logits_op():
    """``megatron_patchset::random_logits(logits)``: upstream's ``RandomSTE`` forward (normal
    logits of the same shape, drawn from the expert-parallel RNG tracker's stream) as a custom op
    whose gradient passes straight through, as ``RandomSTE.backward`` does.

    Under ``--moe-router-force-load-balancing`` the router draws these inside the RNG tracker's
    ``fork``, which reads and sets the CUDA RNG state: dynamo does not trace that, and the graph
    break falls inside the ``try`` block of ``MoELayer.custom_forward``, where dynamo cannot resume.
    It then gives up on the whole MoE body (router, preprocessing, permutation all eager, found on
    the CPU with the real fork: 82 of 84 frames compiled, none of them the MoE body). An opaque op
    keeps the draw, with the same generator and the same numbers, out of the traced code.
    """
    global _RANDOM_LOGITS_OP
    if _RANDOM_LOGITS_OP is None:
        import torch

        @torch.library.custom_op("megatron_patchset::random_logits", mutates_args=(),
                                 schema="(Tensor logits) -> Tensor")
        def random_logits(logits: torch.Tensor) -> torch.Tensor:
            from megatron.core.tensor_parallel.random import (
                get_cuda_rng_tracker,
                get_expert_parallel_rng_tracker_name,
            )

            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                return logits.clone().normal_()

        @random_logits.register_fake
        def _(logits):
            return torch.empty_like(logits)

        random_logits.register_autograd(lambda ctx, grad: grad)
        _RANDOM_LOGITS_OP = random_logits
    return _RANDOM_LOGITS_OP


def force_load_balancing(args: Any) -> bool:
    return requested(args) and bool(getattr(args, "moe_router_force_load_balancing", False))


@compile_patch(
    "compile.random_logits_opaque",
    "megatron.core.transformer.moe.router.apply_random_logits",
    "--moe-router-force-load-balancing draws the router's logits inside the RNG tracker's "
    "fork (CUDA RNG state reads, not traceable) within MoELayer.custom_forward's try block, so "
    "dynamo ran the whole MoE body eagerly: draw them in a custom op",
    enabled=force_load_balancing,
    flags=(FLAG, "--moe-router-force-load-balancing"),
)
def _random_logits_factory(original):
    op = random_logits_op()

    @functools.wraps(original)
    def apply_random_logits(logits):
        return op(logits)

    return apply_random_logits


@compile_patch(
    "compile.tp_group_lookup_quiet",
    "megatron.core.tensor_parallel.layers.get_tensor_model_parallel_group_if_none",
    "the local spec's RowParallelLinear passes tp_group=None and the rank-0-only "
    "deprecation warning is a graph break on rank 0 only: resolve the same group without it "
    "while compiling",
)
def _tp_group_factory(original):
    @functools.wraps(original)
    def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
        import torch

        if tp_group is None and torch.compiler.is_compiling():
            from megatron.core import parallel_state

            if parallel_state.is_initialized():
                getter = (
                    parallel_state.get_expert_tensor_parallel_group
                    if is_expert
                    else parallel_state.get_tensor_model_parallel_group
                )
                tp_group = getter(check_initialized=check_initialized)
        return original(tp_group, is_expert, check_initialized)

    return get_tensor_model_parallel_group_if_none


# ---------------------------------------------------------------------------------------
# Traceable substitutes for TransformerEngine kernels, while compiling
# ---------------------------------------------------------------------------------------
#
# Inside a compiled layer every call into a TE pybind kernel (RMSNorm, fused RoPE, the router's
# fused top-k / aux-loss scores, the router's gating GEMM) is a graph break: the layer is cut
# into many small graphs, each with its own guards and autograd wrapper, and the host work of
# the breaks outweighs what inductor saves (measured 0.87x of eager with them). While dynamo
# traces, these patches route the same math through megatron's own unfused torch code (or an
# equivalent torch expression), which inductor fuses with its neighbours. Eager calls -- the
# layers' eager MoE regions, modules outside the compiled layers, every call without
# compilation -- still run TE's kernels. ``--compile-transformer-layers-te-kernels`` keeps TE's
# kernels inside the compiled layers too.

_ROUTER = "megatron.core.transformer.moe.router"


def traceable_substitutes(args: Any) -> bool:
    return requested(args) and not bool(getattr(args, "compile_transformer_layers_te_kernels", False))


# True while a compiled TransformerLayer runs (set by compile_layer's wrapper, outside the
# traced code): other torch.compile'd code (upstream's own compiled helpers) keeps TE's path.
_IN_COMPILED_LAYER = [False]


def _tracing() -> bool:
    """Dynamo is tracing one of the compiled TransformerLayers."""
    import torch

    return torch.compiler.is_compiling() and _IN_COMPILED_LAYER[0]


def _register_unfused_while_compiling(name: str, function: str, reason: str) -> None:
    """``router.<function>(..., fused=...)`` is called with ``fused=False`` while compiling."""

    def factory(original):
        @functools.wraps(original)
        def unfused_while_compiling(*args, **kwargs):
            # Upstream's fused top-k ignores router replay, the unfused one honours it: keep the
            # fused kernel (a graph break) there, so compiled and eager routing stay the same.
            if kwargs.get("fused") and kwargs.get("router_replay") is None and _tracing():
                kwargs["fused"] = False
            return original(*args, **kwargs)

        return unfused_while_compiling

    compile_patch(name, f"{_ROUTER}.{function}", reason, enabled=_traceable_router,
                  flags=(FLAG, "--moe-router-fusion"))(factory)


def _traceable_router(args: Any) -> bool:
    return traceable_substitutes(args) and bool(getattr(args, "moe_router_fusion", False))


_register_unfused_while_compiling(
    "compile.router_topk_traceable", "topk_routing_with_score_function",
    "--moe-router-fusion's TE top-k kernel is two graph breaks per compiled layer (pybind call, "
    "int() of a pybind enum): while compiling, megatron's unfused top-k, which inductor fuses")
_register_unfused_while_compiling(
    "compile.router_aux_scores_traceable", "compute_routing_scores_for_aux_loss",
    "--moe-router-fusion's TE aux-loss score kernel is two graph breaks per compiled layer: "
    "while compiling, megatron's unfused scores")
_register_unfused_while_compiling(
    "compile.router_aux_loss_traceable", "switch_load_balancing_loss_func",
    "--moe-router-fusion's TE aux-loss kernel is a graph break per compiled layer: while "
    "compiling, megatron's unfused loss")


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


@compile_patch(
    "compile.router_gating_traceable",
    f"{_ROUTER}.router_gating_linear",
    "the router's gating GEMM goes through TE's general_gemm pybind (a graph break per "
    "compiled layer): while compiling, the same GEMM in torch ops",
    enabled=traceable_substitutes,
)
def _router_gating_factory(original):
    import torch

    function = gating_linear_function()

    @functools.wraps(original)
    def router_gating_linear(inp, weight, bias, router_dtype):
        if _tracing() and router_dtype != torch.float64:
            return function.apply(inp, weight, bias, router_dtype)
        return original(inp, weight, bias, router_dtype)

    return router_gating_linear


@compile_patch(
    "compile.rope_traceable",
    "megatron.core.transformer.attention.apply_rotary_pos_emb",
    "TE's fused RoPE (apply_rope_fusion, on by default) is a pybind call, a graph break "
    "per query and key in each compiled layer: while compiling, megatron's unfused bshd RoPE",
    enabled=traceable_substitutes,
)
def _rope_factory(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False):
        # Upstream's fused path is taken only without mRoPE, mscale and MLA interleaving; the
        # others already run unfused (and traceable) there.
        if (config.apply_rope_fusion and cu_seqlens is None and mscale == 1.0
                and getattr(config, "mrope_section", None) is None and not mla_rotary_interleaved
                and _tracing()):
            from megatron.core.models.common.embeddings import rope_utils

            # In fp32, as TE's fused kernel computes (upstream's unfused path rounds cos/sin to
            # the input's dtype): inductor fuses the casts.
            return rope_utils._apply_rotary_pos_emb_bshd(
                t.float(), freqs, rotary_interleaved=config.rotary_interleaved).to(t.dtype)
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group,
                        mla_rotary_interleaved=mla_rotary_interleaved)

    return apply_rotary_pos_emb


def traceable_norm(x, weight, bias, eps: float, zero_centered_gamma: bool, rms: bool):
    """RMSNorm / LayerNorm as TE computes them: the input cast to the autocast dtype (else the
    weight's dtype), the norm in fp32, the output in that dtype. (An fp32 residual stream with
    bf16 weights, ``--fp32-residual-connection``, gives bf16 outputs, as TE's kernels do.)"""
    import torch

    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weight.dtype
    x32 = x.to(dtype).float()
    scale = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    if rms:
        y = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps) * scale
    else:
        y = torch.nn.functional.layer_norm(x32, (x.shape[-1],), scale,
                                           None if bias is None else bias.float(), eps)
    return y.to(dtype)


def _norm_forward(self, inp):
    """Instance ``forward`` of a TE norm built through the TE spec: traceable while compiling."""
    if _tracing():
        return traceable_norm(inp, self.weight, getattr(self, "bias", None), float(self.eps),
                              bool(self.zero_centered_gamma), self.__megatron_patchset_rms__)
    return type(self).forward(self, inp)


def te_norm_classes() -> tuple:
    """TE's ``RMSNorm`` and ``LayerNorm`` (exact types; subclasses such as the fused-residual
    RMSNorm have other forward signatures and are left alone)."""
    import transformer_engine.pytorch as te

    return te.RMSNorm, te.LayerNorm


def make_norm_traceable(norm, classes: Optional[tuple] = None):
    """Give ``norm`` (an exact TE ``RMSNorm`` / ``LayerNorm``) the traceable instance forward;
    other modules (the fused-residual RMSNorm, apex, torch norms) are returned unchanged."""
    import types

    rms_class, ln_class = classes if classes is not None else te_norm_classes()
    if type(norm) not in (rms_class, ln_class):
        return norm
    missing = [a for a in ("eps", "zero_centered_gamma", "weight") if not hasattr(norm, a)]
    if missing:
        raise PatchsetError(
            f"{FLAG}: {type(norm).__qualname__} has no {', '.join(missing)}; this TransformerEngine "
            f"moved them. Run with {TE_KERNELS_FLAG} to keep TE's norm kernels inside compiled layers.")
    norm.__megatron_patchset_rms__ = type(norm) is rms_class
    norm.forward = types.MethodType(_norm_forward, norm)
    return norm


@compile_patch(
    "compile.te_norm_traceable",
    "megatron.core.extensions.transformer_engine_spec_provider.TENorm",
    "the TE spec's q/k and pre-MLP norms are TE RMSNorm/LayerNorm modules whose kernels "
    "are pybind calls, a graph break each in every compiled layer: while compiling, the same "
    "norm in torch ops (fp32, as TE computes it)",
    enabled=traceable_substitutes,
)
def _te_norm_factory(original):
    class TENorm(original):
        """Builds upstream's TE norm, with a forward that is traceable while compiling."""

        def __new__(cls, *args, **kwargs):
            return make_norm_traceable(original(*args, **kwargs))

    TENorm.__qualname__ = TENorm.__name__ = original.__name__
    return TENorm


# ---------------------------------------------------------------------------------------
# The TE spec's attention block as torch code while compiling
# ---------------------------------------------------------------------------------------
# megatron's TE wrappers (QKV ``LayerNormLinear``, output ``Linear``, ``DotProductAttention``)
# call TE forwards that TE wraps in ``torch.compiler.disable``. Each is a graph break, and since
# it sits three calls deep (layer -> attention -> linear), dynamo splits every enclosing frame
# there: the profile at 1x4096 showed the compiled attention block costing as much host time as
# the eager one. In the plain bf16 case -- one tensor-parallel rank, no FP8/FP4 (by config or by
# an enclosing autocast), no TE weight-grad fusion or delay, no parameter splits, no CPU
# offloading -- these modules compute a norm, a GEMM and a causal softmax attention, which torch
# ops give as well: while dynamo traces a compiled layer, the wrapped forwards below run them as
# ``traceable_norm`` + ``F.linear`` and ``F.scaled_dot_product_attention``. Anything else (and
# every eager call) goes to upstream's forward. The patches wrap the classes' ``forward`` in
# place (not subclasses: megatron's MLA compares its spec's linear classes by identity).

_TE_WRAPPERS = "megatron.core.extensions.transformer_engine"

# Whether TE's state around the current compiled-layer call is plain (no FP8 autocast, no CPU
# offload): read by compile_layer's wrapper before each call, outside the traced code, so that
# the traced code only reads (and dynamo guards on) this flag.
_TE_CONTEXT_PLAIN = [True]


@functools.lru_cache(maxsize=1)
def _te_context_checks() -> tuple:
    try:
        from transformer_engine.pytorch.cpu_offload import is_cpu_offload_enabled
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        return ()
    return FP8GlobalStateManager.is_fp8_enabled, is_cpu_offload_enabled


def te_context_plain() -> bool:
    """No FP8/FP4 autocast entered and no TE CPU offloading active (True without TE)."""
    return not any(check() for check in _te_context_checks())


def te_attention_block_substitutes(args: Any) -> bool:
    return traceable_substitutes(args) and getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"


def plain_bf16_linear(module) -> bool:
    """``module`` (a megatron TE linear) is a single-rank, unquantised GEMM whose weight gradient
    TE would return as ``.grad`` (no fused accumulation into ``main_grad``, no delayed wgrad).
    Attributes are read strictly: a TE that renamed one is a clear error, not a silent yes."""
    config = module.config
    return (module.tp_size == 1
            and not module.fuse_wgrad_accumulation
            and list(module.weight_names) == ["weight"]
            and module.te_quant_params is None
            and config.fp8 is None and config.fp4 is None
            and not config.delay_wgrad_compute
            and getattr(module.weight, "gtp_remat_size", None) is None
            and not getattr(module, "return_layernorm_output", False))


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

    normed = traceable_norm(x, module.layer_norm_weight, getattr(module, "layer_norm_bias", None),
                            float(module.eps), bool(module.zero_centered_gamma),
                            module.normalization == "RMSNorm")
    added, returned = _bias_of(module)
    return torch.nn.functional.linear(normed, module.weight, added), returned


def _te_method(original, name: str) -> Callable:
    if not inspect.isfunction(original):
        raise PatchsetError(
            f"{FLAG}: megatron's {name} is {original!r} here, not a function: TransformerEngine is "
            f"not installed (run with {TE_KERNELS_FLAG}, or --transformer-impl local)")
    return original


def _linear_factory(traceable: Callable, name: str) -> Callable:
    def factory(original):
        original = _te_method(original, name)

        # updated=(): not the original's __dict__, which would carry a torch.compiler.disable mark
        @functools.wraps(original, updated=())
        def forward(self, x, *args, **kwargs):
            if not args and not kwargs and _tracing() and _TE_CONTEXT_PLAIN[0] and plain_bf16_linear(self):
                return traceable(self, x)
            return original(self, x, *args, **kwargs)

        return forward

    return factory


_LINEAR_SUBSTITUTES = {
    "compile.te_layernorm_linear_traceable": (
        "TELayerNormColumnParallelLinear.forward", traceable_layernorm_linear,
        "the fused input norm + QKV GEMM is TE's LayerNormLinear, whose forward TE wraps in "
        "torch.compiler.disable (a graph break in every enclosing frame): while compiling, in "
        "plain bf16 on one TP rank, the same norm and GEMM in torch ops"),
    "compile.te_linear_traceable": (
        "TELinear.forward", traceable_linear,
        "TE's Linear (attention output projection; the column/row/duplicated linears inherit this "
        "forward) is compile-disabled by TE, a graph break in every enclosing frame: while "
        "compiling, in plain bf16 on one TP rank, F.linear"),
}

for _name, (_attr, _traceable, _reason) in _LINEAR_SUBSTITUTES.items():
    compile_patch(_name, f"{_TE_WRAPPERS}.{_attr}", _reason, enabled=te_attention_block_substitutes)(
        _linear_factory(_traceable, _attr))


def sdpa_module_eligible(module) -> bool:
    """The module side of :func:`sdpa_eligible` (its configuration, not the call): sbhd layout,
    one context-parallel rank, no dropout in training, no window, FP8, softmax variants,
    max-logit output or deterministic mode."""
    config = module.config
    cp_group = module.cp_group
    return (module.qkv_format == "sbhd"
            and getattr(module, "num_splits", None) is None
            and module.window_size in (None, (-1, 0), (-1, -1))
            and (not module.training or float(module.attention_dropout) == 0.0)
            and module.softmax_type == "vanilla"
            and not module.softcap
            and not module.return_max_logit
            and not module.deterministic
            # hierarchical CP (a2a+p2p) passes a list of groups
            and (cp_group is None or (not isinstance(cp_group, (list, tuple)) and cp_group.size() == 1))
            and config.fp8 is None and config.fp4 is None
            and not getattr(config, "qk_clip", False)
            and not getattr(config, "log_max_attention_logit", False))


def sdpa_eligible(module, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                  packed_seq_params=None, num_splits=None) -> bool:
    """TE's ``DotProductAttention`` call is plain causal (or unmasked) softmax attention without
    bias or packing, by a module that :func:`sdpa_module_eligible` accepts: what
    ``F.scaled_dot_product_attention`` computes."""
    mask = getattr(attn_mask_type, "name", attn_mask_type)
    return (packed_seq_params is None and attention_bias is None and num_splits is None
            and (mask == "causal" or (mask == "no_mask" and attention_mask is None))
            and query.dim() == 4 and query.shape[0] == key.shape[0]
            and query.shape[-1] == key.shape[-1] == value.shape[-1] and key.shape[2] == value.shape[2]
            and query.shape[2] % key.shape[2] == 0
            and sdpa_module_eligible(module))


def traceable_attention(query, key, value, causal: bool, scale: float):
    """TE's sbhd attention output ``[s, b, heads * dim]`` through SDPA. Grouped-query heads
    without copies (``enable_gqa``): query head i reads key/value head i // (heads / groups), the
    order megatron's QKV split gives them."""
    import torch

    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    s, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@compile_patch(
    "compile.te_attention_traceable",
    f"{_TE_WRAPPERS}.TEDotProductAttention.forward",
    "TE's DotProductAttention forward is compile-disabled by TE (a graph break in every "
    "enclosing frame): while compiling, plain causal bf16 attention (no dropout, window, "
    "packing, CP or FP8) as F.scaled_dot_product_attention",
    enabled=te_attention_block_substitutes,
)
def _te_attention_factory(original):
    original = _te_method(original, "TEDotProductAttention.forward")

    @functools.wraps(original, updated=())
    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        if _tracing() and _TE_CONTEXT_PLAIN[0] and sdpa_eligible(
                self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                packed_seq_params, num_splits):
            return traceable_attention(query, key, value,
                                       getattr(attn_mask_type, "name", attn_mask_type) == "causal",
                                       float(self.softmax_scale))
        return original(self, query, key, value, attention_mask, attn_mask_type,
                        attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                        num_splits=num_splits)

    return forward


def attention_block_report(model_chunks: list) -> str:
    """How many TE linears and attentions of the model can trace (:func:`plain_bf16_linear`,
    :func:`sdpa_module_eligible`; the call-time conditions -- masks, FP8 autocast -- are checked
    while tracing)."""
    linears = attentions = linears_ok = attentions_ok = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            patch = patched_by(getattr(type(module), "forward", None))
            if patch in _LINEAR_SUBSTITUTES:
                linears += 1
                linears_ok += plain_bf16_linear(module)
            elif patch == "compile.te_attention_traceable":
                attentions += 1
                attentions_ok += sdpa_module_eligible(module)
    text = f"TE linears {linears_ok} of {linears}, TE attentions {attentions_ok} of {attentions} trace as torch ops"
    if linears_ok < linears:
        text += (" (TE keeps the others: tensor parallelism, FP8/FP4, gradient-accumulation fusion -- "
                 "--no-gradient-accumulation-fusion lets those trace -- or a delayed wgrad)")
    if attentions_ok < attentions:
        text += (" (attention dropout > 0, a sliding window, context parallelism, FP8, another format or "
                 "deterministic mode keeps TE's attention)")
    return text


# Applied with every compilation unless --compile-transformer-layers-te-kernels (the router
# fusion ones only with --moe-router-fusion: they are all ``compile.router_*_traceable``; the
# attention block ones only with the TE spec, ATTENTION_BLOCK_PATCHES).
TRACEABLE_PATCHES = (
    "compile.router_gating_traceable",
    "compile.rope_traceable",
    "compile.te_norm_traceable",
)
ATTENTION_BLOCK_PATCHES = tuple(_LINEAR_SUBSTITUTES) + ("compile.te_attention_traceable",)


# ---------------------------------------------------------------------------------------
# The all-to-all dispatcher's permutation as gathers while compiling
# ---------------------------------------------------------------------------------------
# With --moe-permute-fusion, permutation 1 (before the all-to-all) and its inverse (after it)
# are TE's mask-map kernels: Triton launches made from Python inside a custom op, on the host path
# of every compiled layer's forward and backward. In dropless routing each token has exactly k
# experts, so both directions are gathers of static shape that inductor fuses into the layer's
# graphs: permute gathers each (expert, token) pair's row in megatron's order (expert-major,
# tokens ascending; the order of upstream's unfused argsort permute and of TE's kernel), and its
# gradient sums each token's k rows in fp32; unpermute sums each token's k rows in fp32 (as TE's
# unpermute accumulates) and its gradient gathers. Deterministic: no atomics, unlike upstream's
# unfused path (index_add / scatter_add in the tokens' dtype).

_TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"

# The top-k of the compiled layer running now when its dispatcher qualifies (see
# permutation_topk), else None: set by compile_layer's wrapper, read (and guarded on) while tracing.
_PERMUTE_TOPK = [None]


def permutation_topk(dispatcher) -> Optional[int]:
    """The router's k when every token of ``dispatcher`` routes to exactly k experts and its
    permutation is TE's fused one: the all-to-all dispatcher with --moe-permute-fusion, dropless
    (no capacity factor, no padding to capacity) and no routing-map padding for FP8/FP4."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
        return None
    config = dispatcher.config
    if (not config.moe_permute_fusion or config.moe_expert_capacity_factor is not None
            or config.moe_pad_expert_input_to_capacity or config.moe_router_padding_for_quantization):
        return None
    return int(config.moe_router_topk)


def permutation_maps(routing_map, num_out_tokens: int):
    """``(flat_order, token_of_row)``: the positions in ``routing_map.T`` (flattened, expert-major)
    of the routed pairs in permuted order, and the token of every permuted row."""
    import torch

    num_tokens = routing_map.shape[0]
    flat_order = torch.argsort(routing_map.T.reshape(-1), descending=True, stable=True)[:num_out_tokens]
    return flat_order, torch.remainder(flat_order, num_tokens)


def rows_of_tokens(token_of_row, num_tokens: int, topk: int):
    """``[tokens, k]``: the permuted rows of every token (ascending, i.e. by expert)."""
    import torch

    return torch.argsort(token_of_row, stable=True).view(num_tokens, topk)


def _sum_rows(rows, rows_of_token):
    """``out[t] = sum_j rows[rows_of_token[t, j]]``, accumulated in fp32 (or wider)."""
    import torch

    # Casts only where the dtype changes: under dynamo an autograd function whose output went
    # through a same-dtype .to() got a zero gradient (torch 2.11).
    accumulate = torch.promote_types(rows.dtype, torch.float32)
    gathered = rows[rows_of_token]
    summed = (gathered if accumulate == rows.dtype else gathered.to(accumulate)).sum(dim=1)
    return summed if summed.dtype == rows.dtype else summed.to(rows.dtype)


_ROW_FUNCTIONS = None


def row_functions() -> tuple:
    """``(GatherRows, SumRows)``, the two directions as autograd functions, each the other's
    gradient (built on first use, by the patch factories: torch is imported lazily, and dynamo
    cannot trace a class statement)."""
    global _ROW_FUNCTIONS
    if _ROW_FUNCTIONS is None:
        import torch

        class GatherRows(torch.autograd.Function):
            """``out[r] = x[token_of_row[r]]``; the gradient sums each token's rows."""

            @staticmethod
            def forward(ctx, x, token_of_row, rows_of_token):
                ctx.save_for_backward(rows_of_token)
                return x.index_select(0, token_of_row)

            @staticmethod
            def backward(ctx, grad):
                (rows_of_token,) = ctx.saved_tensors
                return _sum_rows(grad, rows_of_token), None, None

        class SumRows(torch.autograd.Function):
            """``out[t] = sum_j y[rows_of_token[t, j]]`` (fp32); the gradient gathers."""

            @staticmethod
            def forward(ctx, y, rows_of_token, token_of_row):
                ctx.save_for_backward(token_of_row)
                return _sum_rows(y, rows_of_token)

            @staticmethod
            def backward(ctx, grad):
                (token_of_row,) = ctx.saved_tensors
                return grad.index_select(0, token_of_row), None, None

        _ROW_FUNCTIONS = (GatherRows, SumRows)
    return _ROW_FUNCTIONS


def gather_permute(tokens, routing_map, probs, num_out_tokens: int, topk: int):
    """Permutation 1 as a gather: ``(permuted tokens, permuted probs, token of every row)``,
    the row map in the format of upstream's unfused permute (1-D)."""
    flat_order, token_of_row = permutation_maps(routing_map, num_out_tokens)
    gather, _ = row_functions()
    permuted = gather.apply(tokens, token_of_row, rows_of_tokens(token_of_row, tokens.shape[0], topk))
    permuted_probs = None if probs is None else probs.T.reshape(-1).index_select(0, flat_order)
    return permuted, permuted_probs, token_of_row


def sum_unpermute(permuted_tokens, token_of_row, restore_shape):
    """The inverse of :func:`gather_permute` (no probabilities): each token's rows summed."""
    num_tokens = restore_shape[0]
    _, sum_rows = row_functions()
    topk = token_of_row.shape[0] // num_tokens
    return sum_rows.apply(permuted_tokens, rows_of_tokens(token_of_row, num_tokens, topk), token_of_row)


def _permute_factory(original):
    row_functions()  # classes are built here, not while dynamo traces

    @functools.wraps(original)
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
                tokens_per_expert=None, align_size=0):
        topk = _PERMUTE_TOPK[0]
        if (topk and fused and not drop_and_pad and not align_size and _tracing() and tokens.dim() == 2
                and isinstance(num_out_tokens, int) and num_out_tokens == routing_map.shape[0] * topk):
            permuted, permuted_probs, token_of_row = gather_permute(tokens, routing_map, probs, num_out_tokens, topk)
            return permuted, permuted_probs, token_of_row, None, tokens_per_expert
        return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                        drop_and_pad=drop_and_pad, tokens_per_expert=tokens_per_expert, align_size=align_size)

    return permute


def _unpermute_factory(original):
    row_functions()

    @functools.wraps(original)
    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False, pad_offsets=None):
        # A 1-D row map with fused=True comes only from gather_permute (TE's mask map is 2-D):
        # honour it eagerly too, should the permutation have been traced and this call not.
        if fused and sorted_indices.dim() == 1:
            if probs is not None or drop_and_pad or pad_offsets is not None:
                raise PatchsetError(f"{PERMUTATION_PATCHES[1]}: a gathered permutation cannot be undone "
                                    "with merging probabilities, drop-and-pad or padding offsets")
            return sum_unpermute(permuted_tokens, sorted_indices, restore_shape)
        return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                        fused=fused, drop_and_pad=drop_and_pad, pad_offsets=pad_offsets)

    return unpermute


def _traceable_permutation(args: Any) -> bool:
    return traceable_substitutes(args) and bool(getattr(args, "moe_permute_fusion", False))


PERMUTATION_PATCHES = ("compile.moe_permute_traceable", "compile.moe_unpermute_traceable")

compile_patch(
    PERMUTATION_PATCHES[0], f"{_TOKEN_DISPATCHER}.permute",
    "--moe-permute-fusion's TE permute is Triton launched from Python on every compiled layer's host "
    "path: while compiling, the dropless all-to-all permutation as a gather inductor fuses (gradient: "
    "each token's k rows summed in fp32, no atomics)",
    enabled=_traceable_permutation, flags=(FLAG, "--moe-permute-fusion"))(_permute_factory)
compile_patch(
    PERMUTATION_PATCHES[1], f"{_TOKEN_DISPATCHER}.unpermute",
    "the inverse of compile.moe_permute_traceable: each token's k rows summed in fp32, as TE's "
    "unpermute does; TE's row maps still go to TE",
    enabled=_traceable_permutation, flags=(FLAG, "--moe-permute-fusion"))(_unpermute_factory)


PATCH_NAMES = tuple(EAGER_REGIONS) + (
    "compile.aux_loss_backward_opaque",
    "compile.tp_group_lookup_quiet",
)


# ---------------------------------------------------------------------------------------
# Dynamo statistics and the warm-up monitor
# ---------------------------------------------------------------------------------------


def dynamo_stats() -> dict:
    """Process-wide dynamo counters: graphs, graph breaks (with reasons), frames, compile time.

    ``frames`` - ``frames_ok`` are frames dynamo chose not to compile (a resume function that only
    calls an eager region, a frame with nothing to trace): they run eagerly by design. A frame
    that *fails* to compile raises instead, as long as ``suppress_errors`` (recorded) is off."""
    import torch._dynamo
    from torch._dynamo.utils import compilation_time_metrics, counters

    breaks = dict(counters["graph_break"])
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": {reason: int(n) for reason, n in breaks.items()},
        "frames": int(counters["frames"]["total"]),
        "frames_ok": int(counters["frames"]["ok"]),
        "suppress_errors": bool(torch._dynamo.config.suppress_errors),
        "compile_s": float(sum(compilation_time_metrics.get("_compile.compile_inner", []))),
    }


def _megatron_iteration() -> Optional[int]:
    """Megatron's ``args.curr_iteration`` (set before every train_step), None outside training."""
    try:
        from megatron.training.global_vars import get_args

        return getattr(get_args(), "curr_iteration", None)
    except (AssertionError, ImportError):
        return None


def _rank_and_world() -> tuple[int, int]:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class CompileMonitor:
    """Tracks training iterations (a forward pre-hook on the first model chunk reads megatron's
    current iteration) to time the compile warm-up, switch the compiled layers to strict mode
    after it, and report dynamo's counters."""

    def __init__(self, warmup_iters: int, iteration: Callable[[], Optional[int]] = _megatron_iteration):
        self.warmup_iters = warmup_iters
        self.iteration = iteration
        self.strict = False
        self.first: Optional[tuple[int, float]] = None
        self.current: Optional[int] = None
        self.reports: list[dict] = []
        # Taken when the model is built: at exit the process group may be gone already.
        self.rank, self.world = _rank_and_world()

    def pre_forward(self, module, _args) -> None:
        if not module.training:
            return
        iteration = self.iteration()
        if iteration is None or iteration == self.current:
            return
        self.current = iteration
        self.iteration_started(iteration)

    def iteration_started(self, iteration: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = (iteration, now)
            return
        done = iteration - self.first[0]
        seconds = now - self.first[1]
        if done == 1:
            self._say(f"compile: first training iteration (compile warm-up) took {seconds:.1f} s, "
                      f"dynamo/inductor compile time {dynamo_stats()['compile_s']:.1f} s")
        if done == self.warmup_iters and not self.strict:
            self.report("warmup", iterations=done, seconds=seconds)
            self.strict = True

    def report(self, phase: str, **extra) -> dict:
        stats = dict(dynamo_stats(), phase=phase, **extra)
        if self.reports:
            stats["graphs_since_warmup"] = stats["graphs"] - self.reports[0]["graphs"]
            stats["frames_since_warmup"] = stats["frames"] - self.reports[0]["frames"]
        self.reports.append(stats)
        reasons = "; ".join(f"{n}x {' '.join(r.split())[:200]}" for r, n in stats["graph_break_reasons"].items())
        self._say(
            f"compile: {phase}: {stats['graphs']} graphs, {stats['graph_breaks']} graph breaks, "
            f"{stats['frames_ok']} of {stats['frames']} frames compiled (dynamo runs the others eagerly: "
            f"TORCH_LOGS=graph_breaks says why), compile time {stats['compile_s']:.1f} s"
            + (f" (after {extra['iterations']} iterations, {extra['seconds']:.1f} s; from now on a "
               f"recompile of a compiled layer is an error)" if phase == "warmup" else "")
            + (f"; since warm-up +{stats['graphs_since_warmup']} graphs, "
               f"+{stats['frames_since_warmup']} frames" if "graphs_since_warmup" in stats else "")
            + (f"; breaks: {reasons}" if reasons else "")
        )
        self._record(stats)
        return stats

    def final_report(self) -> None:
        if self.reports:
            self.report("final")

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(f"> {line}", flush=True)

    def _record(self, stats: dict) -> None:
        """On the last rank, as megatron's metrics lines are (``MEGATRON_PATCHSET_METRICS``)."""
        from megatron.patchset import training as ps_training

        recorder = ps_training.recorder()
        if recorder is not None and self.rank == self.world - 1:
            recorder.write({"compile": stats})


# ---------------------------------------------------------------------------------------
# Compiling the layers (the pre-wrap hook)
# ---------------------------------------------------------------------------------------


def configure_dynamo() -> None:
    """Process-wide dynamo settings the feature relies on (logged once)."""
    import torch._dynamo

    # A recompile limit hit is an error, not a silent switch of the frame to eager.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # Integer attributes of modules (router.layer_number, ...) are not baked into guards: all
    # layers share one compiled variant instead of one each (the 9th layer would hit the limit).
    torch._dynamo.config.allow_unspec_int_on_nn_module = True


def compile_layer(layer, options: CompileOptions, monitor: Optional[CompileMonitor],
                  permute_topk: Optional[int] = None) -> None:
    """Replace ``layer.forward`` (the instance attribute) with its compiled version.
    ``permute_topk``: see :func:`permutation_topk` (None keeps TE's permutation)."""
    import torch

    original = layer.forward
    compiled = torch.compile(original, **options.compile_kwargs())

    @functools.wraps(original)
    def forward(*args, **kwargs):
        outer = _IN_COMPILED_LAYER[0], _PERMUTE_TOPK[0]
        _IN_COMPILED_LAYER[0] = True
        _PERMUTE_TOPK[0] = permute_topk
        _TE_CONTEXT_PLAIN[0] = te_context_plain()
        try:
            if monitor is not None and monitor.strict and layer.training:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return compiled(*args, **kwargs)
            return compiled(*args, **kwargs)
        finally:
            _IN_COMPILED_LAYER[0], _PERMUTE_TOPK[0] = outer

    forward.__megatron_patchset_compiled__ = True
    layer.forward = forward


def _prepare_token_dispatcher(layer) -> None:
    """The all-to-all dispatcher copies split sizes to the host before permutation 1 (inside the
    compiled ``preprocess``); move that copy to just before the all-to-all (inside the eager
    ``dispatch``), as megatron does when it CUDA-graphs ``moe_preprocess``. Not possible when a
    capacity factor without padding makes the host sync itself happen before permutation 1."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    dispatcher = _token_dispatcher(layer)
    if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
        config = dispatcher.config
        if config.moe_expert_capacity_factor is None or config.moe_pad_expert_input_to_capacity:
            dispatcher.cuda_dtoh_point = "before_ep_alltoall"


def _token_dispatcher(layer):
    """The MoE layer's token dispatcher, None for a dense layer."""
    return getattr(getattr(layer, "mlp", None), "token_dispatcher", None)


def _permutation_applied() -> bool:
    """Both permutation patches (both directions or neither: TE's unpermute cannot undo a
    gathered permutation)."""
    return all(name in applied() for name in PERMUTATION_PATCHES)


def layer_permutation_topk(layer) -> Optional[int]:
    """:func:`permutation_topk` of the layer's dispatcher when :func:`_permutation_applied`."""
    dispatcher = _token_dispatcher(layer)
    if dispatcher is None or not _permutation_applied():
        return None
    return permutation_topk(dispatcher)


def compile_transformer_layers(model_chunks: list, options: CompileOptions,
                               monitor: Optional[CompileMonitor] = None) -> list[str]:
    """Compile every TransformerLayer of the chunks in place; returns their qualified names."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    missing = [name for name in PATCH_NAMES if name not in applied()]
    if missing:
        from megatron.patchset.patches import SKIP_ENV, skipped_patches

        skipped = sorted(set(missing) & skipped_patches())
        raise PatchsetError(
            f"{FLAG}: the compile patches {', '.join(missing)} are not applied; "
            + (f"{SKIP_ENV} leaves out {', '.join(skipped)}, which compilation needs"
               if skipped else "call megatron.patchset.patches.apply(args) before building the model")
        )
    configure_dynamo()
    names = []
    for index, chunk in enumerate(model_chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, TransformerLayer):
                _prepare_token_dispatcher(module)
                compile_layer(module, options, monitor, permute_topk=layer_permutation_topk(module))
                names.append(f"{index}:{name}")
    if monitor is not None and model_chunks:
        model_chunks[0].register_forward_pre_hook(monitor.pre_forward)
    return names


def traceable_norm_count(model_chunks: list) -> int:
    """TE norms of the model with the traceable forward (traced only inside compiled layers)."""
    return sum(1 for chunk in model_chunks for module in chunk.modules()
               if getattr(module, "__megatron_patchset_rms__", None) is not None)


def _attention_block_applied() -> bool:
    return any(name in applied() for name in ATTENTION_BLOCK_PATCHES)


def permutation_report(model_chunks: list) -> str:
    """"; MoE permutation as gathers in N of M MoE layers" when the permutation patches apply."""
    if not _permutation_applied():
        return ""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    moe = [m for chunk in model_chunks for m in chunk.modules()
           if isinstance(m, TransformerLayer) and _token_dispatcher(m) is not None]
    gathered = sum(1 for m in moe if layer_permutation_topk(m))
    return (f"; MoE permutation as gathers in {gathered} of {len(moe)} MoE layers"
            + ("" if gathered == len(moe) else " (the others: TE's kernels; dropless all-to-all only)"))


def pre_wrap_hook(args: Any) -> Callable[[list], list]:
    """The model hook for ``GPTModelConfig.pre_wrap_hooks``."""
    options = options_from_args(args)

    def hook(model_chunks: list) -> list:
        monitor = CompileMonitor(options.warmup_iters)
        atexit.register(monitor.final_report)
        names = compile_transformer_layers(model_chunks, options, monitor)
        monitor._say(
            f"compile: {len(names)} TransformerLayers compiled per layer "
            f"(torch.compile {options.compile_kwargs()}), warm-up {options.warmup_iters} iterations; "
            + (f"TE kernels inside the compiled layers ({TE_KERNELS_FLAG}: a graph break each)"
               if options.te_kernels else
               f"TE norms ({traceable_norm_count(model_chunks)} in the model), the router and RoPE"
               + f" trace as torch code while compiling (inductor fuses them; {TE_KERNELS_FLAG} keeps TE's kernels)"
               + (f"; {attention_block_report(model_chunks)}" if _attention_block_applied() else "")
               + permutation_report(model_chunks))
        )
        return model_chunks

    return hook
