"""tools/bench/peers: megatron flag files translated for a peer framework, the peer's metrics
records and synthetic tokens, tools/bench/bench.py's peer variants, and (with torchtitan installed)
the torchtitan model built from a flag file."""

import contextlib
import io
import os

import bench
import numpy as np
import pytest
import shape
import torchtitan_runner as runner

from megatron.patchset.core import argsfile
from tests.unit.conftest import REFERENCE, ROOT, TINY

PEERS = os.path.join(ROOT, "tools", "bench", "peers")

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


@pytest.fixture(scope="module")
def reference_args():
    return shape.megatron_args(argsfile.read(REFERENCE) + NO_DROPOUT)


def test_reference_config_translates_to_the_qwen3_30b_a3b_layer_shape(reference_args):
    s = shape.shape_from_args(reference_args)
    assert (s.num_layers, s.hidden_size, s.num_attention_heads, s.num_query_groups) == (
        5,
        2048,
        32,
        4,
    )
    assert (s.head_dim, s.num_experts, s.moe_router_topk, s.moe_ffn_hidden_size) == (
        128,
        128,
        8,
        768,
    )
    assert s.qk_layernorm and s.vocab_size == 151936 and s.seq_length == 4096
    assert (s.micro_batch_size, s.global_batch_size, s.grad_accumulation_steps) == (1, 8, 8)
    assert (s.lr, s.min_lr, s.lr_warmup_iters, s.lr_decay_style) == (3e-4, 3e-5, 2, "cosine")
    assert (s.weight_decay, s.clip_grad, s.adam_beta2, s.norm_epsilon) == (0.1, 1.0, 0.999, 1e-6)
    assert s.rotary_base == 1e6 and s.dropout == 0.0 and s.expert_parallel_size == 1
    assert s.tokens_per_iteration == 8 * 4096


def test_defaults_megatron_fills_in_are_translated():
    # tiny_moe.args sets no --kv-channels and no --qk-layernorm: megatron derives the head
    # dimension from the hidden size, and the peer must follow
    s = shape.shape_from_args(shape.megatron_args(argsfile.read(TINY) + NO_DROPOUT))
    assert s.head_dim == 256 // 8 and not s.qk_layernorm and s.num_query_groups == 2
    assert s.vocab_size % 128 == 0 and s.vocab_size >= 4096


def test_the_peer_takes_the_dry_runs_padded_vocabulary():
    """The core's public fill_padded_vocab_size pads as megatron does (to a multiple of
    --make-vocab-size-divisible-by), leaves a size already set alone, and is what the peer's
    embedding gets."""
    from megatron.patchset.core.dry_run import fill_padded_vocab_size

    argv = argsfile.override(argsfile.read(TINY) + NO_DROPOUT, "--vocab-size", "1000")
    args = shape.megatron_args(argv)
    assert args.padded_vocab_size == 1024 and shape.shape_from_args(args).vocab_size == 1024
    args.padded_vocab_size = None
    args.make_vocab_size_divisible_by = 300
    assert fill_padded_vocab_size(args) is None and args.padded_vocab_size == 1200
    args.make_vocab_size_divisible_by = 7
    assert fill_padded_vocab_size(args) is None and args.padded_vocab_size == 1200


@pytest.mark.parametrize(
    "extra, reason",
    [
        (["--moe-shared-expert-intermediate-size", "512"], "shared experts"),
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2"),
        (["--normalization", "LayerNorm"], "RMSNorm only"),
        (["--moe-layer-freq", "([0]+[1]*3)"], "dense layers between MoE layers"),
    ],
)
def test_what_a_peer_cannot_reproduce_is_refused(extra, reason, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron's condition for TP
    args = shape.megatron_args(argsfile.read(TINY) + NO_DROPOUT + extra, world_size=2)
    with pytest.raises(shape.UnsupportedShape, match=reason):
        shape.shape_from_args(args)


def test_flops_are_megatrons_formula_and_scale_with_the_batch(reference_args):
    from megatron.training.training import num_floating_point_operations

    per_iteration = shape.iteration_flops(reference_args)
    assert per_iteration == float(num_floating_point_operations(reference_args, 8))
    assert shape.iteration_flops(reference_args, 4) == pytest.approx(per_iteration / 2)
    # about 4.07 GFLOP per token for this shape (3x the forward's 2 x 0.91 B active
    # parameters, plus attention and the output layer)
    assert 3.5e9 < per_iteration / (8 * 4096) < 4.5e9


def test_records_summarize_like_megatrons(reference_args):
    s = shape.shape_from_args(reference_args)
    flops = shape.iteration_flops(reference_args)
    records = [
        shape.iteration_record(
            iteration=i,
            time_s=None if i == 1 else t,
            loss=12.0 - i,
            grad_norm=1.0,
            learning_rate=3e-4,
            shape=s,
            flops=flops,
            world_size=1,
            max_allocated_gib=40.0,
            max_reserved_gib=41.0,
        )
        for i, t in enumerate([None, 2.0, 0.5, 0.4, 0.6], start=1)
    ]
    records.append({"summary": {"max_allocated_gib": 40.0, "max_reserved_gib": 41.0}})
    result = bench.summarize(records, warmup=2, peak_tflops=790.0)
    assert result["step_ms"] == pytest.approx(500.0)
    assert result["tokens_per_s"] == pytest.approx(8 * 4096 / 0.5)
    assert result["tflops_per_gpu"] == pytest.approx(flops / 0.5 / 1e12)
    assert result["final_loss"] == 7.0 and result["peak_allocated_gib"] == 40.0


def test_synthetic_tokens_follow_megatrons_mock_documents():
    stream = shape.SyntheticTokens(vocab_size=1000, seq_length=64, batch_size=3, seed=1, eod=999)
    tokens, labels = next(stream)
    assert tokens.shape == labels.shape == (3, 64) and tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens[:, 1:], labels[:, :-1])
    # within a document each token is the previous one plus 1; a document ends with eod and
    # the next starts at 1
    prev, nxt = labels.ravel()[:-1], labels.ravel()[1:]
    in_doc = prev != 999
    assert np.all((nxt[in_doc] == prev[in_doc] + 1) | (nxt[in_doc] == 999))
    assert np.all(nxt[~in_doc] == 1)
    again = shape.SyntheticTokens(vocab_size=1000, seq_length=64, batch_size=3, seed=1, eod=999)
    np.testing.assert_array_equal(next(again)[0], tokens)


def test_data_parallel_ranks_split_one_stream():
    whole = shape.SyntheticTokens(500, 32, 4, seed=3)
    ranks = [shape.SyntheticTokens(500, 32, 2, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    batch = next(whole)[0]
    parts = [next(r)[0] for r in ranks]
    np.testing.assert_array_equal(batch[0::2], parts[0])
    np.testing.assert_array_equal(batch[1::2], parts[1])


def test_bench_runs_peer_variants_through_their_runner():
    runner = os.path.join(PEERS, "torchtitan_runner.py")
    assert bench.peer_runner("torchtitan") == runner
    assert bench.peer_runner("torchtitan-graphs") == runner
    assert bench.peer_runner("torchtitanic") is None
    assert bench.peer_runner("fork-full") is None and bench.peer_runner("upstream") is None


def test_runner_splits_its_flags_from_megatrons():
    ours, theirs = runner.split_argv(
        ["--num-layers", "2", "--tt-compile", "--tt-attention", "varlen", "--tt-ac=full", "--bf16"]
    )
    assert ours == ["--tt-compile", "--tt-attention", "varlen", "--tt-ac=full"]
    assert theirs == ["--num-layers", "2", "--bf16"]


def test_runner_refuses_graphs_with_a_host_synchronising_dispatcher():
    args = shape.megatron_args(
        argsfile.read(TINY) + NO_DROPOUT + ["--expert-model-parallel-size", "2"], world_size=2
    )
    s = shape.shape_from_args(args)
    opts = runner.runner_parser().parse_args(["--tt-cuda-graphs"])
    assert any("minimal_async_ep" in p for p in runner.check_options(opts, s))
    opts = runner.runner_parser().parse_args(
        ["--tt-cuda-graphs", "--tt-moe-comm", "minimal_async_ep"]
    )
    assert runner.check_options(opts, s) == []
    with_dropout = shape.shape_from_args(shape.megatron_args(argsfile.read(TINY)))
    opts = runner.runner_parser().parse_args([])
    assert any("dropout" in p for p in runner.check_options(opts, with_dropout))


@pytest.mark.parametrize("config", [REFERENCE, TINY])
def test_torchtitan_model_has_megatrons_parameter_count(config):
    pytest.importorskip("torchtitan")
    import torch
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron.patchset.core.dry_run import count_parameters, target_device

    args = shape.megatron_args(argsfile.read(config) + NO_DROPOUT)
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        total, _active = count_parameters(args, core_transformer_config_from_args(args))
    runner.torch_compat()
    opts = runner.runner_parser().parse_args([])
    model_config = runner.build_model_config(shape.shape_from_args(args), "flex", "standard", opts)
    with torch.device("meta"):
        model = model_config.build()
    assert sum(p.numel() for p in model.parameters()) == total
    assert len(model.layers) == args.num_layers
    norms = [n for n, _ in model.named_parameters() if n.endswith("norm.weight")]
    # attention and MoE norms per layer (and q/k norms with --qk-layernorm), the final norm
    assert len(norms) == args.num_layers * (4 if args.qk_layernorm else 2) + 1


def test_on_torch_before_2_12_more_than_one_rank_takes_torchtitans_partial_dtensor_backend():
    """torchtitan's default backend (spmd_types) builds torch 2.12's DataParallelMeshDims on a mesh
    of more than one rank; on an older torch the runner picks partial_dtensor there, and leaves
    torchtitan's default on one rank, on a newer torch, and when a backend is asked for."""
    assert runner.spmd_backend(None, True, 2) == "partial_dtensor"
    assert runner.spmd_backend(None, True, 1) is None
    assert runner.spmd_backend(None, False, 2) is None
    assert runner.spmd_backend("spmd_types", False, 2) == "spmd_types"
