"""The reduction of a profiler trace to host time per MoE stage, the GPU busy/idle arithmetic and
the pipeline P2P exposure (core/observe/trace_summary.py), on synthetic traces."""

import pytest

from megatron.patchset.core.observe import labels, trace_summary
from tests.unit.core.observe.traces import ann, p2p_trace, synthetic_trace


def test_union_counts_overlaps_once_and_clips_to_the_window():
    assert trace_summary.union_length([]) == 0
    assert trace_summary.union_length([(0, 10), (5, 15), (20, 30)]) == 25
    assert trace_summary.union_length([(0, 100), (10, 20), (30, 40)]) == 100  # nested
    assert trace_summary.union_length([(0, 10), (10, 20)]) == 20  # touching
    assert trace_summary.union_length([(-5, 5), (8, 12), (50, 60)], lo=0, hi=10) == 7
    assert trace_summary.union_length([(20, 30)], lo=0, hi=10) == 0


def test_paint_gives_each_instant_to_the_innermost_interval():
    segs = trace_summary.paint(
        [
            (0, 100, "outer"),
            (10, 40, "inner"),
            (20, 30, "innermost"),
            (60, 70, "late"),
            (150, 160, "alone"),
        ]
    )
    assert segs == [
        (0, 10, "outer"),
        (10, 20, "inner"),
        (20, 30, "innermost"),
        (30, 40, "inner"),
        (40, 60, "outer"),
        (60, 70, "late"),
        (70, 100, "outer"),
        (150, 160, "alone"),
    ]
    # Same start: the shorter interval is the inner one.
    assert trace_summary.paint([(0, 10, "inner"), (0, 50, "outer")]) == [
        (0, 10, "inner"),
        (10, 50, "outer"),
    ]


def test_summary_attributes_host_time_by_category_forward_and_backward():
    s = trace_summary.summarize_trace(synthetic_trace(), meta={"iteration": 6})
    cats = s["categories"]
    approx = pytest.approx
    assert s["iteration"] == 6 and s["step_host_ms"] == approx(1.0)
    assert cats["attention"]["host_ms"] == approx(0.100)
    # router: 50 us forward + the softmax node's 50 us backward (sequence number 5)
    assert cats["router"]["fwd_host_ms"] == approx(0.050) and cats["router"][
        "bwd_host_ms"
    ] == approx(0.050)
    # the permute label inside the dispatch preprocess takes its 20 us out of dispatch
    assert cats["dispatch"]["host_ms"] == approx(0.030)
    assert cats["permutation"]["host_ms"] == approx(0.020)
    assert cats["expert"]["fwd_host_ms"] == approx(0.180) and cats["expert"][
        "bwd_host_ms"
    ] == approx(0.100)
    assert cats["combine"]["host_ms"] == approx(0.050)
    assert cats["optimizer"]["host_ms"] == approx(0.080)
    # the embedding's backward has no labelled forward op: it stays in "other"; all sums to the step
    assert cats["other"]["host_ms"] == approx(1.0 - 0.1 - 0.1 - 0.03 - 0.02 - 0.28 - 0.05 - 0.08)
    assert sum(c["host_ms"] for c in cats.values()) == approx(s["step_host_ms"])
    # launches, syncs and scalar reads land where they were issued (the backward launch on thread 2)
    assert s["kernel_launches"] == 4
    assert [cats[c]["launches"] for c in ("router", "expert", "optimizer")] == [1, 2, 1]
    assert s["d2h_syncs"] == 1 and cats["dispatch"]["syncs"] == 1  # after the permute label ended
    assert cats["dispatch"]["sync_ms"] == approx(0.010) and cats["permutation"]["syncs"] == 0
    assert s["scalar_reads"] == 1 and cats["expert"]["scalar_reads"] == 1
    assert s["d2h_copies"] == 1
    # kernels tied to their launch by correlation id
    assert cats["router"]["gpu_kernel_ms"] == approx(0.030)
    assert cats["expert"]["gpu_kernel_ms"] == approx(0.110)
    assert cats["optimizer"]["gpu_kernel_ms"] == approx(0.150)
    # GPU window: step start to the last GPU activity (1100 us); busy = union of 30+2+70+40+150
    assert s["gpu_window_ms"] == approx(1.100)
    assert s["gpu_busy_ms"] == approx(0.292)
    assert s["gpu_idle_ms"] == approx(1.100 - 0.292)
    # per layer (forward and backward of layer 1)
    assert s["layers"]["1"]["router"] == approx(0.100)
    assert s["layers"]["1"]["expert"] == approx(0.280)
    assert s["details_ms"]["expert/routed (bwd)"] == approx(0.100)


def test_pipeline_p2p_kernels_and_their_exposed_time_by_direction():
    s = trace_summary.summarize_trace(p2p_trace())
    approx = pytest.approx
    assert set(s["p2p"]) == {"backward", "forward"}
    bwd, fwd = s["p2p"]["backward"], s["p2p"]["forward"]
    assert bwd["kernels"] == 1 and bwd["kernel_ms"] == approx(0.100)
    assert bwd["exposed_ms"] == approx(0.070)  # 200-270: only NCCL kernels on the GPU
    assert (
        fwd["kernels"] == 1
        and fwd["kernel_ms"] == approx(0.050)
        and fwd["exposed_ms"] == approx(0.0)
    )
    assert s["categories"]["p2p"]["launches"] == 2
    assert s["categories"]["p2p"]["host_ms"] == approx(0.040)
    assert s["categories"]["p2p"]["gpu_kernel_ms"] == approx(0.150)
    text = trace_summary.format_summary(s)
    assert "pipeline P2P (backward): 1 kernels, 0.10 ms on the GPU, 0.07 ms exposed" in text
    # a trace without pipeline calls has no P2P entries
    assert trace_summary.summarize_trace(synthetic_trace())["p2p"] == {}


def test_p2p_kernels_listed_with_the_compute_inside_them_and_split_against_the_peer():
    kernels = trace_summary.summarize_trace(p2p_trace())["p2p_kernels"]
    assert [(k["dir"], k["ts"], k["end"]) for k in kernels] == [
        ("backward", 200, 300),
        ("forward", 400, 450),
    ]
    assert kernels[0]["compute"] == [[270, 300]] and kernels[1]["compute"] == [[400, 450]]
    # The peer's matching backward kernel starts at 250: 50 us waiting for it, 50 us transfer of
    # which 270-300 overlaps compute; its forward kernel started first, so no wait there.
    peer = [
        {"dir": "backward", "ts": 250, "end": 300, "compute": []},
        {"dir": "forward", "ts": 390, "end": 450, "compute": []},
    ]
    split = trace_summary.split_p2p_wait(kernels, peer)
    approx = pytest.approx
    assert split["backward"] == {
        "kernels": 1,
        "peer_wait_ms": approx(0.050),
        "transfer_ms": approx(0.050),
        "transfer_exposed_ms": approx(0.020),
    }
    assert split["forward"]["peer_wait_ms"] == 0 and split["forward"][
        "transfer_exposed_ms"
    ] == approx(0.0)
    # a peer kernel starting after this one ended: all wait, no transfer
    late = [dict(peer[0], ts=500, end=600), peer[1]]
    assert trace_summary.split_p2p_wait(kernels, late)["backward"]["transfer_ms"] == 0
    assert trace_summary.split_p2p_wait(kernels, peer[:1]) is None  # counts differ: no pairing


def test_summary_needs_the_step_label():
    with pytest.raises(ValueError, match="ps:step"):
        trace_summary.summarize_trace([ann("ps:router:1", 0, 5)])


def test_labels_parse_back():
    assert labels.parse_label(labels.label("dispatch", "all-to-all", 3)) == (
        "dispatch",
        "all-to-all",
        3,
    )
    assert labels.parse_label(labels.label("optimizer")) == ("optimizer", "", None)
    assert labels.parse_label("ps:step") is None and labels.parse_label("aten::mm") is None


def test_top_kernels_sum_the_step_kernels_by_name():
    s = trace_summary.summarize_trace(synthetic_trace())
    top = s["top_kernels"]
    assert top and top == sorted(top, key=lambda k: -k["gpu_ms"])
    assert sum(k["calls"] for k in top) == sum(
        1
        for e in synthetic_trace()
        if e.get("cat") == "kernel" and e.get("ph") == "X" and e["ts"] + e["dur"] > 0
    )
    text = trace_summary.format_summary(s)
    assert "GPU kernels of the step:" in text and top[0]["name"][:20] in text
