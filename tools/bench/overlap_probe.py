"""Which work runs beside the experts' grouped GEMM on this GPU.

    python tools/bench/overlap_probe.py [--mb 256] [--green-sms 124,112,66] [--sm-carveout 20,32]
    torchrun --standalone --nproc-per-node 2 tools/bench/overlap_probe.py [--mb 16]

torch's grouped GEMM (``torch.nn.functional.grouped_mm``) in the weight-gradient form of the
experts' first linear of a Qwen3-30B-A3B rank at EP 8 (16 experts of 2,048 rows each, 2048 x 1536)
is timed alone, each piece of work below alone, and both started at once on two streams (CUDA
events, median of ``--iters``). ``hidden`` is what starting them together saved against running
one after the other.

On one GPU:

- ``sm-kernel``: an element-wise multiply of ``--mb`` MB of fp32, a kernel on the SMs;
- ``device-copy``: ``copy_`` of ``--mb`` MB within the GPU;
- ``host-copy``: ``copy_`` of ``--mb`` MB into pinned host memory, which the copy engines move;
- for each ``--green-sms N``: the GEMM on a green context of N SMs and ``sm-kernel`` on one of
  the other SMs (torch's ``torch.cuda.green_contexts``);
- for each ``--sm-carveout N``: ``sm-kernel`` beside the GEMM launched with N SMs left out of its
  grid (torch's ``torch._C._set_sm_carveout_experimental``, which its grouped GEMM reads when it
  sizes its persistent grid); the GEMM alone is timed with the same carve-out.

Under torchrun, with ``--mb`` MB for each peer:

- ``nccl-all-to-all``: ``torch.distributed.all_to_all_single``;
- ``peer-copies``: each rank copies its part for every peer into that peer's buffer (torch's
  symmetric memory) and the ranks then meet at the buffer's barrier;
- for each ``--sm-carveout N``: ``nccl-all-to-all`` beside the GEMM that leaves N SMs out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from megatron.patchset.core import argsfile
from megatron.patchset.features.grouped_mm.delayed_wgrad import sm_carveout

EXPERTS, ROWS, IN_FEATURES, OUT_FEATURES = 16, 32768, 2048, 1536


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N,N,...") from exc
    if min(counts, default=1) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive SM counts")
    return counts


def carveout_label(work: str, carveout: int) -> str:
    return f"{work}, GEMM leaving {carveout} SMs"


def parse_mb(text: str) -> float:
    try:
        mb = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size in MB") from exc
    if not mb > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive size")
    return mb


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/bench/overlap_probe.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--mb",
        type=parse_mb,
        default=None,
        help="MB (2^20 bytes) each piece of work moves; per peer under torchrun. "
        "Default: 256 on one GPU, 16 under torchrun.",
    )
    p.add_argument(
        "--green-sms",
        type=parse_counts,
        default=[124, 112, 100, 66],
        help="SM counts of the GEMM's green context (one GPU only; empty: none). "
        "Default: 124,112,100,66.",
    )
    p.add_argument(
        "--sm-carveout",
        type=parse_counts,
        default=[16, 20, 24, 32],
        help="SMs the GEMM's grid leaves free, one row each (empty: none). Default: 16,20,24,32.",
    )
    p.add_argument(
        "--iters", type=argsfile.at_least(1), default=20, help="timed runs. Default: 20."
    )
    p.add_argument(
        "--warmup", type=argsfile.at_least(0), default=5, help="untimed runs. Default: 5."
    )
    return p


def row(work: str, alone: float, gemm: float, together: float) -> tuple:
    """One table row, in microseconds: ``hidden`` = (alone + gemm) - together."""
    return (work, alone, gemm, together, alone + gemm, alone + gemm - together)


def format_rows(rows: list[tuple]) -> str:
    lines = [
        "| work | alone us | GEMM alone us | together us | one after the other us | hidden us |",
        "|---|---|---|---|---|---|",
    ]
    for work, alone, gemm, together, serial, hidden in rows:
        lines.append(
            f"| {work} | {alone:.0f} | {gemm:.0f} | {together:.0f} | {serial:.0f} | {hidden:.0f} |"
        )
    return "\n".join(lines)


class Probe:
    """The GEMM's operands and the timing of work started at once on several streams."""

    def __init__(self, warmup: int, iters: int, distributed: bool):
        import torch

        self.torch = torch
        self.warmup, self.iters, self.distributed = warmup, iters, distributed
        dev = torch.device("cuda", torch.cuda.current_device())
        self.x = torch.randn(ROWS, IN_FEATURES, device=dev, dtype=torch.bfloat16)
        self.dy = torch.randn(ROWS, OUT_FEATURES, device=dev, dtype=torch.bfloat16)
        step = ROWS // EXPERTS
        self.offs = torch.arange(1, EXPERTS + 1, device=dev, dtype=torch.int32) * step
        self.carveout = None  # SMs the GEMM's grid leaves free (None: torch's default, none)

    def gemm(self):
        import torch.nn.functional as F

        # the same carve-out the experts' linears set under --moe-wgrad-sm-carveout
        with sm_carveout(self.carveout or 0, self.x.device):
            return F.grouped_mm(self.dy.t(), self.x, offs=self.offs)

    def time(self, parts: list, streams: list | None = None) -> float:
        """Microseconds from the start of all ``parts`` (each on its own stream) to their end."""
        torch = self.torch
        main = torch.cuda.current_stream()
        streams = streams or [torch.cuda.Stream() for _ in parts]
        times = []
        for i in range(self.warmup + self.iters):
            if self.distributed:
                torch.distributed.barrier()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(main)
            for stream, part in zip(streams, parts):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    part()
            for stream in streams:
                main.wait_stream(stream)
            end.record(main)
            torch.cuda.synchronize()
            if i >= self.warmup:
                times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def pair(self, work: str, part, streams: list | None = None) -> tuple:
        gemm_streams = streams[:1] if streams else None
        work_streams = streams[1:] if streams else None
        gemm = self.time([self.gemm], gemm_streams)
        alone = self.time([part], work_streams)
        return row(work, alone, gemm, self.time([self.gemm, part], streams))

    def carved(self, work: str, part, carveouts: list[int]) -> list[tuple]:
        """``pair`` with the GEMM leaving each of ``carveouts`` SMs out of its grid."""
        torch = self.torch
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        too_many = [c for c in carveouts if c >= sms]
        if too_many:
            raise SystemExit(
                f"tools/bench/overlap_probe.py: error: --sm-carveout {too_many[0]} leaves the GEMM "
                f"no SM: this GPU has {sms}"
            )
        if carveouts and not hasattr(torch._C, "_set_sm_carveout_experimental"):
            raise SystemExit(
                f"tools/bench/overlap_probe.py: error: --sm-carveout needs torch's SM carve-out "
                f"(torch 2.11 or newer; this is {torch.__version__}); pass --sm-carveout ''"
            )
        rows = []
        for carveout in carveouts:
            self.carveout = carveout
            try:
                rows.append(self.pair(carveout_label(work, carveout), part))
            finally:
                self.carveout = None
        return rows


def _cuda_stream(stream):
    """A green context's stream as a ``torch.cuda.Stream``."""
    import torch

    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.Stream(
        stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
    )


def one_gpu_rows(
    probe: Probe, mb: float, green_sms: list[int], carveouts: list[int]
) -> list[tuple]:
    torch = probe.torch
    elems = int(mb * 2**20) // 4
    src = torch.randn(elems, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(elems, pin_memory=True)

    def sm_kernel():
        torch.mul(src, 1.0001, out=dst)

    rows = [
        probe.pair("sm-kernel", sm_kernel),
        probe.pair("device-copy", lambda: dst.copy_(src)),
        probe.pair("host-copy", lambda: host.copy_(src, non_blocking=True)),
    ]
    rows += probe.carved("sm-kernel", sm_kernel, carveouts)
    device = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    from torch.cuda.green_contexts import GreenContext

    for count in green_sms:
        if count >= sms:
            continue
        # the contexts live as long as their streams are used
        contexts = [GreenContext.create(share, device) for share in (count, sms - count)]
        streams = [_cuda_stream(context.Stream()) for context in contexts]
        work = f"GEMM on {count} SMs, sm-kernel on {sms - count}"
        rows.append(probe.pair(work, sm_kernel, streams))
        torch.cuda.synchronize()
        del streams, contexts
    return rows


def peer_rows(probe: Probe, mb: float, carveouts: list[int]) -> list[tuple]:
    torch = probe.torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    world, rank = dist.get_world_size(), dist.get_rank()
    part = int(mb * 2**20) // 2
    send = torch.randn(world * part, device="cuda", dtype=torch.bfloat16)
    received = torch.empty_like(send)
    buffer = symm_mem.empty(world * part, device="cuda", dtype=torch.bfloat16)
    handle = symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
    peers = [handle.get_buffer(p, (world * part,), torch.bfloat16) for p in range(world)]

    def nccl():
        dist.all_to_all_single(received, send)

    def copies():
        handle.barrier(channel=0)
        for p in range(world):
            peers[p][rank * part : (rank + 1) * part].copy_(send[p * part : (p + 1) * part])
        handle.barrier(channel=1)

    rows = [probe.pair("nccl-all-to-all", nccl), probe.pair("peer-copies", copies)]
    rows += probe.carved("nccl-all-to-all", nccl, carveouts)
    nccl()
    copies()
    torch.cuda.synchronize()
    if not torch.equal(buffer, received):
        raise RuntimeError("the peer copies delivered other data than NCCL's all-to-all")
    return rows


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("tools/bench/overlap_probe.py: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    distributed = "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    probe = Probe(opts.warmup, opts.iters, distributed)
    mb = opts.mb if opts.mb is not None else (16.0 if distributed else 256.0)
    if distributed:
        rows = peer_rows(probe, mb, opts.sm_carveout)
        where = f"{torch.distributed.get_world_size()}x {torch.cuda.get_device_name()}"
    else:
        rows = one_gpu_rows(probe, mb, opts.green_sms, opts.sm_carveout)
        where = torch.cuda.get_device_name()
    if not distributed or torch.distributed.get_rank() == 0:
        size = f"{mb:g} MB" + (" per peer" if distributed else "")
        print(f"{where}, torch {torch.__version__}; work of {size}; median of {opts.iters}")
        print(format_rows(rows))
    if distributed:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
