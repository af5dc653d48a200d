"""Per-TransformerLayer ``torch.compile`` (``--compile-transformer-layers``).

What it does, and why this way:

* **Per block, in place.** The patch ``torch_compile.compile_layers`` (of megatron's model
  builder: on the built chunks, after the model config's pre-wrap hooks and before ``.cuda()``,
  ``Float16Module`` and DDP/Megatron-FSDP) replaces each ``TransformerLayer``'s *instance*
  ``forward`` with a compiled one. The module stays in the
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
  inductor fuses (``torch_compile.*_traceable``; off with
  ``--compile-transformer-layers-te-kernels``).
  In plain bf16 on one tensor-parallel rank the same holds for the TE spec's attention block: the
  QKV ``LayerNormLinear`` and output ``Linear`` run as the norm and ``F.linear``, TE's
  ``DotProductAttention`` as ``F.scaled_dot_product_attention`` (``torch_compile.te_*_traceable``,
  :data:`ATTENTION_BLOCK_PATCHES`). What still breaks a layer is the MoE layer's eager middle.
* **No silent eager fallback, no recompiles after warm-up.** Dynamo's recompile limit is a hard
  error (``fail_on_recompile_limit_hit``); per-layer integer attributes are not specialised
  (``allow_unspec_int_on_nn_module``), so all layers share one compiled variant. After
  ``--compile-transformer-layers-warmup-iters`` training iterations every call of a compiled layer
  in
  training mode runs under the ``fail_on_recompile`` stance: a recompile raises an error that names
  the guard that failed (the eager regions switch back to the default stance, so megatron's own
  ``jit_fuser`` kernels inside them may still specialise on token counts).
* **Report.** :class:`CompileMonitor` logs the first iteration's time (compile warm-up), dynamo's
  compile time, graphs and graph breaks (with reasons) at the end of warm-up and at exit, and
  writes them as ``{"compile": ...}`` lines into the metrics file (``MEGATRON_PATCHSET_METRICS``).
"""

from __future__ import annotations

import atexit
import functools
import inspect
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import SKIP_ENV, applied, patch, skipped_patches
from megatron.patchset.features.torch_compile import tracing
from megatron.patchset.features.torch_compile.attention_block import (
    ATTENTION_BLOCK_PATCHES,
    attention_block_report,
)
from megatron.patchset.features.torch_compile.eager_regions import PATCH_NAMES
from megatron.patchset.features.torch_compile.flags import (
    FLAG,
    TE_KERNELS_FLAG,
    CompileOptions,
    options_from_args,
)
from megatron.patchset.features.torch_compile.monitor import CompileMonitor
from megatron.patchset.features.torch_compile.permutation import (
    PERMUTATION_PATCHES,
    permutation_topk,
)

_BUILDER = "megatron.training.models.gpt"


def configure_dynamo() -> None:
    """Process-wide dynamo settings the feature relies on (logged once)."""
    import torch._dynamo

    # A recompile limit hit is an error, not a silent switch of the frame to eager.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # Integer attributes of modules (router.layer_number, ...) are not baked into guards: all
    # layers share one compiled variant instead of one each (the 9th layer would hit the limit).
    torch._dynamo.config.allow_unspec_int_on_nn_module = True


def compile_layer(
    layer,
    options: CompileOptions,
    monitor: CompileMonitor | None,
    permute_topk: int | None = None,
) -> None:
    """Replace ``layer.forward`` (the instance attribute) with its compiled version.
    ``permute_topk``: see :func:`permutation_topk` (None keeps TE's permutation)."""
    import torch

    original = layer.forward
    compiled = torch.compile(original, **options.compile_kwargs())

    @functools.wraps(original)
    def forward(*args, **kwargs):
        outer = tracing.IN_COMPILED_LAYER[0], tracing.PERMUTE_TOPK[0]
        tracing.IN_COMPILED_LAYER[0] = True
        tracing.PERMUTE_TOPK[0] = permute_topk
        tracing.TE_CONTEXT_PLAIN[0] = tracing.te_context_plain()
        try:
            if monitor is not None and monitor.strict and layer.training:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return compiled(*args, **kwargs)
            return compiled(*args, **kwargs)
        finally:
            tracing.IN_COMPILED_LAYER[0], tracing.PERMUTE_TOPK[0] = outer

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


def layer_permutation_topk(layer) -> int | None:
    """:func:`permutation_topk` of the layer's dispatcher when :func:`_permutation_applied`."""
    dispatcher = _token_dispatcher(layer)
    if dispatcher is None or not _permutation_applied():
        return None
    return permutation_topk(dispatcher)


def compile_transformer_layers(
    model_chunks: list, options: CompileOptions, monitor: CompileMonitor | None = None
) -> list[str]:
    """Compile every TransformerLayer of the chunks in place; returns their qualified names."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    missing = [name for name in PATCH_NAMES if name not in applied()]
    if missing:
        skipped = sorted(set(missing) & skipped_patches())
        raise PatchsetError(
            f"{FLAG}: the compile patches {', '.join(missing)} are not applied; "
            + (
                f"{SKIP_ENV} leaves out {', '.join(skipped)}, which compilation needs"
                if skipped
                else "call megatron.patchset.apply(args) before building the model"
            )
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
    return sum(
        1
        for chunk in model_chunks
        for module in chunk.modules()
        if getattr(module, "__megatron_patchset_rms__", None) is not None
    )


def _attention_block_applied() -> bool:
    return any(name in applied() for name in ATTENTION_BLOCK_PATCHES)


def permutation_report(model_chunks: list) -> str:
    """ "; MoE permutation as gathers in N of M MoE layers" when the permutation patches apply."""
    if not _permutation_applied():
        return ""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    moe = [
        m
        for chunk in model_chunks
        for m in chunk.modules()
        if isinstance(m, TransformerLayer) and _token_dispatcher(m) is not None
    ]
    gathered = sum(1 for m in moe if layer_permutation_topk(m))
    return f"; MoE permutation as gathers in {gathered} of {len(moe)} MoE layers" + (
        "" if gathered == len(moe) else " (the others: TE's kernels; dropless all-to-all only)"
    )


def compile_hook(args: Any) -> Callable[[list], list]:
    """What :func:`_compile_before_wrapping` runs on the built model chunks: every
    TransformerLayer compiled in place, the compile monitor started, one line saying so."""
    options = options_from_args(args)

    def hook(model_chunks: list) -> list:
        monitor = CompileMonitor(options.warmup_iters)
        atexit.register(monitor.final_report)
        names = compile_transformer_layers(model_chunks, options, monitor)
        monitor._say(
            f"compile: {len(names)} TransformerLayers compiled per layer (torch.compile "
            f"{options.compile_kwargs()}), warm-up {options.warmup_iters} iterations; "
            + (
                f"TE kernels inside the compiled layers ({TE_KERNELS_FLAG}: a graph break each)"
                if options.te_kernels
                else f"TE norms ({traceable_norm_count(model_chunks)} in the model), the router "
                "and RoPE"
                + f" trace as torch code while compiling (inductor fuses them; {TE_KERNELS_FLAG} "
                "keeps TE's kernels)"
                + (
                    f"; {attention_block_report(model_chunks)}"
                    if _attention_block_applied()
                    else ""
                )
                + permutation_report(model_chunks)
            )
        )
        return model_chunks

    return hook


def after(first: Callable[[list], list] | None, second: Callable[[list], list]):
    """One pre-wrap hook: ``first`` (the model config's hooks, composed by megatron), then
    ``second``. ``first`` returning None means what it means to megatron: the hooks' result is
    not used."""

    def pre_wrap_hook(model_chunks: list) -> list | None:
        if first is not None:
            model_chunks = first(model_chunks)
            if model_chunks is None:
                return None
        return second(model_chunks)

    return pre_wrap_hook


@patch(
    "torch_compile.compile_layers",
    f"{_BUILDER}.unimodal_build_distributed_models",
    reason="megatron builds the GPT model chunks and wraps them (GPU move, Float16Module, "
    "DDP/Megatron-FSDP) in one call: compile each TransformerLayer's forward in place in between, "
    "after the model config's pre-wrap hooks (compilation traces what they leave)",
)
def _compile_before_wrapping(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def unimodal_build_distributed_models(*args, **kwargs):
        from megatron.training.global_vars import get_args

        bound = signature.bind(*args, **kwargs)
        bound.arguments["pre_wrap_hook"] = after(
            bound.arguments.get("pre_wrap_hook"), compile_hook(get_args())
        )
        return original(*bound.args, **bound.kwargs)

    return unimodal_build_distributed_models
