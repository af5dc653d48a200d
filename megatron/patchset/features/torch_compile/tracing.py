"""Where the compiled layers are while dynamo traces them: the state the traceable substitutes
read. ``compile_layer``'s wrapper sets it around each compiled-layer call, outside the traced code,
so traced code only reads (and dynamo guards on) it."""

from __future__ import annotations

import functools

# True while a compiled TransformerLayer runs (set by compile_layer's wrapper, outside the
# traced code): other torch.compile'd code (upstream's own compiled helpers) keeps TE's path.
IN_COMPILED_LAYER = [False]


def tracing() -> bool:
    """Dynamo is tracing one of the compiled TransformerLayers."""
    import torch

    return torch.compiler.is_compiling() and IN_COMPILED_LAYER[0]


# The top-k of the compiled layer running now when its dispatcher qualifies for the gathered
# permutation (see permutation.permutation_topk), else None.
PERMUTE_TOPK: list = [None]

# Whether TE's state around the current compiled-layer call is plain (no FP8 autocast, no CPU
# offload): read by compile_layer's wrapper before each call, outside the traced code, so that
# the traced code only reads (and dynamo guards on) this flag.
TE_CONTEXT_PLAIN = [True]


@functools.lru_cache(maxsize=1)
def _te_context_checks() -> tuple:
    try:
        from transformer_engine.pytorch.cpu_offload import is_cpu_offload_enabled
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        return ()
    return FP8GlobalStateManager.is_fp8_enabled, is_cpu_offload_enabled


def te_context_plain() -> bool:
    """No FP8/FP4 autocast entered and no TE CPU offloading active (True without TE)."""
    return not any(check() for check in _te_context_checks())
