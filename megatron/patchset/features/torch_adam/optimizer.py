"""``--adam-impl torch``: megatron-core's Adam as ``torch.optim.AdamW`` / ``Adam`` with
``fused=True``.

megatron-core 0.19.2 builds its Adam from the name ``megatron.core.optimizer.Adam``, TE's FusedAdam
whenever TransformerEngine is installed, with ``params``, ``lr``, ``weight_decay``, ``betas``,
``eps``, ``capturable`` (``--optimizer-cuda-graph``) and ``adam_w_mode``
(``--decoupled-weight-decay``). The patch rebinds that name to a factory that takes the same
arguments and builds torch's fused optimizer instead. Under ``--optimizer-cuda-graph`` it is
capturable and each parameter group's learning rate becomes a 0-d fp32 tensor on the parameters'
device, which megatron's ``OptimizerParamScheduler`` fills in place, so the replayed step follows
the schedule. The optimizer also takes megatron's gradient clipping into its kernel
(:mod:`.clipping`). Arguments only TE's FusedAdam has (those of
``--use-precision-aware-optimizer``) are refused by the feature's rule and, if they arrive anyway,
by the factory.
"""

from __future__ import annotations

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch
from megatron.patchset.features.torch_adam import clipping
from megatron.patchset.features.torch_adam.flags import (
    FLAG,
    MOMENTS_FLAG,
    moments_dtype,
    wants_torch_kernel,
    wants_triton_kernel,
)


def _drop_grad_scale(optimizer, args, kwargs) -> None:
    optimizer.grad_scale = None


def build_adam(
    params,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    capturable: bool = False,
    adam_w_mode: bool = True,
    *,
    impl: str = "torch",
    moments_dtype: str = "fp32",
    **unsupported,
):
    """torch's fused Adam (AdamW when ``adam_w_mode``) from megatron-core's Adam arguments;
    ``impl="triton"``: the same optimizer stepped by :mod:`.triton_step`'s kernel, its moments in
    ``moments_dtype`` (``fp32`` or ``bf16``)."""
    import torch

    if unsupported:
        raise PatchsetError(
            f"{FLAG} {impl}: megatron-core asked its Adam for {', '.join(sorted(unsupported))}, "
            f"which only TransformerEngine's FusedAdam takes; drop {FLAG} {impl} or the flags "
            "that ask for them (--use-precision-aware-optimizer)"
        )
    name = "AdamW" if adam_w_mode else "Adam"
    if impl == "triton":
        from megatron.patchset.features.torch_adam import triton_step

        cls = getattr(triton_step, f"Triton{name}")
        kernel = "one Triton kernel with the clip and the bf16 copy"
    else:
        cls = getattr(torch.optim, name)
        kernel = "fused"
    optimizer = cls(
        params,
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        fused=True,
        capturable=capturable,
    )
    if moments_dtype == "bf16":
        if impl != "triton":
            raise PatchsetError(f"{MOMENTS_FLAG} bf16 acts only with {FLAG} triton")
        optimizer.moments_dtype = torch.bfloat16
        kernel += ", bf16 moments"
    # --clip-grad: the clip scale reaches the fused kernel as its grad_scale (.clipping), set
    # before each step and dropped after it.
    clipping.register(optimizer)
    optimizer.register_step_post_hook(_drop_grad_scale)
    if capturable:
        for group in optimizer.param_groups:
            if group["params"] and not isinstance(group["lr"], torch.Tensor):
                device = group["params"][0].device
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        if impl != "triton":  # the Triton step's own load_state_dict does it
            from megatron.patchset.features.torch_adam.triton_step import lr_on_param_device

            optimizer.register_load_state_dict_post_hook(lr_on_param_device)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        count = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        print(
            f"megatron-patchset: Adam is torch.optim.{name} ({kernel}"
            f"{', capturable' if capturable else ''}) over {count:,} parameters in "
            f"{len(optimizer.param_groups)} groups",
            flush=True,
        )
    return optimizer


def _requested_moments_dtype() -> str:
    """``--adam-moments-dtype`` of the run (megatron's parsed arguments; fp32 outside a run)."""
    try:
        from megatron.training.global_vars import get_args

        return moments_dtype(get_args())
    except (AssertionError, ImportError):  # no parsed arguments: not inside megatron's training
        return "fp32"


def _adam_builder(impl: str):
    """The replacement of megatron-core's Adam for ``impl``. A function of its own per application:
    the registry marks the replacement (sentinel, ``__wrapped__``), which must not stick to the
    module-level build_adam after a revert."""

    def adam(*args, **kwargs):
        return build_adam(*args, impl=impl, moments_dtype=_requested_moments_dtype(), **kwargs)

    return adam


@patch(
    "torch_adam.fused_step",
    "megatron.core.optimizer.Adam",
    flags=(f"{FLAG} torch",),
    enabled=wants_torch_kernel,
    reason="megatron-core takes TE's FusedAdam whenever TransformerEngine is installed; on "
    "Hopper torch's fused AdamW is the faster kernel, most of all captured "
    "(--optimizer-cuda-graph), where TE's capturable kernel is slower than its eager one",
)
def torch_fused_adam(original):
    return _adam_builder("torch")


@patch(
    "torch_adam.triton_step",
    "megatron.core.optimizer.Adam",
    flags=(f"{FLAG} triton",),
    enabled=wants_triton_kernel,
    reason="torch's AdamW stepped by one Triton kernel that also applies megatron's clip and "
    "writes the bf16 model parameters: 30 bytes per parameter instead of the 38 of torch's fused "
    "step plus megatron's copy",
)
def triton_adam(original):
    return _adam_builder("triton")
