"""What a peer framework needs from a megatron flag file, without the peer installed.

``tools/bench/bench.py`` runs peers (``tools/bench/peers/torchtitan_runner.py``) on the same flag
file as megatron. This module turns that flag file into what a peer trains:

- :func:`megatron_args` parses and validates the flags with megatron's own parser (the fork's
  flags included), as ``pretrain_gpt.py`` would, and fills in the padded vocabulary;
- :func:`shape_from_args` reads the model shape, batch and optimizer settings from them and
  refuses what a peer cannot reproduce (tensor, pipeline or context parallelism, shared experts,
  dense layers between MoE layers, biases, tied embeddings, LayerNorm, ...);
- :func:`iteration_flops` is megatron's own FLOP count of one iteration
  (``num_floating_point_operations``), so a peer's TFLOP/s and MFU use the same formula;
- :func:`iteration_record` builds one metrics line in the format of
  ``megatron/patchset/core/observe/metrics.py``, so ``tools/bench/bench.py`` summarizes a peer's run
  with the same code as megatron's;
- :class:`SyntheticTokens` is the token stream of megatron's ``--mock-data`` (documents of
  random length whose tokens count up from 1, each closed by an end-of-document token),
  packed into ``seq_length + 1`` windows: no download, and a loss curve comparable to
  megatron's on mock data.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys

import numpy as np


class UnsupportedShape(ValueError):
    """The flag file asks for something the peer cannot reproduce; one line per reason."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A dropless top-k MoE decoder (Qwen3-MoE layout) and its training setup."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    qk_layernorm: bool
    num_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    vocab_size: int  # megatron's padded vocabulary: the embedding's and output layer's rows
    seq_length: int
    rotary_base: float
    norm_epsilon: float
    init_method_std: float
    micro_batch_size: int
    global_batch_size: int
    data_parallel_size: int
    expert_parallel_size: int
    train_iters: int
    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_iters: int
    lr_decay_style: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    moe_aux_loss_coeff: float
    seed: int
    dropout: float  # the larger of megatron's attention and hidden dropout

    @property
    def grad_accumulation_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch_size * self.seq_length


def megatron_args(argv: list[str], world_size: int = 1) -> argparse.Namespace:
    """``argv`` parsed by megatron's ``parse_args`` (with the fork's flags) and checked by its
    ``validate_args`` for ``world_size`` ranks, with ``padded_vocab_size`` filled in as
    megatron's tokenizer setup would. Device queries are answered as on a Hopper GPU where this
    machine has none (the dry-run's emulation), so the result does not depend on the machine."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron.patchset.core.dry_run import fill_padded_vocab_size, target_device
    from megatron.patchset.core.flags import add_patchset_args

    saved_argv, saved_ws = sys.argv, os.environ.get("WORLD_SIZE")
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        args = parse_args(add_patchset_args)
        args.rank = 0
        with target_device(), contextlib.redirect_stdout(io.StringIO()):
            validate_args(args, {})
        note = fill_padded_vocab_size(args)
    finally:
        sys.argv = saved_argv
        if saved_ws is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved_ws
    if getattr(args, "padded_vocab_size", None) is None:
        raise UnsupportedShape(note or "the padded vocabulary size could not be determined")
    return args


def _refusals(args: argparse.Namespace) -> list[str]:
    """Why a Qwen3-MoE peer cannot train this flag file (empty: it can)."""
    out = []

    def need(condition: bool, reason: str) -> None:
        if not condition:
            out.append(reason)

    need(bool(args.num_experts), "a dense model (no --num-experts): the peer trains an MoE")
    for name, flag in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
        ("context_parallel_size", "--context-parallel-size"),
    ):
        need(getattr(args, name, 1) == 1, f"{flag} {getattr(args, name)}: only 1 is translated")
    need(
        getattr(args, "expert_tensor_parallel_size", 1) in (1, None),
        "--expert-tensor-parallel-size > 1",
    )
    need(args.normalization == "RMSNorm", f"--normalization {args.normalization}: RMSNorm only")
    need(bool(args.swiglu), "no --swiglu: the peer's experts are SwiGLU")
    need(not args.add_bias_linear, "linear biases: pass --disable-bias-linear")
    need(
        bool(args.untie_embeddings_and_output_weights),
        "tied embeddings: pass --untie-embeddings-and-output-weights",
    )
    need(args.position_embedding_type == "rope", "position embeddings other than rope")
    need(
        not getattr(args, "moe_shared_expert_intermediate_size", None),
        "shared experts (--moe-shared-expert-intermediate-size)",
    )
    freq = getattr(args, "moe_layer_freq", 1)
    need(
        freq == 1 or (isinstance(freq, list) and all(f == 1 for f in freq)),
        "dense layers between MoE layers (--moe-layer-freq)",
    )
    need(
        getattr(args, "moe_expert_capacity_factor", None) is None,
        "--moe-expert-capacity-factor: the peer is dropless",
    )
    need(getattr(args, "moe_router_score_function", "softmax") == "softmax", "sigmoid router")
    need(getattr(args, "moe_router_pre_softmax", False) is False, "--moe-router-pre-softmax")
    need(bool(args.bf16), "no --bf16: the peer trains in bf16 with fp32 master weights")
    need(args.optimizer == "adam", f"--optimizer {args.optimizer}: AdamW only")
    need(
        args.lr_decay_style in ("cosine", "linear"),
        f"--lr-decay-style {args.lr_decay_style}",
    )
    need(
        getattr(args, "moe_router_num_groups", None) in (None, 0, 1),
        "--moe-router-num-groups",
    )
    need(not getattr(args, "mtp_num_layers", None), "multi-token prediction")
    need(not getattr(args, "multi_latent_attention", False), "multi-latent attention")
    need(
        getattr(args, "recompute_granularity", None) is None,
        "--recompute-granularity: compare without recomputation",
    )
    return out


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """The model and training setup of validated megatron ``args`` (see :func:`megatron_args`);
    raises :class:`UnsupportedShape` with every reason the peer cannot reproduce it."""
    refusals = _refusals(args)
    if refusals:
        raise UnsupportedShape("; ".join(refusals))
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    return ModelShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=args.kv_channels,
        qk_layernorm=bool(args.qk_layernorm),
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        vocab_size=args.padded_vocab_size,
        seq_length=args.seq_length,
        rotary_base=float(args.rotary_base),
        norm_epsilon=float(args.layernorm_epsilon),
        init_method_std=float(args.init_method_std),
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        data_parallel_size=args.data_parallel_size,
        expert_parallel_size=args.expert_model_parallel_size,
        train_iters=args.train_iters,
        lr=float(args.lr),
        min_lr=float(args.min_lr),
        lr_warmup_iters=int(args.lr_warmup_iters),
        lr_decay_iters=int(args.lr_decay_iters or args.train_iters),
        lr_decay_style=args.lr_decay_style,
        weight_decay=float(args.weight_decay),
        adam_beta1=float(args.adam_beta1),
        adam_beta2=float(args.adam_beta2),
        adam_eps=float(args.adam_eps),
        clip_grad=float(args.clip_grad),
        moe_aux_loss_coeff=float(args.moe_aux_loss_coeff or 0.0),
        seed=int(args.seed),
        dropout=max(float(args.attention_dropout), float(args.hidden_dropout)),
    )


def iteration_flops(args: argparse.Namespace, global_batch_size: int | None = None) -> float:
    """megatron's FLOPs of one iteration of ``global_batch_size`` sequences (default: the
    flag file's): the number ``pretrain_gpt.py`` writes into its metrics."""
    from megatron.training.training import num_floating_point_operations

    batch = args.global_batch_size if global_batch_size is None else global_batch_size
    return float(num_floating_point_operations(args, batch))


def iteration_record(
    *,
    iteration: int,
    time_s: float | None,
    loss: float,
    grad_norm: float | None,
    learning_rate: float | None,
    shape: ModelShape,
    flops: float,
    world_size: int,
    max_allocated_gib: float | None = None,
    max_reserved_gib: float | None = None,
    fwd_bwd_s: float | None = None,
) -> dict:
    """One metrics line with the keys megatron's metrics patch writes (see
    ``megatron/patchset/core/observe/metrics.py``); the loss is the ``lm loss``."""
    record = {
        "iteration": int(iteration),
        "time_s": time_s,
        "losses": {"lm loss": float(loss)},
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "learning_rate": None if learning_rate is None else float(learning_rate),
        "loss_scale": 1.0,
        "skipped": False,
        "num_zeros": None,
        "global_batch_size": shape.global_batch_size,
        "tokens": shape.tokens_per_iteration,
        "flops": float(flops),
        "world_size": int(world_size),
    }
    if fwd_bwd_s is not None:
        record["fwd_bwd_s"] = fwd_bwd_s
    if max_allocated_gib is not None:
        record["max_allocated_gib"] = max_allocated_gib
    if max_reserved_gib is not None:
        record["max_reserved_gib"] = max_reserved_gib
    return record


class SyntheticTokens:
    """Endless ``(tokens, labels)`` batches of ``[batch, seq_length]`` int64 arrays.

    The stream is that of megatron's mock data: documents whose length is drawn uniformly
    from ``[1, max_document_length)``, each ``1, 2, ..., length - 1`` (modulo the vocabulary)
    followed by ``eod``, concatenated. Each sample is the next ``seq_length + 1`` tokens, its
    last token also the first of the next sample (as megatron's GPT dataset cuts samples);
    labels are the tokens shifted by one. Each data-parallel rank reads every
    ``dp_size``-th sample from ``dp_rank`` on, as megatron's sampler hands out a global batch.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_length: int,
        batch_size: int,
        *,
        seed: int = 0,
        eod: int | None = None,
        max_document_length: int = 4096,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.batch_size = batch_size
        self.eod = vocab_size - 1 if eod is None else eod
        self.max_document_length = max_document_length
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self._rng = np.random.default_rng(seed)
        self._buffer = np.empty(0, dtype=np.int64)

    def _document(self) -> np.ndarray:
        length = int(self._rng.integers(1, self.max_document_length))
        body = (np.arange(length - 1, dtype=np.int64) + 1) % self.vocab_size
        return np.concatenate([body, np.array([self.eod], dtype=np.int64)])

    def _sample(self) -> np.ndarray:
        need = self.seq_length + 1
        parts = [self._buffer]
        have = len(self._buffer)
        while have < need:
            doc = self._document()
            parts.append(doc)
            have += len(doc)
        stream = np.concatenate(parts)
        self._buffer = stream[need - 1 :]  # as megatron, a sample's last token starts the next
        return stream[:need]

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        rows = []
        for _ in range(self.batch_size):
            for rank in range(self.dp_size):
                sample = self._sample()
                if rank == self.dp_rank:
                    rows.append(sample)
        window = np.stack(rows)
        return window[:, :-1].copy(), window[:, 1:].copy()
