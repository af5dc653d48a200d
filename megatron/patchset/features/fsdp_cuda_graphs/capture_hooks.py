"""Module hooks of layers graphed by TransformerEngine's per-layer CUDA graphs.

``make_graphed_callables`` refuses modules that carry hooks, and cannot capture what
Megatron-FSDP's hooks do (all-gather and release parameters, attach autograd hooks to a layer's
inputs and outputs). Around capture the hooks are therefore taken off the graphed layers
(:func:`take_off_hooks`) and handed to TransformerEngine as ``capture_time_hooks``
(:func:`capture_time_hooks`), which it runs as ``hook(module)`` around each warm-up and captured
forward and backward, outside the graphs. Afterwards the hooks are put back
(:func:`restore_hooks`); at replay they fire around the graphed call as around an eager forward.

Megatron-FSDP marks its hooks where it registers them:

* a forward pre-hook that attaches the post-backward handler to the layer's inputs carries the
  handler under :data:`BACKWARD_HANDLER` (TE runs it after the layer's backward);
* a forward hook that attaches a pre-backward handler to the layer's outputs carries it under
  :data:`BACKWARD_PRE_HANDLER` (TE runs it before the layer's backward);
* a hook that uses nothing but the module carries :data:`CAPTURE_SAFE` (TE runs it in its own
  phase);
* the root pre-backward wrapper carries :data:`WITHHOLD`: it queues an autograd callback, legal
  only in a real backward pass, and is not given to TE.

Any other hook is refused: TE cannot give it its real arguments. :func:`megatron_fsdp_capture`
does all of this for the layers of a model wrapped in Megatron-FSDP, and is a no-op for other
models.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

# Markers set by Megatron-FSDP on the hooks it registers (megatron_fsdp.py).
BACKWARD_HANDLER = "_cuda_graph_backward_handler"
BACKWARD_PRE_HANDLER = "_cuda_graph_backward_pre_handler"
CAPTURE_SAFE = "_cuda_graph_capture_time_safe"
WITHHOLD = "_cuda_graph_withhold"
MARKERS = (BACKWARD_HANDLER, BACKWARD_PRE_HANDLER, CAPTURE_SAFE, WITHHOLD)
# Set on a gradient hook guarded by skip_while_capturing.
CAPTURE_GUARD = "_cuda_graph_capture_guard"

# TransformerEngine's capture_time_hooks keys (make_graphed_callables).
TE_HOOK_KEYS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
# torch.nn.Module's hook dicts, by the kind of hook they hold.
MODULE_HOOK_DICTS = {
    "forward_pre": "_forward_pre_hooks",
    "forward": "_forward_hooks",
    "backward_pre": "_backward_pre_hooks",
    "backward": "_backward_hooks",
}


class CudaGraphHookError(RuntimeError):
    """A graphed module carries a hook that cannot be run correctly around TE's capture."""


def is_marked(fn: Any) -> bool:
    """Whether ``fn`` is a hook Megatron-FSDP marked for CUDA graph capture."""
    return any(getattr(fn, marker, None) for marker in MARKERS)


@dataclasses.dataclass
class HookStash:
    """The hooks taken off one module: ``(id, hook)`` pairs per kind, in registration order."""

    module: torch.nn.Module
    hooks: dict[str, list[tuple[int, Callable]]]
    forward_pre_with_kwargs: frozenset
    forward_with_kwargs: frozenset
    restored: bool = False

    def count(self) -> int:
        """How many hooks were taken off."""
        return sum(len(v) for v in self.hooks.values())


def take_off_hooks(module: torch.nn.Module) -> HookStash:
    """Remove all forward-pre, forward, backward-pre and backward hooks from ``module``.

    The dicts are emptied in place (not replaced), so the ``RemovableHandle``s that registered
    the hooks stay valid; the with-kwargs flags are left alone.
    """
    hooks = {}
    for kind, attr in MODULE_HOOK_DICTS.items():
        table = getattr(module, attr)
        hooks[kind] = list(table.items())
        table.clear()
    return HookStash(
        module=module,
        hooks=hooks,
        forward_pre_with_kwargs=frozenset(getattr(module, "_forward_pre_hooks_with_kwargs", {})),
        forward_with_kwargs=frozenset(getattr(module, "_forward_hooks_with_kwargs", {})),
    )


def restore_hooks(stash: HookStash) -> None:
    """Put the stashed hooks back, in their original order and under their original ids; hooks
    registered meanwhile stay, after them. Doing it twice changes nothing."""
    if stash.restored:
        return
    for kind, attr in MODULE_HOOK_DICTS.items():
        table = getattr(stash.module, attr)
        saved = stash.hooks[kind]
        saved_ids = {hook_id for hook_id, _ in saved}
        added = [(k, v) for k, v in table.items() if k not in saved_ids]
        table.clear()
        table.update(saved)
        table.update(added)
    stash.restored = True


def _module_only(handler: Callable) -> Callable:
    """TE calls capture-time hooks as ``hook(module)`` and requires None back."""

    def hook(module):
        """The handler, run by TE around the module's backward."""
        handler(module)

    hook.__wrapped__ = handler
    return hook


def _plain_forward_pre(fn: Callable, with_kwargs: bool) -> Callable:
    def hook(module):
        """The forward pre-hook, run by TE before the module's forward."""
        if with_kwargs:
            fn(module, (), {})
        else:
            fn(module, ())

    hook.__wrapped__ = fn
    return hook


def _plain_forward(fn: Callable, with_kwargs: bool) -> Callable:
    def hook(module):
        """The forward hook, run by TE after the module's forward."""
        if with_kwargs:
            fn(module, (), {}, None)
        else:
            fn(module, (), None)

    hook.__wrapped__ = fn
    return hook


def _describe(fn: Callable) -> str:
    target = getattr(fn, "func", fn)
    return getattr(target, "__qualname__", repr(target))


_UNKNOWN = (
    "was not registered by Megatron-FSDP: TransformerEngine's per-layer graph capture runs hooks "
    "as hook(module) outside the graph and cannot run this one correctly. Remove it before "
    "training, or use --cuda-graph-impl none."
)


def capture_time_hooks(stash: HookStash, name: str = "") -> dict[str, dict[int, Callable]] | None:
    """The hooks of one graphed module as its ``capture_time_hooks`` entry (None: no hooks).

    A forward pre-hook marked with a backward handler gives the handler under
    ``backward_hooks``; a forward hook marked with a backward-pre handler gives it under
    ``backward_pre_hooks``; a capture-safe hook is run in its own phase; the root pre-backward
    wrapper is withheld (it is back on the module for replay). Any other hook is refused.
    """
    where = f" on {name or type(stash.module).__name__}"
    te: dict[str, dict[int, Callable]] = {key: {} for key in TE_HOOK_KEYS}
    for hook_id, fn in stash.hooks["forward_pre"]:
        if getattr(fn, WITHHOLD, False):
            continue
        inner = getattr(fn, BACKWARD_HANDLER, None)
        if inner is not None:
            te["backward_hooks"][hook_id] = _module_only(inner)
        elif getattr(fn, CAPTURE_SAFE, False):
            te["forward_pre_hooks"][hook_id] = _plain_forward_pre(
                fn, hook_id in stash.forward_pre_with_kwargs
            )
        else:
            raise CudaGraphHookError(f"forward pre-hook {_describe(fn)}{where} {_UNKNOWN}")
    for hook_id, fn in stash.hooks["forward"]:
        if getattr(fn, WITHHOLD, False):
            continue
        inner = getattr(fn, BACKWARD_PRE_HANDLER, None)
        if inner is not None:
            te["backward_pre_hooks"][hook_id] = _module_only(inner)
        elif getattr(fn, CAPTURE_SAFE, False):
            te["forward_hooks"][hook_id] = _plain_forward(fn, hook_id in stash.forward_with_kwargs)
        else:
            raise CudaGraphHookError(f"forward hook {_describe(fn)}{where} {_UNKNOWN}")
    for kind in ("backward_pre", "backward"):
        for _, fn in stash.hooks[kind]:
            raise CudaGraphHookError(
                f"module {kind.replace('_', '-')} hook {_describe(fn)}{where} {_UNKNOWN}"
            )
    if not any(te.values()):
        return None
    return te


def check_no_hooks_inside(
    module: torch.nn.Module, name: str = "", is_fsdp_hook: Callable[[Any], bool] = is_marked
) -> None:
    """Refuse Megatron-FSDP hooks on submodules of a graphed layer: they would run inside the
    captured region at capture time and never at replay (fine-grained parameter gather, the
    ``optim``/``optim_grads`` strategies, or a root pre-backward hook on a pipeline stage's
    last layer)."""
    for sub_name, sub in module.named_modules():
        if sub is module:
            continue
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            for fn in getattr(sub, attr).values():
                if is_fsdp_hook(fn):
                    raise CudaGraphHookError(
                        f"Megatron-FSDP hook {_describe(fn)} on {name}.{sub_name}, inside a layer "
                        "graphed by TransformerEngine: it would run during capture and never at "
                        "replay. Per-layer graphs need FSDP units of whole layers "
                        "(--data-parallel-sharding-strategy optim_grads_params, no fine-grained "
                        "parameter gather, no pipeline parallelism)."
                    )


def _graph_capturing() -> bool:
    # Imported here: megatron_fsdp is imported by megatron.core.distributed, which cuda_graphs
    # imports in turn.
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    return is_graph_capturing()


def skip_while_capturing(hook: Callable, capturing: Callable[[], bool] = _graph_capturing):
    """``hook`` (a parameter's post-accumulate-grad hook) as a no-op while per-layer CUDA graphs
    are captured: the gradients of TE's warm-up and capture passes are not the step's, and must
    not reach FSDP's gradient buffers."""
    if getattr(hook, CAPTURE_GUARD, False):
        return hook

    @functools.wraps(hook)
    def guarded(param):
        """The gradient hook, skipped while capturing."""
        if capturing():
            return None
        return hook(param)

    setattr(guarded, CAPTURE_GUARD, True)
    return guarded


def guard_gradient_hooks(
    handles: Iterable[Any], capturing: Callable[[], bool] = _graph_capturing
) -> list[tuple[dict, int, Callable]]:
    """Replace, in place, each hook behind the ``RemovableHandle``s with its capture guard (the
    handles stay valid: the dict and the id are unchanged). Returns ``(dict, id, hook)`` for
    each hook guarded now, for :func:`unguard_gradient_hooks`."""
    guarded = []
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is None or handle.id not in hooks:
            continue
        hook = hooks[handle.id]
        if getattr(hook, CAPTURE_GUARD, False):
            continue
        hooks[handle.id] = skip_while_capturing(hook, capturing)
        guarded.append((hooks, handle.id, hook))
    return guarded


def unguard_gradient_hooks(guarded: list[tuple[dict, int, Callable]]) -> None:
    """Put back the hooks :func:`guard_gradient_hooks` guarded."""
    for hooks, hook_id, hook in guarded:
        if hook_id in hooks:
            hooks[hook_id] = hook


def fsdp_instances(model_chunks: Iterable[torch.nn.Module]) -> list[Any]:
    """The ``MegatronFSDP`` modules inside the (wrapped) model chunks."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    found = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, MegatronFSDP) and all(module is not f for f in found):
                found.append(module)
    return found


@contextlib.contextmanager
def raw_parameters(model_chunks: Iterable[torch.nn.Module]) -> Iterator[list[Any]]:
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


def check_capture_config(model_chunks: Iterable[torch.nn.Module], config: Any) -> None:
    """The Megatron-FSDP settings per-layer graphs need (for callers that build the graphs
    without validate_args)."""
    for chunk in model_chunks:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is None or not getattr(ddp, "use_megatron_fsdp", False):
            continue
        missing = [
            flag
            for flag, ok in (
                ("--fsdp-double-buffer", getattr(ddp, "fsdp_double_buffer", False)),
                (
                    "--fsdp-db-use-persist-buf-on-alloc-fail",
                    getattr(ddp, "fsdp_db_use_persist_buf_on_alloc_fail", False),
                ),
                (
                    "--data-parallel-sharding-strategy optim_grads_params",
                    getattr(ddp, "data_parallel_sharding_strategy", None) == "optim_grads_params",
                ),
            )
            if not ok
        ]
        if missing:
            raise CudaGraphHookError(
                "TransformerEngine per-layer CUDA graphs with Megatron-FSDP need "
                + ", ".join(missing)
                + ": the graphs replay at the parameter-buffer addresses seen at capture"
            )
        if getattr(config, "gradient_accumulation_fusion", False):
            raise CudaGraphHookError(
                "TransformerEngine per-layer CUDA graphs with Megatron-FSDP need "
                "--no-gradient-accumulation-fusion (fused wgrad would allocate FSDP grad buckets "
                "inside the capture)"
            )


@dataclasses.dataclass
class CaptureHooks:
    """What :func:`megatron_fsdp_capture` took off the graphed layers: the hooks per layer, and
    each layer's ``capture_time_hooks`` entry (None where it has none)."""

    stashes: list[HookStash]
    capture_time_hooks: list[dict[str, dict[int, Callable]] | None]

    def restore(self) -> None:
        """Put every hook back (idempotent)."""
        for stash in self.stashes:
            restore_hooks(stash)


@contextlib.contextmanager
def megatron_fsdp_capture(
    model_chunks: list[torch.nn.Module],
    callables: list[torch.nn.Module],
    config: Any,
    names: list[str] | None = None,
) -> Iterator[CaptureHooks | None]:
    """Megatron-FSDP's hooks off the graphed ``callables`` for the duration, as TE's
    ``capture_time_hooks``; FSDP's raw parameters in the layers and its gradient hooks paused
    while capturing. Yields None, and changes nothing, for a model without Megatron-FSDP."""
    if not callables or not fsdp_instances(model_chunks):
        yield None
        return
    check_capture_config(model_chunks, config)
    if names is None:
        names = [f"layer {getattr(c, 'layer_number', i)}" for i, c in enumerate(callables)]
    for callable_, name in zip(callables, names):
        check_no_hooks_inside(callable_, name)
    with raw_parameters(model_chunks) as instances:
        guarded = []
        for fsdp in instances:
            guarded += guard_gradient_hooks(fsdp.grad_acc_hooks.values())
        hooks = CaptureHooks([take_off_hooks(c) for c in callables], [])
        try:
            hooks.capture_time_hooks = [
                capture_time_hooks(stash, name) for stash, name in zip(hooks.stashes, names)
            ]
            yield hooks
        finally:
            hooks.restore()
            unguard_gradient_hooks(guarded)
