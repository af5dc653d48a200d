"""The three P2P-overlap flags, their defaults (megatron-core 0.19.2's behaviour) and how they
reach the schedule plan: as extra attributes of the model's ``TransformerConfig``."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

# Config attribute (and argparse dest) -> value that reproduces megatron-core 0.19.2.
BACKWARD_ON_COMM_STREAM = "overlap_p2p_backward_on_comm_stream"
WGRAD_DELAYED_LAYERS = "overlap_p2p_wgrad_delayed_layer_number"
TRANSFORMER_LAYER_WGRAD = "overlap_p2p_with_transformer_layer_wgrad"
DEFAULTS = {
    BACKWARD_ON_COMM_STREAM: False,
    WGRAD_DELAYED_LAYERS: 1,
    TRANSFORMER_LAYER_WGRAD: False,
}
FLAGS = tuple("--" + name.replace("_", "-") for name in DEFAULTS)


@dataclasses.dataclass(frozen=True)
class P2POverlapOptions:
    """The three options as the plan uses them."""

    backward_on_comm_stream: bool = DEFAULTS[BACKWARD_ON_COMM_STREAM]
    wgrad_delayed_layers: int = DEFAULTS[WGRAD_DELAYED_LAYERS]
    transformer_layer_wgrad: bool = DEFAULTS[TRANSFORMER_LAYER_WGRAD]


def options_from_config(config: Any) -> P2POverlapOptions:
    """The options stored on a TransformerConfig; upstream's behaviour for missing ones."""
    return P2POverlapOptions(
        backward_on_comm_stream=bool(
            getattr(config, BACKWARD_ON_COMM_STREAM, DEFAULTS[BACKWARD_ON_COMM_STREAM])
        ),
        wgrad_delayed_layers=int(
            getattr(config, WGRAD_DELAYED_LAYERS, DEFAULTS[WGRAD_DELAYED_LAYERS])
        ),
        transformer_layer_wgrad=bool(
            getattr(config, TRANSFORMER_LAYER_WGRAD, DEFAULTS[TRANSFORMER_LAYER_WGRAD])
        ),
    )


def set_p2p_overlap_options(
    config: Any,
    *,
    overlap_p2p_backward_on_comm_stream: bool = DEFAULTS[BACKWARD_ON_COMM_STREAM],
    overlap_p2p_wgrad_delayed_layer_number: int = DEFAULTS[WGRAD_DELAYED_LAYERS],
    overlap_p2p_with_transformer_layer_wgrad: bool = DEFAULTS[TRANSFORMER_LAYER_WGRAD],
) -> None:
    """Store the options on ``config`` (megatron's TransformerConfig) for the schedule plan.

    ``core_transformer_config_from_args`` copies dataclass fields only, so the options are set
    here, after the config is built. The command-line rules check the layout-dependent upper
    bound of the layer number; this only refuses values no layout can use.
    """
    number = overlap_p2p_wgrad_delayed_layer_number
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ValueError(
            f"{WGRAD_DELAYED_LAYERS} must be an integer >= 1 (the number of backward layers whose "
            f"weight gradients wait for the backward P2P), got {number!r}"
        )
    setattr(config, BACKWARD_ON_COMM_STREAM, bool(overlap_p2p_backward_on_comm_stream))
    setattr(config, WGRAD_DELAYED_LAYERS, number)
    setattr(config, TRANSFORMER_LAYER_WGRAD, bool(overlap_p2p_with_transformer_layer_wgrad))


def requested(args: Any) -> bool:
    """Whether the parsed arguments set any of the three options to a non-default value."""
    return any(getattr(args, name, default) != default for name, default in DEFAULTS.items())


def chunk_layer_counts(config: Any) -> list[int]:
    """Layers (decoder and MTP) in every model chunk, for all pipeline ranks and virtual stages.

    These are the layers a chunk's schedule plan holds, i.e. the most that
    ``overlap_p2p_wgrad_delayed_layer_number`` can defer in that chunk.
    """
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    layout = config.pipeline_model_parallel_layout
    if layout is not None and hasattr(layout, "layout"):
        from megatron.core.transformer.enums import LayerType

        return [
            sum(1 for kind in stage if kind in (LayerType.decoder, LayerType.mtp))
            for rank_stages in layout.layout
            for stage in rank_stages
        ]
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    counts = []
    for rank in range(pp):
        for stage in range(vpp):
            count = get_num_layers_to_build(
                config, vp_stage=stage if vpp > 1 else None, pp_rank=rank
            )
            if rank == pp - 1 and stage == vpp - 1:
                count += config.mtp_num_layers or 0  # MTP sits after the last decoder layer
            counts.append(count)
    return counts


def flags_given(args: argparse.Namespace) -> str:
    """The P2P-overlap flags set away from their defaults, as they were typed."""
    given = []
    for name, default in DEFAULTS.items():
        value = getattr(args, name, default)
        if value != default:
            flag = "--" + name.replace("_", "-")
            given.append(flag if isinstance(default, bool) else f"{flag} {value}")
    return ", ".join(given)


def configure_config(args: argparse.Namespace, config: Any) -> None:
    """Copy the flags onto megatron's TransformerConfig (every run; defaults are upstream's)."""
    if all(hasattr(args, name) for name in DEFAULTS):
        set_p2p_overlap_options(config, **{name: getattr(args, name) for name in DEFAULTS})


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--overlap-p2p-backward-on-comm-stream",
        action="store_true",
        default=False,
        help="In the interleaved 1F1B schedule with --overlap-moe-expert-parallel-comm, run the "
        "backward pipeline send/receive on the communication stream, as megatron already does for "
        "the forward one, so that it overlaps the next virtual stage's forward compute; the first "
        "forward layer's attention is issued before the backward receive is waited on. Needs "
        "--delay-wgrad-compute, pipeline parallelism with a virtual pipeline and P2P overlap (no "
        "--no-overlap-p2p-communication).",
    )
    group.add_argument(
        "--overlap-p2p-wgrad-delayed-layer-number",
        type=int,
        default=1,
        help="In the fine-grained 1F1B schedule (--overlap-moe-expert-parallel-comm with "
        "--delay-wgrad-compute), the last N backward layers of each model chunk defer their "
        "weight-gradient compute until after the backward pipeline send/receive, to overlap it. "
        "Between 1 and the number of layers in a model chunk; a chunk with fewer layers defers "
        "all of them. 1 is megatron's behaviour (only the last backward layer's attention weight "
        "gradient waits).",
    )
    group.add_argument(
        "--overlap-p2p-with-transformer-layer-wgrad",
        action="store_true",
        default=False,
        help="The layers deferred by --overlap-p2p-wgrad-delayed-layer-number defer both their "
        "attention and their MLP/expert weight gradients, not attention alone.",
    )
