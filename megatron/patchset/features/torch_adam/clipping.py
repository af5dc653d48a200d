"""Gradient clipping inside torch's fused Adam kernel (``--adam-impl torch`` with ``--clip-grad``).

megatron-core clips by the total norm in a pass of its own: ``clip_grad_by_total_norm_fp32`` scales
every fp32 main gradient by ``min(1, clip / (norm + 1e-6))`` in place before Adam reads them (a read
and a write of all gradients: 8.2 ms per step on the reference config's 3.74 B parameters, one
H200). torch's fused Adam divides each gradient by the optimizer's ``grad_scale`` tensor as it
reads it (the hook ``torch.amp.GradScaler`` uses), so the same clip costs nothing extra when
``grad_scale`` holds ``max(1, (norm + 1e-6) / clip)``: a 0-d tensor on the device, computed from
the norm without a device-to-host copy, so it is captured with the rest of the step under
``--optimizer-cuda-graph``.

The patch rebinds the name megatron's optimizers call (``megatron.core.optimizer.optimizer``'s
``clip_grad_by_total_norm_fp32``, which both the single and the chained optimizer use). It takes
the fused path only when the parameters it is given are exactly the parameters of one or more
optimizers built by :func:`~megatron.patchset.features.torch_adam.optimizer.build_adam`; any other
set (a separate grad-norm group that splits an optimizer, decoupled gradients, another optimizer)
goes to megatron's own function unchanged. The optimizer drops ``grad_scale`` after each step, so a
step that did not clip never reads a stale one.
"""

from __future__ import annotations

import weakref
from typing import Any

from megatron.patchset.core.registry import patch

_fused_optimizers: weakref.WeakSet = weakref.WeakSet()


def register(optimizer: Any) -> None:
    """Let :func:`clip_into_adam` hand ``optimizer`` its clipping (called by ``build_adam``)."""
    _fused_optimizers.add(optimizer)


def registered(optimizer: Any) -> bool:
    """Whether ``optimizer`` was built by ``build_adam`` (``--adam-impl torch`` or ``triton``)."""
    return optimizer is not None and optimizer in _fused_optimizers


def owners(parameters) -> list | None:
    """The registered optimizers whose parameters are exactly ``parameters`` (together), or None
    when ``parameters`` holds anything else or only part of an optimizer's parameters."""
    ids = {id(p) for p in parameters}
    if not ids:
        return None
    found, covered = [], set()
    for optimizer in list(_fused_optimizers):
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not own & ids:
            continue
        if not own <= ids:
            return None
        found.append(optimizer)
        covered |= own
    return found if covered == ids else None


def clip_scale(max_norm: float, total_norm, device):
    """``max(1, (total_norm + 1e-6) / max_norm)`` as a 0-d fp32 tensor on ``device``; dividing a
    gradient by it is megatron's ``grad * min(1, max_norm / (total_norm + 1e-6))``."""
    import torch

    if isinstance(total_norm, torch.Tensor):
        norm = total_norm.reshape(()).to(device=device, dtype=torch.float32)
        return torch.clamp_min((norm + 1.0e-6) / max_norm, 1.0)
    return torch.tensor(max(1.0, (float(total_norm) + 1.0e-6) / max_norm), device=device)


def clip_into_adam(original):
    """The replacement of ``clip_grad_by_total_norm_fp32``: same arguments, same effect on the
    update; the scale is left to the fused Adam step when :func:`owners` finds its optimizers."""

    def clip_grad_by_total_norm_fp32(
        parameters, max_norm, total_norm, use_decoupled_grad: bool = False
    ):
        params = [parameters] if not isinstance(parameters, (list, tuple)) else list(parameters)
        optimizers = None if use_decoupled_grad else owners(params)
        if optimizers is None:
            return original(parameters, max_norm, total_norm, use_decoupled_grad=use_decoupled_grad)
        for optimizer in optimizers:
            # the first group may hold no parameter on this rank (megatron's distributed
            # optimizer keeps a rank's empty groups); owners() found one in some group
            device = next(p for g in optimizer.param_groups for p in g["params"]).device
            optimizer.grad_scale = clip_scale(max_norm, total_norm, device)
        return None

    return clip_grad_by_total_norm_fp32


@patch(
    "torch_adam.clip",
    "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
    reason="megatron-core scales all fp32 main gradients in a pass of their own before Adam; "
    "torch's fused Adam applies the same scale as it reads them (its grad_scale), one pass fewer "
    "per step",
)
def torch_adam_clip(original):
    return clip_into_adam(original)
