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

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from megatron.patchset.core.registry import PatchsetError, patch

# Markers, set on the object stored in the module's hook dict.
BACKWARD_HANDLER = "_cuda_graph_backward_handler"  # forward-pre wrapper -> runs after backward
BACKWARD_PRE_HANDLER = "_cuda_graph_backward_pre_handler"  # forward wrapper -> runs before backward
CAPTURE_SAFE = "_cuda_graph_capture_time_safe"  # plain hook that ignores all but the module
WITHHOLD = "_cuda_graph_withhold"  # the root pre-backward wrapper: never given to TE
CAPTURE_GUARD = "_patchset_skip_while_capturing"  # gradient hook guarded during capture

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


def _mcore_graph_capturing() -> bool:
    # Imported lazily: megatron_fsdp is imported by megatron.core.distributed, which
    # cuda_graphs imports in turn.
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    return is_graph_capturing()


def skip_while_capturing(
    hook: Callable, capturing: Callable[[], bool] = _mcore_graph_capturing
) -> Callable:
    """``hook`` (a parameter's post-accumulate-grad hook) as a no-op while megatron-core is
    capturing per-layer CUDA graphs (its flag also covers TE's warm-up passes; it is not set by
    full-iteration graphs, which must keep their reduce-scatter)."""
    if getattr(hook, CAPTURE_GUARD, False):
        return hook

    @functools.wraps(hook)
    def guarded(param):
        if capturing():
            return None
        return hook(param)

    setattr(guarded, CAPTURE_GUARD, True)
    return guarded


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


def fsdp_instances(model_chunks: Iterable[Any]) -> list[Any]:
    """The ``MegatronFSDP`` modules inside the (wrapped) model chunks."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    found = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, MegatronFSDP) and all(module is not f for f in found):
                found.append(module)
    return found


@contextlib.contextmanager
def raw_parameters(model_chunks: Iterable[Any]) -> Iterator[list[Any]]:
    """Give the modules Megatron-FSDP's raw (unsharded, persistent) parameters for the duration.

    After the optimizer step the layers hold the DTensor shards; TE records the parameters of
    each graphed layer when capture starts, and what the layer uses at replay are the raw ones
    (Megatron-FSDP swaps them in at every forward). Afterwards the all-gather pipeline is reset
    (capture left prefetched buckets behind) and the sharded parameters are put back when they
    were there before.
    """
    instances = fsdp_instances(model_chunks)
    was_distributed = [bool(f.is_param_fsdp_distributed) for f in instances]
    for fsdp in instances:
        fsdp._replace_param_with_raw_if_needed()
    try:
        yield instances
    finally:
        for fsdp, distributed in zip(instances, was_distributed):
            if distributed:
                fsdp.synchronize_param_gather()  # reset the AG pipeline + back to shards
            else:
                fsdp.all_gather_pipeline.reset(preserve_non_fsdp_units=True)


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
