"""The experts' weight gradients behind the dispatch's backward all-to-all, for the torch grouped
GEMMs (megatron's ``--overlap-dispatch-backward-with-experts-wgrad``).

megatron-core 0.19.2 implements the flag for TransformerEngine's ``GroupedLinear`` only: its
linears keep the weight gradient out of the backward pass (``delay_wgrad_compute``), and the MoE
layer computes it in ``backward_dw()`` on a side stream, after it has issued the dispatch's
backward all-to-all. Between the experts' data gradients and the attention's backward the rank
would otherwise wait for the all-to-all with nothing to compute; with the flag the weight-gradient
GEMMs fill that wait.

Here the same contract holds for the torch grouped GEMMs. In a linear whose
``delay_wgrad_compute`` megatron set:

* the forward runs the grouped GEMM on detached weights, so its backward computes the data
  gradient only, and then :class:`_DeferWeightGradient`, an identity on the output whose backward
  keeps the output gradient and the saved input for later;
* to the weights autograd hands what the immediate path hands them (a dummy for megatron's DDP,
  which then skips its own add), so DDP's hooks see the same calls;
* ``backward_dw()`` (megatron's MoE layer calls it on ``linear_fc2`` and then ``linear_fc1``)
  computes the kept weight gradients with the same call and the same operands as the immediate
  path, into the main grads or ``.grad``, in the order they were kept.

The weight gradients are the same bits as without the flag. Only their time moves: after
DDP's hook for the expert weights has run, which is why the flag is refused with
``--overlap-grad-reduce`` (its bucket could start reducing before the add).

torch's grouped GEMM is a persistent kernel with one thread block per SM, and NCCL's thread blocks
cannot share an SM with one of them, so the all-to-all mostly waits for the GEMM.
``--moe-wgrad-sm-carveout N`` launches these GEMMs on N fewer SMs (torch's SM carve-out, which
sizes the grid; the tiles and their sums are the same, and so are the bits), leaving the
all-to-all SMs of its own.
"""

from __future__ import annotations

import contextlib
import functools

_PENDING = "_patchset_pending_wgrads"


@functools.cache
def _defer_function():
    import torch

    class _DeferWeightGradient(torch.autograd.Function):
        """Identity on the grouped GEMM's output ``y``; the backward keeps ``dy`` for
        ``backward_dw()`` and hands the weights what the immediate path hands them."""

        @staticmethod
        def forward(ctx, y, x, offs, module, fuse_accumulation, *weights):
            ctx.save_for_backward(x, offs)
            ctx.module = module
            ctx.fuse_accumulation = fuse_accumulation
            ctx.weights = weights
            return y.view_as(y)

        @staticmethod
        def backward(ctx, dy):
            from megatron.patchset.features.grouped_mm import torch_grouped_gemm

            x, offs = ctx.saved_tensors
            weights, module = ctx.weights, ctx.module
            ctx.weights = ctx.module = None
            grads = [None] * len(weights)
            if any(ctx.needs_input_grad[5:]):
                getattr(module, _PENDING).append(
                    (dy.contiguous(), x, offs, weights, ctx.fuse_accumulation)
                )
                if ctx.fuse_accumulation:
                    grads = torch_grouped_gemm.main_grad_placeholders(weights)
            return (dy, None, None, None, None, *grads)

    return _DeferWeightGradient


def grouped_linear_forward(module, x, offs, descending: bool, padded: bool):
    """The grouped linear of ``module``'s ``weight{i}`` over ``x`` (rows of expert ``e`` ending at
    ``offs[e]``; from the last expert to the first with ``descending``) with its weight gradient
    kept for ``backward_dw()``. ``padded``: ``x`` has zero rows after the last expert's, and so has
    the output."""
    import torch

    from megatron.patchset.features.grouped_mm import torch_grouped_gemm
    from megatron.patchset.features.grouped_mm.tail import zero_tail

    pending = module.__dict__.setdefault(_PENDING, [])
    if pending and module.training and torch.is_grad_enabled():
        raise RuntimeError(
            "--overlap-dispatch-backward-with-experts-wgrad: the experts' weight gradients of an "
            f"earlier backward pass of {type(module).__name__} were never computed "
            "(backward_dw() did not run); megatron's MoE layer calls it after the dispatch's "
            "backward all-to-all"
        )
    weights = torch_grouped_gemm.expert_weights(module)
    if descending:
        weights = weights[::-1]
    fuse_accumulation = hasattr(weights[0], "grad_added_to_main_grad")
    x = x.contiguous()
    y = torch_grouped_gemm.grouped_mm_with_offsets(
        x, offs, [w.detach() for w in weights], fuse_accumulation
    )
    if padded:  # grouped_mm leaves them unwritten; y is not saved for backward
        zero_tail(y.detach(), offs)
    module.is_first_microbatch = False
    return _defer_function().apply(y, x, offs, module, fuse_accumulation, *weights)


def requested_carveout(module) -> int:
    """``--moe-wgrad-sm-carveout`` of ``module``'s TransformerConfig (0 without one)."""
    from megatron.patchset.features.grouped_mm import flags

    return flags.wgrad_sm_carveout(getattr(module, "config", None))


@contextlib.contextmanager
def sm_carveout(sms: int, device):
    """torch's GEMMs launched inside leave ``sms`` SMs of ``device`` out of their grid."""
    import torch

    if not sms or torch.device(device).type != "cuda":
        yield
        return

    from megatron.patchset.core.errors import PatchsetError
    from megatron.patchset.features.grouped_mm.flags import CARVEOUT_FLAG

    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    put = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if get is None or put is None:
        raise PatchsetError(
            f"{CARVEOUT_FLAG} {sms}: torch {torch.__version__} has no SM carve-out "
            "(torch._C._set_sm_carveout_experimental); use torch 2.11 or newer, or drop the flag"
        )
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if sms >= total:
        raise PatchsetError(
            f"{CARVEOUT_FLAG} {sms} leaves no SM to the GEMMs: this GPU has {total}. "
            "Use fewer (NCCL's all-to-all takes about 20 to 32)."
        )
    before = get()
    put(sms)
    try:
        yield
    finally:
        put(before)


def backward_dw(module) -> None:
    """The weight gradients kept since the last call, in the order of the backward passes that kept
    them, on the current stream, with ``--moe-wgrad-sm-carveout`` SMs left out of their GEMMs."""
    from megatron.patchset.features.grouped_mm import torch_grouped_gemm

    pending = getattr(module, _PENDING, None)
    if not pending:
        return
    with sm_carveout(requested_carveout(module), pending[0][0].device):
        while pending:
            dy, x, offs, weights, fuse_accumulation = pending.pop(0)
            grads = torch_grouped_gemm.weight_gradients(dy, x, offs, weights, fuse_accumulation)
            if fuse_accumulation:
                continue
            for weight, grad in zip(weights, grads):
                weight.grad = grad if weight.grad is None else weight.grad + grad
