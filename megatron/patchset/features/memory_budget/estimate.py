"""A rank's peak GPU memory for a run of the small-batch recipe, from megatron's validated
arguments: the static memory exactly from the parameter counts, the activations per token and
layer from the shapes the layer keeps for its backward, and five coefficients calibrated against
the peaks measured in docs/benchmarks/ (docs/features/memory_budget.md lists them with the
estimate's error).

Static memory, per rank (megatron-core 0.19.2's DDP and DistributedOptimizer):

* the bf16 parameters (2 bytes each), dense ones replicated over the data-parallel ranks, the
  routed experts' divided over the expert-parallel ranks;
* the gradients in the DDP buffers (4 bytes each with fp32 accumulation, megatron's default for
  bf16; 2 with ``--grad-reduce-in-bf16``), not sharded;
* the optimizer state: fp32 main parameters and the two Adam moments (4 bytes each, 2 in bf16),
  sharded over the data-parallel group for dense parameters and over the expert data-parallel
  group for expert parameters under ``--use-distributed-optimizer``, whole without it.

Activations, per micro-batch (one micro-batch is in flight without pipeline parallelism), per
layer and token: ``TOKEN_TENSORS`` hidden-size bf16 tensors (attention, norms, residual, router,
fitted), ``DISPATCH_TENSORS`` more with the static all-to-all's send and receive buffers (fitted),
the dropout masks (1 byte per element, two per layer, when ``--hidden-dropout`` is not 0), less
the pre-MLP norm's output under ``--recompute-modules layernorm``; per row the experts hold (the
static dispatch's slots: top-k x capacity factor rows per token at EP > 1, top-k rows at EP 1):
their input, the first GEMM's output and, unless ``moe_act`` is recomputed, the activation's
output. The logits: ``LOGIT_COPIES`` bf16 copies of tokens x vocabulary (fitted), and
``NATIVE_LOSS_BYTES`` more per token and vocabulary entry with megatron's own fused loss instead
of the Triton one (fitted). ``FIXED_GIB`` covers the graphs' and kernels' workspaces (fitted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

GIB = 1024**3

# Calibrated by least squares (:func:`fit`) against the peaks of the records that
# tests/unit/features/memory_budget/test_estimate.py lists, rounded.
TOKEN_TENSORS = 10.72  # hidden-size bf16 tensors kept per token and layer
DISPATCH_TENSORS = 0.68  # more of them with the static all-to-all (EP > 1)
LOGIT_COPIES = 2.10  # bf16 copies of tokens x vocabulary (the logits and their gradient)
NATIVE_LOSS_BYTES = 6.0  # bytes per token and vocabulary entry more with megatron's fused loss
FIXED_GIB = 0.22  # workspaces of the graphs and kernels
COEFFICIENTS = (TOKEN_TENSORS, DISPATCH_TENSORS, LOGIT_COPIES, NATIVE_LOSS_BYTES, FIXED_GIB)


@dataclasses.dataclass(frozen=True)
class Levers:
    """A combination of memory levers."""

    bf16_moments: bool = False
    recompute: tuple[
        str, ...
    ] = ()  # megatron's --recompute-modules: (), (moe_act,), (moe_act, layernorm)

    def describe(self) -> str:
        parts = ["bf16 Adam moments"] if self.bf16_moments else []
        if self.recompute:
            parts.append(" and ".join(self.recompute) + " recomputed")
        return ", ".join(parts) or "no lever"


@dataclasses.dataclass(frozen=True)
class Shape:
    """What one rank's peak memory depends on (tensor, pipeline and context parallel size 1)."""

    dense_params: int  # on this rank: every parameter but the routed experts'
    expert_params: int  # on this rank: its routed experts'
    dense_shards: int  # ranks the dense optimizer state is divided over
    expert_shards: int  # ranks the expert optimizer state is divided over
    tokens: int  # per micro-batch: micro-batch size x sequence length
    layers: int
    moe_layers: int
    hidden: int
    ffn: int  # dense MLP layers' hidden size
    moe_ffn: int
    gated: bool  # SwiGLU: the first GEMM's output is twice the activation's
    topk: int
    expert_rows_per_token: float  # rows the rank's experts hold per token of the micro-batch
    static_dispatch: bool
    vocabulary: int  # padded
    dropout: bool
    triton_loss: bool
    grad_bytes: int

    @classmethod
    def from_args(cls, args: Any, dense: int, expert: int) -> Shape:
        """The shape of megatron's validated ``args``; ``dense`` and ``expert`` are the whole
        model's parameter counts (:func:`megatron.patchset.core.dry_run.parameter_split`)."""
        ep = args.expert_model_parallel_size
        etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        expert_dp = args.world_size // (etp * ep * args.pipeline_model_parallel_size)
        dist = bool(args.use_distributed_optimizer)
        static = bool(getattr(args, "moe_static_dispatch", False)) and ep > 1
        experts = args.num_experts or 0
        if static:
            rows = args.moe_router_topk * args.moe_static_dispatch_capacity_factor
        elif experts:
            rows = args.moe_router_topk * (args.moe_expert_capacity_factor or 1.0)
        else:
            rows = 0.0
        moe_layers = _moe_layers(args) if experts else 0
        return cls(
            dense_params=dense,
            expert_params=expert // ep,
            dense_shards=args.data_parallel_size if dist else 1,
            expert_shards=expert_dp if dist else 1,
            tokens=args.micro_batch_size * args.seq_length,
            layers=args.num_layers,
            moe_layers=moe_layers,
            hidden=args.hidden_size,
            ffn=args.ffn_hidden_size,
            moe_ffn=args.moe_ffn_hidden_size or args.ffn_hidden_size,
            gated=bool(args.swiglu),
            topk=args.moe_router_topk if experts else 0,
            expert_rows_per_token=rows,
            static_dispatch=static,
            vocabulary=args.padded_vocab_size,
            dropout=bool(args.hidden_dropout),
            triton_loss=bool(getattr(args, "cross_entropy_triton", False)),
            grad_bytes=4 if args.accumulate_allreduce_grads_in_fp32 else 2,
        )


def _moe_layers(args: Any) -> int:
    """Layers with routed experts (``--moe-layer-freq``: an int k, every k-th layer, or a list)."""
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return sum(1 for i in range(args.num_layers) if i % freq == 0)
    return sum(1 for x in freq if x)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A rank's peak memory by part, in bytes."""

    levers: Levers
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    fixed: float

    @property
    def total(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.fixed
        )

    @property
    def gib(self) -> float:
        return self.total / GIB

    def parts(self) -> str:
        names = ("parameters", "gradients", "optimizer", "activations", "logits", "fixed")
        return ", ".join(f"{name} {getattr(self, name) / GIB:.1f}" for name in names)


def estimate(shape: Shape, levers: Levers, coefficients: tuple | None = None) -> Estimate:
    """The peak of one rank of ``shape`` with ``levers``."""
    token_tensors, dispatch_tensors, logit_copies, native_loss_bytes, fixed_gib = (
        coefficients or COEFFICIENTS
    )
    params = shape.dense_params + shape.expert_params
    moments = 2 if levers.bf16_moments else 4
    sharded = shape.dense_params / shape.dense_shards + shape.expert_params / shape.expert_shards
    h2 = 2 * shape.hidden  # bytes of one bf16 hidden-size row
    per_token = token_tensors + (dispatch_tensors if shape.static_dispatch else 0.0)
    per_layer = per_token * h2
    if shape.dropout:
        per_layer += 2 * shape.hidden  # two bool masks
    if "layernorm" in levers.recompute:
        per_layer -= h2
    fc1 = (2 if shape.gated else 1) * shape.moe_ffn
    per_row = h2 + 2 * fc1 + (0 if "moe_act" in levers.recompute else 2 * shape.moe_ffn)
    dense_fc1 = (2 if shape.gated else 1) * shape.ffn
    dense_mlp = h2 + 2 * dense_fc1 + 2 * shape.ffn
    activations = shape.tokens * (
        shape.layers * per_layer
        + shape.moe_layers * shape.expert_rows_per_token * per_row
        + (shape.layers - shape.moe_layers) * dense_mlp
    )
    logits = (
        shape.tokens
        * shape.vocabulary
        * (2 * logit_copies + (0 if shape.triton_loss else native_loss_bytes))
    )
    return Estimate(
        levers=levers,
        parameters=2.0 * params,
        gradients=float(shape.grad_bytes * params),
        optimizer=(4 + 2 * moments) * sharded,
        activations=float(activations),
        logits=float(logits),
        fixed=fixed_gib * GIB,
    )


def fit(points: list[tuple[Shape, Levers, float]]) -> tuple[float, float, float, float]:
    """Least-squares coefficients (TOKEN_TENSORS, DISPATCH_TENSORS, LOGIT_COPIES, FIXED_GIB) for
    measured peaks ``(shape, levers, GiB)``: the estimate is linear in them."""
    import numpy as np

    zero = (0.0,) * len(COEFFICIENTS)
    base = [estimate(s, lv, zero) for s, lv, _ in points]
    columns = []
    for i in range(len(zero)):
        unit = tuple(1.0 if j == i else 0.0 for j in range(len(zero)))
        columns.append(
            [estimate(s, lv, unit).total - b.total for (s, lv, _), b in zip(points, base)]
        )
    a = np.array(columns).T / GIB
    y = np.array([gib - b.total / GIB for (_, _, gib), b in zip(points, base)])
    solution, *_ = np.linalg.lstsq(a, y, rcond=None)
    return tuple(float(x) for x in solution)
