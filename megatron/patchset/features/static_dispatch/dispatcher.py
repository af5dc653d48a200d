"""The all-to-all token dispatcher with static shapes (``--moe-static-dispatch``).

A subclass of megatron's ``MoEAlltoAllTokenDispatcher`` that keeps its stages and replaces what
needs the host:

* ``preprocess``: the per-expert counts stay on the device; the rows each peer's experts will get
  (clipped to the per-peer capacity ``C``) are exchanged with one fixed-size ``all_to_all_single``
  of ``[EP, local experts]`` integers, and the index maps of :mod:`.plan` are computed there.
* ``dispatch_preprocess``: megatron's permutation (static ``tokens x top-k`` rows), then a gather
  into ``EP x C`` send slots. ``token_dispatch`` / ``token_combine`` are megatron's own, with
  equal splits (no host split sizes).
* ``dispatch_postprocess``: a gather from the received slots into expert-major order (what the
  chunk sort does upstream); the experts get the counts as :class:`DeviceSplits` marked padded
  (rows after the last expert's are zeros, and the grouped GEMMs keep them zero).
* ``combine_preprocess`` / ``combine_postprocess``: the inverse gathers, then megatron's unpermute.

With ``--moe-static-dispatch-dedup`` the exchange moves one row per (token, peer) instead of one per
(token, expert): ``preprocess`` exchanges, beside nothing else, the ``[slots, local experts]``
routing map of the tokens each peer will get; ``dispatch_preprocess`` gathers the tokens and their
probabilities into the slots (megatron's permutation is not needed); ``dispatch_postprocess``
fans each received token out to its local experts' rows, ``combine_preprocess`` sums those rows
back into the token's slot, and ``combine_postprocess`` sums each token's rows from its peers
(megatron's unpermutation is not needed). See the ``token_*`` plans of :mod:`.plan`.

Rows that do not fit set the step's overflow flag (:mod:`.state`) and reach no expert; the step
runner (:mod:`.runner`) re-runs such a step through megatron's own path, which this class takes
whenever :func:`state.static` is False.
"""

from __future__ import annotations

from megatron.patchset.core.registry import patch
from megatron.patchset.features.static_dispatch import flags, plan, state
from megatron.patchset.features.static_dispatch.gather import gather_expand, gather_rows, gather_sum

_MOE_LAYER = "megatron.core.transformer.moe.moe_layer"


_announced = False


def announce_dedup(slots: int, rows: int, factor: float) -> None:
    """One line on rank 0, at the first dispatch with one row per token and peer."""
    import torch

    global _announced
    if _announced:
        return
    _announced = True
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(
            f"megatron-patchset: MoE all-to-all with one row per token and peer "
            f"({flags.DEDUP_FLAG}): {slots} token slots per peer and room for {rows} expert rows "
            f"per rank (capacity factor {factor:g})",
            flush=True,
        )


def exchange_counts(kept, group, size: int):
    """``received[s]``: what source rank ``s`` sends to this rank (``kept`` ``[ep, ...]``, one
    equal part per peer): the rows per local expert, or the local routing map of each slot."""
    import torch

    if size == 1:
        return kept
    received = torch.empty_like(kept)
    torch.distributed.all_to_all_single(received, kept.contiguous(), group=group)
    return received


def _weights_descending(linear) -> bool | None:
    """Whether a grouped linear's expert weights lie back to back from the last to the first
    (None: not a grouped linear)."""
    from megatron.patchset.features.grouped_mm.torch_grouped_gemm import stacked_view

    count = getattr(linear, "num_gemms", None)
    if not count or count < 2:
        return None
    weights = [linear._parameters.get(f"weight{i}") for i in range(count)]
    if any(w is None for w in weights):
        return None
    found = stacked_view(weights)
    return found is not None and found[1]


def orient_experts(model) -> None:
    """Before a model's first step: every static dispatcher whose layer's expert weights lie in
    descending order (megatron's DDP buffers under the distributed optimizer hold them so) lays
    its rows out in that order too, so that the grouped GEMMs read the weights in place (one row
    per token and peer). Each expert's rows and every sum keep their order: the results are the
    same to the bit. Checked once per model chunk."""
    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        if chunk is None or getattr(chunk, "_patchset_experts_oriented", False):
            continue
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            experts = getattr(module, "experts", None)
            if experts is None or not hasattr(dispatcher, "experts_descending"):
                continue
            orders = [
                _weights_descending(getattr(experts, name, None))
                for name in ("linear_fc1", "linear_fc2")
            ]
            dispatcher.experts_descending = all(orders)
        chunk._patchset_experts_oriented = True


@patch(
    "static_dispatch.dispatcher",
    f"{_MOE_LAYER}.MoEAlltoAllTokenDispatcher",
    reason="megatron's all-to-all dispatcher copies the per-rank token counts to the host and "
    "waits, for all_to_all_single's split sizes; exchange the counts on the device and move rows "
    "in fixed-size slots instead, so that a full-iteration CUDA graph captures the MoE layers at "
    "EP >= 2",
)
def static_dispatcher(original: type) -> type:
    """``original`` (megatron's MoEAlltoAllTokenDispatcher) with the static path."""

    class StaticAlltoAllTokenDispatcher(original):
        __doc__ = (original.__doc__ or "") + "\n    With static shapes: see " + __name__ + "."
        _exchange = None  # (SendPlan, ReceivePlan) of the current static dispatch
        # Lay the experts' rows out from the last local expert to the first (one row per token
        # and peer): set by orient_experts where the layer's expert weights lie so in memory.
        experts_descending = False

        def _static(self) -> bool:
            return (
                bool(getattr(self.config, flags.CONFIG_ON, False))
                and state.static()
                and not self.drop_and_pad
            )

        def _dedup(self) -> bool:
            return bool(getattr(self.config, flags.CONFIG_DEDUP, False))

        def preprocess(self, routing_map):
            self._exchange = None
            if not self._static():
                return super().preprocess(routing_map)
            if self.tp_size != 1:
                raise RuntimeError(
                    f"{flags.FLAG} needs expert tensor parallel size 1; this layer has "
                    f"{self.tp_size}"
                )
            if self._dedup():
                return self._token_preprocess(routing_map)
            tokens, topk = routing_map.size(0), self.config.moe_router_topk
            rows = tokens * topk
            factor = getattr(self.config, flags.CONFIG_FACTOR, flags.DEFAULT_FACTOR)
            cap = plan.capacity(tokens, topk, self.ep_size, factor)
            send = plan.send_plan(routing_map.sum(0), self.ep_size, cap, rows)
            received = plan.receive_plan(
                exchange_counts(send.kept, self.ep_group, self.ep_size), cap
            )
            state.note_overflow(send.overflow)
            self.num_out_tokens = rows
            # equal splits for megatron's all_to_all (a dynamic step before may have set them)
            self.input_splits = self.output_splits = self.output_splits_tp = None
            self._exchange = (send, received)
            return received.tokens_per_expert

        def _token_preprocess(self, routing_map):
            """One row per (token, peer): the send and receive plans, and the exchange of the
            local routing map of every slot."""
            import torch

            tokens, topk = routing_map.size(0), self.config.moe_router_topk
            factor = getattr(self.config, flags.CONFIG_FACTOR, flags.DEFAULT_FACTOR)
            experts, local = routing_map.size(1), self.num_local_experts
            cap = plan.token_capacity(tokens, topk, experts, self.ep_size, factor)
            send = plan.token_send_plan(routing_map, self.ep_size, cap)
            pairs = routing_map.reshape(tokens * self.ep_size, local).to(torch.uint8)
            slot_maps = gather_rows(pairs, send.slot_pairs, send.pair_slots)  # [S, L]
            local_map = exchange_counts(slot_maps, self.ep_group, self.ep_size)
            rows = plan.expert_rows(tokens, topk, self.ep_size, factor)
            received = plan.token_receive_plan(
                local_map.bool(), rows, topk, descending=self.experts_descending
            )
            state.note_overflow(send.overflow | received.overflow)
            announce_dedup(cap, rows, factor)
            self.num_out_tokens = tokens * topk
            self.input_splits = self.output_splits = self.output_splits_tp = None
            self._exchange = (send, received)
            return received.tokens_per_expert

        def _token_dispatch_preprocess(self, hidden_states, routing_map, probs):
            """megatron's bookkeeping of ``dispatch_preprocess``, then each token and its
            probabilities gathered into its peers' slots."""
            # (--moe-router-padding-for-quantization: refused by moe-static-dispatch-requirements)
            self.hidden_shape = hidden_states.shape
            self.probs = probs
            self.routing_map = routing_map
            hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
            self.tokens_per_expert = self.preprocess(routing_map)
            if self.shared_experts is not None:
                self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
            self.hidden_shape_before_permute = hidden_states.shape
            send = self._exchange[0]
            tokens = hidden_states.size(0)
            pair_probs = probs.reshape(tokens * self.ep_size, self.num_local_experts)
            return (
                gather_expand(hidden_states, send.slot_tokens, send.token_slots),
                gather_rows(pair_probs, send.slot_pairs, send.pair_slots),
            )

        def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
            if self._exchange is not None:
                return tokens_per_expert
            # megatron's own host copy and wait (the dynamic path; also under the device-splits
            # patch, which refuses EP >= 2)
            upstream = original._maybe_dtoh_and_synchronize
            upstream = getattr(upstream, "__wrapped__", upstream)
            return upstream(self, point, tokens_per_expert)

        def dispatch_preprocess(self, hidden_states, routing_map, probs):
            if self._static() and self._dedup():
                return self._token_dispatch_preprocess(hidden_states, routing_map, probs)
            tokens, probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
            if self._exchange is None:
                return tokens, probs
            send = self._exchange[0]
            return (
                gather_rows(tokens, send.slot_rows, send.row_slots),
                gather_rows(probs, send.slot_rows, send.row_slots),
            )

        def dispatch_postprocess(self, global_input_tokens, global_probs):
            if self._exchange is None:
                return super().dispatch_postprocess(global_input_tokens, global_probs)
            from megatron.patchset.features.grouped_mm.linears import DeviceSplits

            received = self._exchange[1]
            if self._dedup():
                pairs = global_probs.reshape(-1)
                return (
                    gather_expand(global_input_tokens, received.expert_slots, received.slot_rows),
                    DeviceSplits(
                        received.tokens_per_expert, padded=True, descending=received.descending
                    ),
                    gather_rows(pairs, received.expert_pairs, received.pair_rows),
                )
            rows, slots = received.expert_rows, received.slot_expert_rows
            return (
                gather_rows(global_input_tokens, rows, slots),
                DeviceSplits(received.tokens_per_expert, padded=True),
                gather_rows(global_probs, rows, slots),
            )

        def combine_preprocess(self, hidden_states):
            if self._exchange is None:
                return super().combine_preprocess(hidden_states)
            received = self._exchange[1]
            if self._dedup():
                return gather_sum(hidden_states, received.slot_rows, received.expert_slots)
            return gather_rows(hidden_states, received.slot_expert_rows, received.expert_rows)

        def combine_postprocess(self, permutated_local_input_tokens):
            if self._exchange is not None and self._dedup():
                send = self._exchange[0]
                rows = permutated_local_input_tokens
                output = gather_sum(rows, send.token_slots, send.slot_tokens)
                output = output.view(self.hidden_shape)
                if self.shared_experts is not None:
                    output = output + self.shared_experts.get_output()
                return output
            if self._exchange is not None:
                send = self._exchange[0]
                permutated_local_input_tokens = gather_rows(
                    permutated_local_input_tokens, send.row_slots, send.slot_rows
                )
            return super().combine_postprocess(permutated_local_input_tokens)

    StaticAlltoAllTokenDispatcher.__module__ = __name__
    StaticAlltoAllTokenDispatcher.__qualname__ = "StaticAlltoAllTokenDispatcher"
    return StaticAlltoAllTokenDispatcher
