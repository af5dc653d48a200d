"""The static dispatcher, with one row per expert and with one row per token and peer
(``--moe-static-dispatch-dedup``), against megatron's all-to-all dispatcher, two gloo processes
(EP = 2, and EP = 1 with every expert on one rank): for routings that fit, the dispatched rows,
expert outputs, combined output and every gradient are identical (fp32 and fp64); an overflow is
flagged on every rank and the step runner re-runs the step dynamically or stops, as asked.

The one-row-per-token exchange sums a token's expert outputs per peer and then over peers, where
megatron sums all of them at once; with top-2 every sum has two terms, which add to the same bits
in either order, so the comparison can ask for identical results there too."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.unit.features.static_dispatch import exchange
from tests.unit.support.cpu_train import free_port


def run(tmp_path, case, dtype="float32", factor=2.0, emulated=None):
    out = str(tmp_path / f"exchange-{emulated}")
    args = (2, free_port(), case, dtype, factor, out, emulated)
    if emulated == "fake":  # one process: rank 1 of 2
        mp.spawn(exchange.emulated_worker, args=(1, *args), nprocs=1, join=True)
        return [torch.load(f"{out}.rank1.pt")]
    mp.spawn(exchange.worker, args=args, nprocs=2, join=True)
    return [torch.load(f"{out}.rank{r}.pt") for r in range(2)]


KEYS = ("rows", "probs", "expert_out", "out", "hidden_grad", "probs_grad", "tokens_per_expert")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["uneven", "one rank receives nothing", "all experts on one rank"])
def test_static_dispatch_equals_megatrons_all_to_all(tmp_path, case, dtype):
    results = run(tmp_path, case, dtype)
    for rank, r in enumerate(results):
        up = r["upstream"]
        assert not up["overflow"]
        for name in ("static", "dedup"):
            st = r[name]
            assert not st["overflow"], name
            for key in KEYS:
                assert up[key].dtype == st[key].dtype, key
                assert torch.equal(up[key], st[key]), f"rank {rank}: {name}: {key} differs"
            for a, b in zip(up["weight_grads"], st["weight_grads"]):
                assert torch.equal(a, b)
            assert st["tail"].eq(0).all()  # padding rows of the static buffers
        # the step runner leaves a step that fits to the static attempt
        for prefix in ("", "dedup_"):
            assert r[f"{prefix}step_rerun"]["ran_static"] and r[f"{prefix}step_fail"]["ran_static"]
        assert r["dedup_announced"]
    if case == "one rank receives nothing":
        for name in ("static", "dedup"):
            assert int(results[1][name]["tokens_per_expert"].sum()) == 0
            assert results[1][name]["rows"].shape[0] == 0
    if case == "all experts on one rank":
        assert results[0]["ep"] == 1 and len(results[0]["static"]["tokens_per_expert"]) == 4


@pytest.mark.slow
def test_overflow_is_flagged_everywhere_and_the_step_reruns_or_stops(tmp_path):
    results = run(tmp_path, "overflow", "float64", factor=1.0)
    for r in results:
        up, st = r["upstream"], r["static"]
        # flagged on both ranks (all-reduced), though only some rank's peer overflowed
        assert st["overflow"] and r["dedup"]["overflow"] and not up["overflow"]
        # rows that did not fit reached no expert: fewer rows than upstream on rank 0
        assert int(st["tokens_per_expert"].sum()) <= int(up["tokens_per_expert"].sum())
        # rerun: the step ran again dynamically, with the gradients of the dynamic path alone
        for prefix in ("", "dedup_"):
            rerun = r[f"{prefix}step_rerun"]
            assert rerun["ran_static"] is False
            for a, b in zip(up["weight_grads"], rerun["weight_grads"]):
                assert torch.equal(a, b)
            assert "--moe-static-dispatch-capacity-factor" in r[f"{prefix}step_fail"]["error"]
    assert int(results[0]["static"]["tokens_per_expert"].sum()) < int(
        results[0]["upstream"]["tokens_per_expert"].sum()
    )


@pytest.mark.slow
def test_the_emulated_rank_sees_the_exchange_of_ranks_that_route_alike(tmp_path):
    """Rank 1 of 2 under the fake process group, with the fork's stand-ins for the expert-parallel
    exchanges, against rank 1 of a real two-process exchange in which both ranks route and hold
    the same tokens, for megatron's dispatcher and the static one: its experts receive the same
    rows, counts and probabilities, compute the same outputs and get the same weight gradients.
    What comes back from the other rank's experts (the combined output, the input gradients)
    has its shape but this rank's values."""
    (fake,) = run(tmp_path, "uneven", "float64", emulated="fake")
    alike = run(tmp_path, "uneven", "float64", emulated="alike")[1]
    for name in ("upstream", "static", "dedup"):
        for key in ("rows", "probs", "expert_out", "tokens_per_expert"):
            assert torch.equal(fake[name][key], alike[name][key]), f"{name}: {key} differs"
        for a, b in zip(fake[name]["weight_grads"], alike[name]["weight_grads"]):
            assert torch.equal(a, b)
        for key in ("out", "hidden_grad", "probs_grad"):
            assert fake[name][key].shape == alike[name][key].shape
            assert torch.isfinite(fake[name][key]).all()
    assert int(fake["static"]["tokens_per_expert"].sum()) > 0
    assert torch.equal(fake["dedup"]["rows"], fake["static"]["rows"])
