"""Process-wide state of the static dispatch: the overflow flag on the device, and whether the
dispatchers run static (the normal case) or megatron's dynamic path (the re-run of a step that
overflowed)."""

from __future__ import annotations

import contextlib

ON_OVERFLOW = "rerun"
_static = True
_flags: dict = {}  # device -> bool tensor: some dispatch of this step did not fit


def static() -> bool:
    return _static


@contextlib.contextmanager
def dynamic():
    """Run megatron's dynamic all-to-all inside the block."""
    global _static
    _static = False
    try:
        yield
    finally:
        _static = True


def overflow_flag(device):
    """The step's overflow flag on ``device`` (allocated once, so a captured graph keeps it)."""
    import torch

    key = str(device)
    if key not in _flags:
        _flags[key] = torch.zeros((), dtype=torch.bool, device=device)
    return _flags[key]


def note_overflow(local) -> None:
    """OR a dispatch's overflow (a bool scalar tensor) into the step's flag, on the device."""
    overflow_flag(local.device).logical_or_(local)


def reset() -> None:
    for flag in _flags.values():
        flag.zero_()


def overflowed(group=None) -> bool:
    """Whether any rank's flag is set: one all-reduce (every rank takes part, with or without MoE
    layers) and one read on the host, after the step."""
    import torch

    if _flags:
        device = next(iter(_flags.values())).device
    else:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
    local = torch.zeros((), dtype=torch.int32, device=device)
    for flag in _flags.values():
        local = torch.maximum(local, flag.to(device=device, dtype=torch.int32))
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(local.item())
