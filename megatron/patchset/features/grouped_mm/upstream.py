"""The upstream change of this feature, as ``export --series`` writes it.

Upstream's form of the two flags is two TransformerConfig fields, ``moe_grouped_gemm_impl``
(``'te'`` or ``'torch'``) and ``moe_expert_splits_on_device``, whose flags megatron's argument
factory makes from the fields (the same names as the overlay's). The GEMMs are this feature's
:mod:`.torch_grouped_gemm`, as the overlay runs it, added as
``megatron/core/transformer/moe/torch_grouped_gemm.py``; ``TEGroupedLinear.forward`` routes to it
(the overlay subclasses megatron's TE grouped linears instead, because that method calls
``super()``). The token dispatcher skips its device-to-host copy and ``TEGroupedMLP.forward`` its
``.tolist()`` when the counts stay on the device; that line differs between core_r0.19.0 and main,
so the edit carries both forms. The rules are ``TransformerConfig.__post_init__`` checks, taken
only with the new options. Tests: ``upstream/test_torch_grouped_gemm.py`` beside this module.
"""

from megatron.patchset.export.changes import UpstreamChange
from megatron.patchset.export.edits import NewFile, OneOf, Replace

HEADER = "# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.\n\n"
CONFIG = "megatron/core/transformer/transformer_config.py"
TE = "megatron/core/extensions/transformer_engine.py"
EXPERTS = "megatron/core/transformer/moe/experts.py"
DISPATCHER = "megatron/core/transformer/moe/token_dispatcher.py"

FIELDS = '''\
    moe_grouped_gemm_impl: Literal['te', 'torch'] = 'te'
    """The GEMMs of the grouped experts (moe_grouped_gemm with the Transformer Engine spec).
    'te': Transformer Engine's GroupedLinear. 'torch': forward, data gradient and weight gradient
    as one torch.nn.functional.grouped_mm each (bf16), with the per-expert row offsets on the
    device; the parameters and the checkpoint format stay those of TE's GroupedLinear. The
    weight gradients go straight into the main grads of megatron's DDP."""

    moe_expert_splits_on_device: bool = False
    """Keep the per-expert token counts on the GPU: the alltoall dispatcher neither copies them to
    the host nor waits for them, and the grouped GEMMs read them there, so a dropless MoE layer
    runs without a host synchronization and cuda_graph_impl='full_iteration' can capture it.
    Requires moe_grouped_gemm_impl='torch', the alltoall dispatcher with moe_permute_fusion, one
    expert-parallel and expert-tensor-parallel rank, and no token dropping or padding."""

'''

VALIDATION = """\
        if self.moe_grouped_gemm_impl == 'torch':
            problems = []
            if self.num_moe_experts is None or not self.moe_grouped_gemm:
                problems.append("num_moe_experts and moe_grouped_gemm=True")
            if self.transformer_impl != 'transformer_engine':
                problems.append("transformer_impl='transformer_engine' (TE's grouped linears)")
            if not self.bf16 or self.fp8 or self.fp4:
                problems.append("bf16 without fp8 or fp4 (the grouped GEMMs run in bf16)")
            if self.add_bias_linear:
                problems.append("add_bias_linear=False (expert biases are not implemented)")
            if self.delay_wgrad_compute or self.overlap_dispatch_backward_with_experts_wgrad:
                problems.append("the weight gradient computed in backward (delay_wgrad_compute)")
            if self.use_transformer_engine_op_fuser or self.moe_single_grouped_weight:
                problems.append(
                    "the per-expert weights of TE's GroupedLinear (no use_transformer_engine_op_"
                    "fuser or moe_single_grouped_weight)"
                )
            if self.cuda_graph_impl == 'full_iteration' and not self.moe_expert_splits_on_device:
                problems.append("moe_expert_splits_on_device=True for full-iteration CUDA graphs")
            if self.cuda_graph_impl == 'full_iteration' and self.cuda_graph_warmup_steps < 1:
                problems.append(
                    "cuda_graph_warmup_steps >= 1 (the first backward probes the grouped GEMM)"
                )
            expert_tp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
            widths = [self.moe_latent_size or self.hidden_size]
            if self.moe_ffn_hidden_size is not None:
                widths.append(self.moe_ffn_hidden_size // expert_tp)
            if any(width % 8 for width in widths):
                problems.append(f"expert GEMM widths that are multiples of 8, not {widths}")
            if problems:
                raise ValueError(
                    "moe_grouped_gemm_impl='torch' requires " + "; ".join(problems) + "."
                )

        if self.moe_expert_splits_on_device:
            problems = []
            if self.moe_grouped_gemm_impl != 'torch':
                problems.append("moe_grouped_gemm_impl='torch' (TE splits its input on the host)")
            if self.moe_token_dispatcher_type != 'alltoall' or not self.moe_permute_fusion:
                problems.append("moe_token_dispatcher_type='alltoall' with moe_permute_fusion")
            if self.expert_model_parallel_size != 1 or (self.expert_tensor_parallel_size or 1) != 1:
                problems.append(
                    "expert_model_parallel_size=1 and expert_tensor_parallel_size=1 (the "
                    "all-to-all and all-gather take host split sizes)"
                )
            if (
                self.moe_expert_capacity_factor is not None
                or self.moe_router_padding_for_quantization
            ):
                problems.append("no token dropping or padding (the token count would be dynamic)")
            if self.cuda_graph_impl in ('local', 'transformer_engine'):
                problems.append(
                    "no per-layer CUDA graphs (they copy the counts to the host after each replay)"
                )
            if problems:
                raise ValueError(
                    "moe_expert_splits_on_device=True requires " + "; ".join(problems) + "."
                )

        if self.moe_single_grouped_weight or self.moe_single_grouped_bias:
"""

CHANGE = UpstreamChange(
    name="grouped_mm",
    subject="moe: experts as torch grouped GEMMs, token counts kept on the device",
    motivation="""
        On Hopper, Transformer Engine's GroupedLinear runs a grouped linear as one cuBLAS GEMM
        per expert (its grouped-tensor GEMM is Blackwell-only), after the per-expert token
        counts were copied to the host to split the input. With 128 experts that is about 500
        launches per MoE layer (fc1 and fc2, forward, data and weight gradient) plus a
        device-to-host synchronization per layer. At one micro-batch of 4096 tokens the experts
        of a 128-expert MoE config run 17.15 ms of GEMM kernels behind 240.40 ms of host time
        and 2,511 launches per step. The synchronization also keeps a dropless MoE step out of
        cuda_graph_impl='full_iteration': the dispatcher's wait on its device-to-host event
        fails the capture (cudaErrorCapturedEvent).""",
    design="""
        moe_grouped_gemm_impl='torch' routes TEGroupedLinear.forward to the new module
        megatron/core/transformer/moe/torch_grouped_gemm.py: forward, data gradient and weight
        gradient as one torch.nn.functional.grouped_mm each, with the per-expert row offsets
        as a device tensor. The parameters (weight0 ... weightN-1), their initialization, the
        state dict and the checkpoint format stay TE's. At its first forward, after DDP, the
        optimizer and a checkpoint load took the parameters and before any CUDA graph is
        captured, each linear moves its expert weights into one (experts, out, in) tensor, so
        the GEMMs read them without a copy; weights that are views of DDP's parameter buffer
        stay where they are. The weight gradient goes straight into DDP's main grads with TE's
        fused-accumulation contract (grad_added_to_main_grad, a dummy gradient for DDP's hook);
        where they lie in reverse expert order, as DDP places them, one Triton kernel adds the
        bf16 gradients into the fp32 main grads (torch's promoted add, to the bit).

        moe_expert_splits_on_device=True keeps the token counts on the GPU: the alltoall
        dispatcher skips its device-to-host copy and wait, and TEGroupedMLP.forward hands the
        counts to the linears as a tensor instead of a list. A dropless MoE layer then has no
        host synchronization, and cuda_graph_impl='full_iteration' captures the whole step.
        It needs one expert-parallel and expert-tensor-parallel rank, the alltoall dispatcher
        with moe_permute_fusion and no token dropping; TransformerConfig refuses other layouts,
        and the torch GEMMs' own limits (bf16, no expert bias, no delayed weight gradient, no
        TE op fuser, widths multiple of 8), only when the new options are set.""",
    figures="""
        One H200, torch 2.11.0+cu130, megatron-core 0.19.2, TransformerEngine 2.20.2,
        2026-11-23, a 128-expert MoE config at 1x4096 tokens: one forward and backward of the
        experts launches 11 kernels against TE's 497; the GEMMs against TE's GroupedLinear at
        128 experts, 2048 -> 1536: relative error 0. With both options and a full-iteration
        CUDA graph, forward+backward takes 64.9 ms against 166.6 ms for the same config with
        TE's per-layer graphs over attention, router and MoE preprocessing (216.5 ms eager);
        at 4x4096 tokens 179.0 ms against 250.1 ms. 20 training iterations of a small config
        against TE's GEMMs: max |loss diff| 0.0017-0.0096; the full-iteration graph against the
        same run eagerly under deterministic mode: losses bit-identical. Expert parallelism
        above one rank has not been measured.""",
    test_plan="""
        $ pytest tests/unit_tests/transformer/moe/test_torch_grouped_gemm.py
        $ TRITON_INTERPRET=1 pytest tests/unit_tests/transformer/moe/test_torch_grouped_gemm.py

        The GEMMs against per-expert matmuls (forward, data and weight gradients, empty
        experts, counts as a list or a tensor), the main-grad accumulation and the config's
        checks run on CPU (torch's grouped_mm has a CPU path for bf16); the Triton
        accumulation runs on a GPU or under Triton's interpreter; the TEGroupedLinear routing
        test needs a GPU with Transformer Engine.""",
    edits=(
        NewFile(
            "megatron/core/transformer/moe/torch_grouped_gemm.py",
            "features/grouped_mm/torch_grouped_gemm.py",
            header=HEADER,
        ),
        Replace(
            CONFIG,
            "TransformerConfig",
            old="""\
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
""",
            new=FIELDS
            + """\
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
""",
        ),
        Replace(
            CONFIG,
            "TransformerConfig.__post_init__",
            old="""\
        if self.moe_single_grouped_weight or self.moe_single_grouped_bias:
""",
            new=VALIDATION,
        ),
        Replace(
            TE,
            "",
            old='''\
        def forward(self, x, m_splits):
            """Forward."""
''',
            new='''\
        def forward(self, x, m_splits):
            """Forward."""
            if self.config.moe_grouped_gemm_impl == 'torch':
                from megatron.core.transformer.moe.torch_grouped_gemm import grouped_linear_forward

                return grouped_linear_forward(self, x, m_splits)
''',
        ),
        OneOf(
            (
                # core_r0.19.0 (0.19.x)
                Replace(
                    EXPERTS,
                    "TEGroupedMLP.forward",
                    old="""\
        tokens_per_expert: list[int] = tokens_per_expert.tolist()
""",
                    new="""\
        if not self.config.moe_expert_splits_on_device:
            tokens_per_expert = tokens_per_expert.tolist()
""",
                ),
                # main: the counts stay a tensor for TE's grouped-tensor path already
                Replace(
                    EXPERTS,
                    "TEGroupedMLP.forward",
                    old="""\
        elif isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = tokens_per_expert.tolist()
""",
                    new="""\
        elif self.config.moe_expert_splits_on_device:
            pass  # the torch grouped GEMMs read the counts on the device
        elif isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = tokens_per_expert.tolist()
""",
                ),
            )
        ),
        Replace(
            DISPATCHER,
            "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
            old="""\
        if not self.drop_and_pad:
            if point == self.cuda_dtoh_point:
""",
            new="""\
        # With moe_expert_splits_on_device nothing on the host needs the counts (one EP and
        # expert-TP rank, static token count): no copy, no synchronization.
        if not self.drop_and_pad and not self.config.moe_expert_splits_on_device:
            if point == self.cuda_dtoh_point:
""",
        ),
        NewFile(
            "tests/unit_tests/transformer/moe/test_torch_grouped_gemm.py",
            "features/grouped_mm/upstream/test_torch_grouped_gemm.py",
        ),
    ),
)
