"""``--moe-static-dispatch-chunks``: megatron's MoE layer (router with its auxiliary loss, the
static dispatcher, reference experts) run whole and in token chunks on the same input, on one
and on two gloo processes (EP = 1, EP = 2; at EP = 2 also with one row per token and peer,
``--moe-static-dispatch-dedup``), fp64: the same output, input gradient and parameter
gradients up to the order in which the expert weight gradients are summed; the experts run once
per chunk. The patch applies only with a chunk count above 1 and reverts."""

import pytest
import torch
import torch.multiprocessing as mp

from megatron.patchset.core import registry
from tests.unit.conftest import parse, tiny_argv
from tests.unit.features.static_dispatch import chunks_worker
from tests.unit.features.static_dispatch.test_patches import STATIC
from tests.unit.support.cpu_train import free_port


def run(tmp_path, world_size, chunk_counts, dedup=False):
    out = str(tmp_path / "chunks")
    args = (world_size, free_port(), "float64", chunk_counts, out, dedup)
    mp.spawn(chunks_worker.worker, args=args, nprocs=world_size, join=True)
    return [torch.load(f"{out}.rank{r}.pt") for r in range(world_size)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size, chunk_counts, dedup",
    [(1, (1, 2, 4), False), (2, (1, 2, 3), False), (2, (1, 2), True)],
    ids=["ep1", "ep2", "ep2-dedup"],
)
def test_chunked_layer_equals_the_whole_layer(tmp_path, world_size, chunk_counts, dedup):
    for rank, result in enumerate(run(tmp_path, world_size, chunk_counts, dedup)):
        assert result["dispatcher"] == "StaticAlltoAllTokenDispatcher"
        whole = result[1]
        assert whole["expert_calls"] == 1
        assert {"router.weight", "experts.w.0"} <= set(whole["grads"])
        for n in chunk_counts[1:]:
            chunked = result[n]
            assert chunked["expert_calls"] == n, f"rank {rank}, {n} chunks"
            assert chunked["bias"] is None
            for key in ("out", "hidden_grad"):
                torch.testing.assert_close(chunked[key], whole[key], rtol=1e-12, atol=1e-12)
            assert chunked["grads"].keys() == whole["grads"].keys()
            for name, grad in whole["grads"].items():
                torch.testing.assert_close(
                    chunked["grads"][name], grad, rtol=1e-12, atol=1e-12, msg=name
                )
            # the router runs once on all tokens: its gradients (auxiliary loss included) match
            assert torch.equal(chunked["grads"]["router.weight"], whole["grads"]["router.weight"])


def test_the_patch_applies_only_with_chunks_and_reverts():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = MoELayer.forward
    one = parse(tiny_argv(*STATIC))
    assert "static_dispatch.chunks" not in {p.name for p in registry.selected(one)}
    args = parse(tiny_argv(*STATIC, "--moe-static-dispatch-chunks", "2"))
    patches = [p for p in registry.selected(args) if p.name == "static_dispatch.chunks"]
    assert len(patches) == 1
    registry.apply_patches(patches)
    try:
        assert MoELayer.forward is not original
        assert MoELayer.forward.__wrapped__ is original
    finally:
        registry.revert(["static_dispatch.chunks"])
    assert MoELayer.forward is original


@pytest.mark.parametrize("connections, warned", [("1", True), ("32", False), (None, False)])
def test_one_hardware_queue_is_named_at_the_first_chunked_layer(
    monkeypatch, capsys, connections, warned
):
    from megatron.patchset.features.static_dispatch import chunks

    if connections is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    monkeypatch.setattr(chunks, "_announced", set())
    chunks.announce(2, 2048, side=True)
    chunks.announce(2, 2048, side=True)  # once per chunk count
    out = capsys.readouterr().out
    assert out.count("MoE layers run in 2 token chunks of 2048 tokens") == 1
    assert ("CUDA_DEVICE_MAX_CONNECTIONS=1 gives both streams one hardware queue" in out) is warned
