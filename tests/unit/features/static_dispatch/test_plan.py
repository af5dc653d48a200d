"""The static exchange's index maps, for every rank of a simulated expert-parallel group: rows
land where megatron's dynamic all-to-all puts them, overflow is flagged and never reaches an
expert, and each map's inverse undoes it."""

import random

import pytest
import torch

from megatron.patchset.features.static_dispatch import plan
from megatron.patchset.features.static_dispatch.gather import gather_rows


def simulate(counts_per_rank, ep, cap):
    """Send and receive plans of every rank; ``counts_per_rank[r]`` is rank r's [ep * L] counts."""
    sends = [plan.send_plan(c, ep, cap, int(c.sum())) for c in counts_per_rank]
    received = [torch.stack([sends[s].kept[r] for s in range(ep)]) for r in range(ep)]
    return sends, [plan.receive_plan(received[r], cap) for r in range(ep)]


def reference_layout(counts_per_rank, ep, cap):
    """What each rank's experts get, in megatron's order (expert, then source rank, then row),
    as (source rank, permuted row) pairs; rows past a peer's capacity are dropped."""
    experts = counts_per_rank[0].numel() // ep
    layout = [[] for _ in range(ep)]
    for dest in range(ep):
        for local in range(experts):
            for source, counts in enumerate(counts_per_rank):
                per_peer = counts.reshape(ep, experts).tolist()
                start = sum(sum(p) for p in per_peer[:dest])
                before = sum(per_peer[dest][:local])
                for j in range(per_peer[dest][local]):
                    if before + j < cap:
                        layout[dest].append((source, start + before + j))
    return layout


def routed_counts(ep, experts, rows, seed, skew=None):
    gen = random.Random(seed)
    out = []
    for _ in range(ep):
        weights = skew or [gen.random() for _ in range(ep * experts)]
        c = [0] * (ep * experts)
        for _ in range(rows):
            c[gen.choices(range(ep * experts), weights)[0]] += 1
        out.append(torch.tensor(c))
    return out


CASES = {
    "uneven": dict(ep=2, experts=3, rows=20, skew=None),
    "one rank receives nothing": dict(ep=2, experts=2, rows=12, skew=[1, 1, 0, 0]),
    "four ranks, empty experts": dict(ep=4, experts=2, rows=16, skew=[3, 0, 1, 0, 0, 0, 2, 1]),
    "all experts local": dict(ep=1, experts=5, rows=14, skew=None),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("factor", [1.0, 1.5, 100.0])
def test_rows_land_where_the_dynamic_all_to_all_puts_them(name, factor):
    case = CASES[name]
    ep, rows = case["ep"], case["rows"]
    counts = routed_counts(ep, case["experts"], rows, seed=7, skew=case["skew"])
    cap = plan.capacity(rows, 1, ep, factor)
    sends, receives = simulate(counts, ep, cap)
    # every permuted row carries its (rank, row) identity through send -> all_to_all -> sort
    payload = [torch.stack([torch.full((rows,), r), torch.arange(rows)], 1) for r in range(ep)]
    slots = [gather_rows(payload[r], sends[r].slot_rows, sends[r].row_slots) for r in range(ep)]
    for r in range(ep):  # padding slots are zeros; a slot with data holds a row of this rank
        sent = slots[r].reshape(ep, cap, 2)
        assert all(int(v) in (0, r) for v in sent[..., 0].flatten())
    arrived = [torch.cat([slots[s].reshape(ep, cap, 2)[r] for s in range(ep)]) for r in range(ep)]
    expected = reference_layout(counts, ep, cap)
    for r in range(ep):
        expert_major = gather_rows(
            arrived[r], receives[r].expert_rows, receives[r].slot_expert_rows
        )
        total = len(expected[r])
        assert int(receives[r].tokens_per_expert.sum()) == total
        assert [tuple(x) for x in expert_major[:total].tolist()] == expected[r]
        assert expert_major[total:].eq(0).all()  # the tail the experts skip is zeros
    overflow = any(bool(s.overflow) for s in sends)
    per_peer = [c.reshape(ep, -1).sum(1) for c in counts]
    assert overflow == any(bool((p > cap).any()) for p in per_peer)
    if factor == 100.0 or ep == 1:
        assert not overflow


def test_inverse_maps_undo_the_gathers_and_drop_what_did_not_fit():
    counts = routed_counts(2, 2, 10, seed=3, skew=[5, 1, 1, 0])
    cap = plan.capacity(10, 1, 2, 1.0)
    (send, _), (recv0, _) = simulate(counts, 2, cap)
    rows = torch.arange(1, 11, dtype=torch.float64)[:, None]
    back = gather_rows(
        gather_rows(rows, send.slot_rows, send.row_slots), send.row_slots, send.slot_rows
    )
    kept = send.row_slots < 2 * cap
    assert bool(send.overflow) and not kept.all()
    assert torch.equal(back[kept], rows[kept]) and back[~kept].eq(0).all()
    slots = torch.arange(1, 2 * cap + 1, dtype=torch.float64)[:, None]
    there = gather_rows(slots, recv0.expert_rows, recv0.slot_expert_rows)
    again = gather_rows(there, recv0.slot_expert_rows, recv0.expert_rows)
    valid = recv0.slot_expert_rows < 2 * cap
    assert torch.equal(again[valid], slots[valid]) and again[~valid].eq(0).all()


def test_gather_gradient_is_the_inverse_gather():
    counts = routed_counts(2, 3, 12, seed=5)
    cap = plan.capacity(12, 1, 2, 1.25)
    send = simulate(counts, 2, cap)[0][0]
    x = torch.randn(12, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, send.slot_rows, send.row_slots), (x,))


def test_capacity():
    assert plan.capacity(4096, 8, 8, 1.25) == 5120
    assert plan.capacity(4096, 8, 1, 1.25) == 4096 * 8  # all rows: nothing can overflow
    assert plan.capacity(3, 1, 2, 1.0) == 2
