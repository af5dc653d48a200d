"""megatron.patchset.features.offload on the CPU: a tiny MoE GPTModel inside megatron-core's real
DistributedDataParallel (gloo, one process; with and without the distributed-optimizer buffer
layout), trained with Adam. The storage bookkeeping is checked directly; training after an
offload/reload cycle must continue bit-identically to a twin run that never offloaded.

The GPU tier (tests/gpu/features/offload/test_offload.py) adds megatron's distributed optimizer,
real device memory
and pinned copies."""

import json

import pytest
import torch.multiprocessing as mp

from megatron.patchset.features import offload
from tests.unit.support.cpu_train import free_port

# Its module fixtures are built once: every test of the module runs in one xdist worker.
pytestmark = pytest.mark.xdist_group("offload-api")

STEPS_BEFORE, STEPS_AFTER = 3, 3


def _build(distributed_optimizer: bool):
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7) if torch.cuda.is_available() else None
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = torch.optim.Adam([p for p in ddp.parameters()], lr=1e-2)
    assert parallel_state.get_data_parallel_world_size() == 1
    return ddp, optimizer


def _batch():
    import torch

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)  # True = masked
    return tokens, labels, position_ids, mask


def _step(ddp, optimizer, batch):
    """One megatron-DDP training step: grads accumulate into main_grad (grad_data), Adam steps
    with them, the grad buffer is zeroed for the next step."""
    tokens, labels, position_ids, mask = batch
    ddp.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
    loss = ddp(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    for param in ddp.parameters():
        param.grad = param.main_grad.to(param.dtype)
    optimizer.step()
    return loss.item()


def worker(rank, port, out, distributed_optimizer):
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0"
    )
    import torch
    from megatron.core import parallel_state

    from tests.unit.support import cpu_shims

    patcher = pytest.MonkeyPatch()
    cpu_shims.install(patcher)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    batch = _batch()
    record = {}

    # Twin run: never offloaded.
    ddp, optimizer = _build(distributed_optimizer)
    record["twin_losses"] = [
        _step(ddp, optimizer, batch) for _ in range(STEPS_BEFORE + STEPS_AFTER)
    ]

    ddp, optimizer = _build(distributed_optimizer)
    losses = [_step(ddp, optimizer, batch) for _ in range(STEPS_BEFORE)]
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    params = dict(ddp.named_parameters())
    before = {
        "values": {n: p.detach().clone() for n, p in params.items()},
        "ids": {n: id(p) for n, p in params.items()},
        "main_grad_ids": {n: id(p.main_grad) for n, p in params.items()},
        "state": {
            n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in params.items()
        },
        "grad_bytes": sum(b.grad_data.untyped_storage().nbytes() for b in buffers),
        "param_bytes": sum(
            b.param_data.untyped_storage().nbytes() for b in buffers if b.param_data is not None
        ),
    }
    in_buffer = {
        n: any(
            b.param_data is not None
            and p.untyped_storage().data_ptr() == b.param_data.untyped_storage().data_ptr()
            for b in buffers
        )
        for n, p in params.items()
    }
    record["params_in_buffer"] = sum(in_buffer.values())
    record["num_params"] = len(params)
    record["planned"] = offload.storages(ddp, optimizer, include_optimizer=True)

    state = offload.offload(ddp, optimizer, include_optimizer=True)
    record["summary"] = state.summary()
    record["is_offloaded"] = offload.is_offloaded(ddp)
    record["bytes_after_offload"] = {
        "params": sum(p.untyped_storage().nbytes() for p in params.values()),
        "main_grads": sum(p.main_grad.untyped_storage().nbytes() for p in params.values()),
        "grad_data": sum(b.grad_data.untyped_storage().nbytes() for b in buffers),
        "optimizer_state": sum(
            v.untyped_storage().nbytes()
            for s in optimizer.state.values()
            for v in s.values()
            if v.dim() > 0
        ),
    }
    try:
        ddp(*batch[:1], batch[2], batch[3])
        record["forward_refused"] = None
    except offload.OffloadError as exc:
        record["forward_refused"] = str(exc)
    try:
        offload.offload(ddp, optimizer)
        record["double_offload"] = None
    except offload.OffloadError as exc:
        record["double_offload"] = str(exc)

    offload.reload(ddp, optimizer)
    record["reload_again_is_noop"] = offload.reload(ddp, optimizer) is None
    record["is_offloaded_after_reload"] = offload.is_offloaded(ddp)
    after = dict(ddp.named_parameters())
    record["same_parameter_objects"] = all(id(after[n]) == i for n, i in before["ids"].items())
    record["same_main_grad_objects"] = all(
        id(after[n].main_grad) == i for n, i in before["main_grad_ids"].items()
    )
    record["values_restored"] = all(torch.equal(after[n], v) for n, v in before["values"].items())
    record["state_restored"] = all(
        torch.equal(optimizer.state[after[n]][k], v)
        for n, s in before["state"].items()
        for k, v in s.items()
    )
    record["main_grads_zero"] = all(not p.main_grad.any() for p in after.values())
    record["still_in_buffer"] = sum(
        any(
            b.param_data is not None
            and p.untyped_storage().data_ptr() == b.param_data.untyped_storage().data_ptr()
            for b in buffers
        )
        for p in after.values()
    )
    record["grad_bytes_after_reload"] = sum(b.grad_data.untyped_storage().nbytes() for b in buffers)
    record["before_bytes"] = {"grad": before["grad_bytes"], "param": before["param_bytes"]}

    # The context manager, then training continues.
    with offload.offloaded(ddp) as inner:
        record["context_kept_bytes"] = inner.kept_bytes
        record["context_optimizer_untouched"] = all(
            v.untyped_storage().nbytes() > 0
            for s in optimizer.state.values()
            for v in s.values()
            if v.dim() > 0
        )
    losses += [_step(ddp, optimizer, batch) for _ in range(STEPS_AFTER)]
    record["losses"] = losses

    # Negative control: rebinding param.data (what module.cpu()/.cuda() does) detaches the
    # parameter from the DDP buffer, which keeps its memory and no longer feeds the module.
    if distributed_optimizer:
        name, param = next((n, p) for n, p in ddp.named_parameters() if in_buffer[n])
        buffer = next(
            b
            for b in buffers
            if b.param_data is not None
            and param.untyped_storage().data_ptr() == b.param_data.untyped_storage().data_ptr()
        )
        held = buffer.param_data.untyped_storage().nbytes()
        param.data = param.data.clone()  # stands in for .cpu() and back
        record["naive_buffer_bytes_kept"] = buffer.param_data.untyped_storage().nbytes() == held
        record["naive_still_in_buffer"] = (
            param.untyped_storage().data_ptr() == buffer.param_data.untyped_storage().data_ptr()
        )
        snapshot = param.detach().clone()
        buffer.param_data.add_(1.0)  # what the distributed optimizer's update does to the buffer
        record["naive_update_reaches_param"] = not torch.equal(param.detach(), snapshot)

    with open(out, "w") as handle:
        json.dump(record, handle)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", params=[True, False], ids=["param-buffer", "no-param-buffer"])
def result(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("offload") / "record.json")
    mp.spawn(worker, args=(free_port(), out, request.param), nprocs=1, join=True)
    with open(out) as handle:
        record = json.load(handle)
    record["distributed_optimizer"] = request.param
    return record


def test_everything_released_and_refused_while_offloaded(result):
    released = result["bytes_after_offload"]
    assert released == {"params": 0, "main_grads": 0, "grad_data": 0, "optimizer_state": 0}
    summary = result["summary"]
    assert result["is_offloaded"]
    assert summary["discarded_bytes"] >= result["before_bytes"]["grad"] > 0
    assert summary["kept_bytes"] > 0
    assert "reload" in result["forward_refused"]
    assert "already offloaded" in result["double_offload"]


def test_bookkeeping_follows_the_buffer_layout(result):
    planned = result["planned"]
    labels = [label for _, _, owners in planned for label in owners]
    kept = {label for _, keep, owners in planned if keep for label in owners}
    if result["distributed_optimizer"]:
        # Every parameter is a view of a param_data buffer: one storage per buffer, not per
        # parameter.
        assert result["params_in_buffer"] == result["num_params"]
        assert any(".param_data" in label for label in kept)
        param_storages = [s for s in planned if any(".param_data" in o for o in s[2])]
        assert sum(n for n, _, _ in param_storages) == result["before_bytes"]["param"]
    else:
        assert result["params_in_buffer"] == 0
        assert not any(".param_data" in label for label in labels)
    # main_grad views share the grad_data storage, which is discarded (not copied).
    grad_storages = [s for s in planned if any(".grad_data" in o for o in s[2])]
    assert grad_storages and not any(keep for _, keep, _ in grad_storages)
    assert all(any(".main_grad" in o for o in owners) for _, _, owners in grad_storages)
    # The optimizer's moments are kept.
    assert any(".exp_avg" in label for label in kept) and any(
        ".exp_avg_sq" in label for label in kept
    )


def test_reload_restores_identity_values_and_aliasing(result):
    assert result["same_parameter_objects"] and result["same_main_grad_objects"]
    assert result["values_restored"] and result["state_restored"]
    assert result["main_grads_zero"]
    assert result["still_in_buffer"] == result["params_in_buffer"]
    assert result["grad_bytes_after_reload"] == result["before_bytes"]["grad"]
    assert result["reload_again_is_noop"] and not result["is_offloaded_after_reload"]
    assert result["context_kept_bytes"] > 0 and result["context_optimizer_untouched"]


def test_training_continues_bit_identically(result):
    assert len(result["losses"]) == STEPS_BEFORE + STEPS_AFTER
    assert result["losses"] == result["twin_losses"]
    assert result["losses"][-1] < result["losses"][0]


def test_naive_param_data_move_breaks_buffer_aliasing(result):
    if not result["distributed_optimizer"]:
        pytest.skip("no parameter buffer without the distributed-optimizer layout")
    assert result["naive_buffer_bytes_kept"]  # nothing was freed
    assert not result["naive_still_in_buffer"]
    assert not result["naive_update_reaches_param"]  # buffer updates no longer reach the module
