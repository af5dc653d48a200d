"""Offload a model's parameters and gradients (and optionally its optimizer state) to host memory,
and bring them back, through the storages of megatron's buffers.

    from megatron.patchset.features.offload import offload, reload, offloaded

    state = offload(model, optimizer, include_optimizer=True)   # GPU memory released
    ...                                                          # e.g. run inference elsewhere
    reload(model, optimizer)                                     # same tensors, same values

    with offloaded(model, optimizer):                            # the same, as a context manager
        ...

Why at the storage level: megatron's ``DistributedDataParallel`` makes every parameter a view of
one flat ``param_data`` buffer (with the distributed optimizer) and every ``main_grad`` a view of
``grad_data``; the distributed optimizer writes updated weights into the buffer and keeps shard
views of it; Megatron-FSDP's parameters are DTensors over its ``DataParallelBuffer``s. Moving a
parameter with ``param.data = param.data.cpu()`` (or ``module.cpu()``) rebinds it to a new tensor:
the buffer keeps its GPU memory, and after the move back the optimizer updates the buffer while
the module reads its own copy, so the weights silently stop training. Here every *storage* behind
the model is copied to host memory (when its contents matter) and resized to zero bytes; on reload
it is resized back and refilled. Every ``Parameter``, view, ``main_grad`` and DTensor keeps its
identity and aliasing; only ``data_ptr()`` changes.

What is collected, per model chunk (a module or a list of them):

* megatron DDP (``.buffers``, ``.expert_parallel_buffers``): ``param_data`` kept, ``grad_data``
  discarded (zeros on reload; megatron zeroes it at the start of every step anyway) unless
  ``keep_grads=True``;
* Megatron-FSDP (``.param_and_grad_buffer.parameter_groups``): weight, transpose-weight and main
  weight buffers kept, gradient buffers discarded;
* then every parameter's storage (parameters outside megatron's buffers, e.g. DDP without the
  distributed optimizer, plain modules) kept, and ``.grad``/``.main_grad`` discarded;
* with ``include_optimizer=True``: every tensor in the optimizer's ``param_groups`` and ``state``
  (main fp32 parameters, Adam moments, ...), for megatron's (chained) optimizers and plain torch
  ones, kept.

Storages shared by several of these are handled once (a storage that any owner must keep is
kept). Only storages on the model's device are touched (an optimizer's CPU-resident part stays).
While offloaded, the model refuses to run forward (a pre-hook raises); nothing else may touch its
tensors. Not covered: CUDA graphs or anything else that cached the old addresses, DeepEP's
communication buffers (allocated outside torch's allocator), NCCL-registered buffers (refused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_STATE_ATTR = "_megatron_patchset_offload"


class OffloadError(RuntimeError):
    """The model cannot be offloaded or reloaded in its present state."""


@dataclasses.dataclass
class _Entry:
    storage: torch.UntypedStorage
    nbytes: int
    keep: bool
    labels: list
    host: torch.Tensor | None = None


@dataclasses.dataclass
class OffloadState:
    """What :func:`offload` released; :func:`reload` consumes it."""

    entries: list
    device: torch.device
    include_optimizer: bool
    hooks: list = dataclasses.field(default_factory=list)

    @property
    def released_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def kept_bytes(self) -> int:
        """Bytes copied to host memory (the rest is discarded and zero-filled on reload)."""
        return sum(e.nbytes for e in self.entries if e.keep)

    def summary(self) -> dict:
        return {
            "storages": len(self.entries),
            "released_bytes": self.released_bytes,
            "kept_bytes": self.kept_bytes,
            "discarded_bytes": self.released_bytes - self.kept_bytes,
            "include_optimizer": self.include_optimizer,
        }


# ---------------------------------------------------------------------------------------------
# Collecting storages
# ---------------------------------------------------------------------------------------------


class _Collector:
    def __init__(self, device: torch.device):
        self.device = device
        self.entries: dict[tuple, _Entry] = {}

    def add(self, tensor: Any, keep: bool, label: str) -> None:
        if tensor is None or not isinstance(tensor, torch.Tensor):
            return
        local = getattr(tensor, "_local_tensor", None)  # DTensor -> its local shard
        if isinstance(local, torch.Tensor):
            tensor = local
        if tensor.device.type != self.device.type or tensor.is_meta:
            return
        if self.device.index is not None and tensor.device.index not in (None, self.device.index):
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:  # already released (e.g. a Megatron-FSDP bucket between uses)
            return
        key = (storage.device.type, storage.device.index, storage.data_ptr())
        entry = self.entries.get(key)
        if entry is None:
            if not storage.resizable():
                logger.warning("offload: %s has a non-resizable storage; left in place", label)
                return
            self.entries[key] = _Entry(storage, nbytes, keep, [label])
        else:
            entry.keep = entry.keep or keep
            entry.nbytes = max(entry.nbytes, nbytes)
            entry.labels.append(label)


def _chunks(model: Any) -> list:
    if isinstance(model, (list, tuple)):
        return list(model)
    return [model]


def _ddp_buffers(chunk: Any) -> list:
    buffers = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, (list, tuple)):
            buffers += [b for b in value if hasattr(b, "grad_data")]
    return buffers


def _fsdp_groups(chunk: Any) -> list:
    for owner in (chunk, getattr(chunk, "module", None)):
        pgb = getattr(owner, "param_and_grad_buffer", None)
        groups = getattr(pgb, "parameter_groups", None)
        if groups is not None:
            return list(groups)
    return []


_FSDP_KEEP = (
    "model_weight_buffer",
    "transpose_weight_buffer",
    "main_weight_buffer",
    "hfsdp_helper_wbuf",
    "hfsdp_helper_wtbuf",
)
_FSDP_GRADS = ("main_grad_buffer", "hfsdp_helper_gbuf")


def _collect_model(collector: _Collector, chunk: Any, index: int, keep_grads: bool) -> None:
    for b, buf in enumerate(_ddp_buffers(chunk)):
        if getattr(buf, "nccl_mem_pool", None) is not None:
            raise OffloadError(
                "offload: a DDP buffer is allocated from an NCCL memory pool (--nccl-ub); its "
                "registered storage cannot be released and restored"
            )
        collector.add(
            getattr(buf, "param_data", None), True, f"chunk{index}.ddp_buffer{b}.param_data"
        )
        collector.add(buf.grad_data, keep_grads, f"chunk{index}.ddp_buffer{b}.grad_data")
        for g, extra in enumerate(getattr(buf, "extra_main_grads", None) or []):
            collector.add(extra, keep_grads, f"chunk{index}.ddp_buffer{b}.extra_main_grad{g}")
    for g, group in enumerate(_fsdp_groups(chunk)):
        for name in _FSDP_KEEP + _FSDP_GRADS:
            buf = getattr(group, name, None)
            data = getattr(buf, "data", None) if buf is not None else None
            keep = name in _FSDP_KEEP or keep_grads
            collector.add(data, keep, f"chunk{index}.fsdp_group{g}.{name}")
    module = chunk if isinstance(chunk, torch.nn.Module) else None
    if module is None:
        raise OffloadError(
            f"offload: model chunk {index} is a {type(chunk).__name__}, not a torch module"
        )
    for name, param in module.named_parameters():
        collector.add(param, True, f"chunk{index}.{name}")
        # main_grad is a plain attribute (megatron DDP) - read it without triggering properties.
        attrs = vars(param) if hasattr(param, "__dict__") else {}
        collector.add(attrs.get("main_grad"), keep_grads, f"chunk{index}.{name}.main_grad")
        collector.add(param.grad, keep_grads, f"chunk{index}.{name}.grad")


def _torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    if optimizer is None:
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for inner in chained:
            yield from _torch_optimizers(inner)
        return
    inner = getattr(optimizer, "optimizer", None)  # megatron's MegatronOptimizer wrappers
    if inner is not None:
        yield from _torch_optimizers(inner)


def _collect_optimizer(collector: _Collector, optimizer: Any) -> None:
    for o, opt in enumerate(_torch_optimizers(optimizer)):
        for g, group in enumerate(opt.param_groups):
            for p, param in enumerate(group["params"]):
                collector.add(param, True, f"optimizer{o}.group{g}.param{p}")
        for s, state in enumerate(opt.state.values()):
            for key, value in state.items():
                collector.add(value, True, f"optimizer{o}.state{s}.{key}")


def _model_device(chunks: list) -> torch.device:
    for chunk in chunks:
        for param in chunk.parameters():
            local = getattr(param, "_local_tensor", None)
            return (local if isinstance(local, torch.Tensor) else param).device
    raise OffloadError("offload: the model has no parameters")


def _byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _refuse_forward(module, _inputs):
    raise OffloadError(
        "this model is offloaded (megatron.patchset.features.offload): call reload(model, ...) "
        "before running it"
    )


# ---------------------------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------------------------


def is_offloaded(model: Any) -> bool:
    return any(getattr(chunk, _STATE_ATTR, None) is not None for chunk in _chunks(model))


def offload(
    model: Any,
    optimizer: Any = None,
    include_optimizer: bool = False,
    *,
    keep_grads: bool = False,
    pin_memory: bool | None = None,
    empty_cache: bool = True,
) -> OffloadState:
    """Release the device memory of ``model``'s parameters and gradients (and, with
    ``include_optimizer``, of ``optimizer``'s parameters and state); parameters and optimizer state
    are copied to host memory first, gradients are discarded unless ``keep_grads``.

    ``model`` is a module or a list of model chunks (megatron DDP, Megatron-FSDP, ``Float16Module``
    or plain modules). Call it between training steps (gradients reduced, optimizer stepped).
    ``pin_memory`` (default: on for CUDA) pins the host copies. Returns the :class:`OffloadState`
    (also kept on the model for :func:`reload`).
    """
    chunks = _chunks(model)
    if is_offloaded(chunks):
        raise OffloadError("offload: the model is already offloaded; reload it first")
    if include_optimizer and optimizer is None:
        raise OffloadError("offload: include_optimizer=True needs the optimizer")
    device = _model_device(chunks)
    collector = _Collector(device)
    for i, chunk in enumerate(chunks):
        _collect_model(collector, chunk, i, keep_grads)
    if include_optimizer:
        _collect_optimizer(collector, optimizer)
    entries = list(collector.entries.values())
    pin = (device.type == "cuda") if pin_memory is None else pin_memory

    _synchronize(device)  # pending reduce-scatters / all-gathers / optimizer kernels
    for entry in entries:
        if entry.keep:
            entry.host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=pin)
            entry.host.copy_(_byte_view(entry.storage, entry.nbytes), non_blocking=pin)
    _synchronize(device)
    for entry in entries:
        entry.storage.resize_(0)
    if empty_cache and device.type == "cuda":
        torch.cuda.empty_cache()

    state = OffloadState(entries, device, include_optimizer)
    for chunk in chunks:
        state.hooks.append(chunk.register_forward_pre_hook(_refuse_forward))
        setattr(chunk, _STATE_ATTR, state)
    logger.info("offload: released %s", state.summary())
    return state


def reload(model: Any, optimizer: Any = None) -> OffloadState | None:
    """Restore what :func:`offload` released: the same storages, resized back and refilled
    (kept contents copied back, discarded gradients zeroed). Returns the state, or None (with a
    warning) when the model is not offloaded. ``optimizer`` is accepted for symmetry; what was
    offloaded with it is recorded in the state."""
    chunks = _chunks(model)
    states = {id(s): s for s in (getattr(c, _STATE_ATTR, None) for c in chunks) if s is not None}
    if not states:
        logger.warning("reload: the model is not offloaded; nothing to do")
        return None
    if len(states) > 1:
        raise OffloadError(
            "reload: the model chunks were offloaded separately; reload each of them"
        )
    (state,) = states.values()
    for entry in state.entries:
        entry.storage.resize_(entry.nbytes)
        view = _byte_view(entry.storage, entry.nbytes)
        if entry.keep:
            view.copy_(entry.host, non_blocking=entry.host.is_pinned())
        else:
            view.zero_()
    _synchronize(state.device)
    for entry in state.entries:
        entry.host = None
    for hook in state.hooks:
        hook.remove()
    for chunk in chunks:
        delattr(chunk, _STATE_ATTR)
    return state


@contextlib.contextmanager
def offloaded(
    model: Any, optimizer: Any = None, include_optimizer: bool = False, **kwargs
) -> Iterator[OffloadState]:
    """``offload`` on entry, ``reload`` on exit (also when the body raises)."""
    state = offload(model, optimizer, include_optimizer, **kwargs)
    try:
        yield state
    finally:
        reload(model, optimizer)


def storages(
    model: Any, optimizer: Any = None, include_optimizer: bool = False, keep_grads: bool = False
) -> list[tuple[int, bool, list]]:
    """(bytes, kept, owners) of every storage :func:`offload` would release (for inspection)."""
    chunks = _chunks(model)
    collector = _Collector(_model_device(chunks))
    for i, chunk in enumerate(chunks):
        _collect_model(collector, chunk, i, keep_grads)
    if include_optimizer:
        _collect_optimizer(collector, optimizer)
    return [(e.nbytes, e.keep, list(e.labels)) for e in collector.entries.values()]


__all__ = [
    "OffloadError",
    "OffloadState",
    "offload",
    "reload",
    "offloaded",
    "is_offloaded",
    "storages",
]
