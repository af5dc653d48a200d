"""Where every token row goes in the static all-to-all: index maps computed on the device from the
per-expert token counts, with shapes that depend only on the layout (no host synchronisation).

Notation: ``ep`` expert-parallel ranks, ``L`` local experts per rank, ``N = tokens x top-k`` rows
after megatron's first permutation (sorted by global expert, hence by destination rank), ``C`` the
per-peer capacity (:func:`capacity`). A rank sends ``ep`` fixed slots of ``C`` rows each; rows of a
peer beyond ``C`` do not fit (the overflow flag records that, and the step is re-run).

Every map is an index into a source tensor, with the value ``len(source)`` marking a padding row
(gathered as zeros). Each map comes with its inverse, so that both directions of autograd are
gathers (:mod:`.gather`): deterministic, no atomics.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def capacity(tokens: int, topk: int, ep: int, factor: float) -> int:
    """Rows one rank may send to one peer: ``ceil(factor x tokens x topk / ep)``, at most all
    ``tokens x topk`` rows (then nothing can overflow)."""
    rows = tokens * topk
    return max(1, min(rows, math.ceil(factor * rows / ep)))


def _exclusive_cumsum(t, dim: int):
    import torch

    return torch.cumsum(t, dim) - t


@dataclasses.dataclass
class SendPlan:
    """The sending side of one rank.

    Attributes:
        slot_rows: ``[ep * C]`` the permuted row each send slot takes (``N``: padding).
        row_slots: ``[N]`` the send slot of each permuted row (``ep * C``: it did not fit).
        kept: ``[ep, L]`` rows sent to each peer's local experts (what the peer receives).
        overflow: bool scalar tensor: some peer got more than ``C`` rows.
    """

    slot_rows: Any
    row_slots: Any
    kept: Any
    overflow: Any


def send_plan(counts, ep: int, cap: int, rows: int) -> SendPlan:
    """The send slots for this rank's per-expert row counts ``counts`` ``[ep * L]`` (global expert
    order) and ``rows`` permuted rows (``counts.sum()``, known on the host: tokens x top-k)."""
    import torch

    device = counts.device
    per_peer = counts.reshape(ep, -1).long()  # [ep, L]
    cum = torch.cumsum(per_peer, 1)  # rows for experts 0..l of each peer
    kept_cum = cum.clamp(max=cap)
    kept = kept_cum - torch.nn.functional.pad(kept_cum[:, :-1], (1, 0))
    peer_rows = cum[:, -1]  # [ep]
    peer_start = _exclusive_cumsum(peer_rows, 0)  # first permuted row of each peer
    sent = kept_cum[:, -1]

    j = torch.arange(cap, device=device)
    valid = j[None, :] < sent[:, None]  # [ep, C]
    slot_rows = torch.where(valid, peer_start[:, None] + j[None, :], rows).reshape(-1)

    p = torch.arange(rows, device=device)
    peer = torch.searchsorted(torch.cumsum(peer_rows, 0), p, right=True).clamp(max=ep - 1)
    within = p - peer_start[peer]
    row_slots = torch.where(within < cap, peer * cap + within, ep * cap)
    return SendPlan(slot_rows, row_slots, kept, (peer_rows > cap).any())


@dataclasses.dataclass
class ReceivePlan:
    """The receiving side: ``ep * C`` received slots (``C`` from each source rank, its valid rows
    first, ordered by local expert) and the expert-major layout the experts read.

    Attributes:
        expert_rows: ``[ep * C]`` the received slot of each expert-major row (``ep * C``:
            padding, after the last expert's rows).
        slot_expert_rows: ``[ep * C]`` the expert-major row of each received slot (``ep * C``:
            an empty slot).
        tokens_per_expert: ``[L]`` rows per local expert.
    """

    expert_rows: Any
    slot_expert_rows: Any
    tokens_per_expert: Any


def receive_plan(received, cap: int) -> ReceivePlan:
    """The layout for ``received`` ``[ep, L]``: rows each source sent to each local expert."""
    import torch

    device = received.device
    ep, experts = received.shape
    received = received.long()
    slots = ep * cap
    tokens_per_expert = received.sum(0)  # [L]
    total = tokens_per_expert.sum()
    # Start of (source s, expert l) in the received slots, and in the expert-major layout.
    recv_start = torch.arange(ep, device=device)[:, None] * cap + _exclusive_cumsum(received, 1)
    expert_start = _exclusive_cumsum(tokens_per_expert, 0)  # [L]
    out_start = expert_start[:, None] + _exclusive_cumsum(received.t(), 1)  # [L, ep]

    # Expert-major row i -> its group (l, s): groups are contiguous in (l, s) order.
    i = torch.arange(slots, device=device)
    group_end = (out_start + received.t()).reshape(-1)
    group = torch.searchsorted(group_end, i, right=True).clamp(max=experts * ep - 1)
    expert, source = group // ep, group % ep
    offset = i - out_start.reshape(-1)[group]
    expert_rows = torch.where(i < total, recv_start[source, expert] + offset, slots)

    # Received slot (s, j) -> its local expert l, then its expert-major row.
    j = torch.arange(cap, device=device).expand(ep, cap).contiguous()
    local = torch.searchsorted(torch.cumsum(received, 1), j, right=True).clamp(max=experts - 1)
    s = torch.arange(ep, device=device)[:, None].expand(ep, cap)
    within = j + s * cap - recv_start[s, local]
    valid = j < received.sum(1)[:, None]
    slot_expert_rows = torch.where(valid, out_start[local, s] + within, slots).reshape(-1)
    return ReceivePlan(expert_rows, slot_expert_rows, tokens_per_expert)
