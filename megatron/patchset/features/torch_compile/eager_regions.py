"""The MoE layer's eager (compile-disabled) regions, and the traceability fixes of the router's
aux-loss backward, force-balanced random logits and the local spec's TP-group look-up."""

from __future__ import annotations

import functools
from collections.abc import Callable

from megatron.patchset.core.registry import patch
from megatron.patchset.features.torch_compile.flags import FLAG, force_load_balancing

_MOE_LAYER = "megatron.core.transformer.moe.moe_layer.MoELayer"
_AUX_SCALER = "megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler"


def eager_region(original: Callable, data_dependent_outputs: bool = False) -> Callable:
    """``original`` under ``torch.compiler.disable``, run with the default compile stance.

    The stance reset matters after warm-up, when compiled layers run under ``fail_on_recompile``:
    functions that megatron itself compiles (``jit_fuser``) and that are called eagerly in here,
    such as the experts' fused activation, may legitimately specialise on per-expert token
    counts; only the layer's own frames are held to "no recompiles".

    With ``data_dependent_outputs`` the first dimension of the returned tensors (the tokens this
    rank received from its expert-parallel peers) is marked unbacked before the compiled code
    resumes with it: otherwise the resumed frame guards on that size, and a rank that receives
    0 or 1 tokens after warm-up (0/1 specialisation) recompiles.
    """
    import torch
    from torch._dynamo.decorators import mark_unbacked

    @functools.wraps(original)
    def region(*args, **kwargs):
        with torch.compiler.set_stance("default"):
            result = original(*args, **kwargs)
        if data_dependent_outputs:
            for value in result if isinstance(result, tuple) else (result,):
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    mark_unbacked(value, 0)
        return result

    return torch.compiler.disable(region)


@patch(
    "torch_compile.moe_dispatch_eager",
    f"{_MOE_LAYER}.dispatch",
    reason="token dispatch is a collective with host-side split sizes and side streams (all-to-all "
    "D2H copies and event syncs, all-gather, DeepEP/HybridEP/NCCL-EP fused dispatch): run eagerly",
)
def _dispatch_eager(original):
    return eager_region(original, data_dependent_outputs=True)


@patch(
    "torch_compile.moe_experts_eager",
    f"{_MOE_LAYER}.routed_experts_compute",
    reason="per-expert token counts are data-dependent (.tolist()/.item() split sizes, "
    "sort_chunks_by_idxs, masked_select, grouped GEMM with host splits): run eagerly",
)
def _experts_eager(original):
    return eager_region(original, data_dependent_outputs=True)


@patch(
    "torch_compile.moe_combine_eager",
    f"{_MOE_LAYER}.combine",
    reason="token combine is a collective with host-side split sizes (all-to-all, reduce-scatter, "
    "DeepEP/HybridEP/NCCL-EP fused combine): run eagerly",
)
def _combine_eager(original):
    return eager_region(original)


# The MoE layer's eager regions (``python -m megatron.patchset --list --reasons``).
EAGER_REGIONS = (
    "torch_compile.moe_dispatch_eager",
    "torch_compile.moe_experts_eager",
    "torch_compile.moe_combine_eager",
)


_AUX_GRAD_OP = None


def aux_loss_grad_op():
    """``megatron_patchset::aux_loss_grad(aux_loss, grad_output)``: upstream's aux-loss gradient
    (ones times ``MoEAuxLossAutoScaler.main_loss_backward_scale``, 1.0 until the schedule sets it)
    as a custom op, opaque to the compiler.

    Dynamo cannot trace upstream's backward (it reads a tensor class attribute: a graph break at
    every aux/z-loss in the router). Traced from a module-level tensor instead, the partitioner
    may compute ``ones * scale`` in the *forward* graph, i.e. with the scale of the previous
    micro-batch (measured: wrong router gradients). As an op that takes ``grad_output``, it runs
    in the backward and reads the scale when the backward runs, exactly as upstream does.
    """
    global _AUX_GRAD_OP
    if _AUX_GRAD_OP is None:
        import torch

        @torch.library.custom_op(
            "megatron_patchset::aux_loss_grad",
            mutates_args=(),
            schema="(Tensor aux_loss, Tensor grad_output) -> Tensor",
        )
        def aux_loss_grad(aux_loss: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler as scaler

            if scaler.main_loss_backward_scale is None:
                scaler.main_loss_backward_scale = torch.tensor(1.0, device=aux_loss.device)
            grad = torch.ones_like(aux_loss) * scaler.main_loss_backward_scale
            if grad.shape != aux_loss.shape:
                # The schedule sets a shape-[1] scale for a 0-d loss; upstream's broadcast gradient
                # is reduced back to the loss's shape by autograd. The op must return that shape
                # itself (its fake says so, and inductor checks it).
                grad = grad.sum_to_size(aux_loss.shape)
            return grad

        @aux_loss_grad.register_fake
        def _(aux_loss, grad_output):
            return torch.empty_like(aux_loss)

        _AUX_GRAD_OP = aux_loss_grad
    return _AUX_GRAD_OP


@patch(
    "torch_compile.aux_loss_backward_opaque",
    f"{_AUX_SCALER}.backward",
    reason="dynamo cannot trace the backward's class-attribute loss scale (a graph break at every "
    "aux/z-loss in the router): compute the same gradient in a custom op run at backward time",
)
def _aux_backward_factory(original):
    op = aux_loss_grad_op()

    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, op(aux_loss, grad_output)

    return backward


_RANDOM_LOGITS_OP = None


def random_logits_op():
    """``megatron_patchset::random_logits(logits)``: upstream's ``RandomSTE`` forward (normal
    logits of the same shape, drawn from the expert-parallel RNG tracker's stream) as a custom op
    whose gradient passes straight through, as ``RandomSTE.backward`` does.

    Under ``--moe-router-force-load-balancing`` the router draws these inside the RNG tracker's
    ``fork``, which reads and sets the CUDA RNG state: dynamo does not trace that, and the graph
    break falls inside the ``try`` block of ``MoELayer.custom_forward``, where dynamo cannot resume.
    It then gives up on the whole MoE body (router, preprocessing, permutation all eager, found on
    the CPU with the real fork: 82 of 84 frames compiled, none of them the MoE body). An opaque op
    keeps the draw, with the same generator and the same numbers, out of the traced code.
    """
    global _RANDOM_LOGITS_OP
    if _RANDOM_LOGITS_OP is None:
        import torch

        @torch.library.custom_op(
            "megatron_patchset::random_logits", mutates_args=(), schema="(Tensor logits) -> Tensor"
        )
        def random_logits(logits: torch.Tensor) -> torch.Tensor:
            from megatron.core.tensor_parallel.random import (
                get_cuda_rng_tracker,
                get_expert_parallel_rng_tracker_name,
            )

            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                return logits.clone().normal_()

        @random_logits.register_fake
        def _(logits):
            return torch.empty_like(logits)

        random_logits.register_autograd(lambda ctx, grad: grad)
        _RANDOM_LOGITS_OP = random_logits
    return _RANDOM_LOGITS_OP


@patch(
    "torch_compile.random_logits_opaque",
    "megatron.core.transformer.moe.router.apply_random_logits",
    reason="--moe-router-force-load-balancing draws the router's logits inside the RNG tracker's "
    "fork (CUDA RNG state reads, not traceable) within MoELayer.custom_forward's try block, so "
    "dynamo ran the whole MoE body eagerly: draw them in a custom op",
    enabled=force_load_balancing,
    flags=(FLAG, "--moe-router-force-load-balancing"),
)
def _random_logits_factory(original):
    op = random_logits_op()

    @functools.wraps(original)
    def apply_random_logits(logits):
        return op(logits)

    return apply_random_logits


@patch(
    "torch_compile.tp_group_lookup_quiet",
    "megatron.core.tensor_parallel.layers.get_tensor_model_parallel_group_if_none",
    reason="the local spec's RowParallelLinear passes tp_group=None and the rank-0-only "
    "deprecation warning is a graph break on rank 0 only: resolve the same group without it while "
    "compiling",
)
def _tp_group_factory(original):
    @functools.wraps(original)
    def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
        import torch

        if tp_group is None and torch.compiler.is_compiling():
            from megatron.core import parallel_state

            if parallel_state.is_initialized():
                getter = (
                    parallel_state.get_expert_tensor_parallel_group
                    if is_expert
                    else parallel_state.get_tensor_model_parallel_group
                )
                tp_group = getter(check_initialized=check_initialized)
        return original(tp_group, is_expert, check_initialized)

    return get_tensor_model_parallel_group_if_none


PATCH_NAMES = EAGER_REGIONS + (
    "torch_compile.aux_loss_backward_opaque",
    "torch_compile.tp_group_lookup_quiet",
)
