"""Step-time model of the communication an emulated rank skips (``bench.py --emulate``).

Under ``--fake-process-group`` one GPU runs one rank's compute and memory of an N-GPU job with
every collective skipped. This module adds the collectives back as bytes over links:

* **expert-parallel all-to-all**, per MoE layer and micro-batch: dispatch and combine in the forward
  pass and both again in the backward pass, each moving ``tokens x top-k x hidden`` bf16 values of
  which ``(EP - 1) / EP`` leave the GPU; the static-shape dispatch (``--moe-static-dispatch``) sends
  fixed slots of its capacity, ``factor`` times as many rows
  (``--moe-static-dispatch-capacity-factor``, default 2); with ``--moe-static-dispatch-dedup`` it
  sends each token once per peer that hosts one of its experts, in slots of ``factor x tokens x
  share`` per peer, at most ``tokens`` (``share``: the fraction of tokens a peer hosts an expert of
  under uniform routing, 0.667 for 128 experts, top-8, EP 8), and beside each token its routing
  among that peer's experts (``L`` fp32 probabilities and ``L`` bytes of routing map forward, ``L``
  fp32 gradients backward);
* **data-parallel gradient reduction**: with the distributed optimizer a reduce-scatter of the
  gradients (fp32 when megatron accumulates them in fp32, as it does for bf16) and an all-gather
  of the bf16 parameters, for the dense parameters over the data-parallel group and for the
  experts over the expert data-parallel group; without it an all-reduce of the gradients.

A collective of ``S`` bytes over ``n`` ranks takes ``S x (n - 1) / n / busbw`` (all-gather,
reduce-scatter, all-to-all; twice that for an all-reduce), with ``busbw`` the bus bandwidth
nccl-tests reports for that collective. A group whose ranks all sit in one node gets the NVLink
figure. Across nodes an all-to-all gets one network card's bandwidth per GPU (NCCL cannot
aggregate NICs for it), and an all-gather or reduce-scatter the cards of the group's GPUs in a
node together, up to the NVLink figure. The defaults (:data:`SYSTEMS`) are published
measurements, cited there; ``--nvlink-gbps``, ``--a2a-nvlink-gbps`` and ``--nic-gbps`` set
others.

The prediction is a plan, not a measurement. It assumes that the all-to-all is not overlapped with
compute (megatron's alltoall dispatcher without ``--overlap-moe-expert-parallel-comm``), except
with ``--moe-static-dispatch-chunks N`` (:func:`chunked_exposed_ms`): there each layer's
all-to-alls run on a side stream in N chunks beside the experts of another chunk, and the model
plays that schedule through with the experts' time taken as their FLOPs at the emulated step's
average TFLOP/s (forward; the backward twice that), which leaves exposed what the experts cannot
cover. It prints two bounds for the data-parallel traffic: none of it hidden, and all of it hidden
behind the forward and backward pass up to their length (megatron's ``--overlap-grad-reduce
--overlap-param-gather``). Latency, congestion and the compute the collectives slow down are not
modelled. For a rank of Qwen3-30B-A3B the prediction is printed beside the published TFLOP/s per
GPU of that model with its communication (:data:`QWEN3_30B_A3B`, each with its layout and source).
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron.patchset.features.static_dispatch.plan import token_share


@dataclasses.dataclass(frozen=True)
class Links:
    """Bus bandwidths in GB/s (1e9 bytes per second) per GPU, as nccl-tests reports them."""

    nvlink: float  # all-gather / reduce-scatter among GPUs of one node
    a2a_nvlink: float  # all-to-all among GPUs of one node
    nic: float  # one GPU's network card: what a collective across nodes gets per GPU of the group
    source: str


# nccl-tests bus bandwidths for large messages (docs/benchmarks.md cites each):
# - all-to-all among 8 H100 on NVLink 4: 320 GB/s; across 32 GPUs of DGX H100 nodes with
#   8x 400 Gb/s InfiniBand: 48 GB/s, one NIC's worth (NVIDIA, GTC 2025 talk S72583);
# - all-gather / reduce-scatter among 8 H200: 361 / 363 GB/s (ring, NCCL 2.27); NCCL's
#   maintainers give about 370 GB/s for H100's NVLink 4 and 46-48 GB/s per 400 Gb/s NDR NIC.
# H200 nodes have the same NVLink 4 switches and NICs: the same figures.
SYSTEMS = {
    "h100": Links(nvlink=360.0, a2a_nvlink=320.0, nic=48.0, source="DGX/HGX H100"),
    "h200": Links(nvlink=360.0, a2a_nvlink=320.0, nic=48.0, source="DGX/HGX H200"),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the byte counts depend on, for one rank of the job."""

    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    layers: int
    moe_layers: int
    hidden: int
    seq: int
    micro_batch: int
    micro_batches: int  # per step and rank
    topk: int
    dense_params: int  # on this rank (not expert)
    expert_params: int  # on this rank
    distributed_optimizer: bool
    grad_bytes: int
    param_bytes: int = 2
    a2a_rows_factor: float = 1.0  # rows sent per routed row: the static dispatch's capacity
    a2a_chunks: int = 1  # --moe-static-dispatch-chunks: all-to-alls beside the experts
    expert_flops: float = 0.0  # the experts' forward FLOPs per MoE layer and micro-batch

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.etp * self.pp)


def _parser() -> argparse.ArgumentParser:
    """The megatron flags the model reads, with megatron's defaults (unknown flags pass)."""
    p = argparse.ArgumentParser(add_help=False)
    for flag, default in (
        ("--tensor-model-parallel-size", 1),
        ("--pipeline-model-parallel-size", 1),
        ("--context-parallel-size", 1),
        ("--expert-model-parallel-size", 1),
        ("--expert-tensor-parallel-size", None),
        ("--num-layers", None),
        ("--hidden-size", None),
        ("--ffn-hidden-size", None),
        ("--num-attention-heads", None),
        ("--num-query-groups", None),
        ("--kv-channels", None),
        ("--seq-length", None),
        ("--micro-batch-size", 1),
        ("--global-batch-size", None),
        ("--num-experts", None),
        ("--moe-router-topk", 2),
        ("--moe-ffn-hidden-size", None),
        ("--vocab-size", None),
    ):
        p.add_argument(flag, type=int, default=default)
    # the static dispatch's default capacity factor (features/static_dispatch/flags.py)
    p.add_argument("--moe-static-dispatch-capacity-factor", type=float, default=2.0)
    p.add_argument("--moe-static-dispatch-chunks", type=int, default=1)
    for flag in (
        "--use-distributed-optimizer",
        "--untie-embeddings-and-output-weights",
        "--group-query-attention",
        "--swiglu",
        "--bf16",
        "--accumulate-allreduce-grads-in-fp32",
        "--qk-layernorm",
        "--moe-static-dispatch",
        "--moe-static-dispatch-dedup",
    ):
        p.add_argument(flag, action="store_true")
    return p


def rows_factor(a: argparse.Namespace, experts: int, ep: int, hidden: int) -> float:
    """Bytes an all-to-all moves, in units of megatron's (``tokens x top-k`` bf16 rows): the static
    dispatch's capacity, or with one row per token and peer its token slots and their routing
    (averaged over the four all-to-alls: ``9 L`` bytes per slot for ``2 hidden`` of the row, the
    probabilities counted as fp32: an upper bound where the router gives bf16)."""
    if not a.moe_static_dispatch:
        return 1.0
    factor = a.moe_static_dispatch_capacity_factor
    if not (a.moe_static_dispatch_dedup and experts):
        return min(factor, ep)  # a peer's slots hold at most all of a rank's rows
    local = experts // ep
    # slots per peer: a share of the tokens, at most all of them
    slots = ep * min(1.0, factor * token_share(experts, a.moe_router_topk, ep))
    return slots / a.moe_router_topk * (1 + 9 * local / (4 * 2 * hidden))


def shape_of(argv: list[str], world: int) -> Shape:
    """The rank's :class:`Shape` from megatron flags (every layer a MoE layer when the model has
    experts, as in the shipped configs)."""
    a, _ = _parser().parse_known_args(argv)
    h, layers = a.hidden_size, a.num_layers
    heads = a.num_attention_heads
    head_dim = a.kv_channels or h // heads
    groups = a.num_query_groups if a.group_query_attention and a.num_query_groups else heads
    attention = h * head_dim * (heads + 2 * groups) + heads * head_dim * h
    norms = 2 * h + (2 * head_dim if a.qk_layernorm else 0)
    experts = a.num_experts or 0
    ffn = a.moe_ffn_hidden_size or a.ffn_hidden_size
    gated = 2 if a.swiglu else 1
    expert_mlp = h * ffn * gated + ffn * h
    vocab = a.vocab_size or 0
    embeddings = vocab * h * (2 if a.untie_embeddings_and_output_weights else 1) + h
    tp, pp, cp, ep = (
        a.tensor_model_parallel_size,
        a.pipeline_model_parallel_size,
        a.context_parallel_size,
        a.expert_model_parallel_size,
    )
    etp = a.expert_tensor_parallel_size or tp
    if experts:
        dense_layer = attention + norms + h * experts
        dense = (layers * dense_layer + embeddings) // (tp * pp)
        expert = layers * experts * expert_mlp // (ep * etp * pp)
    else:
        dense = (
            layers * (attention + norms + (a.ffn_hidden_size * h * (gated + 1))) + embeddings
        ) // (tp * pp)
        expert = 0
    dp = world // (tp * pp * cp)
    global_batch = a.global_batch_size or a.micro_batch_size * dp
    return Shape(
        world=world,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        etp=etp,
        layers=layers,
        moe_layers=layers if experts else 0,
        hidden=h,
        seq=a.seq_length,
        micro_batch=a.micro_batch_size,
        micro_batches=max(1, global_batch // (a.micro_batch_size * dp)),
        topk=a.moe_router_topk,
        dense_params=dense,
        expert_params=expert,
        distributed_optimizer=a.use_distributed_optimizer,
        # megatron accumulates and reduces bf16 gradients in fp32
        grad_bytes=4 if (a.bf16 or a.accumulate_allreduce_grads_in_fp32) else 2,
        a2a_rows_factor=rows_factor(a, experts, ep, h),
        a2a_chunks=a.moe_static_dispatch_chunks if a.moe_static_dispatch else 1,
        # routed rows x (fc1: h -> gated x ffn, fc2: ffn -> h), two FLOPs per multiply-add
        expert_flops=(
            a.seq_length * a.micro_batch_size // cp * a.moe_router_topk * 2 * h * ffn * (gated + 1)
            if experts
            else 0.0
        ),
    )


def spans_nodes(size: int, stride: int, gpus_per_node: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart (megatron's rank order) leaves a node."""
    return size > 1 and size * stride > gpus_per_node


def group_bandwidth(size: int, stride: int, gpus_per_node: int, links: Links) -> float:
    """All-gather / reduce-scatter bus bandwidth of a group: NVLink within a node; across nodes
    the NICs of the group's GPUs in one node, which NCCL's rings use together, up to NVLink's."""
    if not spans_nodes(size, stride, gpus_per_node):
        return links.nvlink
    per_node = max(1, min(size, gpus_per_node // max(1, stride)))
    return min(links.nvlink, per_node * links.nic)


def _collective_ms(nbytes: float, ranks: int, busbw_gbps: float) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return nbytes * (ranks - 1) / ranks / (busbw_gbps * 1e9) * 1e3


def predict(shape: Shape, links: Links, gpus_per_node: int = 8) -> dict:
    """Milliseconds per step of each skipped collective, and what they sum to."""
    tokens = shape.seq * shape.micro_batch // shape.cp
    # bf16 token rows out of this rank (the static dispatch's slots: capacity-padded)
    per_a2a = tokens * shape.topk * shape.hidden * 2 * shape.a2a_rows_factor
    ep_remote = spans_nodes(shape.ep, shape.etp * shape.tp, gpus_per_node)
    a2a_bw = links.nic if ep_remote else links.a2a_nvlink  # an all-to-all gets one NIC
    a2a_count = 4 * shape.moe_layers * shape.micro_batches
    each = _collective_ms(per_a2a, shape.ep, a2a_bw)
    a2a = a2a_count * each

    dense_stride, expert_stride = shape.tp * shape.cp, shape.ep * shape.etp
    dense_remote = spans_nodes(shape.dp, dense_stride, gpus_per_node)
    expert_remote = spans_nodes(shape.expert_dp, expert_stride, gpus_per_node)
    dense_bw = group_bandwidth(shape.dp, dense_stride, gpus_per_node, links)
    expert_bw = group_bandwidth(shape.expert_dp, expert_stride, gpus_per_node, links)
    out = {"a2a_ms": a2a, "a2a_count": a2a_count, "a2a_mb_each": per_a2a / 1e6}
    out.update(a2a_each_ms=each, a2a_chunks=shape.a2a_chunks, expert_flops=shape.expert_flops)
    out["a2a_layer_passes"] = shape.moe_layers * shape.micro_batches
    out["a2a_link"] = "IB" if ep_remote else "NVLink"
    out["dp_link"] = "IB" if dense_remote else "NVLink"
    out["expert_dp_link"] = "IB" if expert_remote else "NVLink"
    grads = (shape.dense_params * shape.grad_bytes, shape.expert_params * shape.grad_bytes)
    params = (shape.dense_params * shape.param_bytes, shape.expert_params * shape.param_bytes)
    groups = ((shape.dp, dense_bw), (shape.expert_dp, expert_bw))
    if shape.distributed_optimizer:
        out["grad_ms"] = sum(_collective_ms(b, n, bw) for b, (n, bw) in zip(grads, groups))
        out["param_ms"] = sum(_collective_ms(b, n, bw) for b, (n, bw) in zip(params, groups))
    else:  # all-reduce: a reduce-scatter and an all-gather of the gradients
        out["grad_ms"] = 2 * sum(_collective_ms(b, n, bw) for b, (n, bw) in zip(grads, groups))
        out["param_ms"] = 0.0
    out["dp_ms"] = out["grad_ms"] + out["param_ms"]
    return out


def pipeline_ms(dispatch: float, combine: float, experts: float, chunks: int) -> float:
    """One MoE layer's dispatch, experts and combine in ``chunks`` chunks, as
    ``--moe-static-dispatch-chunks`` issues them: the all-to-alls in order on one stream (every
    chunk's dispatch, then every chunk's combine), each chunk's experts on the other once its
    dispatch has arrived, each combine once its chunk's experts are done. Returns the time to the
    last combine; with one chunk ``dispatch + experts + combine``."""
    d, c, e = dispatch / chunks, combine / chunks, experts / chunks
    comm, main, done = 0.0, 0.0, []
    for _ in range(chunks):
        comm += d
        main = max(main, comm) + e
        done.append(main)
    for k in range(chunks):
        comm = max(comm, done[k]) + c
    return comm


def chunked_exposed_ms(prediction: dict, tflops: float) -> float:
    """The all-to-all time left on the step with ``--moe-static-dispatch-chunks``: per MoE layer and
    micro-batch, the forward schedule of :func:`pipeline_ms` and the backward's mirror image (every
    combine gradient first, each dispatch gradient after its chunk's experts; the experts'
    backward twice their forward), minus the experts' time, which is their FLOPs at
    ``tflops``."""
    chunks = prediction.get("a2a_chunks", 1)
    if chunks <= 1 or not prediction.get("expert_flops") or tflops <= 0:
        return prediction["a2a_ms"]
    each = prediction["a2a_each_ms"]
    forward = prediction["expert_flops"] / (tflops * 1e9)  # ms
    exposed = pipeline_ms(each, each, forward, chunks) - forward
    exposed += pipeline_ms(each, each, 2 * forward, chunks) - 2 * forward
    return exposed * prediction["a2a_layer_passes"]


def with_compute(prediction: dict, step_ms: float, fwd_bwd_ms: float | None, tflops: float) -> dict:
    """The predicted step: the emulated step plus the all-to-all (what chunks leave of it), plus
    the data-parallel traffic either all exposed or hidden behind forward and backward up to their
    length; TFLOP/s per GPU of each from the emulated run's FLOPs."""
    flops = tflops * step_ms  # per GPU, in TFLOP x ms
    a2a = chunked_exposed_ms(prediction, tflops)
    exposed = a2a + prediction["dp_ms"]
    hidden_up_to = fwd_bwd_ms if fwd_bwd_ms else step_ms
    overlapped = a2a + max(0.0, prediction["dp_ms"] - hidden_up_to)
    return {
        "a2a_exposed_ms": a2a,
        "step_exposed_ms": step_ms + exposed,
        "step_overlapped_ms": step_ms + overlapped,
        "tflops_exposed": flops / (step_ms + exposed),
        "tflops_overlapped": flops / (step_ms + overlapped),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--system",
        choices=sorted(SYSTEMS),
        default=None,
        help="with --emulate: the machines the prediction of the skipped communication is for "
        "(links of tools/bench/comm_model.py). Default: the GPU here (h100 or h200).",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="with --emulate. Default: 8.")
    for flag, what in (
        ("--nvlink-gbps", "all-gather / reduce-scatter bus bandwidth within a node"),
        ("--a2a-nvlink-gbps", "all-to-all bus bandwidth within a node"),
        ("--nic-gbps", "bus bandwidth of one GPU's network card across nodes"),
    ):
        p.add_argument(flag, type=float, default=None, help=f"with --emulate: {what}, GB/s.")


@dataclasses.dataclass(frozen=True)
class Anchor:
    """A published TFLOP/s per GPU for a model, measured with its communication, that a
    prediction is read against."""

    who: str
    tflops: float
    layout: str
    source: str

    def describe(self) -> str:
        return f"{self.who} {self.tflops:g} TFLOP/s per GPU ({self.layout}; {self.source})"


# Qwen3-30B-A3B, BF16, dropless, on DGX H100 (megatron's FLOP count, 23.0 GFLOP per token at 4096)
QWEN3_30B_A3B = (
    Anchor(
        "Megatron-LM",
        234.1,
        "32x H100, TP1 PP1 EP8, MBS 1, GBS 256, HybridEP, forced load balancing",
        "Megatron-LM dev branch, examples/moe_recipes/README.md",
    ),
    Anchor(
        "NeMo AutoModel",
        277,
        "8x H100, EP8 FSDP8, MBS 4, GBS 512, TE + DeepEP",
        "NeMo AutoModel performance summary, pre-training, DGX-H100 BF16",
    ),
)


def anchors_for(shape: Shape) -> tuple[Anchor, ...]:
    """The published figures for the model ``shape`` is a rank of (Qwen3-30B-A3B: 48 MoE layers
    of hidden size 2048, top-8, 4096 tokens per sequence); none for other models."""
    qwen3 = (shape.moe_layers, shape.hidden, shape.topk, shape.seq) == (48, 2048, 8, 4096)
    return QWEN3_30B_A3B if qwen3 else ()


def links_of(opts: argparse.Namespace, device: str | None) -> tuple[str, Links]:
    system = opts.system or ("h200" if device and "H200" in device else "h100")
    base = SYSTEMS[system]
    links = dataclasses.replace(
        base,
        nvlink=opts.nvlink_gbps or base.nvlink,
        a2a_nvlink=opts.a2a_nvlink_gbps or base.a2a_nvlink,
        nic=opts.nic_gbps or base.nic,
    )
    return system, links
