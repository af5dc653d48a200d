"""``--adam-impl torch|triton`` under megatron's ``--use-distributed-optimizer``.

megatron-core's ``DistributedOptimizer`` gives the inner Adam this data-parallel rank's shard of
every parameter: an fp32 main tensor per parameter shard (``shard_fp32_from_float16_groups``)
beside a bf16 view of the same range of the model parameter, which lives in DDP's parameter
buffer (``shard_float16_groups``). After the step megatron copies each main shard into the buffer,
one kernel per parameter, and all-gathers the buffer across the data-parallel group (at once, or
overlapped with the next forward under ``--overlap-param-gather``). Four patches make torch's Adam
and the one-kernel step work there:

* **the step in the checkpoint**: with TransformerEngine installed megatron reads and writes the
  optimizer step as TE's FusedAdam keeps it, one integer per parameter group; torch's Adam keeps a
  0-d ``step`` tensor per parameter, which megatron's sharded checkpoint formats leave out. The
  patched ``state_dict`` puts the step into each saved parameter group (as megatron does when
  neither TE nor apex is installed). megatron's ``load_state_dict`` then hands torch's Adam
  moments without a step, which torch refuses to load, and fills every tensor of each
  parameter's state from the checkpoint, where its model-space formats (``fully_reshardable``)
  keep no step. The patched ``load_state_dict`` gives torch the step while it loads, takes it
  out of the state while megatron fills the moments and main parameters, and then gives every
  parameter's state the saved step (0 without one), on the parameter's device (fused and
  capturable steps read it there).
* **the bf16 shards**: at construction the inner one-kernel step learns the bf16 view of each
  main shard (:meth:`~.triton_step.TritonStep.link_model_shards`), so it writes the model
  parameters' shards itself, and megatron's copy is skipped when it did;
* **the copy**: otherwise one ``_foreach_copy_`` of all main shards into their bf16 views (the
  same rounding as megatron's per-parameter ``copy_``), where nothing else (Megatron-FSDP, FP8 or
  FP4 parameter gathers, the precision-aware optimizer) changes what the copy must do.

The parameter all-gather that follows is megatron's own.
"""

from __future__ import annotations

from typing import Any

from megatron.patchset.core.registry import patch
from megatron.patchset.features.torch_adam import clipping

_TARGET = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"


def ours(distributed: Any) -> bool:
    """Whether the distributed optimizer's inner optimizer is one ``--adam-impl torch|triton``
    built (:func:`~.optimizer.build_adam`)."""
    return clipping.registered(getattr(distributed, "optimizer", None))


def _single_step(inner) -> float | None:
    """The step every parameter's state holds (torch keeps one per parameter), or None before the
    first step."""
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"the parameters of one Adam are at different steps: {sorted(steps)}")
    return steps.pop() if steps else None


def _plain_bf16(distributed: Any) -> bool:
    """Whether copying each main shard into its bf16 view is all the copy has to do."""
    ddp, config = distributed.ddp_config, distributed.config
    return not (
        ddp.use_megatron_fsdp
        or ddp.fp8_param_gather
        or getattr(ddp, "fp4_param_gather", False)
        or config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        or any(group for group in distributed.model_fp32_groups)
    )


@patch(
    "torch_adam.dist_opt_links",
    f"{_TARGET}.__init__",
    reason="the one-kernel step writes the bf16 model parameters itself; under the distributed "
    "optimizer each main tensor is a shard, whose bf16 destination only the distributed optimizer "
    "knows (its shard_float16_groups)",
)
def link_shards(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        link = getattr(self.optimizer, "link_model_shards", None)
        if link is not None and ours(self):
            if _plain_bf16(self):
                link(self.shard_float16_groups, self.shard_fp32_from_float16_groups)
            else:
                link([], [])  # megatron's own copy writes the model parameters

    return __init__


@patch(
    "torch_adam.dist_opt_param_copy",
    f"{_TARGET}._copy_main_params_to_model_params",
    reason="megatron copies the fp32 main shards into DDP's parameter buffer one kernel per "
    "parameter; the one-kernel step has written them already, and torch's _foreach_copy_ does "
    "it in a few multi-tensor kernels otherwise",
)
def shard_copy(original):
    def _copy_main_params_to_model_params(self):
        if not ours(self) or self.is_stub_optimizer or not _plain_bf16(self):
            return original(self)
        take = getattr(self.optimizer, "take_model_copy", None)
        if take is not None and take(self):
            return None
        import torch

        model_data, main_data = self._get_model_and_main_params_data_float16()
        if model_data:
            torch._foreach_copy_(model_data, main_data)
        return None

    return _copy_main_params_to_model_params


@patch(
    "torch_adam.dist_opt_save_step",
    f"{_TARGET}.state_dict",
    reason="with TransformerEngine installed the distributed optimizer saves the step from TE "
    "FusedAdam's parameter groups; torch's Adam keeps it per parameter, and the sharded formats "
    "leave per-parameter steps out, so a resumed run would restart the bias correction",
)
def save_step(original):
    def state_dict(self):
        saved = original(self)
        if ours(self) and "optimizer" in saved:
            step = _single_step(self.optimizer)
            if step is not None:
                for group in saved["optimizer"]["param_groups"]:
                    group["step"] = step
        return saved

    return state_dict


def _fill_steps(step: float | None):
    """A ``load_state_dict`` pre-hook of torch's optimizer: every parameter state without a
    ``step`` gets ``step`` (0 when None). torch's Adam reads each state's step as it loads it."""

    def hook(optimizer, state_dict):
        import torch

        value = 0.0 if step is None else step
        filled = {
            key: (
                state
                if not state or "step" in state
                else {**state, "step": torch.tensor(value, dtype=torch.float32)}
            )
            for key, state in state_dict["state"].items()
        }
        return {**state_dict, "state": filled}

    return hook


def _drop_steps(optimizer) -> None:
    """A ``load_state_dict`` post-hook of torch's optimizer: the parameter states without their
    ``step``, as TE's FusedAdam keeps them. megatron then loads the parameter state (main
    parameters and moments) into every tensor the state holds, and its model-space formats
    (``fully_reshardable``, ``fully_sharded_model_space``) carry no per-parameter step."""
    for state in optimizer.state.values():
        state.pop("step", None)


@patch(
    "torch_adam.dist_opt_load_step",
    f"{_TARGET}.load_state_dict",
    reason="with TransformerEngine installed megatron loads the moments without a step, which "
    "torch's Adam needs in each parameter's state to load at all, and fills every tensor of the "
    "state from the checkpoint, where its model-space formats keep no step; the step saved in "
    "the parameter groups goes into every parameter's state after the load, on its device",
)
def load_step(original):
    def load_state_dict(self, state_dict):
        if not ours(self):
            return original(self, state_dict)
        groups = state_dict.get("optimizer", {}).get("param_groups", [])
        steps = {float(g["step"]) for g in groups if g.get("step") is not None}
        if len(steps) > 1:
            raise RuntimeError(f"the checkpoint's parameter groups are at steps {sorted(steps)}")
        saved = steps.pop() if steps else None
        inner = self.optimizer
        handles = (
            inner.register_load_state_dict_pre_hook(_fill_steps(saved)),
            inner.register_load_state_dict_post_hook(_drop_steps),
        )
        try:
            original(self, state_dict)
        finally:
            for handle in handles:
                handle.remove()
        import torch

        step = 0.0 if saved is None else saved
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param)
                if state:
                    state["step"] = torch.tensor(step, dtype=torch.float32, device=param.device)

    return load_state_dict
