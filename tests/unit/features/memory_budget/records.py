"""The benchmark records the memory estimate is checked against: each run's shape (config, world
size, micro-batch, recipe knobs, extra flags), its levers and its measured peak allocated memory
(GiB), with the record file that holds the figure."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os

from megatron.patchset import recipes
from megatron.patchset.core import argsfile
from megatron.patchset.features.memory_budget.estimate import Levers, Shape
from tests.unit.conftest import REFERENCE, ROOT

QWEN = os.path.join(ROOT, "examples", "configs", "qwen3_30b_a3b.args")
RECORD_DIR = os.path.join(ROOT, "docs", "benchmarks")

NONE = Levers()
MOMENTS = Levers(bf16_moments=True)
MOE_ACT = Levers(recompute=("moe_act",))
MOE_ACT_NORM = Levers(recompute=("moe_act", "layernorm"))
MEMORY_80G = Levers(bf16_moments=True, recompute=("moe_act",))  # the recipe's former MEMORY=80G


@dataclasses.dataclass(frozen=True)
class Run:
    """One shape of the small_batch recipe as a record ran it."""

    config: str
    world: int
    micro_batch: int
    knobs: tuple[tuple[str, str], ...] = ()
    extra: tuple[str, ...] = ()

    def argv(self, *more: str) -> list[str]:
        flags = recipes.flags("small_batch", **dict(self.knobs))
        argv = argsfile.read(self.config) + list(self.extra)
        argv += ["--micro-batch-size", str(self.micro_batch)]
        argv += ["--global-batch-size", str(self.micro_batch * self.world)]
        argv += flags + list(more)
        if self.world > 1:
            argv.append("--fake-process-group")
        return argv


REF_4X4096 = Run(REFERENCE, 1, 4)
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")
REF_1X4096_NO_DROPOUT = Run(REFERENCE, 1, 1, extra=NO_DROPOUT)
REF_4X4096_NO_DROPOUT = Run(REFERENCE, 1, 4, extra=NO_DROPOUT)
# megatron's fused loss in place of the Triton one, with the one-kernel Adam
NATIVE_LOSS = (("KERNELS", "0"),)
REF_1X4096_NATIVE = Run(REFERENCE, 1, 1, NATIVE_LOSS, NO_DROPOUT + ("--adam-impl", "triton"))
REF_4X4096_NATIVE = Run(REFERENCE, 1, 4, NATIVE_LOSS, NO_DROPOUT + ("--adam-impl", "triton"))
EP8 = (("EP", "8"), ("DIST_OPT", "1"))
L1_1X4096 = Run(QWEN, 32, 1, EP8)
L1_1X4096_CF125 = Run(QWEN, 32, 1, EP8 + (("CAPACITY_FACTOR", "1.25"),))
L1_2X4096 = Run(QWEN, 32, 2, EP8)
L2_1X4096 = Run(QWEN, 8, 1, EP8)
L2_2X4096 = Run(QWEN, 8, 2, EP8)
EP4_12L = (("EP", "4"), ("DIST_OPT", "1"))
REAL_12L_1X4096 = Run(QWEN, 4, 1, EP4_12L, ("--num-layers", "12"))
REAL_12L_2X4096 = Run(QWEN, 4, 2, EP4_12L, ("--num-layers", "12"))

# (record file, run, levers, measured peak allocated GiB): the recipe's rows.
MEASURED = (
    ("2026-11-27-reference-4x4096-memory-levers-h200.md", REF_4X4096, NONE, 81.58),
    ("2026-11-27-reference-4x4096-memory-levers-h200.md", REF_4X4096, MOMENTS, 67.66),
    ("2026-11-27-reference-4x4096-memory-levers-h200.md", REF_4X4096, MOE_ACT, 80.64),
    ("2026-11-27-reference-4x4096-memory-levers-h200.md", REF_4X4096, MOE_ACT_NORM, 80.33),
    ("2026-11-27-reference-4x4096-memory-levers-h200.md", REF_4X4096, MEMORY_80G, 66.72),
    ("2026-11-27-reference-4x4096-h100-fit.md", REF_4X4096, MEMORY_80G, 66.71),
    ("2026-11-27-emulated-qwen3-l1-1x4096.md", L1_1X4096, NONE, 76.20),
    ("2026-11-27-emulated-qwen3-l1-1x4096-memory-h200.md", L1_1X4096, MOMENTS, 72.64),
    ("2026-11-27-emulated-qwen3-l1-1x4096-memory-h200.md", L1_1X4096, MEMORY_80G, 68.14),
    ("2026-11-27-emulated-qwen3-l1-1x4096-fused-rows-h100.md", L1_1X4096, MEMORY_80G, 68.21),
    ("2026-11-27-emulated-qwen3-l1-1x4096-fused-rows-h100.md", L1_1X4096_CF125, MEMORY_80G, 60.31),
    ("2026-11-27-emulated-qwen3-l1-2x4096.md", L1_2X4096, NONE, 112.71),
    ("2026-11-27-emulated-qwen3-l1-2x4096-fused-rows-h200.md", L1_2X4096, MEMORY_80G, 100.15),
    ("2026-11-27-emulated-qwen3-l2-1x4096.md", L2_1X4096, NONE, 108.25),
    ("2026-11-27-emulated-qwen3-l2-1x4096-fused-rows-h200.md", L2_1X4096, MEMORY_80G, 89.53),
    ("2026-11-27-real-4xh100-qwen3-12l-1x4096-check.md", REAL_12L_1X4096, MEMORY_80G, 40.01),
    ("2026-11-27-real-4xh100-qwen3-12l-2x4096-check.md", REAL_12L_2X4096, MEMORY_80G, 49.83),
    # megatron's fused loss against the Triton one, dropout off
    ("2026-11-24-small-batch-vs-torchtitan.md", REF_1X4096_NATIVE, NONE, 70.95),
    ("2026-11-24-small-batch-vs-torchtitan.md", REF_4X4096_NATIVE, NONE, 95.14),
)
# The same recipe in a record the coefficients were not fitted to (dropout off).
HELD_OUT = (
    ("2026-11-24-small-batch-vs-torchtitan.md", REF_1X4096_NO_DROPOUT, NONE, 67.48),
    ("2026-11-24-small-batch-vs-torchtitan.md", REF_4X4096_NO_DROPOUT, NONE, 81.23),
)


def record_text(name: str) -> str:
    with open(os.path.join(RECORD_DIR, name)) as handle:
        return handle.read()


@functools.cache
def validated_args(run: Run, *more: str):
    """megatron's validated arguments of ``run`` (device queries answered as on the target)."""
    from megatron.patchset.core.dry_run import fill_padded_vocab_size
    from tests.unit.conftest import validated

    args = validated(run.argv(*more), run.world)
    args.rank = 0
    fill_padded_vocab_size(args)
    return args


@functools.cache
def shape(run: Run) -> Shape:
    from megatron.patchset.core.dry_run import target_device
    from megatron.patchset.features.memory_budget.choice import shape_of

    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        return shape_of(validated_args(run))
