"""The one-row-per-token exchange (``--moe-static-dispatch-dedup``) for every rank of a simulated
expert-parallel group, top-k up to 6: each rank's experts get the rows of megatron's order
(local expert, then source rank, then token), a token crosses to a peer once whatever the number
of that peer's experts it picked, the layer's output and its gradients equal a direct computation
in fp64, and whatever does not fit is flagged and reaches no expert."""

import math

import pytest
import torch

from megatron.patchset.features.static_dispatch import plan
from megatron.patchset.features.static_dispatch.gather import (
    gather_expand,
    gather_rows,
    gather_sum,
)

H = 5


def routing(ep, local, tokens, topk, seed, skew=0.0):
    """Each rank's routing map ``[T, ep x L]`` and probabilities; ``skew`` favours expert 0."""
    gen = torch.Generator().manual_seed(seed)
    maps, probs = [], []
    for _ in range(ep):
        scores = torch.rand(tokens, ep * local, generator=gen)
        scores[:, 0] += skew
        chosen = scores.topk(topk, dim=1).indices
        m = torch.zeros(tokens, ep * local, dtype=torch.bool).scatter_(1, chosen, True)
        maps.append(m)
        probs.append(torch.rand(tokens, ep * local, generator=gen, dtype=torch.float64) * m)
    return maps, probs


def exchange(sent, ep):
    """An all-to-all among ``ep`` simulated ranks of ``[ep x C, ...]`` send buffers."""
    parts = [s.reshape(ep, -1, *s.shape[1:]) for s in sent]
    return [torch.cat([parts[s][r] for s in range(ep)]) for r in range(ep)]


def run(maps, probs, hidden, weights, ep, factor, descending=False):
    """The dispatch, an expert computation ``(x @ W_e) * p`` and the combine on every rank; with
    ``descending`` the experts' rows are laid out from the last local expert to the first."""
    tokens, experts = maps[0].shape
    local, topk = experts // ep, int(maps[0][0].sum())
    cap = plan.token_capacity(tokens, topk, experts, ep, factor)
    rows = plan.expert_rows(tokens, topk, ep, factor)
    sends = [plan.token_send_plan(m, ep, cap) for m in maps]
    slot_maps = [
        gather_rows(m.reshape(tokens * ep, local).to(torch.uint8), s.slot_pairs, s.pair_slots)
        for m, s in zip(maps, sends)
    ]
    receives = [
        plan.token_receive_plan(m.bool(), rows, topk, descending=descending)
        for m in exchange(slot_maps, ep)
    ]
    slots_x = [gather_expand(h, s.slot_tokens, s.token_slots) for h, s in zip(hidden, sends)]
    slots_p = [
        gather_rows(p.reshape(tokens * ep, local), s.slot_pairs, s.pair_slots)
        for p, s in zip(probs, sends)
    ]
    back, layouts = [], []
    for r, (x, p, rc) in enumerate(zip(exchange(slots_x, ep), exchange(slots_p, ep), receives)):
        ex = gather_expand(x, rc.expert_slots, rc.slot_rows)
        ep_probs = gather_rows(p.reshape(-1), rc.expert_pairs, rc.pair_rows)
        out, start = [], 0
        for g, n in enumerate(rc.tokens_per_expert.tolist()):
            e = local - 1 - g if descending else g
            out.append(
                ex[start : start + n] @ weights[r * local + e] * ep_probs[start : start + n, None]
            )
            start += n
        out.append(ex[start:] * 0)
        back.append(gather_sum(torch.cat(out), rc.slot_rows, rc.expert_slots))
        layouts.append((rc, ex))
    outs = [gather_sum(b, s.token_slots, s.slot_tokens) for b, s in zip(exchange(back, ep), sends)]
    return sends, receives, layouts, outs, cap, rows


@pytest.mark.parametrize("descending", [False, True], ids=["expert_order", "descending"])
@pytest.mark.parametrize(
    "ep, local, tokens, topk, factor",
    [
        (4, 4, 20, 6, 1.5),
        (4, 3, 17, 5, 2.0),
        (2, 2, 9, 3, 1.5),
        (1, 5, 11, 4, 1.0),
        (8, 2, 24, 8, 1.5),
    ],
)
def test_rows_land_in_megatrons_order_and_the_layer_is_exact(
    ep, local, tokens, topk, factor, descending
):
    maps, probs = routing(ep, local, tokens, topk, seed=ep * 10 + topk)
    gen = torch.Generator().manual_seed(1)
    hidden = [torch.randn(tokens, H, generator=gen, dtype=torch.float64) for _ in range(ep)]
    weights = [torch.randn(H, H, generator=gen, dtype=torch.float64) for _ in range(ep * local)]
    for t in (*hidden, *probs):
        t.requires_grad_(True)
    sends, receives, layouts, outs, cap, rows = run(
        maps, probs, hidden, weights, ep, factor, descending
    )
    assert not any(bool(s.overflow) for s in sends) and not any(bool(r.overflow) for r in receives)

    order = list(range(local))[::-1] if descending else list(range(local))
    for r, (rc, ex) in enumerate(layouts):
        # megatron's order: local expert (from the last with descending), then source rank,
        # then token
        assert rc.descending is descending
        expected = [
            (s, t)
            for e in order
            for s in range(ep)
            for t in range(tokens)
            if maps[s][t, r * local + e]
        ]
        assert rc.tokens_per_expert.tolist() == [
            sum(int(maps[s][:, r * local + e].sum()) for s in range(ep)) for e in order
        ]
        got = [
            (int(x) // cap, int(sends[int(x) // cap].slot_tokens[r * cap + int(x) % cap]))
            for x in rc.expert_slots[: len(expected)]
        ]
        assert got == expected and len(expected) > 0
        taken = torch.stack([hidden[s][t] for s, t in expected]).detach()
        assert torch.equal(ex[: len(expected)], taken)
        assert ex[len(expected) :].eq(0).all()

    # a token crosses to a peer once: the slots used are the (token, peer) pairs with an expert,
    # fewer than the routed (token, expert) pairs wherever a peer hosts several picked experts
    for s, send in enumerate(sends):
        to_peer = maps[s].reshape(tokens, ep, local).any(2)
        assert int((send.slot_tokens < tokens).sum()) == int(to_peer.sum())
        assert int(to_peer.sum()) < int(maps[s].sum())

    grad = [torch.randn(tokens, H, generator=gen, dtype=torch.float64) for _ in range(ep)]
    sum((o * g).sum() for o, g in zip(outs, grad)).backward()
    for s in range(ep):
        h = hidden[s].detach().clone().requires_grad_(True)
        p = probs[s].detach().clone().requires_grad_(True)
        direct = sum(
            (h @ weights[e]) * p[:, e : e + 1] * maps[s][:, e : e + 1] for e in range(ep * local)
        )
        assert torch.allclose(outs[s], direct, rtol=1e-12, atol=1e-12)
        (direct * grad[s]).sum().backward()
        assert torch.allclose(hidden[s].grad, h.grad, rtol=1e-12, atol=1e-12)
        assert torch.allclose(probs[s].grad, p.grad, rtol=1e-12, atol=1e-12)
        assert probs[s].grad[~maps[s]].eq(0).all()  # no gradient for experts not picked


def test_what_does_not_fit_is_flagged_and_reaches_no_expert():
    ep, local, tokens, topk = 4, 2, 16, 3
    maps, probs = routing(ep, local, tokens, topk, seed=3, skew=5.0)  # every token picks expert 0
    hidden = [torch.randn(tokens, H, dtype=torch.float64) for _ in range(ep)]
    weights = [torch.eye(H, dtype=torch.float64) for _ in range(ep * local)]
    sends, receives, layouts, outs, cap, rows = run(maps, probs, hidden, weights, ep, 1.0)
    assert bool(sends[0].overflow)  # peer 0 hosts expert 0: all 16 tokens, capacity below
    assert cap < tokens
    sent_to_0 = int((sends[0].slot_tokens[:cap] < tokens).sum())
    assert sent_to_0 == cap  # the first cap tokens, in token order
    assert sends[0].token_slots[cap:, 0].eq(ep * cap).all()  # the rest: no slot
    # peer 0 receives the first cap tokens of every rank, each with its experts on peer 0
    kept = [
        maps[s][(sends[s].slot_tokens[:cap]).clamp(max=tokens - 1)][:, :local] for s in range(ep)
    ]
    arrived = sum(
        int(k[: int((sends[s].slot_tokens[:cap] < tokens).sum())].sum()) for s, k in enumerate(kept)
    )
    rc, ex = layouts[0]
    assert int(rc.tokens_per_expert.sum()) == min(arrived, rows)
    assert ex[min(arrived, rows) :].eq(0).all()
    # a token that did not fit at peer 0 gets nothing back from peer 0's experts
    dropped = sends[0].token_slots[:, 0] == ep * cap
    assert dropped.any()
    direct = sum(
        hidden[0] * probs[0][:, e : e + 1] * maps[0][:, e : e + 1] for e in range(ep * local)
    )
    not_there = sum(
        hidden[0] * probs[0][:, e : e + 1] * maps[0][:, e : e + 1] for e in range(local)
    )
    assert torch.allclose(outs[0][dropped], (direct - not_there)[dropped].detach(), atol=1e-12)

    # more expert rows than the receiving rank has room for: flagged there
    few = plan.token_receive_plan(torch.ones(6, 3, dtype=torch.bool), 10, 3)
    assert bool(few.overflow) and few.tokens_per_expert.tolist() == [6, 4, 0]
    assert int((few.expert_slots < 6).sum()) == 10 and few.slot_rows.max() == 10


def test_a_layer_without_tokens_sends_and_receives_nothing():
    ep, local, topk = 2, 3, 2
    routing_map = torch.zeros(0, ep * local, dtype=torch.bool)
    cap = plan.token_capacity(0, topk, ep * local, ep, 1.25)
    send = plan.token_send_plan(routing_map, ep, cap)
    assert send.slot_tokens.eq(0).all() and send.token_slots.shape == (0, ep)
    assert not bool(send.overflow)
    received = plan.token_receive_plan(torch.zeros(ep * cap, local, dtype=torch.bool), ep, topk)
    assert received.tokens_per_expert.tolist() == [0] * local
    assert received.expert_slots.eq(ep * cap).all() and not bool(received.overflow)
    out = gather_sum(torch.zeros(ep * cap, H), send.token_slots, send.slot_tokens)
    assert out.shape == (0, H)


def test_token_capacity():
    share = 1 - math.comb(112, 8) / math.comb(128, 8)
    assert plan.token_share(128, 8, 8) == pytest.approx(share)
    assert 0.667 < share < 0.668
    assert plan.token_capacity(4096, 8, 128, 8, 1.25) == math.ceil(1.25 * 4096 * share)
    assert plan.token_capacity(4096, 8, 128, 1, 1.25) == 4096  # one rank: every token once
    assert plan.expert_rows(4096, 8, 8, 1.25) == 8 * plan.capacity(4096, 8, 8, 1.25)


def test_the_row_scan_is_torchs_cumsum_along_rows():
    gen = torch.Generator().manual_seed(4)
    for shape in ((8, 37), (29, 16), (1, 5), (6, 1)):
        x = torch.rand(shape, generator=gen) < 0.4
        assert torch.equal(plan.cumsum_rows(x), torch.cumsum(x.long(), 1))


def test_the_descending_layout_changes_no_sum():
    """Laid out from the last local expert to the first, every slot still sums its experts' rows
    in local expert order, and each expert gets the same rows in the same order: the layer's
    outputs are those of megatron's order to the bit (float32)."""
    ep, local, tokens, topk = 4, 4, 20, 6
    maps, probs = routing(ep, local, tokens, topk, seed=7)
    gen = torch.Generator().manual_seed(2)
    hidden = [torch.randn(tokens, H, generator=gen) for _ in range(ep)]
    weights = [torch.randn(H, H, generator=gen) for _ in range(ep * local)]
    probs = [p.float() for p in probs]
    ups = run(maps, probs, hidden, weights, ep, 1.5)
    downs = run(maps, probs, hidden, weights, ep, 1.5, descending=True)
    for up, down in zip(ups[3], downs[3]):
        assert torch.equal(up, down)
    for (up, _), (down, _) in zip(ups[2], downs[2]):
        assert torch.equal(up.tokens_per_expert.flip(0), down.tokens_per_expert)
        # the slots' fan-in lists the same entries (their rows moved with the layout)
        assert torch.equal(up.expert_slots.sort().values, down.expert_slots.sort().values)
        assert torch.equal(
            (up.slot_rows < len(up.expert_slots)).sum(1),
            (down.slot_rows < len(up.expert_slots)).sum(1),
        )
