"""pretrain_gpt.py's data path, model config, forward_step and loss_func on a tiny local-spec
MoE GPT on the CPU: one process, and two processes with expert parallelism 2 (gloo), on mock data
and on an indexed dataset written with megatron's own builder."""

import json
import math

import pytest
import torch.multiprocessing as mp

from megatron.patchset.core import argsfile
from tests.unit.support import cpu_train
from tests.unit.support.indexed_data import write_dataset


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


def indexed_argv(tmp_path, world_size):
    """The CPU config on an indexed dataset instead of --mock-data."""
    prefix = write_dataset(tmp_path / "text", documents=64, length=300, vocab=4096)
    argv = argsfile.remove(cpu_train.cpu_argv(), "--mock-data")
    argv = argsfile.override(argv, "--global-batch-size", str(2 * world_size))
    return argv + ["--data-path", prefix, "--split", "99,1,0"], prefix


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_training_on_an_indexed_dataset(tmp_path, world_size):
    """pretrain_gpt.py's dataset provider builds megatron's GPTDataset from <prefix>.bin/.idx;
    the batches are the file's tokens and the model learns them (EP=2 over two processes)."""
    import numpy

    argv, prefix = indexed_argv(tmp_path, world_size)
    if world_size == 2:
        argv += ["--expert-model-parallel-size", "2"]
    out = str(tmp_path / "run")
    mp.spawn(
        cpu_train.run,
        args=(world_size, argv, cpu_train.free_port(), out, 6),
        nprocs=world_size,
        join=True,
    )
    recs = [json.load(open(f"{out}.rank{r}.json")) for r in range(world_size)]
    data = numpy.memmap(prefix + ".bin", dtype=numpy.uint16, mode="r")
    text = bytes(numpy.asarray(data, dtype=numpy.uint16))
    for rec in recs:
        assert rec["dataset"] == "GPTDataset" and rec["ep"] == world_size
        first = numpy.asarray(rec["batch_tokens"], dtype=numpy.uint16).tobytes()
        assert first in text  # a run of the file's own tokens
        assert all(math.isfinite(x) for x in rec["losses"])
        assert rec["losses"][-1] < rec["losses"][0] - 1.0


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_continues_bit_identically(tmp_path, world_size):
    """8 iterations in one go against 4, a checkpoint (megatron's distributed checkpointing of
    the model, with the optimizer, RNG and consumed samples), and 4 more from it: iterations 5-8
    have the same losses and gradient norms to the last bit (EP=2 over two processes). Every part
    of the checkpoint shows within two resumed iterations (the weights, the consumed samples and
    the RNG's dropout masks in the first one's loss, Adam's moments and step in the second one's);
    the last two show that the run goes on as the uninterrupted one does."""
    from tests.unit.support import cpu_resume

    argv, _ = indexed_argv(tmp_path, world_size)
    argv += ["--num-workers", "0"]  # megatron's loader workers are not needed on the CPU
    if world_size == 2:
        argv += ["--expert-model-parallel-size", "2"]
    checkpoint = str(tmp_path / "checkpoint")
    runs = {}
    for mode in ("full", "save", "resume"):
        out = str(tmp_path / mode)
        mp.spawn(
            cpu_resume.run,
            args=(world_size, argv, cpu_train.free_port(), out, mode, 4, 8, checkpoint),
            nprocs=world_size,
            join=True,
        )
        runs[mode] = [json.load(open(f"{out}.rank{r}.json")) for r in range(world_size)]
    for full, saved, resumed in zip(runs["full"], runs["save"], runs["resume"]):
        assert full["iterations"] == list(range(1, 9)) and resumed["iterations"] == list(
            range(5, 9)
        )
        assert saved["losses"] == full["losses"][:4]
        assert resumed["losses"] == full["losses"][4:]
        assert resumed["grad_norms"] == full["grad_norms"][4:]
        assert all(math.isfinite(x) for x in full["losses"])


@pytest.mark.slow
def test_one_rank_of_a_larger_layout_under_the_fake_process_group(tmp_path):
    """Rank 1 of a 4-GPU EP=4 layout in one process (megatron's --fake-process-group): the
    expert-parallel exchanges are the fork's stand-ins (every rank routes as this one), so the
    token counts are consistent, each local expert receives tokens and the losses stay finite
    while the model learns; upstream's fake group alone would hand the dispatcher garbage counts."""
    out = str(tmp_path / "run")
    argv = cpu_train.cpu_argv(
        "--global-batch-size", "8", "--expert-model-parallel-size", "4", "--fake-process-group"
    )
    mp.spawn(
        cpu_train.run,
        args=(4, argv, cpu_train.free_port(), out, 4, 1),
        nprocs=1,
        join=True,
    )
    rec = json.load(open(f"{out}.rank1.json"))
    assert rec["ep"] == 4
    assert all(math.isfinite(x) for x in rec["losses"])
    assert rec["losses"][-1] < rec["losses"][0]
    # 2 x 128 tokens, top-2 of 8 experts: this rank sends 2 x 128 x 2 / 4 = 128 token copies to
    # each EP rank on average; as every one of the 4 ranks routes alike, its 2 experts receive 4
    # times what it sends to itself.
    for counts in rec["expert_tokens"]:
        assert len(counts) == 2 and all(c > 0 for c in counts)
        assert sum(counts) % 4 == 0
