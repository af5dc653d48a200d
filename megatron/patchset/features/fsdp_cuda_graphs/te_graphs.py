"""TransformerEngine per-layer CUDA graphs (``--cuda-graph-impl transformer_engine``) with
Megatron-FSDP.

In megatron-core 0.19.2 this combination cannot work: the layers handed to TE's
``make_graphed_callables`` still carry Megatron-FSDP's module hooks (TE 2.20.2 refuses such
modules, and older TE captured them in the wrong phase: wrong numerics, illegal memory accesses
at replay), and ``GraphableMegatronModule.__call__`` calls the capture/replay functions directly,
so none of the layer's hooks run at replay (its parameters are never all-gathered).

What this module changes (each a registered patch, on with ``--use-megatron-fsdp
--cuda-graph-impl transformer_engine``, except the dtype fix, on for any TE graph run):

``fsdp_cuda_graphs.capture_helper``
    The training loop's ``TECudaGraphHelper`` becomes :class:`FSDPCudaGraphHelper`. Around
    capture it gives the modules FSDP's raw parameters, takes all four kinds of module hooks off
    every graphed layer (:func:`take_off_hooks`), hands TE the hooks as ``capture_time_hooks``
    (:func:`capture_time_hooks`: FSDP's wrappers are replaced by their inner handlers, under
    the key of the phase they belong to) and puts every hook back afterwards, also when capture
    fails, and again (idempotently) before graphs are deleted.
``fsdp_cuda_graphs.hooks_fire_on_graphed_call``
    ``GraphableMegatronModule.__call__`` runs capture and replay through ``nn.Module.__call__``,
    so the layer's hooks (FSDP's unshard, release, pre- and post-backward) fire around them.
``fsdp_cuda_graphs.capture_uses_original_forward``
    The base ``_te_cuda_graph_capture`` calls the layer's real ``forward`` (the swapped-in one
    would recurse).
``fsdp_cuda_graphs.static_inputs_params_dtype``
    Sample inputs for capture are created in the model's ``params_dtype``, not always bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron.patchset.core.registry import patch
from megatron.patchset.features.fsdp_cuda_graphs import capture_hooks, fsdp_hooks

# The capture-time hook machinery is capture_hooks, the module upstream gets verbatim.
TE_HOOK_KEYS = capture_hooks.TE_HOOK_KEYS
MODULE_HOOK_DICTS = capture_hooks.MODULE_HOOK_DICTS
CudaGraphHookError = capture_hooks.CudaGraphHookError
HookStash = capture_hooks.HookStash
take_off_hooks = capture_hooks.take_off_hooks
restore_hooks = capture_hooks.restore_hooks
capture_time_hooks = capture_hooks.capture_time_hooks
check_capture_config = capture_hooks.check_capture_config
# The attribute upstream's GraphableMegatronModule.__call__ keeps the layer's forward in while
# capture or replay runs as the forward.
ORIGINAL_FORWARD = "_te_cuda_graph_forward"


def check_no_hooks_inside(module: torch.nn.Module, name: str = "") -> None:
    """capture_hooks.check_no_hooks_inside, recognising Megatron-FSDP's hooks by name (marked
    or not)."""
    capture_hooks.check_no_hooks_inside(
        module, name, lambda fn: fsdp_hooks.local_name(fn) is not None
    )


# ---------------------------------------------------------------------------------------
# Patches on GraphableMegatronModule
# ---------------------------------------------------------------------------------------


def _graphed_step_with_hooks(module: torch.nn.Module, step: Callable, args: tuple, kwargs: dict):
    """Run ``step`` (capture or replay) as the module's forward through ``nn.Module.__call__``,
    so that the module's hooks run around it; the instance attribute is removed afterwards."""
    state = module.__dict__
    had_forward = "forward" in state
    previous = state.get("forward")
    state[ORIGINAL_FORWARD] = module.forward
    state["forward"] = step
    try:
        return torch.nn.Module.__call__(module, *args, **kwargs)
    finally:
        if had_forward:
            state["forward"] = previous
        else:
            state.pop("forward", None)
        state.pop(ORIGINAL_FORWARD, None)


@patch(
    "fsdp_cuda_graphs.hooks_fire_on_graphed_call",
    "megatron.core.transformer.module.GraphableMegatronModule.__call__",
    reason="on the TE graph path __call__ calls capture/replay directly, so the layer's module "
    "hooks (Megatron-FSDP's unshard/reshard/backward hooks) never run: go through "
    "nn.Module.__call__",
)
def _call(original):
    from megatron.core.transformer.module import GraphableMegatronModule

    def __call__(self, *args, **kwargs):
        # upstream's three branches, each predicate evaluated once (this runs on every layer call)
        if self._should_call_local_cudagraph(*args, **kwargs):
            return original(self, *args, **kwargs)
        if self._should_call_te_cudagraph(*args, **kwargs):
            step = self._te_cuda_graph_replay if self.cuda_graphs else self._te_cuda_graph_capture
            return _graphed_step_with_hooks(self, step, args, kwargs)
        return super(GraphableMegatronModule, self).__call__(*args, **kwargs)

    return __call__


@patch(
    "fsdp_cuda_graphs.capture_uses_original_forward",
    "megatron.core.transformer.module.GraphableMegatronModule._te_cuda_graph_capture",
    reason="with capture run as the module's forward, the base capture (self.forward) would call "
    "itself: call the forward saved before the swap",
)
def _capture(original):
    def _te_cuda_graph_capture(self, *args, **kwargs):
        forward = self.__dict__.get(ORIGINAL_FORWARD)
        if forward is None:
            return original(self, *args, **kwargs)
        return forward(*args, **kwargs)

    return _te_cuda_graph_capture


def _te_graphs_wanted(args: Any) -> bool:
    return args is not None and getattr(args, "cuda_graph_impl", "none") == "transformer_engine"


def _te_graphs_not_bf16(args: Any) -> bool:
    """Upstream's capture inputs are bf16: only a fp32/fp16 model needs the dtype patch (a bf16
    model then still runs upstream's code, so MEGATRON_PATCHSET=off can graph it)."""
    return _te_graphs_wanted(args) and not getattr(args, "bf16", False)


@patch(
    "fsdp_cuda_graphs.static_inputs_params_dtype",
    "megatron.core.transformer.module.GraphableMegatronModule.get_layer_static_inputs",
    reason="capture sample hidden states are hard-coded bf16; a fp32 or fp16 model captures graphs "
    "for the wrong dtype: use config.params_dtype",
    flags=("--cuda-graph-impl transformer_engine without --bf16",),
    enabled=_te_graphs_not_bf16,
)
def _static_inputs(original):
    def get_layer_static_inputs(self, seq_length, micro_batch_size):
        inputs = original(self, seq_length, micro_batch_size)
        dtype = getattr(self.config, "params_dtype", None) or torch.bfloat16
        hidden = inputs.get("hidden_states")
        if hidden is not None and hidden.dtype != dtype:
            inputs["hidden_states"] = torch.ones_like(hidden, dtype=dtype).requires_grad_(
                hidden.requires_grad
            )
        return inputs

    return get_layer_static_inputs


# ---------------------------------------------------------------------------------------
# The capture helper
# ---------------------------------------------------------------------------------------


@patch(
    "fsdp_cuda_graphs.capture_helper",
    "megatron.training.training.TECudaGraphHelper",
    reason="make_graphed_callables gets layers with Megatron-FSDP's hooks on and DTensor params: "
    "take the hooks off, pass FSDP's inner handlers as TE capture_time_hooks, capture with raw "
    "params, restore (FSDPCudaGraphHelper, a subclass)",
)
def _helper_class(original):
    """The training loop's ``TECudaGraphHelper`` becomes :class:`FSDPCudaGraphHelper`."""

    class FSDPCudaGraphHelper(original):
        """TE per-layer graph capture for Megatron-FSDP models (see the module docstring)."""

        _patchset_stashes: list = []
        _patchset_capture_time_hooks: list | None = None

        def create_cudagraphs(self):
            if not self.flattened_callables:
                return super().create_cudagraphs()
            check_capture_config(self.model, self.config)
            names = [
                f"layer {getattr(c, 'layer_number', i)}"
                for i, c in enumerate(self.flattened_callables)
            ]
            for callable_, name in zip(self.flattened_callables, names):
                check_no_hooks_inside(callable_, name)
            with fsdp_hooks.raw_parameters(self.model):
                self._patchset_stashes = [take_off_hooks(c) for c in self.flattened_callables]
                try:
                    self._patchset_capture_time_hooks = [
                        capture_time_hooks(stash, name)
                        for stash, name in zip(self._patchset_stashes, names)
                    ]
                    _log_capture(self._patchset_stashes, self._patchset_capture_time_hooks)
                    return super().create_cudagraphs()
                finally:
                    self._patchset_capture_time_hooks = None
                    self.restore_callable_hooks()
                    _end_capture_if_left_on()

        def _get_cuda_graph_input_data(self):
            sample_args, kwargs = super()._get_cuda_graph_input_data()
            hooks = self._patchset_capture_time_hooks
            if hooks is not None and any(h is not None for h in hooks):
                if "capture_time_hooks" in kwargs:
                    raise CudaGraphHookError(
                        "megatron-core already passes capture_time_hooks; the fork's patch is stale"
                    )
                kwargs["capture_time_hooks"] = list(hooks)
            return sample_args, kwargs

        def restore_callable_hooks(self):
            """Put back every hook taken off for capture (idempotent)."""
            for stash in self._patchset_stashes:
                restore_hooks(stash)

        def delete_cuda_graphs(self):
            self.restore_callable_hooks()
            return super().delete_cuda_graphs()

    FSDPCudaGraphHelper.__module__ = __name__
    FSDPCudaGraphHelper.__qualname__ = "FSDPCudaGraphHelper"
    return FSDPCudaGraphHelper


def _log_capture(stashes: list, te_hooks: list) -> None:
    """One line on rank 0: how many hooks were taken off and what TE runs at capture."""
    per_key = {
        key: sum(len((entry or {}).get(key, {})) for entry in te_hooks) for key in TE_HOOK_KEYS
    }
    taken = sum(stash.count() for stash in stashes)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(
            f"megatron-patchset: CUDA graph capture with Megatron-FSDP: {taken} module hooks taken "
            f"off {len(stashes)} layers for capture; TE runs at capture "
            + ", ".join(f"{n} {key}" for key, n in per_key.items())
            + "; the hooks are restored after capture",
            flush=True,
        )


def _end_capture_if_left_on() -> None:
    """After a failed capture megatron's (and TE's) capture flags can stay set; clear them."""
    from megatron.core.transformer import cuda_graphs as mcore_graphs

    if mcore_graphs.is_graph_capturing():
        mcore_graphs._set_capture_end()
        te_end = getattr(mcore_graphs, "te_set_capture_end", None)
        if te_end is not None:
            te_end()
