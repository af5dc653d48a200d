"""Backward P2P overlap for megatron's fine-grained (EP all-to-all overlapped) 1F1B schedule.

With ``--overlap-moe-expert-parallel-comm`` megatron-core schedules one forward and one
backward micro-batch of a model chunk together, layer by layer, through the model's *schedule
plan* (``GPTModel.build_schedule_plan``; the schedule calls ``type(plan).run``). In the
interleaved pipeline with ``overlap_p2p_comm``, the plan's ``run`` also receives the pipeline
send/receive callbacks. In megatron-core 0.19.2 the forward one (``post_forward``) is issued on
the communication stream but the backward one (``post_backward``) on the computation stream,
and only the attention weight gradient of the chunk's last backward layer is held back until
after ``post_backward`` to overlap it.

This module is the fork's own schedule plan with three options, read from the model's
``TransformerConfig`` (extra attributes set by
:func:`~megatron.patchset.features.p2p_overlap.flags.set_p2p_overlap_options`; a config without
them behaves exactly as upstream):

``overlap_p2p_backward_on_comm_stream`` (default False)
    ``post_backward`` runs on the communication stream, like ``post_forward``. When a backward
    P2P callback is present, the forward chunk's first layer's attention is issued before the
    backward receive is waited on, so that compute is queued while the receive is in flight.
``overlap_p2p_wgrad_delayed_layer_number`` N (default 1)
    The last N backward layers of the chunk (model layers N-1 ... 0) defer their weight
    gradients until after ``post_backward``; a chunk with fewer layers defers all of them.
``overlap_p2p_with_transformer_layer_wgrad`` (default False)
    Deferred layers defer their MLP/expert weight gradient as well, not only attention's.

Deferral only changes *when* a weight-gradient GEMM is enqueued, and only with
``delay_wgrad_compute`` (without it a node's ``backward_dw`` does nothing); every parameter still
receives the same gradients in the same order, so the arithmetic is upstream's.

Pieces:

* :func:`run_layer` / :func:`run_chunk`: the layer-level and chunk-level orders;
* ``P2POverlapLayerSchedulePlan``, ``P2POverlapChunkSchedulePlan``, ``P2POverlapGPTModel``:
  subclasses of megatron's layer plan, chunk plan and ``GPTModel`` using them. They are created
  on first access (this module is imported by the patch registry and stays cheap to import);
* the patch ``p2p_overlap.schedule_plan``: megatron's model builder
  (``megatron.training.models.gpt.GPTModelBuilder.build_model``) instantiates the ``GPTModel``
  name of its module, which the patch rebinds to ``P2POverlapGPTModel`` when a flag asks for it.
"""

from __future__ import annotations

from megatron.patchset.core.registry import PatchsetError, patch
from megatron.patchset.features.p2p_overlap.flags import P2POverlapOptions, options_from_config

PATCH_NAME = "p2p_overlap.schedule_plan"

# ---------------------------------------------------------------------------------------
# The orders
# ---------------------------------------------------------------------------------------


def _forward(layer, node: str, hidden):
    """One forward node of ``layer`` (nothing when there is no forward layer)."""
    if layer is None:
        return hidden
    with layer.get_low_precision_context():
        return getattr(layer, node).forward(hidden)


def _backward(layer, node: str, grad):
    """One backward (input-gradient) node of ``layer``."""
    if layer is None:
        return grad
    return getattr(layer, node).backward(grad)


def run_layer(
    f_layer,
    b_layer,
    f_input=None,
    b_grad=None,
    *,
    skip_f_pre_dispatch: bool = False,
    defer_pre_dispatch_dw: bool = False,
    defer_mlp_dw: bool = False,
):
    """One forward layer and one backward layer, interleaved as upstream's layer plan does.

    Each all-to-all of one direction runs on the communication stream while the other
    direction computes. Differences from upstream, all off by default:

    * ``skip_f_pre_dispatch``: the forward attention (pre-dispatch computation) already ran,
      issued early by :func:`run_chunk`;
    * ``defer_mlp_dw``: the backward MLP/expert weight gradient is left to the caller;
    * ``defer_pre_dispatch_dw``: so is the attention (and shared-expert) weight gradient.
      Upstream's ``is_last_layer_in_bwd`` is this flag for the chunk's last backward layer.

    Returns ``(f_output, b_input_grad)``.
    """
    early_attn_release = b_layer is not None and b_layer.config.ep_overlap_early_attn_memory_release

    b_grad = _backward(b_layer, "mtp_post_process", b_grad)
    b_grad = _backward(b_layer, "moe_combine", b_grad)  # comm
    if not skip_f_pre_dispatch:
        f_input = _forward(f_layer, "pre_dispatch_computation", f_input)
    b_grad = _backward(b_layer, "mlp", b_grad)
    f_input = _forward(f_layer, "moe_dispatch", f_input)  # comm
    if b_layer is not None and not defer_mlp_dw:
        b_layer.mlp.backward_dw()
    b_grad = _backward(b_layer, "moe_dispatch", b_grad)  # comm
    if early_attn_release:
        b_grad = _backward(b_layer, "pre_dispatch_computation", b_grad)
    f_input = _forward(f_layer, "mlp", f_input)
    f_input = _forward(f_layer, "moe_combine", f_input)  # comm
    if not early_attn_release:
        b_grad = _backward(b_layer, "pre_dispatch_computation", b_grad)
    f_input = _forward(f_layer, "mtp_post_process", f_input)
    if b_layer is not None and not defer_pre_dispatch_dw:
        b_layer.pre_dispatch_computation.backward_dw()
    return f_input, b_grad


def _plan_options(f_plan, b_plan) -> P2POverlapOptions:
    # Both plans come from chunks of one model, which share one config; the backward plan is
    # the one whose behaviour the options change.
    plan = b_plan if b_plan is not None else f_plan
    return options_from_config(getattr(plan, "config", None))


def _flush_deferred_wgrad(layer, with_mlp: bool) -> None:
    """A deferred layer's weight gradients, then its state. MLP first: the attention node is the
    layer's first backward node, whose ``backward_dw`` fires Megatron-FSDP's post-backward
    hook (releasing the layer's gathered parameters)."""
    if with_mlp:
        layer.mlp.backward_dw()
    layer.pre_dispatch_computation.backward_dw()
    layer.release_state()


def run_chunk(
    f_schedule_plan,
    b_schedule_plan,
    b_grad=None,
    pre_forward=None,
    pre_backward=None,
    post_forward=None,
    post_backward=None,
):
    """Forward of one micro-batch and backward of another through one model chunk.

    Same protocol as upstream's ``TransformerModelChunkSchedulePlan.run`` (the schedule passes
    the pipeline callbacks, each taking the chunk's ``vp_stage``). Order:

    1. forward: ``pre_forward``, embedding; with the comm-stream option and a backward P2P
       callback, also layer 0's attention;
    2. backward: ``pre_backward`` (waits for the backward receive), output-layer backward;
    3. layers: forward layer i with backward layer (n-1-i), then the unpaired rest; the last
       N backward layers keep their weight gradients (attention, and MLP with the
       transformer-layer option) and their state;
    4. ``post_forward`` on the communication stream; ``post_backward`` on the communication
       stream with the option, else on the computation stream;
    5. the deferred weight gradients, in backward order, each layer's state released after;
    6. output layer forward, embedding backward, stream joins, release of the backward plan.

    With the default options this is upstream's order, call for call.
    """
    import torch
    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.utils import nvtx_range_pop, nvtx_range_push

    f_plan, b_plan = f_schedule_plan, b_schedule_plan
    options = _plan_options(f_plan, b_plan)
    f_count = f_plan.num_layers() if f_plan is not None else 0
    b_count = b_plan.num_layers() if b_plan is not None else 0
    # Backward layer positions (0 = first popped = last model layer) from which wgrads wait.
    first_deferred = b_count - min(max(options.wgrad_delayed_layers, 0), b_count)
    issue_attention_early = (
        options.backward_on_comm_stream
        and post_backward is not None
        and b_plan is not None
        and f_count > 0
    )

    f_input = None
    if f_plan is not None:
        if pre_forward is not None:
            pre_forward(f_plan.vp_stage)
        f_plan.record_current_stream()
        f_input = f_plan.pre_process.forward()
        if issue_attention_early:
            # pre_backward below makes the computation stream wait for the backward receive;
            # queue independent forward work before it.
            f_input = _forward(f_plan.get_layer(0), "pre_dispatch_computation", f_input)

    if b_plan is not None:
        b_plan.record_current_stream()
        assert b_grad is not None, "a backward schedule plan needs the output gradient"
        if pre_backward is not None:
            pre_backward(b_plan.vp_stage)
            b_plan.record_current_stream()
        if b_plan.post_process is not None:
            b_grad = b_plan.post_process.backward(b_grad)

    deferred = []
    for position in range(max(f_count, b_count)):
        # Past min(f_count, b_count) only one side has layers left, so this is upstream's
        # paired loop followed by the backward-only and then the forward-only remainder.
        f_layer = f_plan.get_layer(position) if position < f_count else None
        b_layer = b_plan.pop_layer() if position < b_count else None
        defer = b_layer is not None and position >= first_deferred
        label = f"p2p-overlap layer step {position}"
        nvtx_range_push(label)
        f_input, b_grad = run_layer(
            f_layer,
            b_layer,
            f_input,
            b_grad,
            skip_f_pre_dispatch=issue_attention_early and position == 0,
            defer_pre_dispatch_dw=defer,
            defer_mlp_dw=defer and options.transformer_layer_wgrad,
        )
        if defer:
            deferred.append(b_layer)
        elif b_layer is not None:
            b_layer.release_state()
        nvtx_range_pop(label)

    if f_plan is not None and post_forward is not None:
        with torch.cuda.stream(pp_utils.get_comm_stream()):
            f_plan.wait_current_stream()
            post_forward(f_input, f_plan.vp_stage)
    if b_plan is not None and post_backward is not None:
        if options.backward_on_comm_stream:
            with torch.cuda.stream(pp_utils.get_comm_stream()):
                b_plan.wait_current_stream()
                post_backward(b_grad, b_plan.vp_stage)
        else:
            b_plan.wait_current_stream()
            post_backward(b_grad, b_plan.vp_stage)

    # The weight-gradient GEMMs run on the computation stream while the P2P is in flight.
    for layer in deferred:
        _flush_deferred_wgrad(layer, options.transformer_layer_wgrad)

    if f_plan is not None and f_plan.post_process is not None:
        f_input = f_plan.post_process.forward(f_input)
    if b_plan is not None:
        b_plan.pre_process.backward(b_grad)
    for plan in (f_plan, b_plan):
        if plan is not None:
            plan.wait_current_stream()
    if b_plan is not None:
        b_plan.release_state()
    return f_input


# ---------------------------------------------------------------------------------------
# Classes (built on first access: megatron's model modules are slow to import)
# ---------------------------------------------------------------------------------------

_CLASS_NAMES = ("P2POverlapLayerSchedulePlan", "P2POverlapChunkSchedulePlan", "P2POverlapGPTModel")
_CLASSES: dict | None = None


def _build_classes() -> dict:
    from megatron.core.models.common.model_chunk_schedule_plan import (
        TransformerLayerSchedulePlan,
        TransformerModelChunkSchedulePlan,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    class P2POverlapLayerSchedulePlan(TransformerLayerSchedulePlan):
        """megatron's layer plan (same nodes) with the fork's :func:`run_layer`."""

        run = staticmethod(run_layer)

    class P2POverlapChunkSchedulePlan(TransformerModelChunkSchedulePlan):
        """megatron's chunk plan with the fork's layer plans and :func:`run_chunk`."""

        LAYER_SCHEDULE_PLAN_CLASS = P2POverlapLayerSchedulePlan
        run = staticmethod(run_chunk)

        def __init__(self, model, *args, **kwargs):
            super().__init__(model, *args, **kwargs)
            # run_chunk reads the options here: release_state() drops the chunk state's model.
            self.config = model.config

    class P2POverlapGPTModel(GPTModel):
        """megatron's GPTModel whose fine-grained schedule plan is the fork's."""

        def build_schedule_plan(
            self,
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=None,
            labels=None,
            inference_context=None,
            packed_seq_params=None,
            extra_block_kwargs=None,
            runtime_gather_output=None,
            inference_params=None,
            loss_mask=None,
            padding_mask=None,
            *,
            output_processor=None,
            output_processor_context=None,
        ):
            """Same signature and preparation as ``GPTModel.build_schedule_plan``; returns a
            :class:`P2POverlapChunkSchedulePlan`. Inference arguments are unused, as upstream."""
            del inference_context, inference_params
            if self.config.fine_grained_activation_offloading:
                self.preprocess_for_fine_grained_offloading()
            if self.config.moe_paged_stash:
                self.preprocess_for_paged_stash()
            return P2POverlapChunkSchedulePlan(
                self,
                input_ids,
                position_ids,
                attention_mask,
                decoder_input=decoder_input,
                labels=labels,
                packed_seq_params=packed_seq_params,
                extra_block_kwargs=extra_block_kwargs,
                runtime_gather_output=runtime_gather_output,
                loss_mask=loss_mask,
                padding_mask=padding_mask,
                output_processor=output_processor,
                output_processor_context=output_processor_context,
            )

    classes = {}
    for cls in (P2POverlapLayerSchedulePlan, P2POverlapChunkSchedulePlan, P2POverlapGPTModel):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        classes[cls.__name__] = cls
    return classes


def plan_classes() -> dict:
    """``{name: class}`` of the three subclasses, created once."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _build_classes()
    return _CLASSES


def __getattr__(name: str):
    if name in _CLASS_NAMES:
        return plan_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------
# The patch
# ---------------------------------------------------------------------------------------


@patch(
    PATCH_NAME,
    "megatron.training.models.gpt.GPTModel",
    reason="the fine-grained 1F1B plan issues the backward P2P on the computation stream and "
    "defers only one attention wgrad past it; build P2POverlapGPTModel, whose plan does neither",
    kind="feature",
)
def _model_class(original):
    """The model builder's ``GPTModel`` becomes :class:`P2POverlapGPTModel` (a subclass)."""
    cls = plan_classes()["P2POverlapGPTModel"]
    if not issubclass(cls, original):
        raise PatchsetError(
            f"{PATCH_NAME}: megatron.training.models.gpt.GPTModel is {original!r}, not "
            "megatron-core's GPTModel (or a base of it); another change replaced it first"
        )
    return cls
