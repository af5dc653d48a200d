"""Adam and AdamW as one Triton kernel that also writes the bf16 model parameters.

With bf16 training a mixed-precision Adam step is two passes over the parameters: the Adam kernel
reads the fp32 gradient, the fp32 main parameter and both moments and writes the parameter and
both moments back, and the optimizer's copy then reads the fp32 main parameter again and writes
the bf16 model parameter. With a gradient scale (gradient clipping folded into the step, as
torch's fused kernel takes it) torch's kernel also writes the scaled gradient back: 38 bytes per
parameter in all. One kernel that reads the gradient, the parameter and both moments and writes
the parameter, both moments and the bf16 model parameter moves 30; with both moments kept in
bf16 (the update still computed in fp32) it moves 22.

:class:`TritonAdamW` (and :class:`TritonAdam`, Adam with L2 weight decay) is torch's optimizer
class with its own ``step``: the same state (``exp_avg``, ``exp_avg_sq`` and a 0-d fp32 ``step``
per parameter on its device, as torch's fused and capturable optimizers keep it), the same
``state_dict``, the same update rule as torch's fused kernel, and an optional ``grad_scale``
attribute (a 0-d fp32 tensor each gradient is divided by as it is read). The learning rate may
be a device tensor (the capturable form, which ``OptimizerParamScheduler`` fills in place); the
step reads every tensor on the device, so it can be captured in a CUDA graph.

The model parameter of each main parameter comes from the parameters the optimizer was built
with: Megatron builds Adam over the bf16 model parameters, and its
``Float16OptimizerWithFloat16Params`` then puts the fp32 main copy in the same place of the same
group and links it as ``model_param.main_param``. A parameter whose link does not hold gets no
bf16 write. A caller whose main tensors are shards of the model parameters (the distributed
optimizer) gives the step each shard's bf16 view instead (:meth:`TritonStep.link_model_shards`).
:meth:`TritonStep.take_model_copy` tells the owner of the main parameters that the last step
already wrote every model tensor it would copy.

One launch covers all tensors: a table gives each program its tensor and block. Addresses reach
the kernel as element offsets from one fp32 and one bf16 anchor tensor; when every address is 16
bytes aligned the kernel says so, and its loads and stores are vectorised. The bias corrections
are computed in fp64 in the kernel (``1 - beta ** step``), the element-wise update in fp32 in
torch's order of operations. Without Triton, or on a CPU tensor outside Triton's interpreter
(``TRITON_INTERPRET=1``), or for tensors the kernel does not take (not fp32, not contiguous), the
step is torch's own one.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BLOCK = 512
NUM_WARPS = 4


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adam_step_kernel(
        f32,
        bf16,
        block_tensor,
        block_start,
        offsets,
        numels,
        group_of,
        lrs,
        hyper,
        grad_scale,
        BLOCK: tl.constexpr,
        ADAMW: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        ALIGNED: tl.constexpr,
        MOMENTS_BF16: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid).to(tl.int64)
        index = tl.load(block_start + pid) + tl.arange(0, BLOCK)
        mask = index < tl.load(numels + t)
        # offsets row t: param, grad, exp_avg, exp_avg_sq, step (fp32 elements from f32; the
        # moments bf16 elements from bf16 with MOMENTS_BF16), model (bf16 elements from bf16),
        # whether there is a model parameter to write
        p_at = tl.load(offsets + 7 * t)
        g_at = tl.load(offsets + 7 * t + 1)
        m_at = tl.load(offsets + 7 * t + 2)
        v_at = tl.load(offsets + 7 * t + 3)
        s_at = tl.load(offsets + 7 * t + 4)
        b_at = tl.load(offsets + 7 * t + 5)
        has_model = tl.load(offsets + 7 * t + 6)
        if ALIGNED:
            p_at = tl.multiple_of(p_at, 4)
            g_at = tl.multiple_of(g_at, 4)
            if MOMENTS_BF16:
                m_at = tl.multiple_of(m_at, 8)
                v_at = tl.multiple_of(v_at, 8)
            else:
                m_at = tl.multiple_of(m_at, 4)
                v_at = tl.multiple_of(v_at, 4)
            b_at = tl.multiple_of(b_at, 8)
        group = tl.load(group_of + t).to(tl.int64)
        lr = tl.load(lrs + group).to(tl.float64)
        beta1 = tl.load(hyper + 4 * group)
        beta2 = tl.load(hyper + 4 * group + 1)
        eps = tl.load(hyper + 4 * group + 2).to(tl.float32)
        decay = tl.load(hyper + 4 * group + 3)
        step = tl.load(f32 + s_at).to(tl.float64)
        correction1 = 1.0 - tl.exp(step * tl.log(beta1))
        correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2))).to(tl.float32)
        step_size = (lr / correction1).to(tl.float32)

        param = tl.load(f32 + p_at + index, mask=mask)
        grad = tl.load(f32 + g_at + index, mask=mask)
        if MOMENTS_BF16:
            exp_avg = tl.load(bf16 + m_at + index, mask=mask).to(tl.float32)
            exp_avg_sq = tl.load(bf16 + v_at + index, mask=mask).to(tl.float32)
        else:
            exp_avg = tl.load(f32 + m_at + index, mask=mask)
            exp_avg_sq = tl.load(f32 + v_at + index, mask=mask)
        if HAS_SCALE:
            grad = grad / tl.load(grad_scale)
        if ADAMW:
            param = param - (lr * decay).to(tl.float32) * param
        else:
            grad = grad + param * decay.to(tl.float32)
        exp_avg = beta1.to(tl.float32) * exp_avg + (1.0 - beta1).to(tl.float32) * grad
        exp_avg_sq = beta2.to(tl.float32) * exp_avg_sq + (1.0 - beta2).to(tl.float32) * grad * grad
        denom = tl.sqrt(exp_avg_sq) / correction2_sqrt + eps
        param = param - step_size * exp_avg / denom
        tl.store(f32 + p_at + index, param, mask=mask)
        # bf16 values are rounded to nearest even in integer arithmetic, so that Triton's
        # interpreter (which truncates) rounds as the GPU and torch's copy do; NaN stays a quiet
        # NaN.
        if MOMENTS_BF16:
            bits = exp_avg.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(exp_avg != exp_avg, 0x7FC0, bits).to(tl.uint16)
            tl.store(bf16 + m_at + index, bits.to(tl.bfloat16, bitcast=True), mask=mask)
            bits = exp_avg_sq.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(exp_avg_sq != exp_avg_sq, 0x7FC0, bits).to(tl.uint16)
            tl.store(bf16 + v_at + index, bits.to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(f32 + m_at + index, exp_avg, mask=mask)
            tl.store(f32 + v_at + index, exp_avg_sq, mask=mask)
        if has_model != 0:
            bits = param.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(param != param, 0x7FC0, bits).to(tl.uint16)
            tl.store(bf16 + b_at + index, bits.to(tl.bfloat16, bitcast=True), mask=mask)

    return adam_step_kernel


def available(device) -> bool:
    """Whether the kernel runs on ``device``: CUDA with Triton, or any device under Triton's
    interpreter (``TRITON_INTERPRET=1``)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return importlib.util.find_spec("triton") is not None


def lr_on_param_device(optimizer) -> None:
    """A ``load_state_dict`` post-hook: every param group's learning rate that is a tensor (a
    capturable step reads it on the device) becomes a 0-d fp32 tensor on the group's param
    device again. A checkpoint's param groups may bring it on another device (a rank loading the
    state that rank 0 saved from its own GPU) or on the CPU, and a captured step cannot copy it
    there."""
    for group in optimizer.param_groups:
        lr = group["lr"]
        if not group["params"] or not isinstance(lr, torch.Tensor):
            continue
        device = group["params"][0].device
        if lr.device != device or lr.dtype != torch.float32 or lr.dim() != 0:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)


class _Plan:
    """The kernel's tables for one set of tensors (rebuilt when any address changes)."""

    def __init__(self, key, rows, numels, groups, device, written, moments_bf16=False):
        self.key = key
        self.moments_bf16 = moments_bf16
        self.f32 = torch.empty(4, device=device)
        self.bf16 = torch.empty(8, device=device, dtype=torch.bfloat16)
        anchor32, anchor16 = self.f32.data_ptr(), self.bf16.data_ptr()

        def f32_at(t):
            return (t.data_ptr() - anchor32) // 4

        def bf16_at(t):
            return (t.data_ptr() - anchor16) // 2

        moment_at = bf16_at if moments_bf16 else f32_at
        table = []
        for param, grad, avg, avg_sq, step, model in rows:
            model_at = [0, 0] if model is None else [bf16_at(model), 1]
            table.append(
                [f32_at(param), f32_at(grad), moment_at(avg), moment_at(avg_sq), f32_at(step)]
                + model_at
            )
        addresses = [t.data_ptr() for row in rows for t in row[:4]]
        addresses += [row[5].data_ptr() for row in rows if row[5] is not None]
        self.aligned = all(a % 16 == 0 for a in addresses)
        counts = [-(-n // BLOCK) for n in numels]
        self.offsets = torch.tensor(table, dtype=torch.int64).to(device)
        self.numels = torch.tensor(numels, dtype=torch.int64).to(device)
        self.group_of = torch.tensor(groups, dtype=torch.int32).to(device)
        self.block_tensor = torch.repeat_interleave(
            torch.arange(len(rows), dtype=torch.int32), torch.tensor(counts)
        ).to(device)
        self.block_start = torch.cat(
            [torch.arange(c, dtype=torch.int64) * BLOCK for c in counts]
        ).to(device)
        self.blocks = sum(counts)
        self.steps = [row[4] for row in rows]
        self.written = written
        self.hyper_key = None
        self.hyper = None
        self.lr_key = None
        self.lr_table = None


class TritonStep:
    """The ``step`` of :class:`TritonAdamW` / :class:`TritonAdam` (a mixin over torch's class).

    ``moments_dtype`` (``torch.float32``, the default, or ``torch.bfloat16``) is the dtype the two
    moments are kept in; the update itself is computed in fp32. The other arguments are those of
    torch's class.
    """

    adamw = True
    moments_dtype = torch.float32

    def __init__(self, *args, moments_dtype=None, **kwargs):
        if moments_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"moments_dtype must be torch.float32 or torch.bfloat16, not {moments_dtype}"
            )
        super().__init__(*args, **kwargs)
        if moments_dtype is not None:
            self.moments_dtype = moments_dtype
        self._remember_model_params()

    def _remember_model_params(self) -> None:
        self._model_params = [list(group["params"]) for group in self.param_groups]
        self._shard_models = {}
        self._plan = None
        self._wrote_model_params = False
        self._covers = {}

    def link_model_shards(self, model_groups, main_groups) -> None:
        """The bf16 destination of each main tensor that is a shard of its model parameter
        (megatron's distributed optimizer: ``shard_float16_groups`` beside
        ``shard_fp32_from_float16_groups``, views of DDP's parameter buffer). These links replace
        the pairing by position with the parameters the optimizer was built with, which the
        distributed optimizer's regrouping undoes: a main tensor without a link gets no bf16
        write, and no links (empty groups) means no bf16 writes. A link with another size is
        ignored."""
        self._model_params = []
        self._shard_models = {}
        for models, mains in zip(model_groups, main_groups):
            for model, main in zip(models, mains):
                if model is not None and main is not None and model.numel() == main.numel():
                    self._shard_models[id(main)] = model
        self._plan = None

    def _model_of(self, param, built):
        """The bf16 model tensor the kernel writes for ``param``, or None."""
        model = self._shard_models.get(id(param))
        if model is None:
            if built is None or getattr(built, "main_param", None) is not param:
                return None
            model = built
        if (
            model is param
            or model.dtype != torch.bfloat16
            or not model.is_contiguous()
            or model.device != param.device
            or model.numel() != param.numel()
        ):
            return None
        return model

    def _rows(self):
        """(param, grad, exp_avg, exp_avg_sq, step, model or None) per parameter with a gradient,
        with its group index; None when a tensor is one the kernel does not take."""
        rows, groups = [], []
        for g, group in enumerate(self.param_groups):
            built = self._model_params[g] if g < len(self._model_params) else []
            for i, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                if (
                    param.dtype != torch.float32
                    or grad.dtype != torch.float32
                    or grad.is_sparse
                    or not param.is_contiguous()
                    or not grad.is_contiguous()
                    or grad.shape != param.shape
                    or grad.device != param.device
                ):
                    return None, None
                state = self.state[param]
                if "step" not in state:
                    # megatron's init_state_fn may have made the moments already (a checkpoint
                    # load allocates them before the first step)
                    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                for moment in ("exp_avg", "exp_avg_sq"):
                    if moment not in state:
                        state[moment] = torch.zeros_like(
                            param, dtype=self.moments_dtype, memory_format=torch.preserve_format
                        )
                    elif state[moment].dtype != self.moments_dtype:
                        # moments loaded in another dtype (a checkpoint, megatron's dummy state)
                        state[moment] = state[moment].to(self.moments_dtype)
                step, avg, avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                if (
                    step.dtype != torch.float32
                    or step.device != param.device
                    or not avg.is_contiguous()
                    or not avg_sq.is_contiguous()
                ):
                    return None, None
                model = self._model_of(param, built[i] if i < len(built) else None)
                rows.append((param, grad, avg, avg_sq, step, model))
                groups.append(g)
        return rows, groups

    def _current_plan(self):
        rows, groups = self._rows()
        if rows is None or not rows:
            return None
        device = rows[0][0].device
        if any(row[0].device != device for row in rows) or not available(device):
            return None
        key = tuple(t.data_ptr() if t is not None else 0 for row in rows for t in row) + tuple(
            groups
        )
        if self._plan is None or self._plan.key != key:
            written = {(id(row[5]), id(row[0])) for row in rows if row[5] is not None}
            numels = [row[0].numel() for row in rows]
            bf16 = self.moments_dtype == torch.bfloat16
            self._plan = _Plan(key, rows, numels, groups, device, written, moments_bf16=bf16)
        return self._plan

    def _tables(self, plan):
        """The per-group learning rates (a device vector, captured from the groups' tensors) and
        the per-group beta1, beta2, eps and weight decay (fp64, rebuilt when a value changes)."""
        device = plan.offsets.device
        lrs = [group["lr"] for group in self.param_groups]
        if all(isinstance(lr, torch.Tensor) for lr in lrs):
            lr_table = torch.stack([lr.reshape(()).to(device, torch.float32) for lr in lrs])
        else:
            key = tuple(float(lr) for lr in lrs)
            if plan.lr_key != key:
                plan.lr_table = torch.tensor(key, dtype=torch.float32).to(device)
                plan.lr_key = key
            lr_table = plan.lr_table
        key = tuple(
            (float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]), float(g["weight_decay"]))
            for g in self.param_groups
        )
        if plan.hyper_key != key:
            plan.hyper = torch.tensor(key, dtype=torch.float64).reshape(-1).to(device)
            plan.hyper_key = key
        return lr_table, plan.hyper

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step of all parameters with a gradient, as torch's ``step``: one kernel launch
        where the kernel takes the tensors, torch's own step otherwise."""
        self._wrote_model_params = False
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
                return self._torch_step(closure)
        plan = self._current_plan()
        if plan is None:
            return self._torch_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr_table, hyper = self._tables(plan)
        scale = getattr(self, "grad_scale", None)
        torch._foreach_add_(plan.steps, 1.0)
        _kernel()[(plan.blocks,)](
            plan.f32,
            plan.bf16,
            plan.block_tensor,
            plan.block_start,
            plan.offsets,
            plan.numels,
            plan.group_of,
            lr_table,
            hyper,
            scale if scale is not None else plan.f32,
            BLOCK=BLOCK,
            ADAMW=self.adamw,
            HAS_SCALE=scale is not None,
            ALIGNED=plan.aligned,
            MOMENTS_BF16=plan.moments_bf16,
            num_warps=NUM_WARPS,
        )
        self._wrote_model_params = True
        return loss

    def load_state_dict(self, state_dict) -> None:
        """torch's load, with each tensor learning rate on its params' device
        (:func:`lr_on_param_device`) and the moments kept in ``moments_dtype``. torch casts
        every floating state tensor but the step to its parameter's dtype (fp32) as it loads it;
        the moments are cast back (fp32 moments of a checkpoint rounded to nearest even, bf16 ones
        unchanged). megatron's distributed optimizer loads the state in place of tensors it
        gets from this load, so its checkpoint's moments also arrive in ``moments_dtype``."""
        super().load_state_dict(state_dict)
        lr_on_param_device(self)
        if self.moments_dtype == torch.float32:
            return
        for state in self.state.values():
            for moment in ("exp_avg", "exp_avg_sq"):
                value = state.get(moment)
                if isinstance(value, torch.Tensor) and value.dtype != self.moments_dtype:
                    state[moment] = value.to(self.moments_dtype)

    def _torch_step(self, closure=None):
        """torch's own step (where the kernel does not run); it takes fp32 moments, so bf16 ones
        are widened for it and rounded back (to nearest even, as the kernel does) after it."""
        if self.moments_dtype == torch.float32:
            return super().step(closure)
        moments = ("exp_avg", "exp_avg_sq")
        for state in self.state.values():
            for moment in moments:
                if moment in state:
                    state[moment] = state[moment].float()
        loss = super().step(closure)
        for state in self.state.values():
            for moment in moments:
                if moment in state:
                    state[moment] = state[moment].to(self.moments_dtype)
        return loss

    @property
    def aligned(self) -> bool | None:
        """Whether the last step's tensors were all 16-byte aligned, so that the kernel loaded and
        stored them vectorised; None before the kernel's first step."""
        return None if self._plan is None else self._plan.aligned

    def take_model_copy(self, owner) -> bool:
        """True when the last step wrote every bf16 model tensor that ``owner`` (megatron's
        ``Float16OptimizerWithFloat16Params``, or its ``DistributedOptimizer`` with shards) copies
        from its main parameters; the copy is then already done. Each step's writes are taken
        once."""
        if not getattr(self, "_wrote_model_params", False) or self._plan is None:
            return False
        self._wrote_model_params = False
        cached = self._covers.get(id(owner))
        if cached is None or cached[0] != self._plan.key:
            if hasattr(owner, "shard_float16_groups"):
                groups = zip(owner.shard_float16_groups, owner.shard_fp32_from_float16_groups)
            else:
                groups = zip(owner.float16_groups, owner.fp32_from_float16_groups)
            pairs = {
                (id(model), id(main))
                for models, mains in groups
                for model, main in zip(models, mains)
            }
            cached = (self._plan.key, pairs <= self._plan.written)
            self._covers[id(owner)] = cached
        return cached[1]


class TritonAdamW(TritonStep, torch.optim.AdamW):
    """torch's AdamW (state, state_dict, update rule) stepped by the one-kernel step."""

    adamw = True


class TritonAdam(TritonStep, torch.optim.Adam):
    """torch's Adam with L2 weight decay, stepped by the one-kernel step."""

    adamw = False
