"""tools/bench/memory_peak.py on a synthetic allocator snapshot (the layout
torch.cuda.memory._snapshot() writes): the peak inside the trace window, the blocks alive at it,
call sites, the comparison."""

import io
import pickle

import memory_peak

GIB = 1024**3


def frames(site):
    # torch's own frame first: the call site is the innermost frame outside torch.
    return [
        {"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
        {"filename": f"/x/site-packages/megatron/core/{site}.py", "line": 7, "name": site},
    ]


def snapshot(extra_site_gib=0.0):
    a, b, c = (
        (0x1000, GIB, frames("a")),
        (0x2000, 2 * GIB, frames("b")),
        (0x3000, GIB // 2, frames("c")),
    )
    events = [
        {"action": "alloc", "addr": addr, "size": size, "frames": fr} for addr, size, fr in (a, b)
    ]
    events += [
        {"action": "free_requested", "addr": b[0], "size": b[1], "frames": b[2]},
        {"action": "free_completed", "addr": b[0], "size": b[1], "frames": b[2]},
        {"action": "alloc", "addr": c[0], "size": c[1], "frames": c[2]},
    ]
    blocks = [
        {"address": addr, "size": size, "state": "active_allocated", "frames": fr}
        for addr, size, fr in (a, c)
    ]
    blocks.append(
        {"address": 0x9000, "size": GIB, "state": "inactive", "frames": []}
    )  # cached, not allocated
    if extra_site_gib:
        # Allocated before the trace window starts and alive throughout.
        blocks.append(
            {
                "address": 0x8000,
                "size": int(extra_site_gib * GIB),
                "state": "active_allocated",
                "frames": frames("stash"),
            }
        )
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [events]}


def test_peak_is_found_inside_the_trace_window():
    total, live = memory_peak.peak(snapshot())
    assert total == 3 * GIB  # a + b, before b was freed; at the end only a + c = 1.5 GiB
    assert sorted(live) == [0x1000, 0x2000]
    assert memory_peak.by_site(live) == {
        "megatron/core/a.py:7 a": [GIB, 1],
        "megatron/core/b.py:7 b": [2 * GIB, 1],
    }


def test_comparison_ranks_the_sites_that_grew(tmp_path):
    paths = []
    for name, extra in (("b", 0.0), ("c", 1.5)):
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(pickle.dumps(snapshot(extra)))
        paths.append(str(path))
    out = io.StringIO()
    memory_peak.report(paths, top=5, device=0, out=out)
    text = out.getvalue()
    assert f"{paths[0]}: peak 3.00 GiB" in text and f"{paths[1]}: peak 4.50 GiB" in text
    rows = text.split("blocks  call site\n")[1].splitlines()
    assert rows[0].split() == [
        "1.500",
        "+1.500",
        "(0.000)",
        "1",
        "megatron/core/stash.py:7",
        "stash",
    ]
