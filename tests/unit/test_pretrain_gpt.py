"""pretrain_gpt.py's data path, model config, forward_step and loss_func on a tiny local-spec
MoE GPT on the CPU: one process, and two processes with expert parallelism 2 (gloo)."""

import json
import math

import pytest
import torch.multiprocessing as mp

from tests.unit.support import cpu_train


def train(tmp_path, world_size, *extra, steps=6):
    out = str(tmp_path / "run")
    argv = cpu_train.cpu_argv("--global-batch-size", str(2 * world_size), *extra)
    mp.spawn(
        cpu_train.run,
        args=(world_size, argv, cpu_train.free_port(), out, steps),
        nprocs=world_size,
        join=True,
    )
    return [json.load(open(f"{out}.rank{r}.json")) for r in range(world_size)]


@pytest.mark.slow
def test_one_process_forward_backward_and_learning(tmp_path):
    (rec,) = train(tmp_path, 1)
    # Per-token losses come back as [batch, sequence]; the first loss is near ln(vocab).
    assert rec["output_shape"] == [2, 128]
    assert abs(rec["losses"][0] - math.log(4096)) < 0.5
    # loss_func reports [sum of token losses, token count], consistent with the loss.
    total, count = rec["reports"][0]
    assert count == rec["tokens"][0] == 2 * 128
    assert total / count == pytest.approx(rec["losses"][0], rel=1e-5)
    # Gradients reach attention, the router and every expert.
    norms = rec["grad_norms"]
    assert any("router" in n and v > 0 for n, v in norms.items())
    assert any("self_attention.linear_qkv" in n and v > 0 for n, v in norms.items())
    assert sum(1 for n, v in norms.items() if "local_experts" in n and v > 0) >= 8
    # Repeating one batch, Adam drives the loss down.
    assert rec["losses"][-1] < rec["losses"][0] - 1.0
    assert rec["local_experts"] == 4 and rec["ep"] == 1


@pytest.mark.slow
def test_two_processes_expert_parallel(tmp_path):
    recs = train(tmp_path, 2, "--expert-model-parallel-size", "2")
    for rec in recs:
        assert rec["ep"] == 2
        # 8 experts over EP=2: 4 per rank (counted per layer; 4 layers).
        assert rec["local_experts"] == 4
        assert all(math.isfinite(x) for x in rec["losses"])
        assert rec["losses"][-1] < rec["losses"][0] - 1.0
