"""The upstream change of this feature, as ``export --series`` writes it.

Upstream's form: Megatron-FSDP marks its hooks where it registers them (``_register_fsdp_hooks``,
the markers the overlay attaches afterwards by the hooks' names); ``TECudaGraphHelper`` takes
them off the graphed layers for capture and hands them to TE as ``capture_time_hooks``
(:mod:`.capture_hooks`, exported verbatim as ``megatron/core/transformer/te_cuda_graph_hooks.py``,
the module the overlay's helper runs); ``GraphableMegatronModule.__call__`` runs capture and
replay through ``nn.Module.__call__`` so the hooks fire, inline; the capture inputs take the
model's dtype; the rules are checks of ``validate_args`` under ``--use-megatron-fsdp
--cuda-graph-impl transformer_engine``. The tests are ``upstream/test_te_cuda_graph_hooks.py``
beside this module.
"""

from megatron.patchset.export.changes import UpstreamChange
from megatron.patchset.export.edits import NewFile, Replace

HEADER = "# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.\n\n"
FSDP = "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py"
MODULE = "megatron/core/transformer/module.py"
GRAPHS = "megatron/core/transformer/cuda_graphs.py"
ARGUMENTS = "megatron/training/arguments.py"
REGISTER = "MegatronFSDP._register_fsdp_hooks"
HELPER = "TECudaGraphHelper"
GRAPHABLE = "GraphableMegatronModule"

CHANGE = UpstreamChange(
    name="fsdp_cuda_graphs",
    subject="cuda_graphs: TE per-layer CUDA graphs with Megatron-FSDP",
    motivation="""
        --cuda-graph-impl transformer_engine does not work with --use-megatron-fsdp. Megatron-FSDP
        makes every transformer layer an FSDP unit with four module hooks (all-gather before
        forward, release after forward, all-gather before backward, reduce-scatter and release
        after backward). TransformerEngine's make_graphed_callables refuses modules with hooks
        ("Modules must not have hooks registered"), and two of the hooks are wrappers that attach
        autograd hooks to the layer's inputs and outputs, which cannot be captured. And
        GraphableMegatronModule.__call__ calls the capture and replay functions directly, so
        none of a graphed layer's hooks run at replay: its parameters are never all-gathered.""",
    design="""
        Megatron-FSDP marks its hooks where it registers them: the post-backward wrapper
        carries its handler (_cuda_graph_backward_handler), the pre-backward wrapper its handler
        (_cuda_graph_backward_pre_handler), the hooks that use only the module are marked
        capture-time safe, and the root pre-backward wrapper is withheld (it queues an autograd
        callback, legal only in a real backward pass).

        TECudaGraphHelper.create_cudagraphs runs the capture inside megatron_fsdp_capture
        (new megatron/core/transformer/te_cuda_graph_hooks.py): for a model wrapped in
        Megatron-FSDP it takes every hook off the graphed layers, passes them to TE as
        capture_time_hooks (each wrapper replaced by its handler, under the phase it belongs
        to; an unmarked hook is refused with its name), gives the layers FSDP's raw parameters
        (TE records them; the layers use them at replay), pauses FSDP's gradient hooks during
        capture (the gradients of TE's warm-up passes are not the step's), and puts everything
        back afterwards, also when capture fails. Models without Megatron-FSDP are captured as
        before.

        GraphableMegatronModule.__call__ runs capture or replay as the module's forward through
        nn.Module.__call__, so the module's hooks run around it as around an eager forward;
        _te_cuda_graph_capture calls the module's own forward. The sample inputs of the capture
        take params_dtype when the model is not bf16 (they were always bf16).

        validate_args refuses, under --use-megatron-fsdp --cuda-graph-impl transformer_engine
        only: a sharding strategy other than optim_grads_params, no --fsdp-double-buffer or no
        --fsdp-db-use-persist-buf-on-alloc-fail (the graphs replay at the parameter-buffer
        addresses of their capture), and gradient-accumulation fusion, fine-grained parameter
        gather, --fp8-param-gather, --overlap-moe-expert-parallel-comm, --delay-wgrad-compute,
        pipeline parallelism, hybrid FSDP, fine-grained activation offloading and
        --cuda-graph-warmup-steps 0, which the capture does not handle.""",
    figures="""
        1x and 2x H200, megatron-core 0.19.2, TransformerEngine 2.20.2, 2026-11-22: a tiny MoE
        config, 13 iterations (3 eager, 10 replayed) with --deterministic-mode, graph scopes
        attn, attn moe_router moe_preprocess and moe_router, on one GPU, DP=2 and EP=2: losses
        and grad norms bit-identical to eager Megatron-FSDP. Without the change the same flags
        stop at capture: TE refuses the layers ("Modules must not have hooks registered").""",
    test_plan="""
        $ pytest tests/unit_tests/transformer/test_te_cuda_graph_hooks.py

        The tests run on CPU: hooks taken off, routed to TE's capture-time keys and restored;
        hooks firing around capture and replay; the capture inputs' dtype; megatron_fsdp_capture
        leaving a model without Megatron-FSDP alone; validate_args. Bit-identity to eager
        Megatron-FSDP needs GPUs (a training run with and without the graphs).""",
    edits=(
        NewFile(
            "megatron/core/transformer/te_cuda_graph_hooks.py",
            "features/fsdp_cuda_graphs/capture_hooks.py",
            header=HEADER,
        ),
        Replace(
            FSDP,
            REGISTER,
            old="""\
            # Register the post-forward hook that attaches the custom backward hook
            # on the output tensor(s).
            return module.register_forward_hook(forward_hook)
""",
            new="""\
            # TransformerEngine's per-layer CUDA graph capture cannot run this wrapper: it runs
            # the handler before the module's backward instead (te_cuda_graph_hooks.py). The
            # root pre-backward is left to the real backward pass.
            if custom_backward_handler is _root_pre_backward:
                setattr(forward_hook, "_cuda_graph_withhold", True)
            else:
                setattr(forward_hook, "_cuda_graph_backward_pre_handler", custom_backward_handler)

            # Register the post-forward hook that attaches the custom backward hook
            # on the output tensor(s).
            return module.register_forward_hook(forward_hook)
""",
        ),
        Replace(
            FSDP,
            REGISTER,
            old="""\
        # These hooks need to be exposed for manual management by 1F1B Overlapping
""",
            new="""\
        # Hooks that use nothing but the module: TransformerEngine's per-layer CUDA graph capture
        # runs them as hook(module) around the captured forward (te_cuda_graph_hooks.py).
        for hook in (
            _pre_forward_param_unshard,
            _post_forward,
            _release_module_fp8_transpose_cache,
        ):
            setattr(hook, "_cuda_graph_capture_time_safe", True)

        # These hooks need to be exposed for manual management by 1F1B Overlapping
""",
        ),
        Replace(
            FSDP,
            REGISTER,
            old="""\
                    self.forward_pre_hooks[f"module {name} register post-backward hook"] = (
                        module.register_forward_pre_hook(
                            functools.partial(
                                _register_post_backward_hook, _post_backward_release_module
                            ),
                            with_kwargs=True,
                        )
                    )
""",
            new="""\
                    register_post_backward_hook = functools.partial(
                        _register_post_backward_hook, _post_backward_release_module
                    )
                    # Run by TransformerEngine's per-layer CUDA graph capture after the module's
                    # backward, in place of this wrapper (te_cuda_graph_hooks.py).
                    setattr(
                        register_post_backward_hook,
                        "_cuda_graph_backward_handler",
                        _post_backward_release_module,
                    )
                    self.forward_pre_hooks[f"module {name} register post-backward hook"] = (
                        module.register_forward_pre_hook(
                            register_post_backward_hook, with_kwargs=True
                        )
                    )
""",
        ),
        Replace(
            MODULE,
            f"{GRAPHABLE}.get_layer_static_inputs",
            old="""\
            dtype=torch.bfloat16,
""",
            new="""\
            dtype=torch.bfloat16 if self.config.bf16 else self.config.params_dtype,
""",
        ),
        Replace(
            MODULE,
            f"{GRAPHABLE}._te_cuda_graph_capture",
            old="""\
        return self.forward(*args, **kwargs)
""",
            new="""\
        # While __call__ runs the capture as the module's forward, self.forward is this method.
        forward = self.__dict__.get('_te_cuda_graph_forward', self.forward)
        return forward(*args, **kwargs)
""",
        ),
        Replace(
            MODULE,
            f"{GRAPHABLE}.__call__",
            old="""\
            return cuda_graph_func(*args, **kwargs)
""",
            new="""\
            # Run the capture or replay as the module's forward through nn.Module.__call__, so
            # that the module's hooks (Megatron-FSDP's parameter all-gather and release) run
            # around it as around an eager forward.
            state = self.__dict__
            instance_forward = state.get('forward')
            state['_te_cuda_graph_forward'] = self.forward
            state['forward'] = cuda_graph_func
            try:
                return super().__call__(*args, **kwargs)
            finally:
                if instance_forward is None:
                    state.pop('forward', None)
                else:
                    state['forward'] = instance_forward
                state.pop('_te_cuda_graph_forward', None)
""",
        ),
        Replace(
            GRAPHS,
            "",
            old="""\
from megatron.core.transformer.module import GraphableMegatronModule, MegatronModule
""",
            new="""\
from megatron.core.transformer.module import GraphableMegatronModule, MegatronModule
from megatron.core.transformer.te_cuda_graph_hooks import megatron_fsdp_capture
""",
        ),
        Replace(
            GRAPHS,
            f"{HELPER}.__init__",
            old="""\
        self._capture_finished = False
        self._graphs_created = False
""",
            new="""\
        self._capture_finished = False
        self._graphs_created = False
        # Megatron-FSDP's hooks taken off the graphed layers while create_cudagraphs() runs.
        self._capture_hooks = None
""",
        ),
        Replace(
            GRAPHS,
            f"{HELPER}._get_cuda_graph_input_data",
            old="""\
        kwargs = get_make_graphed_callables_kwargs()
        return sample_args, kwargs
""",
            new="""\
        kwargs = get_make_graphed_callables_kwargs()
        capture_time_hooks = getattr(self._capture_hooks, 'capture_time_hooks', None)
        if capture_time_hooks and any(capture_time_hooks):
            # Megatron-FSDP's hooks of the graphed layers, run by TE outside the graphs.
            kwargs['capture_time_hooks'] = capture_time_hooks
        return sample_args, kwargs
""",
        ),
        Replace(
            GRAPHS,
            HELPER,
            old='''\
    def create_cudagraphs(self):
        """
        Capture CUDA Graphs per TransformerLayer per microbatch.
        """
        start_time = self._start_capturing()
''',
            new='''\
    def create_cudagraphs(self):
        """
        Capture CUDA Graphs per TransformerLayer per microbatch.

        With Megatron-FSDP, the hooks of the graphed layers are taken off for the capture and
        run by TE as capture-time hooks; they are put back afterwards, also when capture fails.
        """
        with megatron_fsdp_capture(self.model, self.flattened_callables, self.config) as hooks:
            self._capture_hooks = hooks
            try:
                self._create_cudagraphs()
            finally:
                self._capture_hooks = None

    def _create_cudagraphs(self):
        """Capture the CUDA Graphs (see create_cudagraphs)."""
        start_time = self._start_capturing()
''',
        ),
        Replace(
            ARGUMENTS,
            "validate_args",
            old="""\
                "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using "
                "CUDA Graph with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
            )
""",
            new="""\
                "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using "
                "CUDA Graph with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
            )
            if args.use_megatron_fsdp:
                # The graphs replay at the parameter-buffer addresses of their capture: every
                # layer must be an FSDP unit all-gathered into the same fixed buffers.
                assert (
                    args.data_parallel_sharding_strategy == "optim_grads_params"
                    and args.fsdp_double_buffer
                    and args.fsdp_db_use_persist_buf_on_alloc_fail
                ), (
                    "--cuda-graph-impl transformer_engine with --use-megatron-fsdp needs "
                    "--data-parallel-sharding-strategy optim_grads_params, --fsdp-double-buffer "
                    "and --fsdp-db-use-persist-buf-on-alloc-fail."
                )
                unsupported = [
                    flag
                    for flag, value in (
                        ("--gradient-accumulation-fusion", args.gradient_accumulation_fusion),
                        (
                            "--megatron-fsdp-enable-fine-grained-param-gather",
                            args.megatron_fsdp_enable_fine_grained_param_gather,
                        ),
                        ("--fp8-param-gather", args.fp8_param_gather),
                        (
                            "--overlap-moe-expert-parallel-comm",
                            args.overlap_moe_expert_parallel_comm,
                        ),
                        ("--delay-wgrad-compute", args.delay_wgrad_compute),
                        (
                            "--pipeline-model-parallel-size > 1",
                            args.pipeline_model_parallel_size > 1,
                        ),
                        (
                            "--num-distributed-optimizer-instances > 1",
                            args.num_distributed_optimizer_instances > 1,
                        ),
                        (
                            "--fine-grained-activation-offloading",
                            args.fine_grained_activation_offloading,
                        ),
                        ("--cuda-graph-warmup-steps 0", args.cuda_graph_warmup_steps < 1),
                    )
                    if value
                ]
                assert not unsupported, (
                    "--cuda-graph-impl transformer_engine with --use-megatron-fsdp does not "
                    f"support {', '.join(unsupported)}."
                )
""",
        ),
        NewFile(
            "tests/unit_tests/transformer/test_te_cuda_graph_hooks.py",
            "features/fsdp_cuda_graphs/upstream/test_te_cuda_graph_hooks.py",
        ),
    ),
)
