"""The observe patches: one clear line per overflow, re-run and spill, and the buffer report."""

import types

import torch

from megatron.patchset.core import registry
from megatron.patchset.features.paged_stash import report


def test_overflow_report_lines():
    lines = []
    overflow = report.OverflowReport(emit=lines.append)
    cfg = types.SimpleNamespace(
        moe_paged_stash_buffer_size_factor_cuda=0.05,
        moe_paged_stash_buffer_size_factor_cpu=0.0,
        moe_expert_rank_capacity_factor=1.5,
    )
    overflow(0, 0, 0, config=cfg)
    assert lines == []
    overflow(2, 0, 0, config=cfg)
    assert "OVERFLOW" in lines[0] and "stash buffer full on 2 rank(s)" in lines[0]
    assert (
        "re-runs the step" in lines[0]
        and "--moe-paged-stash-buffer-size-factor-cuda (now 0.05)" in lines[0]
    )
    overflow(0, 0, 0, config=cfg)
    assert "re-run of this step finished without overflow (1 re-run(s) so far)" in lines[1]
    overflow(0, 1, 0, config=cfg)
    assert (
        "receive budget exceeded" in lines[2]
        and "--moe-expert-rank-capacity-factor (now 1.5)" in lines[2]
    )
    overflow(0, 0, 0, config=cfg)
    overflow(0, 0, 2, config=cfg)
    assert "pinned host memory on 2 rank(s)" in lines[-1] and overflow.reruns == 2


def test_overflow_report_ncclep_keeps_budget():
    lines = []
    overflow = report.OverflowReport(emit=lines.append)
    cfg = types.SimpleNamespace(
        moe_paged_stash_buffer_size_factor_cuda=0.02,
        moe_paged_stash_buffer_size_factor_cpu=0.0,
        moe_expert_rank_capacity_factor=2.0,
        moe_flex_dispatcher_backend="ncclep",
    )
    overflow(1, 0, 0, config=cfg)
    assert "stash buffer full on 1 rank(s)" in lines[0]
    assert (
        "with the same NCCL EP receive budget" in lines[0]
        and "without the receive budget" not in lines[0]
    )


def test_overflow_patch_prints_on_rank0(capsys):
    class Runner:
        config = types.SimpleNamespace(
            moe_paged_stash_buffer_size_factor_cuda=0.05,
            moe_paged_stash_buffer_size_factor_cpu=0.0,
            moe_expert_rank_capacity_factor=1.5,
        )

        def check(self):
            return (1, 0, 0)

    wrapped = registry.get("paged_stash.report_overflow").factory(Runner.check)
    assert wrapped(Runner()) == (1, 0, 0)
    out = capsys.readouterr().out
    assert out.startswith(f"{report.LOG_PREFIX}: OVERFLOW")
    report._REPORT.rerun_pending = False


def test_buffer_report(capsys):
    class Mgr:
        stash_buffers = None

        def allocate(self):
            return None

    wrapped = registry.get("paged_stash.report_buffers").factory(Mgr.allocate)
    wrapped(Mgr())
    assert "WARNING: no MoE activation was marked" in capsys.readouterr().out
    buf = types.SimpleNamespace(
        cuda_buffer=torch.zeros(128, 256, dtype=torch.bfloat16), host_buffer=None
    )
    Mgr.stash_buffers = {torch.bfloat16: {256: buf}}
    wrapped(Mgr())
    out = capsys.readouterr().out
    assert "bfloat16 width 256: 128 token rows, 0.1 MiB GPU" in out
