"""``record_function`` labels on megatron's MoE, attention and pipeline methods.

Installed from the first training iteration of a profiled run (before torch.compile traces
anything: replacing methods later would change what compiled layers guard on, a recompile), they
record only while the profiled iteration runs (:data:`RECORDING`). A label reads
``ps:<category>[/<detail>]:<layer>``; :mod:`~megatron.patchset.core.observe.trace_summary`
reduces a trace by them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

LABEL_PREFIX = "ps:"
STEP_LABEL = "ps:step"

# Table order and the names a Megatron MoE engineer knows them by.
CATEGORIES = {
    "attention": "attention (self-attention block)",
    "router": "router (gating, top-k, aux loss)",
    "dispatch": "token dispatch (preprocess, all-to-all, D2H splits)",
    "permutation": "permutation / unpermutation",
    "expert": "expert compute (grouped GEMM, split sizes)",
    "combine": "combine (all-to-all back, postprocess)",
    "p2p": "pipeline P2P send/recv (schedule)",
    "grad_sync": "gradient reduction (finalize_model_grads)",
    "optimizer": "optimizer step",
    "other": "other (embedding, norms, loss, schedule, untagged)",
}
MOE_CATEGORIES = ("router", "dispatch", "permutation", "expert", "combine")


def label(category: str, detail: str = "", layer: Any = None) -> str:
    name = category + (f"/{detail}" if detail else "")
    return f"{LABEL_PREFIX}{name}:{'' if layer is None else layer}"


def parse_label(name: str) -> tuple[str, str, int | None] | None:
    """(category, detail, layer) of a ``ps:`` label; None for other names and the step."""
    if not name.startswith(LABEL_PREFIX) or name == STEP_LABEL:
        return None
    body, _, layer = name[len(LABEL_PREFIX) :].rpartition(":")
    if not body:
        return None
    category, _, detail = body.partition("/")
    return category, detail, int(layer) if layer.lstrip("-").isdigit() else None


_current_layer: list = [None]


# True while the profiled iteration runs: the labels are installed from the first training
# iteration on (before torch.compile traces anything: replacing methods later would change
# what compiled layers guard on, a recompile), and record only while this is set.
RECORDING = [False]


def _labelled(original: Callable, category: str, detail: str, *, sets_layer: bool) -> Callable:
    """``original`` inside a ``record_function`` label while recording. Traced by dynamo (a
    compiled layer), it is just ``original``: no label, no guard on the recording state. A
    compile-disabled ``original`` (the compiled layers' eager MoE regions) gets a
    compile-disabled wrapper: the graph break moves out by one call, and the region is labelled
    in compiled runs too."""
    import torch

    @functools.wraps(original)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling() or not RECORDING[0]:
            return original(*args, **kwargs)
        owner = args[0] if args else None
        layer = getattr(owner, "layer_number", None) if sets_layer else _current_layer[-1]
        if sets_layer:
            _current_layer.append(layer)
        try:
            with torch.profiler.record_function(label(category, detail, layer)):
                return original(*args, **kwargs)
        finally:
            if sets_layer:
                _current_layer.pop()

    if getattr(original, "_torchdynamo_disable", False):
        # Dynamo would inline the wrapper (skipping the label) and break at ``original``.
        return torch.compiler.disable(run)
    return run


# (module, owner, attribute, category, detail, sets_layer): methods are wrapped on their class.
_METHOD_LABELS = (
    ("megatron.core.transformer.attention", "Attention", "forward", "attention", "", True),
    (
        "megatron.core.transformer.multi_latent_attention",
        "MultiLatentAttention",
        "forward",
        "attention",
        "mla",
        True,
    ),
    ("megatron.core.transformer.moe.moe_layer", "MoELayer", "route", "router", "", True),
    (
        "megatron.core.transformer.moe.moe_layer",
        "MoELayer",
        "preprocess",
        "dispatch",
        "preprocess",
        True,
    ),
    (
        "megatron.core.transformer.moe.moe_layer",
        "MoELayer",
        "dispatch",
        "dispatch",
        "all-to-all",
        True,
    ),
    (
        "megatron.core.transformer.moe.moe_layer",
        "MoELayer",
        "shared_experts_compute",
        "expert",
        "shared",
        True,
    ),
    (
        "megatron.core.transformer.moe.moe_layer",
        "MoELayer",
        "routed_experts_compute",
        "expert",
        "routed",
        True,
    ),
    (
        "megatron.core.transformer.moe.moe_layer",
        "MoELayer",
        "combine",
        "combine",
        "all-to-all",
        True,
    ),
    (
        "megatron.core.transformer.moe.moe_layer",
        "MoELayer",
        "postprocess",
        "combine",
        "postprocess",
        True,
    ),
    (
        "megatron.core.transformer.moe.token_dispatcher",
        None,
        "permute",
        "permutation",
        "permute",
        False,
    ),
    (
        "megatron.core.transformer.moe.token_dispatcher",
        None,
        "unpermute",
        "permutation",
        "unpermute",
        False,
    ),
    (
        "megatron.core.transformer.moe.token_dispatcher",
        None,
        "sort_chunks_by_idxs",
        "permutation",
        "sort_chunks",
        False,
    ),
) + tuple(
    # Pipeline send/receive by direction: what moves activations forward, what moves gradients
    # backward, and the two calls that do both at once.
    (
        "megatron.core.pipeline_parallel.p2p_communication",
        "P2PCommunicator",
        name,
        "p2p",
        direction,
        False,
    )
    for direction, names in (
        ("forward", ("recv_forward", "send_forward", "send_forward_recv_forward")),
        ("backward", ("recv_backward", "send_backward", "send_backward_recv_backward")),
        (
            "both",
            (
                "send_forward_recv_backward",
                "send_backward_recv_forward",
                "send_forward_backward_recv_forward_backward",
            ),
        ),
    )
    for name in names
)


class Labels:
    """Installs the ``record_function`` labels; :meth:`remove` puts every original back."""

    def __init__(self, optimizer: Any = None, config: Any = None):
        import importlib

        self._undo: list[Callable[[], None]] = []
        for module_name, owner_name, attr, category, detail, sets_layer in _METHOD_LABELS:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            owner = module if owner_name is None else getattr(module, owner_name, None)
            if owner is None or not hasattr(owner, attr):
                continue
            self._wrap(
                owner,
                attr,
                lambda f, c=category, d=detail, s=sets_layer: _labelled(f, c, d, sets_layer=s),
            )
        if optimizer is not None and hasattr(optimizer, "step"):
            self._wrap(optimizer, "step", lambda f: _labelled(f, "optimizer", "", sets_layer=False))
        if config is not None and getattr(config, "finalize_model_grads_func", None) is not None:
            self._wrap(
                config,
                "finalize_model_grads_func",
                lambda f: _labelled(f, "grad_sync", "", sets_layer=False),
            )

    def _wrap(self, owner: Any, attr: str, make: Callable[[Callable], Callable]) -> None:
        own = vars(owner) if hasattr(owner, "__dict__") else {}
        had_own = attr in own
        saved = own.get(attr) if had_own else None
        setattr(owner, attr, make(getattr(owner, attr)))

        def undo():
            if had_own:
                setattr(owner, attr, saved)
            else:
                delattr(owner, attr)

        self._undo.append(undo)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
