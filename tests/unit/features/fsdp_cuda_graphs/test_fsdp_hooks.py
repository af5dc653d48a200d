"""Megatron-FSDP's hooks carry markers naming their inner handlers, unknown hooks are a drift error,
gradient hooks pause during capture, and the real Megatron-FSDP registers the hooks the markers
expect."""

import functools
import types

import pytest
import torch

from megatron.patchset.features.fsdp_cuda_graphs import fsdp_hooks, te_graphs
from tests.unit.features.fsdp_cuda_graphs.fakes import unit_and_log


def test_markers_name_the_inner_handlers():
    unit, root, _, _ = unit_and_log(with_root=True)
    roles = {}
    for module in (unit, root):
        for table in (module._forward_pre_hooks, module._forward_hooks):
            for fn in table.values():
                roles.setdefault(fsdp_hooks.local_name(fn), set()).add(fsdp_hooks.mark_hook(fn))
    assert roles == {
        "_pre_forward_param_unshard": {"plain"},
        "_post_forward": {"plain"},
        "_register_post_backward_hook": {"backward"},
        "create_custom_backward_hook.<locals>.forward_hook": {"backward_pre", "withhold"},
    }
    wrapper = next(
        fn for fn in unit._forward_pre_hooks.values() if isinstance(fn, functools.partial)
    )
    assert (
        fsdp_hooks.local_name(getattr(wrapper, fsdp_hooks.BACKWARD_HANDLER))
        == "_post_backward_release_module"
    )
    assert (
        fsdp_hooks.local_name(torch.nn.Linear.forward) is None
        and fsdp_hooks.mark_hook(print) is None
    )


def test_unknown_fsdp_hook_is_a_drift_error():
    def _new_hook(module, *unused):
        return None

    _new_hook.__qualname__ = "MegatronFSDP._register_fsdp_hooks.<locals>._new_hook"
    with pytest.raises(fsdp_hooks.FSDPHookDriftError, match="_new_hook"):
        fsdp_hooks.mark_hook(_new_hook)


def test_gradient_hooks_pause_while_capturing():
    unit, _, registrar, log = unit_and_log()
    capturing = [True]
    assert (
        fsdp_hooks.guard_gradient_hooks(registrar.grad_acc_hooks.values(), lambda: capturing[0])
        == 2
    )
    assert (
        fsdp_hooks.guard_gradient_hooks(registrar.grad_acc_hooks.values(), lambda: capturing[0])
        == 2
    )  # no double wrap
    stash = te_graphs.take_off_hooks(unit)
    unit(torch.randn(2, 4)).sum().backward()
    assert "process_grads" not in log
    capturing[0] = False
    unit(torch.randn(2, 4)).sum().backward()
    assert log.count("process_grads") == 2
    te_graphs.restore_hooks(stash)
    handle = next(iter(registrar.grad_acc_hooks.values()))
    handle.remove()  # the handle still refers to the guarded entry
    log.clear()
    unit(torch.randn(2, 4)).sum().backward()
    assert log.count("process_grads") == 1


def _local_code_objects(code, prefix=""):
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const.co_qualname, const
            yield from _local_code_objects(const)


def test_real_megatron_fsdp_hook_functions_are_known():
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    local = dict(_local_code_objects(MegatronFSDP._register_fsdp_hooks.__code__))
    prefix = "MegatronFSDP._register_fsdp_hooks.<locals>."
    for name in (
        "_pre_forward_param_unshard",
        "_post_forward",
        "_register_post_backward_hook",
        "_post_backward_release_module",
        "_pre_backward_param_unshard",
        "_root_pre_backward",
        "_release_module_fp8_transpose_cache",
        "create_custom_backward_hook.<locals>.forward_hook",
    ):
        assert prefix + name in local, name
    assert local[prefix + "create_custom_backward_hook.<locals>.forward_hook"].co_freevars == (
        "custom_backward_handler",
    )
    # The capture helper and the adapter still look these names up.
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    import megatron.training.training as training

    assert adapter.MegatronFSDP is MegatronFSDP
    assert training.TECudaGraphHelper.__name__ == "TECudaGraphHelper"
