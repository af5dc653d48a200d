"""Megatron-FSDP's module hooks, made recognisable to TransformerEngine's per-layer CUDA graphs.

Megatron-FSDP (``optim_grads_params``) makes every transformer layer an *FSDP unit* and hangs
four module hooks on it (megatron-core 0.19.2, ``MegatronFSDP._register_fsdp_hooks``):

=====================  ==========================================
===================================
module hook            registered callable                         what must happen at graph capture
=====================  ==========================================
===================================
forward pre            ``_pre_forward_param_unshard``               run as is (all-gather the layer)
forward pre            ``partial(_register_post_backward_hook,     wrapper: its inner handler
                       _post_backward_release_module)``
                       (``_post_backward_release_module``)
                                                                    runs after the layer's backward
forward                ``_post_forward``                            run as is (release after
forward)
forward                ``create_custom_backward_hook(...)``'s       wrapper: its inner handler
                       ``forward_hook``
                       (``_pre_backward_param_unshard``)
                                                                    runs before the layer's backward
=====================  ==========================================
===================================

The two *wrappers* do their work by attaching autograd machinery to the layer's inputs and
outputs, which cannot happen inside a CUDA graph; TransformerEngine instead runs plain
``hook(module)`` callables around each captured forward and backward
(``make_graphed_callables(capture_time_hooks=...)``). So each wrapper carries a marker naming
its inner handler, and the CUDA-graph helper
(:mod:`~megatron.patchset.features.fsdp_cuda_graphs.te_graphs`) hands TE
the inner handlers under the right keys and withholds the wrappers.

The markers are attached where the hooks are registered: :class:`CudaGraphAwareMegatronFSDP`
(the class megatron's FSDP adapter instantiates, rebound by the patch below) calls upstream's
``_register_fsdp_hooks`` and then tags each hook it registered, recognising it by its
qualified name (the hooks are local functions of that method). A hook of that method that is
not in the table above is an error (upstream changed), never silently passed to TE.

The same subclass keeps FSDP from processing gradients while graphs are being captured: TE's
warm-up backward passes accumulate parameter gradients, which must not be copied into FSDP's
main-grad buckets or reduce-scattered (megatron's DDP skips them the same way).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from megatron.patchset.core.registry import PatchsetError, patch
from megatron.patchset.features.fsdp_cuda_graphs import capture_hooks

# Markers, set on the object stored in the module's hook dict (capture_hooks' names, the names
# upstream's Megatron-FSDP sets where it registers the hooks).
BACKWARD_HANDLER = capture_hooks.BACKWARD_HANDLER  # forward-pre wrapper -> runs after backward
BACKWARD_PRE_HANDLER = capture_hooks.BACKWARD_PRE_HANDLER  # forward wrapper -> before backward
CAPTURE_SAFE = capture_hooks.CAPTURE_SAFE  # plain hook that ignores all but the module
WITHHOLD = capture_hooks.WITHHOLD  # the root pre-backward wrapper: never given to TE
CAPTURE_GUARD = capture_hooks.CAPTURE_GUARD  # gradient hook guarded during capture

_HOOK_PREFIX = "MegatronFSDP._register_fsdp_hooks.<locals>."
# Hooks that use only their first argument (the module): TE may call them as hook(module).
_PLAIN_HOOKS = (
    "_pre_forward_param_unshard",
    "_post_forward",
    "_release_module_fp8_transpose_cache",
)
_POST_BACKWARD_WRAPPER = "_register_post_backward_hook"
_PRE_BACKWARD_WRAPPER = "create_custom_backward_hook.<locals>.forward_hook"
_ROOT_PRE_BACKWARD = "_root_pre_backward"
_WRAPPER_CELL = "custom_backward_handler"

PATCH_NAME = "fsdp_cuda_graphs.hook_markers"


class FSDPHookDriftError(PatchsetError):
    """A Megatron-FSDP hook does not look like megatron-core 0.19.2's."""


def local_name(fn: Any) -> str | None:
    """The name of ``fn`` inside ``MegatronFSDP._register_fsdp_hooks``, or None when ``fn``
    is not one of that method's local functions (through ``functools.partial`` and the
    ``torch.compiler.disable`` wrapper)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    qualname = getattr(inspect.unwrap(target), "__qualname__", "") or ""
    if not qualname.startswith(_HOOK_PREFIX):
        return None
    return qualname[len(_HOOK_PREFIX) :]


def _wrapped_handler(fn: Callable) -> Callable:
    """The handler that a ``create_custom_backward_hook`` wrapper calls from its grad hook."""
    raw = inspect.unwrap(fn)
    names = raw.__code__.co_freevars
    if _WRAPPER_CELL not in names or raw.__closure__ is None:
        raise FSDPHookDriftError(
            f"Megatron-FSDP's pre-backward hook wrapper no longer closes over {_WRAPPER_CELL!r} "
            f"(free variables: {names}); megatron-core changed create_custom_backward_hook: update "
            "features/fsdp_cuda_graphs/fsdp_hooks.py"
        )
    return raw.__closure__[names.index(_WRAPPER_CELL)].cell_contents


def mark_hook(fn: Any) -> str | None:
    """Attach the CUDA-graph marker to one hook registered by Megatron-FSDP.

    Returns the role (``"plain"``, ``"backward"``, ``"backward_pre"``, ``"withhold"``) or None
    for a hook that Megatron-FSDP did not register. Idempotent.
    """
    name = local_name(fn)
    if name is None:
        return None
    if name in _PLAIN_HOOKS:
        setattr(fn, CAPTURE_SAFE, True)
        return "plain"
    if name == _POST_BACKWARD_WRAPPER and isinstance(fn, functools.partial) and fn.args:
        setattr(fn, BACKWARD_HANDLER, fn.args[0])
        return "backward"
    if name == _PRE_BACKWARD_WRAPPER:
        inner = _wrapped_handler(fn)
        if local_name(inner) == _ROOT_PRE_BACKWARD:
            setattr(fn, WITHHOLD, True)
            return "withhold"
        setattr(fn, BACKWARD_PRE_HANDLER, inner)
        return "backward_pre"
    raise FSDPHookDriftError(
        f"unknown Megatron-FSDP module hook {name!r}: megatron-core's _register_fsdp_hooks "
        "registers a hook this fork does not know how to run under CUDA graph capture; update "
        "features/fsdp_cuda_graphs/fsdp_hooks.py"
    )


def mark_module_hooks(modules: Iterable[Any]) -> dict[str, int]:
    """Mark every Megatron-FSDP forward(-pre) hook on ``modules``; returns counts per role."""
    counts: dict[str, int] = {}
    for module in modules:
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for fn in hooks.values():
                role = mark_hook(fn)
                if role is not None:
                    counts[role] = counts.get(role, 0) + 1
    return counts


_mcore_graph_capturing = capture_hooks._graph_capturing
skip_while_capturing = capture_hooks.skip_while_capturing


def guard_gradient_hooks(
    handles: Iterable[Any], capturing: Callable[[], bool] = _mcore_graph_capturing
) -> int:
    """Replace, in place, each hook behind the ``RemovableHandle``s with its capture guard (the
    handles stay valid: the dict and the id are unchanged). Returns how many were guarded."""
    count = 0
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is None or handle.id not in hooks:
            continue
        hooks[handle.id] = skip_while_capturing(hooks[handle.id], capturing)
        count += 1
    return count


fsdp_instances = capture_hooks.fsdp_instances
raw_parameters = capture_hooks.raw_parameters


def wanted(args: Any) -> bool:
    return bool(
        args is not None
        and getattr(args, "use_megatron_fsdp", False)
        and getattr(args, "cuda_graph_impl", "none") == "transformer_engine"
    )


@patch(
    PATCH_NAME,
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter.MegatronFSDP",
    reason="TE per-layer graph capture must tell FSDP's autograd-attaching hook wrappers from "
    "their inner handlers, and FSDP must not reduce gradients of the capture passes: mark the "
    "hooks where they are registered and guard the gradient hooks (CudaGraphAwareMegatronFSDP, a "
    "subclass)",
    kind="feature",
)
def _fsdp_class(original):
    """The adapter's ``MegatronFSDP`` becomes :class:`CudaGraphAwareMegatronFSDP`."""

    class CudaGraphAwareMegatronFSDP(original):
        """Megatron-FSDP whose hooks carry CUDA-graph markers and whose gradient hooks pause
        while per-layer graphs are captured."""

        def _register_fsdp_hooks(self, root_module):
            result = super()._register_fsdp_hooks(root_module)
            mark_module_hooks(root_module.modules())
            guard_gradient_hooks(self.grad_acc_hooks.values())
            return result

    CudaGraphAwareMegatronFSDP.__module__ = __name__
    CudaGraphAwareMegatronFSDP.__qualname__ = "CudaGraphAwareMegatronFSDP"
    return CudaGraphAwareMegatronFSDP
