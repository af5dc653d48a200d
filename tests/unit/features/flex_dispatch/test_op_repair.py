"""The repair of custom-op ADInplaceOrView kernels that index mutated arguments torch 2.11 dropped
for equalling their defaults (TE 2.20's NCCL EP ops), on ops defined the same way here."""

import pytest

from megatron.patchset.features.flex_dispatch import manager_checks


def _define_ep_like_ops(namespace):
    """Ops shaped like transformer_engine_ep::prepare_and_dispatch: mutated outputs, the last
    one optional with default None; and one whose mutated arguments have no default."""

    import torch

    @torch.library.custom_op(
        f"{namespace}::dispatch", mutates_args=("state", "out", "scale"), device_types="cpu"
    )
    def dispatch(
        state: torch.Tensor,
        x: torch.Tensor,
        k: int,
        out: torch.Tensor,
        scale: torch.Tensor | None = None,
    ) -> None:
        out.copy_(x * k)
        state.add_(1)
        if scale is not None:
            scale.fill_(float(k))

    @torch.library.custom_op(f"{namespace}::plain", mutates_args=("out",), device_types="cpu")
    def plain(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    return dispatch, plain


def test_repair_of_custom_op_kernels_that_index_dropped_default_arguments():
    import torch

    ns = "ps_unit_ep"
    _define_ep_like_ops(ns)
    state, x, out = torch.zeros(2), torch.ones(3, requires_grad=True), torch.empty(3)
    # The defect on the pinned torch: the default None is dropped, the kernel indexes it.
    with pytest.raises(IndexError, match="tuple index out of range"):
        torch.ops.ps_unit_ep.dispatch(state, x, 2, out, None)

    assert manager_checks.repair_mutable_default_kernels(ns) == [
        f"{ns}::dispatch"
    ]  # plain has no defaults
    assert manager_checks.repair_mutable_default_kernels(ns) == []  # idempotent
    before = out._version
    torch.ops.ps_unit_ep.dispatch(state, x, 2, out, None)
    assert out.tolist() == [2.0, 2.0, 2.0] and state.tolist() == [1.0, 1.0]
    assert out._version > before  # autograd still sees the mutation
    scale = torch.zeros(1)
    torch.ops.ps_unit_ep.dispatch(state, x, 3, out, scale)
    assert (
        out.tolist() == [3.0, 3.0, 3.0] and scale.tolist() == [3.0] and state.tolist() == [2.0, 2.0]
    )
    torch.ops.ps_unit_ep.plain(x.detach(), out)
    assert out.tolist() == [1.0, 1.0, 1.0]
