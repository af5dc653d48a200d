#!/usr/bin/env python3
"""Train torchtitan's Qwen3-MoE model on the shape of a megatron flag file, for
tools/bench/bench.py.

    torchrun --nproc-per-node 1 tools/bench/peers/torchtitan_runner.py \\
        $(grep -v '^#' examples/configs/reference_moe.args) --train-iters 12 \\
        --tt-compile --tt-cuda-graphs

Every argument not starting with ``--tt-`` is a megatron flag: the runner parses and validates
them with megatron's own parser (``tools/bench/peers/shape.py``) and builds from them torchtitan's
Qwen3-MoE decoder with the same layer shape, depth, vocabulary (megatron's padded one),
sequence length, micro- and global batch, and AdamW with the same learning-rate schedule,
weight decay (none on norm weights, as megatron), betas, epsilon and gradient clipping. What
runs is torchtitan's: its model and initialisation, its parallelisation function (FSDP2 mixed
precision: bf16 compute, fp32 master weights and gradient reduction; expert parallelism),
its per-block ``torch.compile``, its chunked cross-entropy, its CUDA-graph wrapper of the
forward-backward step, its fused AdamW and gradient clipping, and its auxiliary-loss-free
expert-bias load balancing (torchtitan has no auxiliary loss: megatron's
``--moe-aux-loss-coeff`` is not translated). The data are synthetic tokens distributed as
megatron's ``--mock-data`` (``shape.SyntheticTokens``). The training loop is this file's.

With ``MEGATRON_PATCHSET_METRICS`` set, the last rank appends one line per iteration in the
format of megatron's metrics patch, with megatron's FLOP count for the iteration, and a
``summary`` line with the peak memory over all ranks; ``MEGATRON_PATCHSET_TIME_FWD_BWD=1``
adds the forward-backward time (all micro-batches, between two device synchronisations).

torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.12
added. On an older torch the runner defines a stand-in before importing torchtitan. Only
torchtitan's ``full_dtensor`` and ``spmd_types`` backends use it, on a mesh of more than one
rank: there the runner selects ``partial_dtensor`` in place of torchtitan's default
(``spmd_types``), and ``--tt-spmd-backend`` refuses the other two.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import time

import shape as peer_shape  # a sibling: this script's folder is on sys.path

ATTENTION_BACKENDS = ("flex", "flex_flash", "varlen")
MOE_COMM_BACKENDS = ("standard", "deepep", "hybridep", "minimal_async_ep")
# EP token dispatchers with no host synchronisation, which a CUDA graph can capture.
GRAPHABLE_EP_BACKENDS = ("minimal_async_ep", "hybridep")
AC_MODES = ("none", "selective", "full")


def runner_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="torchtitan's Qwen3-MoE on a megatron flag file's shape (see the module "
        "docstring); arguments not starting with --tt- are megatron flags",
        add_help=True,
    )
    p.add_argument(
        "--tt-compile",
        action="store_true",
        help="torch.compile each transformer block and the loss (torchtitan's compile)",
    )
    p.add_argument(
        "--tt-cuda-graphs",
        action="store_true",
        help="capture the forward-backward step in a CUDA graph after one eager step "
        "(torchtitan's trainer does so unless --training.disable_cuda_graphs)",
    )
    p.add_argument(
        "--tt-attention",
        choices=ATTENTION_BACKENDS,
        default="flex",
        help="torchtitan's attention backend (flex: FlexAttention, Triton; flex_flash: "
        "FlexAttention's flash backend, Hopper; varlen: flash-attention varlen). Default: flex",
    )
    p.add_argument(
        "--tt-moe-comm",
        choices=MOE_COMM_BACKENDS,
        default="standard",
        help="torchtitan's token dispatcher with expert parallelism (standard: all-to-all "
        "through torch.distributed; local dispatch at EP=1). Default: standard",
    )
    p.add_argument(
        "--tt-hybridep-capacity-factor",
        type=float,
        default=None,
        help="HybridEP's non_blocking_capacity_factor (no host sync: CUDA graphs possible)",
    )
    p.add_argument(
        "--tt-ac",
        choices=AC_MODES,
        default="none",
        help="torchtitan's activation checkpointing. Default: none (megatron's reference "
        "config recomputes nothing)",
    )
    p.add_argument(
        "--tt-loss-chunks",
        type=int,
        default=0,
        help="chunks of torchtitan's chunked cross-entropy (the output layer and loss run per "
        "sequence chunk); 0: the whole output layer, then torchtitan's cross-entropy. Default: 0",
    )
    p.add_argument(
        "--tt-optimizer-impl",
        choices=("fused", "foreach", "for-loop"),
        default=None,
        help="AdamW implementation. Default: fused on GPUs, foreach on CPUs",
    )
    p.add_argument(
        "--tt-spmd-backend",
        default=None,
        help="torchtitan's parallelism.spmd_backend. Default: torchtitan's default",
    )
    p.add_argument(
        "--tt-fsdp-reshard",
        choices=("default", "always", "never"),
        default=None,
        help="torchtitan's parallelism.fsdp_reshard_after_forward. Default: torchtitan's default",
    )
    return p


def spmd_backend(requested: str | None, compat: bool, world_size: int) -> str | None:
    """torchtitan's ``parallelism.spmd_backend`` for the run: the requested one; without one, on a
    torch older than 2.12 (``compat``) with more than one rank, ``partial_dtensor`` (torchtitan's
    default, ``spmd_types``, builds torch 2.12's ``DataParallelMeshDims`` there); else None,
    torchtitan's default."""
    if requested:
        return requested
    if compat and world_size > 1:
        return "partial_dtensor"
    return None


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(runner arguments, megatron arguments): ``--tt-*`` flags and their values go to the
    runner, the rest to megatron."""
    ours, theirs = [], []
    takes_value = {
        "--tt-attention",
        "--tt-moe-comm",
        "--tt-hybridep-capacity-factor",
        "--tt-ac",
        "--tt-loss-chunks",
        "--tt-optimizer-impl",
        "--tt-spmd-backend",
        "--tt-fsdp-reshard",
    }
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name.startswith("--tt-") or token in ("-h", "--help"):
            ours.append(token)
            if name in takes_value and "=" not in token and i + 1 < len(argv):
                ours.append(argv[i + 1])
                i += 1
        else:
            theirs.append(token)
        i += 1
    return ours, theirs


def check_options(opts: argparse.Namespace, shape: peer_shape.ModelShape) -> list[str]:
    """Combinations of runner options and shape that torchtitan cannot run (empty: fine)."""
    out = []
    ep = shape.expert_parallel_size
    if opts.tt_cuda_graphs and ep > 1:
        graphable = opts.tt_moe_comm == "minimal_async_ep" or (
            opts.tt_moe_comm == "hybridep" and opts.tt_hybridep_capacity_factor is not None
        )
        if not graphable:
            out.append(
                f"--tt-cuda-graphs with EP={ep} needs a dispatcher without host "
                "synchronisation: --tt-moe-comm minimal_async_ep, or hybridep with "
                "--tt-hybridep-capacity-factor"
            )
    if ep == 1 and opts.tt_moe_comm != "standard":
        out.append(f"--tt-moe-comm {opts.tt_moe_comm} needs expert parallelism (EP > 1)")
    if opts.tt_hybridep_capacity_factor is not None and opts.tt_moe_comm != "hybridep":
        out.append("--tt-hybridep-capacity-factor applies to --tt-moe-comm hybridep only")
    if opts.tt_loss_chunks < 0:
        out.append("--tt-loss-chunks must be 0 (no chunking) or more")
    elif opts.tt_loss_chunks and shape.seq_length % opts.tt_loss_chunks:
        out.append(
            f"--tt-loss-chunks {opts.tt_loss_chunks} must divide the sequence length "
            f"{shape.seq_length}"
        )
    if shape.dropout > 0:
        out.append(
            f"dropout {shape.dropout:g}: torchtitan's Qwen3 has none; set "
            "--attention-dropout 0 --hidden-dropout 0 for every variant"
        )
    if shape.global_batch_size % (shape.micro_batch_size * shape.data_parallel_size):
        out.append("the global batch is not a multiple of micro-batch x data-parallel size")
    return out


def torch_compat() -> list[str]:
    """Stand-ins for what torchtitan imports from a newer torch; returns what was added. Call
    it before importing torchtitan."""
    import torch
    import torch.distributed.fsdp as fsdp

    added = []
    if not torch.cuda.is_available():
        # torchtitan takes CUDA when it finds no accelerator; its modules read the device type
        # when imported, so it is set before the first of them.
        import torchtitan.tools.utils as tt_utils

        tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass
        class DataParallelMeshDims:
            """Stand-in on torch < 2.12 (type annotations of torchtitan's FSDP helpers);
            constructing one means a backend that needs the real one was selected."""

            shard: object = None
            replicate: object = None

            def __post_init__(self):
                raise RuntimeError(
                    "torchtitan's full_dtensor/spmd_types backends need torch >= 2.12"
                )

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")

    import inspect

    import torch.nn.attention.flex_attention as flex

    original = flex.create_block_mask
    if "separate_full_blocks" not in inspect.signature(original).parameters:

        @functools.wraps(original)
        def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
            """torch < 2.12 always separates full blocks, the only value torchtitan passes
            outside its batch-invariant mode."""
            if not separate_full_blocks:
                raise RuntimeError("separate_full_blocks=False needs torch >= 2.12")
            return original(*args, **kwargs)

        flex.create_block_mask = create_block_mask
        added.append("flex_attention.create_block_mask(separate_full_blocks=True)")
    return added


def build_model_config(shape: peer_shape.ModelShape, attention: str, moe_comm: str, opts):
    """torchtitan's Qwen3-MoE config of ``shape``: the 30B-A3B flavour's top level
    (embedding, output layer, final norm and their initialisation) resized to the shape, and
    ``shape.num_layers`` Qwen3-MoE blocks built by torchtitan's own layer builder (whose output
    projections are initialised for this depth)."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.common.nn_modules import RMSNorm

    base = qwen3.qwen3_configs["30B-A3B"](attn_backend=attention, moe_comm_backend=moe_comm)
    rope = CosSinRoPE.Config(
        dim=shape.head_dim, max_seq_len=shape.seq_length, theta=shape.rotary_base
    )
    layers = qwen3._build_qwen3_moe_layers(
        n_layers=shape.num_layers,
        dim=shape.hidden_size,
        n_heads=shape.num_attention_heads,
        n_kv_heads=shape.num_query_groups,
        head_dim=shape.head_dim,
        moe_hidden_dim=shape.moe_ffn_hidden_size,
        num_experts=shape.num_experts,
        top_k=shape.moe_router_topk,
        attn_backend=attention,
        moe_comm_backend=moe_comm,
        non_blocking_capacity_factor=opts.tt_hybridep_capacity_factor,
        rope=rope,
    )
    config = dataclasses.replace(
        base,
        dim=shape.hidden_size,
        vocab_size=shape.vocab_size,
        layers=layers,
        enable_weight_tying=False,
        norm=dataclasses.replace(base.norm, normalized_shape=shape.hidden_size),
        tok_embeddings=dataclasses.replace(
            base.tok_embeddings,
            num_embeddings=shape.vocab_size,
            embedding_dim=shape.hidden_size,
        ),
        lm_head=dataclasses.replace(
            base.lm_head, in_features=shape.hidden_size, out_features=shape.vocab_size
        ),
    )
    for _fqn, norm, _parent, _attr in config.traverse(RMSNorm.Config):
        norm.eps = shape.norm_epsilon
    if not shape.qk_layernorm:
        for block in config.layers:
            block.attention.qk_norm = None
    return config


def optimizer_config(shape: peer_shape.ModelShape, implementation: str):
    """torchtitan's AdamW with megatron's settings: no weight decay on norm weights (megatron
    exempts one-dimensional parameters; in this model those are the RMSNorm weights)."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    common = {
        "lr": shape.lr,
        "betas": (shape.adam_beta1, shape.adam_beta2),
        "eps": shape.adam_eps,
    }
    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r"norm\.weight$",
                optimizer_name="AdamW",
                optimizer_kwargs={**common, "weight_decay": 0.0},
            ),
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={**common, "weight_decay": shape.weight_decay},
            ),
        ],
        implementation=implementation,
    )


def lr_scheduler_config(shape: peer_shape.ModelShape):
    from torchtitan.components.optimizer import LRSchedulersContainer

    return LRSchedulersContainer.Config(
        warmup_steps=shape.lr_warmup_iters,
        total_steps=shape.lr_decay_iters,
        decay_type=shape.lr_decay_style,
        min_lr_factor=shape.min_lr / shape.lr if shape.lr else 0.0,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, megatron_argv = split_argv(argv)
    opts = runner_parser().parse_args(ours)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    margs = peer_shape.megatron_args(megatron_argv, world_size)
    shape = peer_shape.shape_from_args(margs)
    problems = check_options(opts, shape)
    if problems:
        print("torchtitan_runner: " + "; ".join(problems), file=sys.stderr, flush=True)
        return 2
    flops = peer_shape.iteration_flops(margs)

    import torch

    compat = torch_compat()
    if compat and opts.tt_spmd_backend in ("full_dtensor", "spmd_types"):
        print(
            f"torchtitan_runner: --tt-spmd-backend {opts.tt_spmd_backend} needs torch >= 2.12 "
            f"(this is {torch.__version__})",
            file=sys.stderr,
        )
        return 2

    cuda = torch.cuda.is_available()
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.cudagraph import cudagraph_teardown, wrap_with_cuda_graph
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.token_dispatcher import update_ep_token_dispatcher_config
    from torchtitan.models.qwen3 import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    from megatron.patchset.core.observe.metrics import (
        FWD_BWD_ENV,
        MetricsRecorder,
        metrics_path,
    )

    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    graphs = opts.tt_cuda_graphs and cuda
    ep = shape.expert_parallel_size

    parallelism_kwargs = {"expert_parallel_degree": ep}
    backend = spmd_backend(opts.tt_spmd_backend, bool(compat), world_size)
    if backend:
        parallelism_kwargs["spmd_backend"] = backend
    if opts.tt_fsdp_reshard:
        parallelism_kwargs["fsdp_reshard_after_forward"] = opts.tt_fsdp_reshard
    parallelism = ParallelismConfig(**parallelism_kwargs)
    training = TrainingConfig(
        local_batch_size=shape.micro_batch_size,
        global_batch_size=shape.global_batch_size,
        seq_len=shape.seq_length,
        max_norm=shape.clip_grad,
        steps=shape.train_iters,
        disable_cuda_graphs=not graphs,
    )
    compile_config = CompileConfig(enable=opts.tt_compile, components=["model", "loss"])

    dist_utils.init_distributed(CommConfig())
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    torch.manual_seed(shape.seed)

    model_config = build_model_config(shape, opts.tt_attention, opts.tt_moe_comm, opts)
    runtime = argparse.Namespace(parallelism=parallelism, training=training)
    update_ep_token_dispatcher_config(model_config, runtime)
    set_qwen3_sharding_config(model_config, enable_sp=False, enable_ep=ep > 1)

    with torch.device("meta"):
        model = model_config.build()
    ac_config = None
    if opts.tt_ac != "none":
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        ac_config = (SelectiveAC if opts.tt_ac == "selective" else FullAC).Config()
    model = parallelize_qwen3(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=ac_config,
        dump_folder=os.environ.get("TMPDIR", "/tmp"),
    )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    cross_entropy = CrossEntropyLoss.Config(global_vocab_size=shape.vocab_size)
    if opts.tt_loss_chunks > 0:
        loss_fn = ChunkedLossWrapper.Config(
            num_chunks=opts.tt_loss_chunks, loss_fn=cross_entropy
        ).build(compile_config=compile_config)
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    else:
        loss_fn = cross_entropy.build(compile_config=compile_config)

    implementation = opts.tt_optimizer_impl or ("fused" if cuda else "foreach")
    optimizers = optimizer_config(shape, implementation).build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], parallel_dims)
    schedulers = lr_scheduler_config(shape).build(
        optimizers=optimizers, training_steps=shape.train_iters
    )
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)

    def forward_backward(inputs, labels, global_valid_tokens, extra_kwargs):
        with train_context():
            hidden = model(inputs, **extra_kwargs)
            loss, _ = loss_fn(
                hidden, labels, global_valid_tokens, positions=extra_kwargs["positions"]
            )
            del hidden
            loss.backward()
        return loss

    step_fn = wrap_with_cuda_graph(forward_backward) if graphs else forward_backward

    if parallel_dims.dp_enabled:
        batch_mesh = parallel_dims.get_mesh("batch")
        dp_size, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    else:
        batch_mesh, dp_size, dp_rank = None, 1, 0
    if dp_size * shape.micro_batch_size * shape.grad_accumulation_steps != (
        shape.global_batch_size
    ):
        print(
            f"torchtitan_runner: torchtitan's data-parallel size {dp_size} differs from "
            f"megatron's {shape.data_parallel_size}",
            file=sys.stderr,
        )
        return 2
    tokens = peer_shape.SyntheticTokens(
        shape.vocab_size,
        shape.seq_length,
        shape.micro_batch_size,
        seed=shape.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    positions = (
        torch.arange(shape.seq_length, device=device)
        .unsqueeze(0)
        .expand(shape.micro_batch_size, -1)
        .contiguous()
    )
    global_valid_tokens = torch.tensor(shape.tokens_per_iteration, dtype=torch.int64, device=device)
    # The positions are the same every step (one sequence, no document resets, as megatron's
    # default), so is the mask: built once, which torchtitan's CUDA graphs require.
    attention_masks = model.get_attention_masks(positions=positions)
    loss_mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims.dp_cp_enabled else None
    path = metrics_path()
    recorder = MetricsRecorder(path) if path else None
    writer = rank == world_size - 1
    time_fwd_bwd = os.environ.get(FWD_BWD_ENV, "") not in ("", "0") and cuda
    params = [p for p in model.parameters()]

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    if rank == 0:
        print(
            f"torchtitan_runner: {shape.num_layers} layers, hidden {shape.hidden_size}, "
            f"{shape.num_experts} experts top-{shape.moe_router_topk}, vocab {shape.vocab_size},"
            f" {shape.micro_batch_size}x{shape.seq_length} tokens x "
            f"{shape.grad_accumulation_steps} micro-batches x {dp_size} DP, EP={ep}; "
            f"compile={opts.tt_compile} cuda_graphs={graphs} attention={opts.tt_attention} "
            f"moe_comm={opts.tt_moe_comm} ac={opts.tt_ac}; "
            f"{sum(p.numel() for p in params):,} parameters; megatron FLOPs/iteration "
            f"{flops:.4g}" + (f"; torch stand-ins: {', '.join(compat)}" if compat else ""),
            flush=True,
        )

    synchronize()
    last = time.perf_counter()
    for iteration in range(1, shape.train_iters + 1):
        optimizers.zero_grad(set_to_none=not graphs)
        lr = optimizers.optimizers[-1].param_groups[0]["lr"]  # this step's learning rate
        accumulated = None
        if time_fwd_bwd:
            synchronize()
            fwd_bwd_start = time.perf_counter()
        for _ in range(shape.grad_accumulation_steps):
            x, y = next(tokens)
            inputs = torch.from_numpy(x).to(device, non_blocking=True)
            labels = torch.from_numpy(y).to(device, non_blocking=True)
            extra = {"positions": positions, "attention_masks": attention_masks}
            loss = step_fn(inputs, labels, global_valid_tokens, extra).detach()
            # a replayed graph overwrites its output: keep a copy
            accumulated = loss.clone() if accumulated is None else accumulated.add_(loss)
        fwd_bwd_s = None
        if time_fwd_bwd:
            synchronize()
            fwd_bwd_s = time.perf_counter() - fwd_bwd_start
        grad_norm = dist_utils.clip_grad_norm_(
            params, shape.clip_grad, foreach=True, ep_enabled=parallel_dims.ep_enabled
        )
        optimizers.step()
        schedulers.step()
        if loss_mesh is not None:
            loss_value = dist_utils.dist_sum(accumulated, loss_mesh)
        else:
            loss_value = float(accumulated.item())
        grad_norm_value = float(grad_norm.item())
        now = time.perf_counter()
        elapsed, last = now - last, now
        if recorder is not None and writer:
            memory = {}
            if cuda:
                memory = {
                    "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                }
            recorder.write(
                peer_shape.iteration_record(
                    iteration=iteration,
                    time_s=None if iteration == 1 else elapsed,
                    loss=loss_value,
                    grad_norm=grad_norm_value,
                    learning_rate=lr,
                    shape=shape,
                    flops=flops,
                    world_size=world_size,
                    fwd_bwd_s=fwd_bwd_s,
                    **memory,
                )
            )
        if rank == 0:
            print(
                f"torchtitan_runner: iteration {iteration}/{shape.train_iters} "
                f"{elapsed * 1e3:.1f} ms loss {loss_value:.6f} grad norm {grad_norm_value:.4f}",
                flush=True,
            )
    if recorder is not None:
        recorder.summary()
    if graphs:
        cudagraph_teardown()
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
