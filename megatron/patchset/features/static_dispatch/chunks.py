"""MoE layers in token chunks whose all-to-alls overlap the experts of another chunk
(``--moe-static-dispatch-chunks N``).

megatron's MoE layer runs router, dispatch all-to-all, experts and combine all-to-all one after
the other: while the all-to-all moves a layer's rows the GPU computes nothing. Here the layer
routes all its tokens at once (the router, its auxiliary loss and its metrics see the same tokens
as megatron's), then splits them along the sequence into ``N`` chunks, each with a dispatcher of
its own (a shallow copy: the dispatcher keeps per-call state), and runs

* the permutation of every chunk, on the current stream;
* the dispatch all-to-alls of chunks 0 ... N-1, then their combine all-to-alls, on a side stream;
* each chunk's experts on the current stream once its dispatch has arrived; each combine waits
  for its chunk's experts.

So while the experts compute chunk ``k``, the side stream moves the rows of the chunks after it
(dispatch) or before it (combine); only the first dispatch and the last combine wait for the
network. In the backward pass autograd issues every combine gradient first, then each chunk's
experts and right after them its dispatch gradient: the combine gradients of the earlier chunks
and the dispatch gradients of the later ones overlap the experts' backward. A CUDA graph
captures the two streams as parallel branches; on the CPU both are the host, in the same order.

For autograd each all-to-all is one node of the current stream (:func:`functions`); the node
runs it on the side stream and the identities around it carry the event waits. So the engine
moves no tensor between streams: where it does, it calls ``record_stream``, and the caching
allocator then keeps every such block until a CUDA graph capture ends (with the crossings left
to autograd, capturing the full-iteration graph of a 48-layer model at 8 micro-batches ran out
of device memory on one H200). Tensors read across streams
stay referenced until the reading stream's work is waited for.

Every token's rows meet the same expert weights as without chunks; what differs is the order in
which the expert weight gradients are summed (chunk by chunk) and the capacity, which applies per
chunk (``ceil(F x tokens / N x top-k / EP)`` rows per peer).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch
from megatron.patchset.features.static_dispatch import flags, state

_MOE_LAYER = "megatron.core.transformer.moe.moe_layer.MoELayer"
_STAGES = ("route", "expert_compute", "postprocess")
_side_streams: dict = {}  # device index -> the all-to-all stream
_announced: set = set()


def announce(chunks: int, tokens: int, side: bool) -> None:
    """One line on rank 0, at the first chunked forward."""
    import torch

    if chunks in _announced:
        return
    _announced.add(chunks)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        where = "on a side stream beside the experts" if side else "in program order (no GPU)"
        print(
            f"megatron-patchset: MoE layers run in {chunks} token chunks of {tokens} tokens per "
            f"sequence, their all-to-alls {where} ({flags.CHUNKS_FLAG} {chunks})",
            flush=True,
        )
        if side and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            print(
                "megatron-patchset: warning: CUDA_DEVICE_MAX_CONNECTIONS=1 gives both streams "
                "one hardware queue, so the chunks' all-to-alls wait for the experts instead of "
                f"overlapping them; {flags.CHUNKS_FLAG} needs more queues (export "
                "CUDA_DEVICE_MAX_CONNECTIONS=32, as the small_batch recipe does with A2A_CHUNKS)",
                flush=True,
            )


def side_stream(device):
    """The stream the chunks' all-to-alls run on (one per GPU, made once); None off the GPU."""
    import torch

    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


class Streams:
    """The current stream (experts) and the side stream (all-to-alls), with the events between
    them; every method is a no-op on the CPU."""

    def __init__(self, device):
        import torch

        self.side = side_stream(device)
        self.main = torch.cuda.current_stream(device) if self.side is not None else None

    def mark(self, on_side: bool = False):
        """An event at the current end of one stream's work."""
        if self.side is None:
            return None
        return (self.side if on_side else self.main).record_event()

    @contextlib.contextmanager
    def on_side(self, after=None):
        """Run the block on the side stream, after ``after`` (an event of :meth:`mark`)."""
        if self.side is None:
            yield
            return
        import torch

        if after is not None:
            self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            yield

    def main_waits(self, event) -> None:
        if self.side is not None and event is not None:
            self.main.wait_event(event)


@contextlib.contextmanager
def using(layer, dispatcher):
    """``layer``'s stages call ``dispatcher`` inside the block."""
    own = layer.token_dispatcher
    layer.token_dispatcher = dispatcher
    try:
        yield
    finally:
        layer.token_dispatcher = own


def chunk_dispatchers(layer, chunks: int) -> list:
    """One dispatcher per chunk: shallow copies of the layer's, made once per chunk count."""
    held = getattr(layer, "_patchset_chunk_dispatchers", None)
    if held is None or len(held) != chunks or held[0].__class__ is not type(layer.token_dispatcher):
        held = [copy.copy(layer.token_dispatcher) for _ in range(chunks)]
        layer._patchset_chunk_dispatchers = held
    return held


class Link:
    """One all-to-all of one chunk: the side-stream event its consumers wait for, and the
    gradients it reads in the backward pass, held until the current stream has waited for it."""

    __slots__ = ("done", "held")

    def __init__(self):
        self.done = None
        self.held = None


def _exchange_function():
    import torch

    class Exchange(torch.autograd.Function):
        """An all-to-all stage (``stage``: the layer's dispatch or combine) on the side stream.

        For autograd it is a node of the current stream, so the engine moves no tensor between
        streams (its cross-stream ``record_stream`` would hold every such block until a CUDA
        graph capture ends); the stream crossings are :class:`Before` and :class:`After`. The
        backward pass runs the same stage on the gradients (the static all-to-all has equal
        splits, so it is its own transpose), after what the current stream has issued."""

        @staticmethod
        def forward(ctx, link, streams, stage, after, *tensors):
            ctx.link, ctx.streams, ctx.stage = link, streams, stage
            with streams.on_side(after=after), torch.no_grad():
                outputs = tuple(stage(*tensors))
            link.done = streams.mark(on_side=True)
            ctx.shapes = [(o.shape, o.dtype, o.device) for o in outputs]
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            link, streams = ctx.link, ctx.streams
            grads = tuple(
                torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                for g, (shape, dtype, device) in zip(grads, ctx.shapes)
            )
            with streams.on_side(after=streams.mark()), torch.no_grad():
                inputs = tuple(ctx.stage(*grads))
            link.done = streams.mark(on_side=True)
            link.held = grads  # read on the side stream: kept until Before's backward
            return (None, None, None, None, *inputs)

    class Before(torch.autograd.Function):
        """Identity before an all-to-all; backward: the current stream waits for that
        all-to-all's backward, whose results it passes on."""

        @staticmethod
        def forward(ctx, link, streams, *tensors):
            ctx.link, ctx.streams = link, streams
            return tuple(t.view_as(t) for t in tensors)

        @staticmethod
        def backward(ctx, *grads):
            ctx.streams.main_waits(ctx.link.done)
            ctx.link.held = None
            return (None, None, *grads)

    class After(torch.autograd.Function):
        """Identity after an all-to-all: the current stream waits for it; backward: identity."""

        @staticmethod
        def forward(ctx, link, streams, *tensors):
            streams.main_waits(link.done)
            return tuple(t.view_as(t) for t in tensors)

        @staticmethod
        def backward(ctx, *grads):
            return (None, None, *grads)

    return Exchange, Before, After


@functools.cache
def functions():
    return _exchange_function()


def chunked_forward(layer, hidden_states, padding_mask, chunks: int):
    """megatron's MoE layer forward (route, dispatch, experts, combine, postprocess) in ``chunks``
    sequence chunks, the all-to-alls on the side stream. Returns ``(output, None)``.

    Issue order: the permutation of every chunk; then per chunk its dispatch (side stream, after
    the permutations) and its experts (once that dispatch has arrived); then the combines (each
    after its chunk's experts). The side stream thus runs dispatch 0 ... N-1, then combine
    0 ... N-1. The order also sets autograd's: the backward pass issues every combine gradient
    first, then each chunk's experts and, right after them, its dispatch gradient."""
    import torch

    seq = hidden_states.size(0)
    if seq % chunks:
        raise PatchsetError(
            f"{flags.CHUNKS_FLAG} {chunks}: this MoE layer gets {seq} tokens per sequence, not a "
            f"multiple of {chunks}; choose a chunk count that divides it"
        )
    if padding_mask is not None:
        padding_mask = padding_mask.transpose(0, 1).bool()
    shared = layer.shared_experts_compute(hidden_states)
    probs, routing_map = layer.route(hidden_states, padding_mask)
    step, rows = seq // chunks, routing_map.size(0) // chunks  # rows are [seq, batch] flattened
    dispatchers = chunk_dispatchers(layer, chunks)
    streams = Streams(hidden_states.device)
    announce(chunks, step, streams.side is not None)
    exchange_fn, before, after = functions()

    def stage(dispatcher, method):
        def run(*tensors):
            with using(layer, dispatcher):
                out = getattr(layer, method)(*tensors)
            return out if isinstance(out, tuple) else (out,)

        return run

    # Every tensor one stream reads from the other stays referenced until this function returns,
    # after the current stream has waited for every all-to-all (After): the caching allocator
    # cannot give its block to the other stream while it is still being read.
    links = [Link() for _ in range(chunks)]
    inputs = []
    for k, dispatcher in enumerate(dispatchers):
        part = slice(k * rows, (k + 1) * rows)
        with using(layer, dispatcher):
            permuted = layer.preprocess(
                hidden_states[k * step : (k + 1) * step], probs[part], routing_map[part]
            )
        inputs.append(before.apply(links[k], streams, *permuted))
    permuted_all = streams.mark()

    arrived, outputs = [], []
    for k, dispatcher in enumerate(dispatchers):
        out = exchange_fn.apply(
            links[k], streams, stage(dispatcher, "dispatch"), permuted_all, *inputs[k]
        )
        arrived.append(after.apply(links[k], streams, *out))
        with using(layer, dispatcher):
            output, bias = layer.routed_experts_compute(*arrived[k])
        if bias is not None:
            raise PatchsetError(f"{flags.CHUNKS_FLAG}: the experts return a bias; drop the flag")
        link = Link()
        (output,) = before.apply(link, streams, output)
        outputs.append((link, output, streams.mark()))

    combined, results = [], []
    for (link, output, computed), dispatcher in zip(outputs, dispatchers):
        out = exchange_fn.apply(link, streams, stage(dispatcher, "combine"), computed, output)
        combined.append(after.apply(link, streams, *out)[0])
    for k, dispatcher in enumerate(dispatchers):
        part = None if shared is None else shared[k * step : (k + 1) * step]
        with using(layer, dispatcher):
            results.append(layer.postprocess(combined[k], part))
    return torch.cat(results, dim=0), None


def applies(layer, intermediate_tensors) -> int:
    """The chunk count for this call of ``layer``'s forward; 1 where megatron's own forward runs
    (no chunks asked, the dynamic re-run of an overflowed step, a forward split into stages by a
    schedule or a per-layer graph, the MoE layer recomputed as a whole, inference)."""
    config = layer.config
    chunks = int(getattr(config, flags.CONFIG_CHUNKS, 1) or 1)
    if chunks <= 1 or not getattr(config, flags.CONFIG_ON, False) or not state.static():
        return 1
    if intermediate_tensors is not None or list(layer.fwd_execution_map) != list(_STAGES):
        return 1
    if getattr(layer, "moe_layer_recompute", False) and layer.training:
        return 1
    if hasattr(layer, "_inference_token_dispatcher"):
        return 1
    return chunks


@patch(
    "static_dispatch.chunks",
    f"{_MOE_LAYER}.forward",
    reason="megatron's MoE layer waits for each all-to-all with nothing to compute; with "
    "--moe-static-dispatch-chunks N it routes all tokens, then runs N sequence chunks whose "
    "all-to-alls (on a side stream) overlap the experts of another chunk",
    flags=(flags.CHUNKS_FLAG,),
    enabled=lambda args: flags.requested(args) and flags.chunks(args) > 1,
)
def _chunked(original):
    @functools.wraps(original)
    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        chunks = applies(self, intermediate_tensors)
        if chunks == 1:
            return original(self, hidden_states, intermediate_tensors, padding_mask)
        return chunked_forward(self, hidden_states, padding_mask, chunks)

    return forward
