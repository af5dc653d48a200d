"""The copy of the fp32 main parameters into the bf16 model parameters as one multi-tensor kernel
(``--adam-impl torch``).

After each Adam step megatron-core's ``Float16OptimizerWithFloat16Params`` copies every fp32 main
parameter into its bf16 model parameter. For bf16 it has no multi-tensor kernel (its
``_dummy_overflow_buf`` is None) and copies one parameter at a time: 1,318 copy kernels per step on
the reference config, 7.3 ms of GPU time on one H200.
``torch._foreach_copy_`` converts fp32 to bf16 in the same multi-tensor kernel torch's fused
optimizers use. The result is the same rounding (round to nearest even) to the bit. fp16 training
keeps megatron's own multi-tensor copy.
"""

from __future__ import annotations

from megatron.patchset.core.registry import patch


def foreach_copy_main_to_model(original):
    """The replacement of ``_copy_main_params_to_model_params``: one ``_foreach_copy_`` where
    megatron would loop over the parameters."""

    def _copy_main_params_to_model_params(self):
        # --adam-impl triton: the step wrote the model parameters already (.triton_step).
        take = getattr(getattr(self, "optimizer", None), "take_model_copy", None)
        if take is not None and take(self):
            return None
        if getattr(self, "_dummy_overflow_buf", None) is not None:
            return original(self)
        import torch

        model_data, main_data = self._get_model_and_main_params_data_float16()
        if model_data:
            torch._foreach_copy_(model_data, main_data)
        return None

    return _copy_main_params_to_model_params


@patch(
    "torch_adam.foreach_param_copy",
    "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params."
    "_copy_main_params_to_model_params",
    reason="with bf16 megatron-core copies the fp32 main parameters into the model parameters one "
    "kernel per parameter; torch's _foreach_copy_ does it in a few multi-tensor kernels",
)
def foreach_param_copy(original):
    return foreach_copy_main_to_model(original)
