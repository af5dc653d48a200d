"""Bus bandwidth of the collectives the step-time model uses, measured on this host's GPUs.

    torchrun --standalone --nproc-per-node 4 tools/bench/busbw.py [--sizes-mb 16,128,512]

For each message size (the per-rank buffer: what each rank sends in an all-to-all, the gathered
output of an all-gather, the input of a reduce-scatter) it times NCCL's all-to-all, all-gather and
reduce-scatter of bf16 data with CUDA events after warm-up, and prints the bus bandwidth as
nccl-tests reports it: ``size / time x (n - 1) / n``. These are the figures
``tools/bench/comm_model.py`` takes as ``--a2a-nvlink-gbps`` and ``--nvlink-gbps``.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron.patchset.core import argsfile


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(v) for v in text.split(",") if v]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MB,MB,...") from exc
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive sizes")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/bench/busbw.py", description=__doc__)
    p.add_argument(
        "--sizes-mb",
        type=parse_sizes,
        default=[16.0, 128.0, 512.0],
        help="per-rank buffer sizes in MB (1e6 bytes). Default: 16,128,512.",
    )
    p.add_argument(
        "--iters", type=argsfile.at_least(1), default=20, help="timed calls. Default: 20."
    )
    p.add_argument(
        "--warmup", type=argsfile.at_least(0), default=5, help="untimed calls. Default: 5."
    )
    return p


def bus_bandwidth(nbytes: float, seconds: float, ranks: int) -> float:
    """GB/s as nccl-tests reports it for all-to-all, all-gather and reduce-scatter."""
    return nbytes / seconds * (ranks - 1) / ranks / 1e9


COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter")


def time_collective(name: str, elems: int, ranks: int, warmup: int, iters: int) -> float:
    """Seconds per call of one collective on a per-rank buffer of ``elems`` bf16 values."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(elems, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(buf)
    shard = torch.empty(elems // ranks, dtype=torch.bfloat16, device="cuda")

    def call():
        if name == "all-to-all":
            dist.all_to_all_single(out, buf)
        elif name == "all-gather":
            dist.all_gather_into_tensor(out, buf[: elems // ranks])
        else:
            dist.reduce_scatter_tensor(shard, buf)

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    import torch
    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        print("tools/bench/busbw.py: error: start it with torchrun", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for mb in opts.sizes_mb:
        elems = int(mb * 1e6 / 2) // n * n
        for name in COLLECTIVES:
            seconds = time_collective(name, elems, n, opts.warmup, opts.iters)
            rows.append(
                (name, elems * 2 / 1e6, seconds * 1e3, bus_bandwidth(elems * 2, seconds, n))
            )
    if rank == 0:
        device = torch.cuda.get_device_name(0)
        print(f"{n}x {device}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, bf16")
        print("| collective | size MB | time ms | bus bandwidth GB/s |")
        print("|---|---|---|---|")
        for name, size, ms, busbw in rows:
            print(f"| {name} | {size:.0f} | {ms:.3f} | {busbw:.1f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
