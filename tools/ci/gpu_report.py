"""Summary table of the GPU tier's training runs (the JSON files tests/gpu writes)."""

import glob
import json
import os
import sys


def main(folder: str) -> None:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as handle:
            run = json.load(handle)
        losses = run.get("losses") or []

        def at(i, losses=losses):
            return f"{losses[i - 1]:.4f}" if len(losses) >= i else "-"

        step = run.get("step_ms")
        peak = (run.get("summary") or {}).get("max_allocated_gib")
        rows.append(
            [
                run["name"],
                str(run["nproc"]),
                str(len(losses)),
                at(1),
                at(10),
                at(len(losses)) if losses else "-",
                f"{step:.1f}" if step else "-",
                f"{peak:.2f}" if peak else "-",
                f"{run.get('seconds', 0):.0f}",
            ]
        )
    head = [
        "run",
        "GPUs",
        "iters",
        "loss it1",
        "loss it10",
        "loss last",
        "step ms",
        "peak GiB",
        "wall s",
    ]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for row in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu-report/runs")
