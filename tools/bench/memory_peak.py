#!/usr/bin/env python3
"""What is allocated at the memory peak, by call site, from a megatron memory snapshot.

    python pretrain_gpt.py ... --record-memory-history --memory-snapshot-path b.pickle
    python tools/bench/memory_peak.py b.pickle                 # the peak and its largest call sites
    python tools/bench/memory_peak.py b.pickle c.pickle        # c's peak against b's, site by site

Megatron (``--record-memory-history``) records the caching allocator's alloc/free trace with
Python stacks and, at every log interval, the last rank dumps ``torch.cuda.memory._snapshot()``.
The live blocks at dump time are known; walking the trace backwards from them (an ``alloc``
undone removes its block, a ``free_completed`` undone puts it back) gives the allocated bytes
before every event, hence the peak inside the trace window and the blocks alive at it. Each block
is charged to its innermost frame outside torch itself (``file:line function``).
"""

from __future__ import annotations

import argparse
import collections
import pickle
import sys

GIB = 1024**3


def call_site(frames: list) -> str:
    """The innermost frame that is not torch's own code (nor a C++ frame)."""
    for frame in frames or []:
        name = frame.get("filename", "")
        if not name or name.startswith("??") or "/torch/" in name or name.endswith(".cpp"):
            continue
        short = name.split("site-packages/")[-1]
        return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame)"


def live_blocks(snapshot: dict, device: int = 0) -> dict:
    """Blocks allocated at dump time: address -> (size, frames)."""
    blocks = {}
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", []):
            if block.get("state", "").startswith("active"):
                blocks[block["address"]] = (block["size"], block.get("frames", []))
    return blocks


def peak(snapshot: dict, device: int = 0) -> tuple[int, dict]:
    """The largest allocated total inside the trace window and the blocks alive at it."""
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    live = live_blocks(snapshot, device)
    current = sum(size for size, _ in live.values())
    best, best_index = current, len(events)  # index i: the state before event i
    for index in range(len(events) - 1, -1, -1):
        event = events[index]
        if event["action"] == "alloc":
            current -= event["size"]
        elif event["action"] == "free_completed":
            current += event["size"]
        if current > best:
            best, best_index = current, index
    # Second pass: rebuild the live set at the peak.
    for event in reversed(events[best_index:]):
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            live[event["addr"]] = (event["size"], event.get("frames", []))
    return best, live


def by_site(live: dict) -> dict:
    totals: dict = collections.defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        site = totals[call_site(frames)]
        site[0] += size
        site[1] += 1
    return dict(totals)


def report(paths: list[str], top: int, device: int, out=sys.stdout) -> None:
    results = []
    for path in paths:
        with open(path, "rb") as handle:
            total, live = peak(pickle.load(handle), device)
        results.append((path, total, by_site(live)))
        print(
            f"{path}: peak {total / GIB:.2f} GiB allocated in the trace window, {len(live)} blocks",
            file=out,
        )
    base: dict | None = results[0][2] if len(results) > 1 else None
    last_path, _, sites = results[-1]
    rows = sorted(sites.items(), key=lambda kv: -(kv[1][0] - (base or {}).get(kv[0], [0, 0])[0]))
    header = (
        "GiB at peak" + ("  vs first  (first)" if base is not None else "") + "  blocks  call site"
    )
    print(f"\nlargest call sites at the peak of {last_path}:\n{header}", file=out)
    for site, (size, count) in rows[:top]:
        line = f"{size / GIB:11.3f}"
        if base is not None:
            before = base.get(site, [0, 0])[0]
            line += f"  {(size - before) / GIB:+8.3f}  ({before / GIB:.3f})"
        print(f"{line}  {count:6d}  {site}", file=out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tools/bench/memory_peak.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "snapshots",
        nargs="+",
        help="megatron's --memory-snapshot-path files; with two or "
        "more, the last is compared site by site with the first",
    )
    parser.add_argument("--top", type=int, default=20, help="call sites to print")
    parser.add_argument("--device", type=int, default=0, help="device index inside the snapshot")
    args = parser.parse_args(argv)
    report(args.snapshots, args.top, args.device)


if __name__ == "__main__":
    main()
