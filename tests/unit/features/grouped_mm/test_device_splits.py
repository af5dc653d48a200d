"""--moe-expert-splits-on-device: the token counts reach the grouped GEMMs on the device, through
megatron's own all-to-all dispatcher and TEGroupedMLP, without .tolist()."""

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.features.grouped_mm import linears
from megatron.patchset.features.grouped_mm import torch_grouped_gemm as tgg
from tests.unit.features.grouped_mm.conftest import (
    IN,
    OUT,
    SPLITS,
    FakeTEGroupedLinear,
    grouped_mlp,
    rows,
)

SPLIT_PATCHES = [
    "grouped_mm.splits_on_device_dispatcher",
    "grouped_mm.splits_on_device_grouped_mlp",
]


@pytest.fixture
def split_patches():
    registry.apply_patches([registry.get(n) for n in SPLIT_PATCHES])
    try:
        yield
    finally:
        registry.revert(SPLIT_PATCHES)


def test_device_splits_give_the_offsets_of_the_counts_without_a_host_list():
    splits = linears.DeviceSplits(torch.tensor(SPLITS))
    assert splits.tolist() is splits and len(splits) == len(SPLITS)
    offs = linears.group_offsets(splits, torch.device("cpu"))
    assert offs.dtype == torch.int32 and offs.tolist() == [0, 5, 8, 8, 17, 18, 18]
    assert tgg._offsets_cache == {}  # the host-list cache is not involved


def test_grouped_mlp_reads_the_token_counts_without_tolist(monkeypatch):
    """With the patch TEGroupedMLP never turns the counts tensor into a host list (on a GPU that is
    the device-to-host copy and sync), and computes exactly what upstream's host-list path does."""
    splits = [3, 0, 6, 2]
    mlp = grouped_mlp(splits)
    x = rows(sum(splits), IN)
    probs = torch.rand(sum(splits), generator=torch.Generator().manual_seed(3))
    expected, _ = mlp(
        x, torch.tensor(splits), probs
    )  # upstream: .tolist(), offsets from the host list

    def refuse(self):
        raise AssertionError("tokens_per_expert.tolist() called")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    with pytest.raises(AssertionError, match="tolist"):
        mlp(x, torch.tensor(splits), probs)
    name = "grouped_mm.splits_on_device_grouped_mlp"
    registry.apply_patches([registry.get(name)])
    try:
        out, bias = mlp(x, torch.tensor(splits), probs)
    finally:
        registry.revert([name])
    assert bias is None
    assert torch.equal(out, expected)


def test_grouped_mlp_patch_refuses_te_linears(split_patches):
    from types import SimpleNamespace

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    fake = SimpleNamespace(linear_fc1=FakeTEGroupedLinear(2, IN, OUT), _with_fused_impl=False)
    with pytest.raises(RuntimeError, match="--moe-grouped-gemm-impl torch"):
        TEGroupedMLP.forward(fake, rows(2), torch.tensor([1, 1]), torch.ones(2))


@pytest.fixture
def alltoall_dispatcher(monkeypatch):
    """A real MoEAlltoAllTokenDispatcher of megatron on one gloo rank (EP = TP = 1), 4 experts
    top-2."""
    import warnings

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.unit.support import cpu_shims

    cpu_shims.install(monkeypatch)
    host_copies = []
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def counting_to_host(tensor, *args, **kwargs):
        if torch.is_tensor(tensor):
            host_copies.append(tuple(tensor.shape))
        return to_host(tensor, *args, **kwargs)

    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", counting_to_host)
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        parallel_state.initialize_model_parallel()

        def build(num_local_experts=4, **overrides):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = TransformerConfig(
                    num_layers=1,
                    hidden_size=IN,
                    num_attention_heads=4,
                    num_moe_experts=num_local_experts,
                    moe_router_topk=2,
                    moe_token_dispatcher_type="alltoall",
                    use_cpu_initialization=True,
                    moe_ffn_hidden_size=OUT,
                    **overrides,
                )
            dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher(
                num_local_experts,
                list(range(num_local_experts)),
                config,
                pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
            )
            return dispatcher

        yield build, host_copies
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def routing(tokens=6, experts_=4, topk=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.rand(tokens, experts_, generator=gen).topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts_, dtype=torch.bool).scatter_(1, chosen, True)
    return routing_map, routing_map.float() * 0.5


def test_dispatcher_returns_the_counts_on_the_device_through_megatrons_own_dispatch(
    alltoall_dispatcher, split_patches
):
    """One local expert (no chunk sort): megatron's dispatch path end to end; the token counts it
    hands the experts are the tensor preprocess computed, and nothing was copied to the host."""
    build, host_copies = alltoall_dispatcher
    dispatcher = build(num_local_experts=1)
    routing_map, probs = routing(experts_=1, topk=1)
    hidden = rows(6)
    tokens, probs_out = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    tokens, probs_out = dispatcher.token_dispatch(tokens, probs_out)
    tokens, tokens_per_expert, _ = dispatcher.dispatch_postprocess(tokens, probs_out)
    assert torch.is_tensor(tokens_per_expert) and tokens_per_expert.tolist() == [6]
    assert host_copies == []
    assert not hasattr(dispatcher, "d2h_event")  # upstream records (and waits for) it
    assert tokens.shape == (6, IN)


def test_without_the_patch_the_dispatcher_copies_the_counts_to_the_host(alltoall_dispatcher):
    build, host_copies = alltoall_dispatcher
    dispatcher = build(num_local_experts=1)
    routing_map, probs = routing(experts_=1, topk=1)
    tokens, probs_out = dispatcher.dispatch_preprocess(rows(6), routing_map, probs)
    tokens, probs_out = dispatcher.token_dispatch(tokens, probs_out)
    dispatcher.dispatch_postprocess(tokens, probs_out)
    assert (1,) in host_copies and hasattr(dispatcher, "d2h_event")


def test_dispatcher_patch_at_every_sync_point_and_its_refusals(alltoall_dispatcher, split_patches):
    build, host_copies = alltoall_dispatcher
    dispatcher = build(num_local_experts=4)
    routing_map, _ = routing()
    counts = dispatcher.preprocess(routing_map)
    # Four local experts without the fused chunk sort: the sort needs host split sizes.
    with pytest.raises(RuntimeError, match="--moe-permute-fusion"):
        dispatcher._maybe_dtoh_and_synchronize("before_permutation_1", counts)
    dispatcher.config.moe_permute_fusion = True
    for point in dispatcher.cuda_sync_point_priority:
        assert dispatcher._maybe_dtoh_and_synchronize(point, counts) is counts
    assert host_copies == [] and torch.equal(counts, routing_map.sum(0))
    dispatcher.ep_size = 2
    with pytest.raises(RuntimeError, match="expert parallelism"):
        dispatcher._maybe_dtoh_and_synchronize("before_finish", counts)


def test_device_splits_feed_megatrons_tokens_per_expert_log(tmp_path):
    """megatron's --save-tokens-per-expert-interval hook records list(m_splits) of every experts'
    fc1 input; device splits give it the counts (a host read only in that logging step)."""
    from megatron.training.activation_logging import ActivationLogger

    logger = ActivationLogger(str(tmp_path))
    hook = logger._make_tpe_hook("model", "decoder.layers.3.mlp.experts.linear_fc1")
    hook(None, (rows(5), linears.DeviceSplits(torch.tensor([3, 0, 2]))), {}, None)
    assert [list(r) for r in logger._decoder_tpe_records.values()] == [[[3, 0, 2]]]
