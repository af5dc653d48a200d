"""The upstream change of this feature, as ``export --series`` writes it.

Upstream's form is a field of megatron's own DDP config, ``scale_gradients_in_loss``
(``--ddp-scale-gradients-in-loss``): ``DistributedDataParallel`` keeps its buckets unscaled and
exposes the factor as ``loss_scaling_factor``, which ``train`` multiplies into
``config.grad_scale_func``. The overlay does the same with two patches (:mod:`.patches`); the
test is ``upstream/test_ddp_scale_gradients_in_loss.py`` beside this module.
"""

from megatron.patchset.export.changes import UpstreamChange
from megatron.patchset.export.edits import NewFile, Replace

CONFIG = "megatron/core/distributed/distributed_data_parallel_config.py"
DDP = "megatron/core/distributed/distributed_data_parallel.py"
ARGUMENTS = "megatron/training/arguments.py"
TRAINING = "megatron/training/training.py"

CHANGE = UpstreamChange(
    name="dp_grad_scaling",
    subject="ddp: apply the data-parallel gradient scaling to the loss gradient",
    motivation="""
        Without average_in_collective, DistributedDataParallel multiplies every gradient bucket
        by 1/dp_size before the reduce-scatter (all-reduce): a read and a write of every fp32
        main gradient per step. One rank of Qwen3-30B-A3B at EP 8 holds 5.2 B parameters on its
        GPU, so that is 20.6 GB read and written per step, 9.5 ms of a 332 ms step on one H200
        when the rest of the step runs in CUDA graphs.""",
    design="""
        The backward pass is linear in the loss gradient that starts it, and the training loop
        seeds every backward pass (and the MoE auxiliary and MTP losses) from
        config.grad_scale_func. With scale_gradients_in_loss, DistributedDataParallel keeps its
        buckets' scaling factor at 1 and exposes the factor it would have applied as
        loss_scaling_factor; train() multiplies it into grad_scale_func. The gradients reach the
        reduction already scaled, so the NaN check, the norm, the clip and checkpoints see what
        they see today.

        With a power-of-two dp_size the factor is a power of two, and every product and sum of
        the backward pass, the accumulation over micro-batches and the reduction round the same
        scaled as unscaled: the gradients are bitwise identical to today's, short of values that
        leave the floating-point range within that factor. Off by default. It has no effect with
        calculate_per_token_loss (nothing is scaled before the reduction) and is refused with
        average_in_collective (the expert buffers keep a factor other than the dense ones).""",
    figures="""
        With the same change applied to megatron-core 0.19.2 at run time (the DDP's bucket
        factors set to 1 after its constructor, the factor in scale_loss). One H200, torch
        2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28: one rank of Qwen3-30B-A3B at 32
        GPUs, EP 8, the distributed optimizer (--fake-process-group, full-iteration CUDA
        graphs), 1x4096 tokens: 332.3 -> 322.8 ms per
        step. Bitwise: losses, gradient norms, main parameters and Adam moments equal with and
        without it over 4 iterations of a small MoE GPT at dp_size 2 (fp32 and bf16 parameters)
        and 4 (EP 1 and 2) on CPU with gloo; 12 iterations at dp_size 2 and EP 2 on two H200
        with NCCL and full-iteration CUDA graphs. This change's test passes on CPU on
        core_r0.19.0 and main with the change applied.""",
    test_plan="""
        $ pytest tests/unit_tests/distributed/test_ddp_scale_gradients_in_loss.py

        Two ranks (gloo on CPU, NCCL with two GPUs): a Linear layer in DistributedDataParallel,
        fp32 and bf16 parameters, with and without the distributed optimizer: the reduced main
        gradients with scale_gradients_in_loss equal today's bitwise; without the loss-gradient
        half they are dp_size times larger; average_in_collective is refused.""",
    edits=(
        Replace(
            CONFIG,
            "DistributedDataParallelConfig",
            old='''\
    average_in_collective: bool = False
    """If true, compute average in collective directly, as opposed to dividing by the
       dp_size first and then computing sum in the collective."""
''',
            new='''\
    average_in_collective: bool = False
    """If true, compute average in collective directly, as opposed to dividing by the
       dp_size first and then computing sum in the collective."""

    scale_gradients_in_loss: bool = False
    """If true, the 1/dp_size that gradients are otherwise multiplied by before the collective
       is applied to the loss gradient instead (DistributedDataParallel.loss_scaling_factor,
       which the training loop multiplies into its grad_scale_func): one pass less over the
       gradient buffers per step, bitwise identical gradients when dp_size is a power of two.
       Not with average_in_collective."""
''',
        ),
        Replace(
            CONFIG,
            "DistributedDataParallelConfig.__post_init__",
            old="""\
        if self.num_buckets is not None:
""",
            new="""\
        if self.scale_gradients_in_loss:
            assert (
                not self.average_in_collective
            ), "scale_gradients_in_loss applies 1/dp_size to the loss; average_in_collective too"

        if self.num_buckets is not None:
""",
        ),
        Replace(
            DDP,
            "DistributedDataParallel.__init__",
            old="""\
        # Compute gradient scaling factors.
""",
            new="""\
        # The factor the training loop applies to the loss gradient (scale_gradients_in_loss).
        self.loss_scaling_factor = 1.0

        # Compute gradient scaling factors.
""",
        ),
        Replace(
            DDP,
            "DistributedDataParallel.__init__",
            old="""\
                gradient_scaling_factor = 1.0 / data_parallel_world_size
                expert_gradient_scaling_factor = 1.0 / data_parallel_world_size
""",
            new="""\
                gradient_scaling_factor = 1.0 / data_parallel_world_size
                expert_gradient_scaling_factor = 1.0 / data_parallel_world_size
                if self.ddp_config.scale_gradients_in_loss:
                    self.loss_scaling_factor = gradient_scaling_factor
""",
        ),
        Replace(
            DDP,
            "DistributedDataParallel.__init__",
            old="""\
                else:
                    assert scaling_factor == target_gradient_scaling_factor
""",
            new="""\
                else:
                    assert scaling_factor == target_gradient_scaling_factor
            if self.loss_scaling_factor != 1.0:
                # Applied to the loss gradient instead of the buffer.
                scaling_factor = 1.0
""",
        ),
        Replace(
            ARGUMENTS,
            "_add_distributed_args",
            old="""\
    group.add_argument('--overlap-param-gather', action='store_true',
""",
            new="""\
    group.add_argument(
        '--ddp-scale-gradients-in-loss',
        action='store_true',
        default=False,
        help='If set, apply the 1/data-parallel-size gradient scaling to the loss gradient '
        'instead of to the gradient buffers before the collective.',
    )
    group.add_argument('--overlap-param-gather', action='store_true',
""",
        ),
        Replace(
            TRAINING,
            "get_megatron_ddp_config",
            old="""\
        kwargs["average_in_collective"] = args.ddp_average_in_collective
""",
            new="""\
        kwargs["average_in_collective"] = args.ddp_average_in_collective
        kwargs["scale_gradients_in_loss"] = args.ddp_scale_gradients_in_loss
""",
        ),
        Replace(
            TRAINING,
            "train",
            old="""\
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None
""",
            new="""\
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None
    loss_scaling_factor = getattr(model[0], 'loss_scaling_factor', 1.0)
    if config.grad_scale_func is not None and loss_scaling_factor != 1.0:
        # DDP's 1/dp_size, applied to the loss gradient (scale_gradients_in_loss).
        scale_loss = config.grad_scale_func
        config.grad_scale_func = lambda loss: scale_loss(loss) * loss_scaling_factor
""",
        ),
        NewFile(
            "tests/unit_tests/distributed/test_ddp_scale_gradients_in_loss.py",
            "features/dp_grad_scaling/upstream/test_ddp_scale_gradients_in_loss.py",
        ),
    ),
)
