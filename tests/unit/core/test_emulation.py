"""The layout emulation's patch of the distributed optimizer's parameter all-gather under
megatron's ``--fake-process-group``: torch's fake backend copies an all-gather's input into every
rank's part of the output (the rank's whole parameter buffer at each step); with the patch the
parameter all-gather moves nothing, synchronous or coalesced and asynchronous as megatron's DDP
issues it, also where the data-parallel group holds the same ranks as the expert-parallel one."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.unit.support.cpu_train import free_port

NAME = "compat.fake_group_param_all_gather"


def worker(_, port, out, ep):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron.core import parallel_state
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from torch.distributed import _coalescing_manager
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron.patchset.core import registry

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=ep, create_gloo_process_groups=False
    )
    dp = parallel_state.get_data_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()

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
    seen["same_ranks"] = torch.distributed.get_process_group_ranks(
        dp
    ) == torch.distributed.get_process_group_ranks(ep_group)
    registry.apply_patches([registry.get(NAME)], check=False)
    try:
        seen["with"] = [gather(dp, False), gather(dp, True)]
    finally:
        registry.revert([NAME])
    torch.save(seen, out)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("ep", [2, 4])
def test_the_parameter_all_gather_copies_nothing_under_the_fake_group(tmp_path, ep):
    out = str(tmp_path / "seen.pt")
    mp.spawn(worker, args=(free_port(), out, ep), nprocs=1, join=True)
    seen = torch.load(out)
    assert seen["same_ranks"] is (ep == 4)  # EP 4 of 4: data- and expert-parallel ranks alike
    for output in seen["without"]:  # the fake backend's own copies, one per rank of 4
        assert output.shape == (4, 3) and torch.equal(output, torch.arange(3.0).expand(4, 3))
    for output in seen["with"]:
        assert output.eq(-1).all()


def test_the_patch_is_listed_for_the_fake_group_only():
    from megatron.patchset.core import registry

    patch = registry.get(NAME)
    assert patch.kind == "compat" and patch.flags == ("--fake-process-group",)
    assert patch.target == "megatron.core.distributed.param_and_grad_buffer.dist_all_gather_func"
