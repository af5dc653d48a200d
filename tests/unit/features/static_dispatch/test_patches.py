"""The static dispatch's patches: the dispatcher class megatron's MoE layer builds, and the step
wrapper megatron's training loop builds (the graph wrapper under full-iteration graphs, the
forward-backward function otherwise); all revertible."""

import pytest

from megatron.patchset.core import registry
from tests.unit.conftest import parse, tiny_argv

STATIC = (
    "--moe-grouped-gemm-impl",
    "torch",
    "--moe-expert-splits-on-device",
    "--moe-permute-fusion",
    "--moe-static-dispatch",
)


@pytest.mark.parametrize("graphs", [True, False])
def test_patches_rebind_what_megatron_builds_and_revert(graphs):
    import megatron.training.training as training
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    extra = ("--cuda-graph-impl", "full_iteration") if graphs else ()
    args = parse(tiny_argv(*STATIC, *extra))
    patches = [p for p in registry.selected(args) if p.feature == "static_dispatch"]
    expected = {"static_dispatch.dispatcher"} | (
        {"static_dispatch.graph_step"} if graphs else {"static_dispatch.eager_step"}
    )
    assert {p.name for p in patches} == expected
    original_fb = training.get_forward_backward_func
    registry.apply_patches(patches)
    try:
        dispatcher = moe_layer.MoEAlltoAllTokenDispatcher
        assert issubclass(dispatcher, token_dispatcher.MoEAlltoAllTokenDispatcher)
        assert dispatcher is not token_dispatcher.MoEAlltoAllTokenDispatcher
        if graphs:
            assert issubclass(training.FullCudaGraphWrapper, FullCudaGraphWrapper)
            assert training.FullCudaGraphWrapper is not FullCudaGraphWrapper
        else:
            assert training.get_forward_backward_func is not original_fb
            assert training.FullCudaGraphWrapper is FullCudaGraphWrapper
    finally:
        registry.revert([p.name for p in patches])
    assert moe_layer.MoEAlltoAllTokenDispatcher is token_dispatcher.MoEAlltoAllTokenDispatcher
    assert training.FullCudaGraphWrapper is FullCudaGraphWrapper
    assert training.get_forward_backward_func is original_fb


def test_without_the_flag_nothing_of_it_applies():
    args = parse(tiny_argv("--moe-grouped-gemm-impl", "torch"))
    assert not [p for p in registry.selected(args) if p.feature == "static_dispatch"]
