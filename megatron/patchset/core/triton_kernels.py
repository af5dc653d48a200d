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


def row_block(row_len: int) -> tuple[int, int]:
    """(rows, columns) of one program of a row kernel over rows of ``row_len`` elements: up to
    2048 columns, about 4096 elements per program."""
    import triton

    block = min(2048, triton.next_power_of_2(max(row_len, 1)))
    return max(1, 4096 // block), block
