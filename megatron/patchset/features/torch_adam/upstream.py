"""The upstream changes of this feature, as ``export --series`` writes them.

Upstream's form of the choice is an ``OptimizerConfig`` field, ``adam_fusion_impl`` ('auto',
'torch' or 'triton'; flag ``--adam-fusion-impl``), routed where megatron-core picks its Adam class
in ``_get_megatron_optimizer_based_on_param_groups``. The bf16 moments are upstream's own
``exp_avg_dtype`` / ``exp_avg_sq_dtype`` set to bf16, which ``__post_init__`` accepts with
'triton' only. The kernel's file is this feature's :mod:`.triton_step`, as the overlay runs it;
the tests are ``upstream/test_triton_adam.py`` beside this module.

The change is the kernel and its use by megatron's bf16 optimizer and its distributed optimizer:
eager and captured steps, the copy to the bf16 model params skipped when the kernel wrote them
(whole params, or the distributed optimizer's shards linked by ``link_model_shards``), and the
distributed optimizer's checkpoint carrying torch's per-param step in its param groups (as its
no-TransformerEngine path does) when TransformerEngine is installed.

The second change, :data:`CLIP_CHANGE` (``torch_adam_clip``, after the first: it ``needs`` it),
folds megatron's gradient clip into that step, as :mod:`.clipping` does in the overlay: where
megatron clips the main params by the total norm (``MegatronOptimizer.clip_grad_norm`` and
``ChainedOptimizer.step``) a new ``MegatronOptimizer._clip_grads_in_optimizer_step`` sets the inner
optimizer's ``grad_scale`` (``max(1, (norm + 1e-6) / clip)``, a 0-d device tensor) in place of
``clip_grad_by_total_norm_fp32``'s pass, when the params are all of that optimizer's and their
grads are not decoupled; the factory's step post-hook drops the scale after each step. Its tests
are ``upstream/test_adam_grad_clip.py``.
"""

from megatron.patchset.export.changes import UpstreamChange
from megatron.patchset.export.edits import InsertAfter, NewFile, Replace

HEADER = "# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.\n\n"
CONFIG = "megatron/core/optimizer/optimizer_config.py"
FACTORY = "megatron/core/optimizer/__init__.py"
MIXED = "megatron/core/optimizer/optimizer.py"
DISTRIB = "megatron/core/optimizer/distrib_optimizer.py"
ARGUMENTS = "megatron/training/arguments.py"
CHANGE = UpstreamChange(
    name="torch_adam",
    subject="optimizer: torch's fused AdamW or one Triton kernel as adam_fusion_impl",
    motivation="""
        With TransformerEngine installed, --optimizer adam is always TE's FusedAdam (Apex's
        without TE; torch's AdamW only when neither is installed). Under --optimizer-cuda-graph
        megatron asks it to be capturable, and TE's capturable kernel is slower than its eager
        one: on a 3.74B-parameter MoE config with fp32 main parameters one H200 spends 47.4 ms in
        it per step, against 30.8 ms eager. torch's fused AdamW is capturable without that cost.
        With bf16 parameters the step is also two passes over the parameters: Adam reads the
        gradient, the parameter and both moments and writes three of them back, and
        Float16OptimizerWithFloat16Params then reads each fp32 main parameter again to write its
        bf16 copy; the distributed optimizer copies each fp32 main shard into the param buffer
        the same way. torch's Adam under the distributed optimizer also loses its step in the
        checkpoint when TransformerEngine is installed: megatron saves the step from the param
        groups, as TE's FusedAdam keeps it, and torch's Adam keeps it per param.""",
    design="""
        A new OptimizerConfig field, adam_fusion_impl (flag --adam-fusion-impl), picks the Adam
        class where _get_megatron_optimizer_based_on_param_groups builds it. 'auto' (the
        default) keeps today's choice. 'torch' builds torch.optim.AdamW (torch.optim.Adam
        without decoupled_weight_decay) with fused=True. 'triton' builds TritonAdamW /
        TritonAdam (megatron/core/optimizer/triton_adam.py): torch's class, state and
        state_dict, with a step that is one Triton kernel over all parameters. Each program
        takes one block of one tensor from a table; the bias corrections are computed in fp64,
        the update in fp32 in the order of torch's fused kernel, and the bf16 model parameter
        of each main parameter (linked by Float16OptimizerWithFloat16Params as
        model_param.main_param) is written in the same kernel, rounded to nearest even as
        copy_ does. Float16OptimizerWithFloat16Params then skips its copy when the step wrote
        every model parameter it would copy (take_model_copy). Where the kernel cannot run (no
        Triton, a CPU tensor outside TRITON_INTERPRET=1, a tensor that is not fp32 and
        contiguous) the step is torch's fused one and the copy runs as before.

        Both are capturable under optimizer_cuda_graph: the learning rate of each parameter
        group becomes a 0-d device tensor, which OptimizerParamScheduler already fills in
        place, so a replayed step follows the schedule; a learning rate loaded from a
        checkpoint goes back to the params' device as such a tensor (lr_on_param_device: a rank
        may otherwise load the tensor rank 0 saved from its own GPU, which a captured step
        cannot read). With 'triton', exp_avg_dtype and
        exp_avg_sq_dtype may both be torch.bfloat16 without the precision-aware optimizer: the
        kernel keeps both moments in bf16 (4 bytes per parameter less) and computes the update
        in fp32.

        OptimizerConfig.__post_init__ refuses 'torch' and 'triton' with another optimizer, and
        with the precision-aware optimizer and CPU offload (their state is TE's FusedAdam's and
        the hybrid optimizer's).

        The distributed optimizer takes both. Its Adam steps this rank's fp32 main shards;
        DistributedOptimizer.__init__ gives the Triton step the bf16 view of each shard in the
        param buffer (link_model_shards; none with fp8 or fp4 param gather), so the kernel
        writes them and _copy_main_params_to_model_params returns early when it did. Its
        checkpoint keeps the step as TE's FusedAdam does when TransformerEngine is installed
        (in the param groups), while torch's Adam keeps one per param: state_dict now reads
        torch's per-param step into the saved param groups, load_state_dict gives it back to
        every param's state (0 for a checkpoint without one; torch's Adam loads no state
        without it), and _set_main_param_and_optimizer_states leaves the step alone, as the
        sharded formats already treat it (read from param_groups): the model-space formats
        carry no per-param step, which made it a KeyError.""",
    figures="""
        One H200, torch 2.11.0+cu130, megatron-core 0.19.2, TransformerEngine 2.20.2,
        2026-11-24, the tensor shapes of a 3.74B-parameter MoE config, each form replayed as a
        CUDA graph: torch's fused capturable AdamW over 1.0B parameters 7.95 ms; the whole bf16
        step over 1.0B parameters with the clip folded into the step (the follow-up's form):
        torch's fused AdamW plus one multi-tensor bf16 copy 11.09 ms, the Triton kernel 7.61 ms,
        with the same bf16 copies to the bit. The training step of that config at 1x4096 tokens
        with full-iteration CUDA graphs and the follow-up's clip folding: 125.4 ms with TE's
        FusedAdam, 108.6 ms with 'torch', 93.5 ms with 'triton'; bf16 moments lowered the peak
        memory at 4x4096 tokens from 81.58 to 67.66 GiB (195.9 -> 190.8 ms per step, 2026-11-27).
        This change alone (without the clip folding) was not measured separately. The
        distributed optimizer is checked on one GPU by a bit-identical resume of the captured
        recipe at data-parallel size 1, not yet across several GPUs.""",
    test_plan="""
        $ TRITON_INTERPRET=1 pytest tests/unit_tests/optimizer/test_triton_adam.py
        $ pytest tests/unit_tests/optimizer/test_triton_adam.py

        The kernel's steps against torch.optim.AdamW and Adam (fp32 moments within 1e-6, bf16
        moments against a reference that rounds them after each fp32 update), the bf16 model
        parameter write, the state_dict round trip, the factory's classes and capturable
        learning rates, and the config checks; on a GPU, or on CPU under Triton's
        interpreter (the factory and config tests run on CPU either way). The distributed
        optimizer on two data-parallel ranks (gloo on CPU, where CPU tensors stand in for
        CUDA ones; NCCL on two GPUs), with its checkpoint code as with TransformerEngine
        installed: 'torch' and 'triton' step as torch's AdamW over the full params (1e-6), the
        Triton step writes every bf16 shard, and state_dict -> load_state_dict with the param
        state loaded without its per-param step gives every param the step and the next step
        to the bit.""",
    edits=(
        NewFile(
            "megatron/core/optimizer/triton_adam.py",
            "features/torch_adam/triton_step.py",
            header=HEADER,
        ),
        Replace(
            CONFIG,
            "OptimizerConfig",
            old='''\
    decoupled_weight_decay: bool = True
    """If true, decouples weight decay from the gradient update, equivalent to AdamW. If false,
    original Adam update rule will be used. Defaults to True.
    """
''',
            new='''\
    decoupled_weight_decay: bool = True
    """If true, decouples weight decay from the gradient update, equivalent to AdamW. If false,
    original Adam update rule will be used. Defaults to True.
    """

    adam_fusion_impl: str = 'auto'
    """Implementation of the Adam step. If 'auto', TransformerEngine's FusedAdam is used (Apex's
    without TransformerEngine, torch.optim.AdamW without either). If 'torch', torch.optim.AdamW
    (torch.optim.Adam without decoupled_weight_decay) with fused=True. If 'triton', the same
    optimizer class and state, stepped by one Triton kernel that also writes the bf16 model
    params; it keeps both moments in bf16 when exp_avg_dtype and exp_avg_sq_dtype are
    torch.bfloat16. With 'torch' and 'triton', optimizer_cuda_graph makes each param group's
    learning rate a device tensor. Defaults to 'auto'.
    """
''',
        ),
        Replace(
            CONFIG,
            "OptimizerConfig.__post_init__",
            old="""\
        if self.use_precision_aware_optimizer:
            assert (
                self.optimizer == 'adam'
            ), '--use-precision-aware-optimizer only supported with adam'
""",
            new="""\
        if self.adam_fusion_impl not in ('auto', 'torch', 'triton'):
            raise ValueError(
                "adam_fusion_impl must be 'auto', 'torch' or 'triton', "
                f"not {self.adam_fusion_impl!r}."
            )
        if self.adam_fusion_impl != 'auto':
            impl = f"adam_fusion_impl='{self.adam_fusion_impl}'"
            if self.optimizer != 'adam':
                raise ValueError(f"{impl} only supported with optimizer='adam'.")
            if self.use_precision_aware_optimizer or self.optimizer_cpu_offload:
                raise ValueError(
                    f"{impl} is not supported with the precision-aware optimizer or optimizer "
                    "CPU offload (their state is TransformerEngine's FusedAdam's): use "
                    "adam_fusion_impl='auto'."
                )

        if self.use_precision_aware_optimizer:
            assert (
                self.optimizer == 'adam'
            ), '--use-precision-aware-optimizer only supported with adam'
""",
        ),
        Replace(
            CONFIG,
            "OptimizerConfig.__post_init__",
            old="""\
            assert (
                self.exp_avg_dtype == torch.float32
            ), "exp_avg_dtype can only be fp32 when not using precision-aware optimizer"
            assert (
                self.exp_avg_sq_dtype == torch.float32
            ), "exp_avg_sq_dtype can only be fp32 when not using precision-aware optimizer"
""",
            new="""\
            # The Triton Adam step keeps both moments in bf16 itself.
            bf16_moments = (
                self.adam_fusion_impl == 'triton'
                and self.exp_avg_dtype == self.exp_avg_sq_dtype == torch.bfloat16
            )
            assert self.exp_avg_dtype == torch.float32 or bf16_moments, (
                "exp_avg_dtype can only be fp32 when not using precision-aware optimizer "
                "(or bf16, with exp_avg_sq_dtype bf16 and adam_fusion_impl='triton')"
            )
            assert self.exp_avg_sq_dtype == torch.float32 or bf16_moments, (
                "exp_avg_sq_dtype can only be fp32 when not using precision-aware optimizer "
                "(or bf16, with exp_avg_dtype bf16 and adam_fusion_impl='triton')"
            )
""",
        ),
        Replace(
            FACTORY,
            "",
            old="""\
    SGDOptimizerConfig,
)
""",
            new="""\
    SGDOptimizerConfig,
)
from .triton_adam import TritonAdam, TritonAdamW, lr_on_param_device
""",
        ),
        Replace(
            FACTORY,
            "_get_megatron_optimizer_based_on_param_groups",
            old="""\
            # on source of optimizer (Torch or TE/Apex)
            if USING_PYTORCH_OPTIMIZER:
""",
            new="""\
            # on source of optimizer (Torch, Triton or TE/Apex)
            if config.adam_fusion_impl == 'torch':
                adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
                kwargs["fused"] = True
            elif config.adam_fusion_impl == 'triton':
                # torch's fused step where the Triton kernel does not run.
                adam_cls = TritonAdamW if config.decoupled_weight_decay else TritonAdam
                kwargs["fused"] = True
                kwargs["moments_dtype"] = config.exp_avg_dtype
            elif USING_PYTORCH_OPTIMIZER:
""",
        ),
        Replace(
            FACTORY,
            "_get_megatron_optimizer_based_on_param_groups",
            old="""\
            optimizer = adam_cls(**kwargs)
""",
            new="""\
            optimizer = adam_cls(**kwargs)
            if config.optimizer_cuda_graph and config.adam_fusion_impl != 'auto':
                # A captured step reads the learning rate from a device tensor, which
                # OptimizerParamScheduler fills in place; one loaded from a checkpoint goes back
                # to the params' device (TritonAdam's load_state_dict does it itself).
                if config.adam_fusion_impl == 'torch':
                    optimizer.register_load_state_dict_post_hook(lr_on_param_device)
                for group in optimizer.param_groups:
                    if group['params'] and not isinstance(group['lr'], torch.Tensor):
                        device = group['params'][0].device
                        group['lr'] = torch.tensor(float(group['lr']), device=device)
""",
        ),
        Replace(
            MIXED,
            "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
            old="""\
        # Only needed for the float16 params.
        model_data, main_data = self._get_model_and_main_params_data_float16()
""",
            new="""\
        # The Triton Adam step may have written the model params already.
        take_model_copy = getattr(self.optimizer, 'take_model_copy', None)
        if take_model_copy is not None and take_model_copy(self):
            return
        # Only needed for the float16 params.
        model_data, main_data = self._get_model_and_main_params_data_float16()
""",
        ),
        Replace(
            ARGUMENTS,
            "_add_regularization_args",
            old="""\
    group.add_argument('--adam-eps', type=float, default=1e-08,
                       help='Term added to the denominator to improve'
                       'numerical stability')
""",
            new="""\
    group.add_argument('--adam-eps', type=float, default=1e-08,
                       help='Term added to the denominator to improve'
                       'numerical stability')
    group.add_argument(
        '--adam-fusion-impl',
        type=str,
        default='auto',
        choices=['auto', 'torch', 'triton'],
        help="Implementation of the Adam step. auto: TransformerEngine's FusedAdam (Apex's "
        "without TransformerEngine, torch's AdamW without either). torch: torch's fused AdamW, "
        "capturable under --optimizer-cuda-graph. triton: the same optimizer stepped by one "
        "Triton kernel that also writes the bf16 model params; with --exp-avg-dtype bf16 "
        "--exp-avg-sq-dtype bf16 it keeps both moments in bf16.",
    )
""",
        ),
        Replace(
            DISTRIB,
            "DistributedOptimizer.__init__",
            old="""\
            self.optimizer.param_groups = [g["orig_group"] for g in self.opt_group_ranges]
            self.optimizer.load_state_dict(self.optimizer.state_dict())
""",
            new="""\
            self.optimizer.param_groups = [g["orig_group"] for g in self.opt_group_ranges]
            self.optimizer.load_state_dict(self.optimizer.state_dict())

        # The Triton Adam step writes the bf16 shards of the model params (views of the param
        # buffer) itself, unless they are quantized.
        link_model_shards = getattr(self.optimizer, 'link_model_shards', None)
        if link_model_shards is not None:
            if self.ddp_config.fp8_param_gather or self.ddp_config.fp4_param_gather:
                link_model_shards([], [])
            else:
                link_model_shards(self.shard_float16_groups, self.shard_fp32_from_float16_groups)
""",
        ),
        Replace(
            DISTRIB,
            "DistributedOptimizer.state_dict",
            old="""\
        elif USING_TE_OPTIMIZER or USING_APEX_OPTIMIZER:
            # Extract 'step', for TE FusedAdam support.
""",
            new="""\
        elif isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            # torch's Adam (adam_fusion_impl 'torch' or 'triton') keeps 'step' per param, none
            # before the first step.
            steps = list(
                set([s["step"].item() for s in inner_state_dict["state"].values() if "step" in s])
            )
            assert len(steps) <= 1, f"steps: {steps}"
            step = steps[0] if len(steps) == 1 else None
        elif USING_TE_OPTIMIZER or USING_APEX_OPTIMIZER:
            # Extract 'step', for TE FusedAdam support.
""",
        ),
        Replace(
            DISTRIB,
            "DistributedOptimizer.load_state_dict",
            old="""\
                for v in self.optimizer.state.values():
                    v["step"] = step.detach().clone()
""",
            new="""\
                for v in self.optimizer.state.values():
                    v["step"] = step.detach().clone()
        elif isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            # torch's Adam (adam_fusion_impl 'torch' or 'triton') loads a state only with its
            # 'step'; a checkpoint without one starts at 0.
            steps = list(
                set(
                    [
                        g["step"]
                        for g in state_dict["optimizer"]["param_groups"]
                        if g.get("step") is not None
                    ]
                )
            )
            assert len(steps) <= 1, f"steps: {steps}"
            step = float(steps[0]) if len(steps) == 1 else 0.0
            for s in state_dict_state.values():
                s["step"] = torch.tensor(step, dtype=torch.float32)
""",
        ),
        Replace(
            DISTRIB,
            "DistributedOptimizer._set_main_param_and_optimizer_states",
            old="""\
            for key in dst_tensors:
                if not isinstance(tensors[key], torch.Tensor):
""",
            new="""\
            for key in dst_tensors:
                if key == "step":
                    # torch Adam's "step" is loaded from param_groups (see load_state_dict).
                    continue
                if not isinstance(tensors[key], torch.Tensor):
""",
        ),
        Replace(
            DISTRIB,
            "DistributedOptimizer._copy_main_params_to_model_params",
            old="""\
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return

""",
            new="""\
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return

        # The Triton Adam step may have written the model param shards already.
        take_model_copy = getattr(self.optimizer, 'take_model_copy', None)
        if take_model_copy is not None and take_model_copy(self):
            return

""",
        ),
        NewFile(
            "tests/unit_tests/optimizer/test_triton_adam.py",
            "features/torch_adam/upstream/test_triton_adam.py",
        ),
    ),
)

CLIP_CHANGE = UpstreamChange(
    name="torch_adam_clip",
    subject="optimizer: clip grads in the fused Adam step via grad_scale",
    motivation="""
        megatron-core clips the gradients by their total norm in a pass of its own:
        clip_grad_by_total_norm_fp32 multiplies every fp32 main grad by
        min(1, clip_grad / (norm + 1e-6)) in place, a read and a write of all grads, before the
        Adam step reads them again. torch's fused Adam (adam_fusion_impl 'torch') and the Triton
        Adam step ('triton') already divide each grad by the optimizer's grad_scale tensor as
        they read it (the hook torch.amp.GradScaler uses), so the clip can be applied there
        without that pass.""",
    design="""
        A new method, MegatronOptimizer._clip_grads_in_optimizer_step, called where the main
        params are clipped by the total norm (MegatronOptimizer.clip_grad_norm and
        ChainedOptimizer.step): with adam_fusion_impl 'torch' or 'triton', grads that are not
        decoupled, and params that are exactly the inner optimizer's params, it sets
        self.optimizer.grad_scale = clamp_min((total_norm + 1e-6) / clip_grad, 1), a 0-d fp32
        tensor computed on the device from the norm (no host sync, so it is captured with the
        step under optimizer_cuda_graph), and clip_grad_by_total_norm_fp32 is not called.
        Dividing by it is the clip's multiplication by min(1, clip_grad / (total_norm + 1e-6)).
        Otherwise (adam_fusion_impl 'auto', the precision-aware optimizer's decoupled grads, a
        separate grad-norm group such as MTP's, clipped by its own norm) the clip is
        clip_grad_by_total_norm_fp32 as before.

        The factory registers a step post-hook on the optimizers it builds for 'torch' and
        'triton' that drops grad_scale after each step, so a step without clipping never reads
        the scale of an earlier one.""",
    figures="""
        One H200, torch 2.11.0+cu130, megatron-core 0.19.2, TransformerEngine 2.20.2,
        2026-11-24, the tensor shapes of a 3.74B-parameter MoE config, each form replayed as a
        CUDA graph: torch's fused capturable AdamW over 1.0B parameters takes 10.17 ms after a
        separate scaling pass (megatron's clip) and 9.45 ms with the clip as its grad_scale
        (7.95 ms without a clip; torch's kernel writes the scaled grads back). The whole bf16 step
        over 1.0B parameters with the clip as grad_scale: torch's fused AdamW plus one
        multi-tensor bf16 copy 11.09 ms, the Triton kernel of 'triton' (which reads the scale and
        does not write the grads back) 7.61 ms, with the same bf16 copies to the bit. The
        training step with and without this change alone was not measured.""",
    test_plan="""
        $ TRITON_INTERPRET=1 pytest tests/unit_tests/optimizer/test_adam_grad_clip.py
        $ pytest tests/unit_tests/optimizer/test_adam_grad_clip.py

        On one rank (gloo on CPU, where CPU tensors stand in for CUDA ones; NCCL on a GPU), a
        bf16 Linear layer in DDP with megatron's bf16 optimizer and its distributed optimizer,
        'torch' and 'triton', stepped through ChainedOptimizer.step and through the
        MegatronOptimizer's own step with clip_grad 1.0 and grad norms above it: the same grad
        norm and main params within 1e-6 of clip_grad_by_total_norm_fp32 followed by the same
        Adam step, the scale given to the step and dropped after it. No scale with 'auto',
        decoupled grads, part of the params, or a param in MTP's grad-norm group (whose clip
        stays clip_grad_by_total_norm_fp32's); a Python float norm gives the same 0-d scale.""",
    edits=(
        Replace(
            MIXED,
            "MegatronOptimizer.clip_grad_norm",
            old="""\
            if main_params:
                clip_grad_by_total_norm_fp32(
""",
            new="""\
            if main_params and not self._clip_grads_in_optimizer_step(
                main_params, clip_grad, grad_norm, use_decoupled_grad(main_params)
            ):
                clip_grad_by_total_norm_fp32(
""",
        ),
        InsertAfter(
            MIXED,
            "MegatronOptimizer.clip_grad_norm",
            text='''
    def _clip_grads_in_optimizer_step(
        self,
        params: List[torch.nn.Parameter],
        max_norm: Union[int, float],
        total_norm: Union[float, torch.Tensor],
        use_decoupled_grad: bool,
    ) -> bool:
        """Leave the clip of params by total_norm to the inner optimizer's step, where it can.

        torch's fused Adam and the Triton Adam step (adam_fusion_impl 'torch' or 'triton')
        divide each grad by the optimizer's grad_scale tensor as they read it, which saves
        clip_grad_by_total_norm_fp32's pass over the grads. The scale is computed on the device
        (no host sync: it is captured with the step under optimizer_cuda_graph) and dropped
        after the step. Only for params that are all of the inner optimizer's params (not a
        separate grad-norm group) with grads that are not decoupled.

        Returns:
            bool: whether the step applies the clip.
        """
        if (
            self.config.adam_fusion_impl == 'auto'
            or use_decoupled_grad
            or {id(p) for p in params} != {id(p) for p in self.get_parameters()}
        ):
            return False
        norm = torch.as_tensor(total_norm, dtype=torch.float32, device=params[0].device)
        # Dividing by max(1, (norm + 1e-6) / max_norm) is clip_grad_by_total_norm_fp32's
        # multiplication by min(1, max_norm / (norm + 1e-6)).
        self.optimizer.grad_scale = torch.clamp_min((norm.reshape(()) + 1.0e-6) / max_norm, 1.0)
        return True
''',
        ),
        Replace(
            MIXED,
            "ChainedOptimizer.step",
            old="""\
                if main_params:
                    clip_grad_by_total_norm_fp32(
""",
            new="""\
                if main_params and not optimizer._clip_grads_in_optimizer_step(
                    main_params, optimizer.config.clip_grad, grad_norm, use_decoupled_grad
                ):
                    clip_grad_by_total_norm_fp32(
""",
        ),
        Replace(
            FACTORY,
            "_get_megatron_optimizer_based_on_param_groups",
            # after torch_adam's lines, which stay as they are (the series finds them applied)
            old="""\
                        group['lr'] = torch.tensor(float(group['lr']), device=device)
""",
            new="""\
                        group['lr'] = torch.tensor(float(group['lr']), device=device)
            if config.adam_fusion_impl != 'auto':
                # The grad clip given to a step as its grad_scale holds for that step only.
                optimizer.register_step_post_hook(
                    lambda opt, args, kwargs: setattr(opt, 'grad_scale', None)
                )
""",
        ),
        NewFile(
            "tests/unit_tests/optimizer/test_adam_grad_clip.py",
            "features/torch_adam/upstream/test_adam_grad_clip.py",
        ),
    ),
    needs=("torch_adam",),
)
