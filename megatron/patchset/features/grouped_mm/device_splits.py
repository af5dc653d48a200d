"""``--moe-expert-splits-on-device``: the per-expert token counts stay on the GPU.

With one expert-parallel and expert-tensor-parallel rank, megatron's all-to-all dispatcher copies
the counts to the host and waits only so that TE's grouped linear can split its input there; the
torch grouped_mm experts (:mod:`.linears`) take them on the device, so a dropless MoE layer runs
without a host synchronisation and a full-iteration CUDA graph can capture it.
"""

from __future__ import annotations

import functools

from megatron.patchset.core.registry import patch
from megatron.patchset.features.grouped_mm.flags import FLAG, SPLITS_FLAG, splits_on_device
from megatron.patchset.features.grouped_mm.linears import DeviceSplits, GroupedMMForward

_TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_EXPERTS = "megatron.core.transformer.moe.experts"
_SPLITS_UPSTREAM_PR = (
    "proposed (megatron-core 0.19.2 always copies the token counts to the host for TE's grouped "
    "linear)"
)
_SPLITS_REASON = (
    "with one expert-parallel and expert-tensor-parallel rank the all-to-all dispatcher copies "
    "the per-expert token counts to the host and waits for the copy only so that TE's grouped "
    "linear can split its input on the host; the torch grouped_mm takes them on the device, so "
    "the MoE layer runs without a host synchronisation and a full-iteration CUDA graph can "
    "capture it"
)


def host_splits_needed(dispatcher) -> list[str]:
    """What makes this all-to-all dispatcher need the token counts on the host (empty: nothing)."""
    config = dispatcher.config
    needs = []
    if dispatcher.ep_size != 1:
        needs.append(
            f"expert parallelism ({dispatcher.ep_size} ranks: the all-to-all takes host split "
            "sizes)"
        )
    if dispatcher.tp_size != 1:
        needs.append(
            f"expert tensor parallelism ({dispatcher.tp_size} ranks: the all-gather takes host "
            "split sizes)"
        )
    if config.moe_expert_capacity_factor is not None or config.moe_router_padding_for_quantization:
        needs.append("token dropping or padding (the permuted token count is dynamic)")
    if dispatcher.num_local_experts > 1 and not config.moe_permute_fusion:
        needs.append("--moe-permute-fusion (the unfused chunk sort splits on the host)")
    return needs


@patch(
    "grouped_mm.splits_on_device_dispatcher",
    f"{_TOKEN_DISPATCHER}.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
    reason=_SPLITS_REASON,
    upstream_pr=_SPLITS_UPSTREAM_PR,
    flags=(SPLITS_FLAG,),
    enabled=splits_on_device,
)
def dispatcher_keeps_splits_on_device(original):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` that returns the token counts as
    they are, on the device, and neither copies nor synchronises (see :data:`_SPLITS_REASON`)."""

    @functools.wraps(original)
    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if self.drop_and_pad:  # upstream copies nothing there either
            return original(self, point, tokens_per_expert)
        needs = host_splits_needed(self)
        if needs:
            raise RuntimeError(
                f"{SPLITS_FLAG}: this MoE layer's all-to-all dispatcher needs the per-expert token "
                f"counts on the host for {'; '.join(needs)}. Drop {SPLITS_FLAG} for this layout."
            )
        return tokens_per_expert

    return _maybe_dtoh_and_synchronize


@patch(
    "grouped_mm.splits_on_device_grouped_mlp",
    f"{_EXPERTS}.TEGroupedMLP.forward",
    reason="TEGroupedMLP.forward turns the token counts into a host list (.tolist(): a "
    "device-to-host copy and sync); hand them to the torch grouped_mm linears on the device "
    "instead",
    upstream_pr=_SPLITS_UPSTREAM_PR,
    flags=(SPLITS_FLAG,),
    enabled=splits_on_device,
)
def grouped_mlp_takes_device_splits(original):
    """``TEGroupedMLP.forward`` that hands a token-count tensor to its linears as
    :class:`DeviceSplits` (upstream calls ``.tolist()`` on it, a device-to-host copy and sync)."""

    @functools.wraps(original)
    def forward(
        self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs
    ):
        import torch

        if isinstance(tokens_per_expert, torch.Tensor):
            fused = getattr(self, "_with_fused_impl", False)
            if not isinstance(self.linear_fc1, GroupedMMForward) or fused:
                runs = type(self.linear_fc1).__name__ + (
                    " through the TE op fuser" if fused else ""
                )
                raise RuntimeError(
                    f"{SPLITS_FLAG} needs the experts' linears of {FLAG} torch; this TEGroupedMLP "
                    f"runs {runs}"
                )
            tokens_per_expert = DeviceSplits(tokens_per_expert)
        return original(
            self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs
        )

    return forward
