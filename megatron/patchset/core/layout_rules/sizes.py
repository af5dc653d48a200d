"""Sizes and counts must be positive before anything divides by them (a gate: when this rule
fails, the later rules of the phase are not run)."""

from __future__ import annotations

import argparse

from megatron.patchset.core.rules import rule

# (flag, least value); a flag whose value is None (not given) is not checked.
LEAST = (
    ("--tensor-model-parallel-size", 1),
    ("--pipeline-model-parallel-size", 1),
    ("--context-parallel-size", 1),
    ("--expert-model-parallel-size", 1),
    ("--expert-tensor-parallel-size", 1),
    ("--num-layers-per-virtual-pipeline-stage", 1),
    ("--num-virtual-stages-per-pipeline-rank", 1),
    ("--micro-batch-size", 1),
    ("--global-batch-size", 1),
    ("--num-layers", 1),
    ("--hidden-size", 1),
    ("--ffn-hidden-size", 1),
    ("--num-attention-heads", 1),
    ("--num-query-groups", 1),
    ("--kv-channels", 1),
    ("--seq-length", 1),
    ("--max-position-embeddings", 1),
    ("--vocab-size", 1),
    ("--num-experts", 1),
    ("--moe-router-topk", 1),
    ("--moe-ffn-hidden-size", 1),
    ("--moe-shared-expert-intermediate-size", 1),
    ("--train-iters", 0),
    ("--eval-iters", 0),
    ("--eval-interval", 1),
    ("--log-interval", 1),
    ("--save-interval", 1),
    ("--exit-interval", 1),
    ("--lr-warmup-iters", 0),
    ("--cuda-graph-warmup-steps", 0),
)


def dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def world_size_problem(args: argparse.Namespace) -> str | None:
    """The world size the run is checked for must be at least 1."""
    size = getattr(args, "world_size", None)
    if size is None or size >= 1:
        return None
    source = (
        f"--dry-run-world-size {size}"
        if getattr(args, "dry_run_world_size", None) is not None
        else f"WORLD_SIZE={size}"
    )
    return f"{source} (the number of GPUs: 1 or more)"


@rule(
    "sizes-positive", phase="layout", flags=tuple(f for f, _ in LEAST) + ("WORLD_SIZE",), gate=True
)
def _sizes_positive(args):
    """Parallel sizes, batch sizes, model dimensions and intervals are at least 1 (counts of
    iterations at least 0); megatron divides by most of them before it checks them."""
    problems = [world_size_problem(args)]
    for flag, least in LEAST:
        value = getattr(args, dest(flag), None)
        if value is not None and not isinstance(value, bool) and value < least:
            problems.append(f"{flag} {value} ({least} or more)")
    problems = [p for p in problems if p]
    if problems:
        return f"out of range: {'; '.join(problems)}."
    return None
