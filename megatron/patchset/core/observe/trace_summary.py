"""The summary of one profiled training iteration, reduced from its chrome trace.

How host time is attributed (:func:`summarize_trace`):

* The step is the ``ps:step`` label around ``train_step``; its duration is the host time.
* Forward: a CPU event belongs to the innermost ``ps:`` label around it on its thread.
* Backward: autograd records the forward op's sequence number on the backward node
  (``autograd::engine::evaluate_function: ...``); the node inherits the category and layer of
  the forward op with that number (the last one to start: the op that created the node).
* The step's timeline (all threads) is painted with the innermost (latest-started) tagged
  interval covering each instant; whatever no label covers is ``other``. The categories
  therefore add up to the step's host time.
* CUDA runtime/driver calls are counted for the category painted at their start on their own
  thread: kernel launches (``*LaunchKernel*``), device-to-host synchronisations
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking
  ``cudaMemcpy``); kernels are tied to their launch by the correlation id.
* GPU busy time is the union of kernel, memcpy and memset intervals inside the GPU window
  (from the start of the step to the later of its host end and the last GPU activity); idle
  is the rest of that window. The GPU is synchronised before the profiled step starts.
* Pipeline P2P (:func:`p2p_exposure`): the kernels launched inside megatron's
  ``P2PCommunicator`` calls, per direction; *exposed* is their GPU time during which no
  compute (non-NCCL) kernel runs.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from megatron.patchset.core.observe.labels import (
    CATEGORIES,
    MOE_CATEGORIES,
    STEP_LABEL,
    parse_label,
)

TOP_KERNELS = 15  # the summary lists the kernels with the most GPU time in the step
SYNC_CALLS = {
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
}
SCALAR_OPS = {"aten::_local_scalar_dense"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of the intervals (touching ones joined)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_length(
    intervals: Iterable[tuple[float, float]], lo: float = float("-inf"), hi: float = float("inf")
) -> float:
    """Total length covered by the intervals (clipped to [lo, hi]), overlaps counted once."""
    return sum(
        b - a
        for a, b in merge((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    )


def paint(intervals: list[tuple[float, float, Any]]) -> list[tuple[float, float, Any]]:
    """Elementary segments (start, end, tag): each instant gets the tag of the covering interval
    that started last (the innermost, for nested intervals); uncovered instants are left out."""
    points = sorted({p for a, b, _ in intervals for p in (a, b)})
    by_start = sorted(((a, b, i) for i, (a, b, _) in enumerate(intervals)))
    active: list = []  # heap of (-start, end, -index, index): latest start, then shortest
    out: list[tuple[float, float, Any]] = []
    k = 0
    for left, right in zip(points, points[1:]):
        while k < len(by_start) and by_start[k][0] <= left:
            a, b, i = by_start[k]
            heapq.heappush(active, (-a, b, -i, i))
            k += 1
        while active and active[0][1] <= left:
            heapq.heappop(active)
        if not active:
            continue
        # Entries that ended may hide below the top; the top itself is live here.
        tag = intervals[active[0][3]][2]
        if out and out[-1][1] == left and out[-1][2] == tag:
            out[-1] = (out[-1][0], right, tag)
        else:
            out.append((left, right, tag))
    return out


def _lookup(segments: list[tuple[float, float, Any]], starts: list[float], t: float) -> Any:
    i = bisect.bisect_right(starts, t) - 1
    if i >= 0 and segments[i][0] <= t < segments[i][1]:
        return segments[i][2]
    return None


def _end(e: dict) -> float:
    return float(e["ts"]) + float(e.get("dur") or 0.0)


def summarize_trace(events: list[dict], *, meta: dict | None = None) -> dict:
    """The summary of one profiled step from chrome-trace events (``traceEvents``)."""
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    steps = [e for e in complete if e.get("name") == STEP_LABEL]
    if not steps:
        raise ValueError(f"no {STEP_LABEL!r} event in the trace")
    step = max(steps, key=lambda e: float(e.get("dur") or 0))
    lo, hi = float(step["ts"]), _end(step)
    host_pid = step.get("pid")

    def inside(e):
        return lo <= float(e["ts"]) < hi

    # Forward labels, per thread.
    tagged: list[tuple[float, float, tuple]] = []
    per_thread: dict[Any, list] = defaultdict(list)
    for e in complete:
        parsed = parse_label(e.get("name", ""))
        if parsed and e.get("cat") == "user_annotation" and inside(e):
            category, detail, layer = parsed
            item = (float(e["ts"]), min(_end(e), hi), (category, detail, layer, "fwd"))
            tagged.append(item)
            per_thread[e.get("tid")].append(item)
    fwd_paint = {tid: paint(items) for tid, items in per_thread.items()}
    fwd_starts = {tid: [s[0] for s in segs] for tid, segs in fwd_paint.items()}

    # Forward op sequence numbers -> tag; backward nodes inherit it.
    cpu_ops = [e for e in complete if e.get("cat") == "cpu_op" and inside(e)]
    by_seq: dict[int, tuple[float, tuple]] = {}
    for e in cpu_ops:
        seq = (e.get("args") or {}).get("Sequence number")
        if seq is None or e["name"].startswith(BACKWARD_PREFIX) or e.get("tid") not in fwd_paint:
            continue
        tag = _lookup(fwd_paint[e["tid"]], fwd_starts[e["tid"]], float(e["ts"]))
        if tag is not None and (seq not in by_seq or float(e["ts"]) >= by_seq[seq][0]):
            by_seq[seq] = (float(e["ts"]), tag)
    for e in cpu_ops:
        seq = (e.get("args") or {}).get("Sequence number")
        if e["name"].startswith(BACKWARD_PREFIX) and seq in by_seq:
            category, detail, layer, _ = by_seq[seq][1]
            item = (float(e["ts"]), min(_end(e), hi), (category, detail, layer, "bwd"))
            tagged.append(item)
            per_thread[e.get("tid")].append(item)

    timeline = paint(tagged)
    thread_paint = {tid: paint(items) for tid, items in per_thread.items()}
    thread_starts = {tid: [s[0] for s in segs] for tid, segs in thread_paint.items()}

    def tag_of(e):
        tid = e.get("tid")
        if tid not in thread_paint:
            return None
        return _lookup(thread_paint[tid], thread_starts[tid], float(e["ts"]))

    blank = {
        "host_us": 0.0,
        "fwd_host_us": 0.0,
        "bwd_host_us": 0.0,
        "launches": 0,
        "syncs": 0,
        "sync_us": 0.0,
        "scalar_reads": 0,
        "gpu_kernel_us": 0.0,
    }
    cats: dict[str, dict] = {name: dict(blank) for name in CATEGORIES}
    layers: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    details: dict[str, float] = defaultdict(float)

    def bucket(tag) -> dict:
        name = tag[0] if tag and tag[0] in cats else "other"
        return cats[name]

    covered = 0.0
    for a, b, tag in timeline:
        span = b - a
        covered += span
        c = bucket(tag)
        c["host_us"] += span
        c["fwd_host_us" if tag[3] == "fwd" else "bwd_host_us"] += span
        if tag[2] is not None:
            layers[str(tag[2])][tag[0]] += span
        details[tag[0] + (f"/{tag[1]}" if tag[1] else "") + f" ({tag[3]})"] += span
    cats["other"]["host_us"] += (hi - lo) - covered

    launches = syncs = graph_launches = scalar_reads = 0
    correlation: dict[Any, str] = {}
    p2p_launch: dict[Any, str] = {}  # correlation id -> direction of the pipeline P2P call
    for e in complete:
        if e.get("cat") not in RUNTIME_CATS or not inside(e):
            continue
        tag = tag_of(e)
        c = bucket(tag)
        name = e.get("name", "")
        if "LaunchKernel" in name:
            launches += 1
            c["launches"] += 1
        elif "GraphLaunch" in name:
            graph_launches += 1
            c["launches"] += 1
        if name in SYNC_CALLS:
            syncs += 1
            c["syncs"] += 1
            c["sync_us"] += float(e.get("dur") or 0)
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            correlation[corr] = tag[0] if tag and tag[0] in cats else "other"
            if tag and tag[0] == "p2p":
                p2p_launch[corr] = tag[1] or "unknown"
    for e in cpu_ops:
        if e.get("name") in SCALAR_OPS:
            scalar_reads += 1
            bucket(tag_of(e))["scalar_reads"] += 1

    device = [e for e in complete if e.get("cat") in DEVICE_CATS and _end(e) > lo]
    gpu_hi = max([hi] + [_end(e) for e in device])
    busy = union_length(((float(e["ts"]), _end(e)) for e in device), lo, gpu_hi)
    d2h = sum(1 for e in device if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", ""))
    per_kernel: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in device:
        if e.get("cat") == "kernel":
            corr = (e.get("args") or {}).get("correlation")
            cats[correlation.get(corr, "other")]["gpu_kernel_us"] += float(e.get("dur") or 0)
            entry = per_kernel[e.get("name", "?")]
            entry[0] += 1
            entry[1] += float(e.get("dur") or 0)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    p2p_spans, compute = split_kernels(device, p2p_launch)
    p2p = p2p_exposure(p2p_spans, compute, lo, gpu_hi)
    p2p_list = p2p_kernels(p2p_spans, compute, lo, gpu_hi)

    ms = 1e-3
    categories = {}
    for name, c in cats.items():
        categories[name] = {
            "host_ms": c["host_us"] * ms,
            "fwd_host_ms": c["fwd_host_us"] * ms,
            "bwd_host_ms": c["bwd_host_us"] * ms,
            "launches": c["launches"],
            "syncs": c["syncs"],
            "sync_ms": c["sync_us"] * ms,
            "scalar_reads": c["scalar_reads"],
            "gpu_kernel_ms": c["gpu_kernel_us"] * ms,
        }
    return {
        "version": 1,
        **(meta or {}),
        "host_pid": host_pid,
        "step_host_ms": (hi - lo) * ms,
        "gpu_window_ms": (gpu_hi - lo) * ms,
        "gpu_busy_ms": busy * ms,
        "gpu_idle_ms": ((gpu_hi - lo) - busy) * ms if device else None,
        "gpu_events": len(device),
        "kernel_launches": launches,
        "graph_launches": graph_launches,
        "d2h_syncs": syncs,
        "d2h_copies": d2h,
        "scalar_reads": scalar_reads,
        "categories": categories,
        "layers": {
            k: {c: v * ms for c, v in sorted(d.items())}
            for k, d in sorted(layers.items(), key=lambda kv: int(kv[0]))
        },
        "details_ms": {k: v * ms for k, v in sorted(details.items(), key=lambda kv: -kv[1])},
        "p2p": p2p,
        "p2p_kernels": p2p_list,
        "top_kernels": [{"name": name, "calls": n, "gpu_ms": us * ms} for name, (n, us) in top],
    }


def split_kernels(device: list[dict], p2p_launch: dict) -> tuple[list, list]:
    """The step's kernels as ``(p2p, compute)``: ``p2p`` = ``(start, end, direction)`` of the
    kernels launched by a pipeline P2P call, in start order; ``compute`` = ``(start, end)`` of the
    kernels that are not NCCL's."""
    p2p, compute = [], []
    for e in device:
        if e.get("cat") != "kernel":
            continue
        span = (float(e["ts"]), _end(e))
        direction = p2p_launch.get((e.get("args") or {}).get("correlation"))
        if direction is not None:
            p2p.append((*span, direction))
        elif not is_comm_kernel(e.get("name", "")):
            compute.append(span)
    p2p.sort()
    return p2p, compute


def p2p_kernels(p2p: list, compute: list, lo: float, hi: float) -> list[dict]:
    """Every pipeline P2P kernel of the step in start order: ``{"dir", "ts", "end", "compute"}``
    (microseconds on the trace's clock, which all processes of one host share), ``compute`` being
    the compute-kernel intervals inside the kernel's span. Enough to split each kernel, once it is
    paired with its peer's (:func:`split_p2p_wait`), into waiting for the peer and transferring."""
    merged = merge(compute)
    starts = [a for a, _ in merged]
    out = []
    for a, b, direction in p2p:
        if b <= lo or a >= hi:
            continue
        inside = []
        for c0, c1 in itertools.islice(merged, max(0, bisect.bisect_right(starts, a) - 1), None):
            if c0 >= b:
                break
            if c1 > a:
                inside.append([max(a, c0), min(b, c1)])
        out.append({"dir": direction, "ts": a, "end": b, "compute": inside})
    return out


def split_p2p_wait(mine: list[dict], peer: list[dict]) -> dict | None:
    """Pair this rank's P2P kernels with its pipeline peer's, in order (NCCL matches the
    operations of two ranks in the order they were issued), and split each kernel's time into
    *peer wait* (from its start until the peer's matching kernel starts: the pipeline dependency,
    which overlap cannot remove) and *transfer* (from then to its end), with the exposed part of
    the transfer (no compute kernel running). Per direction, in milliseconds; None when the
    kernel counts differ (the pairing would be wrong)."""
    if len(mine) != len(peer) or not mine:
        return None
    out: dict[str, dict] = {}
    for k, q in zip(mine, peer):
        begin = min(max(k["ts"], q["ts"]), k["end"])
        overlap = union_length([tuple(c) for c in k["compute"]], begin, k["end"])
        row = out.setdefault(
            k["dir"],
            {"kernels": 0, "peer_wait_ms": 0.0, "transfer_ms": 0.0, "transfer_exposed_ms": 0.0},
        )
        row["kernels"] += 1
        row["peer_wait_ms"] += (begin - k["ts"]) * 1e-3
        row["transfer_ms"] += (k["end"] - begin) * 1e-3
        row["transfer_exposed_ms"] += (k["end"] - begin - overlap) * 1e-3
    return out


def is_comm_kernel(name: str) -> bool:
    """NCCL's kernels (all-to-all, all-reduce, send/receive, ...): communication, not compute."""
    return "nccl" in name.lower()


def p2p_exposure(p2p: list, compute: list, lo: float, hi: float) -> dict:
    """Per direction of the pipeline P2P calls (``forward``, ``backward``, ``both``): how many
    kernels their launches produced, the time those kernels ran (union) and how much of it is
    *exposed*: P2P kernel time during which no compute kernel (any kernel that is not NCCL's)
    runs on the GPU. Overlapped P2P hides behind compute; exposed P2P is time the GPU spends
    on nothing but moving pipeline tensors (or waiting for the peer to send them)."""
    spans: dict[str, list] = defaultdict(list)
    for a, b, direction in p2p:
        spans[direction].append((a, b))
    compute_us = union_length(compute, lo, hi)
    out = {}
    for direction, items in sorted(spans.items()):
        total = union_length(items, lo, hi)
        overlapped = total + compute_us - union_length(items + compute, lo, hi)
        out[direction] = {
            "kernels": len(items),
            "kernel_ms": total * 1e-3,
            "exposed_ms": (total - overlapped) * 1e-3,
        }
    return out


def format_summary(summary: dict) -> str:
    """Markdown: the category table, the step totals and the per-layer MoE breakdown."""
    step = summary["step_host_ms"]
    gpu = summary.get("gpu_events", 0) > 0
    head = [
        "category",
        "host ms",
        "% of step",
        "fwd (or call) ms",
        "bwd ms",
        "kernel launches",
        "D2H syncs",
        "item/tolist",
        "GPU kernel ms",
    ]
    rows = [head]
    for name, title in CATEGORIES.items():
        c = summary["categories"].get(name)
        if c is None:
            continue
        rows.append(
            [
                title,
                f"{c['host_ms']:.2f}",
                f"{100 * c['host_ms'] / step:.1f}%" if step else "-",
                f"{c['fwd_host_ms']:.2f}",
                f"{c['bwd_host_ms']:.2f}",
                str(c["launches"]),
                str(c["syncs"]),
                str(c["scalar_reads"]),
                f"{c['gpu_kernel_ms']:.2f}" if gpu else "-",
            ]
        )
    lines = [markdown_table(rows), ""]
    facts = [
        f"host time of the step: {step:.2f} ms",
        (
            f"GPU busy: {summary['gpu_busy_ms']:.2f} ms, idle: {summary['gpu_idle_ms']:.2f} ms of "
            f"a {summary['gpu_window_ms']:.2f} ms window "
            f"({100 * summary['gpu_idle_ms'] / summary['gpu_window_ms']:.1f}% idle)"
        )
        if gpu
        else "GPU: no CUDA activity recorded (CPU run)",
        f"kernel launches: {summary['kernel_launches']}"
        + (
            f" (+{summary['graph_launches']} CUDA graph launches)"
            if summary.get("graph_launches")
            else ""
        ),
        f"device-to-host syncs: {summary['d2h_syncs']} (D2H copies {summary['d2h_copies']}, "
        f"aten::_local_scalar_dense {summary['scalar_reads']})",
    ]
    for direction, p in (summary.get("p2p") or {}).items():
        facts.append(
            f"pipeline P2P ({direction}): {p['kernels']} kernels, {p['kernel_ms']:.2f} ms on the "
            f"GPU, {p['exposed_ms']:.2f} ms exposed (no compute kernel running)"
        )
    lines += [f"* {f}" for f in facts]
    if summary.get("layers"):
        cols = ["attention", *MOE_CATEGORIES]
        table = [["layer", *cols, "total"]]
        for layer, values in summary["layers"].items():
            table.append(
                [layer, *(f"{values.get(c, 0.0):.2f}" for c in cols), f"{sum(values.values()):.2f}"]
            )
        lines += ["", "Host ms per layer (forward and backward):", "", markdown_table(table)]
    if summary.get("top_kernels"):
        table = [["kernel (most GPU time first)", "calls", "GPU ms"]]
        table += [
            [k["name"][:90], str(k["calls"]), f"{k['gpu_ms']:.2f}"] for k in summary["top_kernels"]
        ]
        lines += ["", "GPU kernels of the step:", "", markdown_table(table)]
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    """Rows of strings (the first is the header) as a Markdown table with aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["| " + " | ".join(c.ljust(widths[i]) for i, c in enumerate(r)) + " |" for r in rows]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)
