"""Which order the static dispatch lays the experts' rows out in: from the last local expert to
the first where megatron's DDP buffers hold the layer's expert weights in that order (under the
distributed optimizer), so that the grouped GEMMs read them in place; in expert order otherwise."""

from types import SimpleNamespace

import torch

from megatron.patchset.features.static_dispatch.dispatcher import orient_experts
from tests.unit.features.grouped_mm.conftest import IN, OUT, FakeTEGroupedLinear

EXPERTS = 4


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.token_dispatcher = SimpleNamespace(experts_descending=None)
        self.experts = torch.nn.Module()
        self.experts.linear_fc1 = FakeTEGroupedLinear(EXPERTS, IN, 2 * OUT)
        self.experts.linear_fc2 = FakeTEGroupedLinear(EXPERTS, OUT, IN)


def place_like_ddp(model):
    """Every parameter as a view of one flat buffer, laid out as megatron-core's DDP lays out a
    buffer (its own layout function: parameters in reverse order)."""
    from megatron.core.distributed.param_and_grad_buffer import (
        _compute_default_per_buffer_param_layout,
    )

    params = list(model.parameters())
    layout = _compute_default_per_buffer_param_layout(params, None)
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.bfloat16)
    for p in params:
        start, end, _ = layout.param_index_map[p]
        buffer[start:end].copy_(p.detach().reshape(-1))
        p.data = buffer[start:end].view(p.shape)


def test_weights_in_ddps_buffer_take_the_descending_layout():
    model = torch.nn.Sequential(Layer(), Layer())
    place_like_ddp(model)
    orient_experts(model)
    assert [layer.token_dispatcher.experts_descending for layer in model] == [True, True]


def test_weights_of_their_own_keep_expert_order_and_the_choice_is_made_once():
    model = torch.nn.Sequential(Layer())
    orient_experts([model])
    assert model[0].token_dispatcher.experts_descending is False
    place_like_ddp(model)
    orient_experts([model])  # once per model chunk: a graph captured since keeps its layout
    assert model[0].token_dispatcher.experts_descending is False


def test_one_linear_out_of_order_keeps_expert_order():
    model = torch.nn.Sequential(Layer())
    place_like_ddp(model[0].experts.linear_fc1)
    orient_experts(model)
    assert model[0].token_dispatcher.experts_descending is False


def test_layers_without_a_static_dispatcher_are_left_alone():
    layer = Layer()
    layer.token_dispatcher = SimpleNamespace()
    place_like_ddp(layer)
    orient_experts(layer)
    orient_experts(None)
    assert not hasattr(layer.token_dispatcher, "experts_descending")
