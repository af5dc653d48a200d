"""The layout emulation's patch of the distributed optimizer's parameter all-gather under
megatron's ``--fake-process-group``: torch's fake backend copies an all-gather's input into every
rank's part of the output (the rank's whole parameter buffer at each step); with the patch a
data-parallel all-gather moves nothing, synchronous or coalesced and asynchronous as megatron's
DDP issues it, while an all-gather over the expert-parallel group still reaches the backend."""

import torch
import torch.multiprocessing as mp

from tests.unit.support.cpu_train import free_port

NAME = "compat.fake_group_param_all_gather"


def worker(_, port, out):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron.core import parallel_state
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from torch.distributed import _coalescing_manager
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron.patchset.core import registry

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=2, create_gloo_process_groups=False
    )
    dp = parallel_state.get_data_parallel_group()
    ep = parallel_state.get_expert_model_parallel_group()

    def gather(group, coalesced):
        output = torch.full((group.size(), 3), -1.0)
        shard = torch.arange(3.0)
        if coalesced:
            with _coalescing_manager(group, async_ops=True) as handles:
                buffers.dist_all_gather_func(output, shard, group=group, async_op=True)
            handles.wait()
        else:
            buffers.dist_all_gather_func(output, shard, group=group)
        return output

    seen = {"without": [gather(dp, False), gather(dp, True)]}
    registry.apply_patches([registry.get(NAME)], check=False)
    try:
        seen["with"] = [gather(dp, False), gather(dp, True)]
        seen["expert"] = gather(ep, False)
    finally:
        registry.revert([NAME])
    torch.save(seen, out)
    torch.distributed.destroy_process_group()


def test_the_data_parallel_all_gather_copies_nothing_under_the_fake_group(tmp_path):
    out = str(tmp_path / "seen.pt")
    mp.spawn(worker, args=(free_port(), out), nprocs=1, join=True)
    seen = torch.load(out)
    for output in seen["without"]:  # the fake backend's own copies, one per rank of 4
        assert output.shape == (4, 3) and torch.equal(output, torch.arange(3.0).expand(4, 3))
    for output in seen["with"]:
        assert output.eq(-1).all()
    assert torch.equal(seen["expert"], torch.arange(3.0).expand(2, 3))


def test_the_patch_is_listed_for_the_fake_group_only():
    from megatron.patchset.core import registry

    patch = registry.get(NAME)
    assert patch.kind == "compat" and patch.flags == ("--fake-process-group",)
    assert patch.target == "megatron.core.distributed.param_and_grad_buffer.dist_all_gather_func"
