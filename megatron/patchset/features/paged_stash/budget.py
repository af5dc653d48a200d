"""HybridEP's static receive budget restored on CUDA-graph replay.

With ``--cuda-graph-modules ... moe_preprocess`` the dispatcher's preprocessing
(``_HybridEPManager.setup_metadata``, which sets the budget as a Python int) runs only while the
graph is captured; on replay only tensor attributes are restored, so from the second replay HybridEP
silently falls back to dynamic, CPU-synchronised dispatch. The patch recomputes the budget from the
restored routing map's shape before each dispatch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.registry import patch
from megatron.patchset.features.paged_stash.flags import preprocess_graphed


def rank_budget(num_tokens: int, topk: int, factor: float, align: int | None) -> int:
    """Rows of HybridEP's static per-rank receive buffer: tokens x top-k x the rank capacity
    factor, rounded up to ``align`` (megatron's sizing rule for ``num_permuted_tokens``)."""
    budget = int(num_tokens * topk * factor)
    if align:
        budget += -budget % align
    return budget


def restore_static_budget(manager: Any, align_for: Callable[[Any], int | None]) -> bool:
    """Set a HybridEP manager's static receive budget when a graph replay skipped the
    preprocessing that sets it; returns whether it was restored."""
    factor = getattr(manager, "moe_expert_rank_capacity_factor", None)
    routing_map = getattr(manager, "routing_map", None)
    if (
        factor is None
        or getattr(manager, "num_permuted_tokens", None) is not None
        or getattr(manager, "drop_and_pad", False)
        or routing_map is None
    ):
        return False
    rows = int(routing_map.shape[0])
    manager.num_permuted_tokens = rank_budget(
        rows, manager.config.moe_router_topk, factor, align_for(manager.config)
    )
    if getattr(manager, "_padded_num_tokens", None) is None:
        manager._padded_num_tokens = rows
    if getattr(manager, "_original_num_tokens", None) is None:
        manager._original_num_tokens = rows
    return True


@patch(
    "paged_stash.hybridep_budget_on_graph_replay",
    "megatron.core.transformer.moe.token_dispatcher._HybridEPManager.dispatch",
    reason="with CUDA graphs over moe_preprocess, HybridEP's setup_metadata (which sets the "
    "static receive budget as a Python int) only runs at capture; on replay the budget is lost "
    "and dispatch silently becomes dynamic and CPU-synchronised: recompute it from the restored "
    "routing map before dispatching",
    upstream_pr="fork-only (megatron-core 0.19.2 restores only tensor attributes on replay)",
    flags=("--moe-expert-rank-capacity-factor", "--cuda-graph-modules moe_preprocess"),
    enabled=lambda args: (
        getattr(args, "moe_expert_rank_capacity_factor", None) is not None
        and getattr(args, "moe_flex_dispatcher_backend", None) == "hybridep"
        and preprocess_graphed(args)
    ),
)
def _wrap_hybridep_dispatch(original):
    @functools.wraps(original)
    def dispatch(self, hidden_states, *args, **kwargs):
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

        restore_static_budget(self, get_align_size_for_quantization)
        return original(self, hidden_states, *args, **kwargs)

    return dispatch
