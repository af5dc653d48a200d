"""Where the features' Triton kernels can run."""

from __future__ import annotations

import os


def triton_runs_on(device) -> bool:
    """Whether a Triton kernel runs on ``device``: a CUDA device with Triton installed (torch's CUDA
    builds ship it), or any device under Triton's interpreter (``TRITON_INTERPRET=1``, which the
    CPU tests use)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
