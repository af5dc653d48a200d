"""HybridEP's static receive budget restored on CUDA-graph replay."""

import types

import torch

from megatron.patchset.core import registry
from megatron.patchset.features.paged_stash import budget


def _hybridep_manager(**kw):
    cfg = types.SimpleNamespace(moe_router_topk=2)
    m = types.SimpleNamespace(
        config=cfg,
        moe_expert_rank_capacity_factor=1.5,
        num_permuted_tokens=None,
        drop_and_pad=False,
        routing_map=torch.zeros(4096, 8, dtype=torch.bool),
        _padded_num_tokens=None,
        _original_num_tokens=None,
    )
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def test_budget_restored_on_replay():
    m = _hybridep_manager()
    assert budget.restore_static_budget(m, lambda cfg: 256)
    assert m.num_permuted_tokens == 12288 and m._padded_num_tokens == 4096 == m._original_num_tokens


def test_budget_left_alone_when_set_or_dropless():
    m = _hybridep_manager(num_permuted_tokens=777)
    assert not budget.restore_static_budget(m, lambda cfg: 256) and m.num_permuted_tokens == 777
    m = _hybridep_manager(moe_expert_rank_capacity_factor=None)  # megatron's dropless re-run
    assert not budget.restore_static_budget(m, lambda cfg: 256) and m.num_permuted_tokens is None


def test_hybridep_dispatch_wrapper_calls_through():
    seen = {}

    def dispatch(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        seen["budget"] = self.num_permuted_tokens
        return hidden_states

    wrapped = registry.get("paged_stash.hybridep_budget_on_graph_replay").factory(dispatch)
    m = _hybridep_manager()
    m.config.use_transformer_engine_op_fuser, m.config.fp8, m.config.fp4 = True, None, None
    assert wrapped(m, "h") == "h" and seen["budget"] == 12288
