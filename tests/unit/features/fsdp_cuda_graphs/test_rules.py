"""The rules for TE per-layer CUDA graphs under Megatron-FSDP, as pretrain_gpt.py runs them."""

import pytest

from tests.unit.conftest import combination_failures, tiny_argv

FSDP = (
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--ckpt-format",
    "fsdp_dtensor",
)


GRAPHS = (
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-modules",
    "attn",
    "moe_router",
    "moe_preprocess",
)


DOUBLE_BUFFER = ("--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail")


def fsdp_graphs_argv(*extra, double_buffer=DOUBLE_BUFFER, graphs=GRAPHS):
    return tiny_argv(*FSDP, *graphs, *double_buffer, *extra)


@pytest.mark.parametrize(
    "world_size, extra", [(1, ()), (2, ()), (2, ("--expert-model-parallel-size", "2"))]
)
def test_fsdp_cuda_graphs_layouts_are_valid(world_size, extra):
    assert combination_failures(fsdp_graphs_argv(*extra), world_size) == {}
    # Eager Megatron-FSDP needs none of it.
    assert combination_failures(tiny_argv(*FSDP, *extra), world_size) == {}


@pytest.mark.parametrize(
    "drop, named",
    [
        ("--fsdp-double-buffer", "address"),
        ("--fsdp-db-use-persist-buf-on-alloc-fail", "dynamic buffer during replay"),
    ],
)
def test_fsdp_cuda_graphs_double_buffer(drop, named):
    argv = fsdp_graphs_argv(double_buffer=tuple(f for f in DOUBLE_BUFFER if f != drop))
    got = combination_failures(argv, 2)
    assert set(got) == {"fsdp-cuda-graphs-double-buffer"}
    message = got["fsdp-cuda-graphs-double-buffer"]
    assert drop in message and named in message and "illegal memory access" in message


def test_fsdp_cuda_graphs_double_buffer_other_strategy_and_any_scope():
    argv = fsdp_graphs_argv(
        "--data-parallel-sharding-strategy",
        "optim_grads",
        double_buffer=(),
        graphs=("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe_router"),
    )
    message = combination_failures(argv, 2)["fsdp-cuda-graphs-double-buffer"]
    for flag in (
        "optim_grads_params",
        "--fsdp-double-buffer",
        "--fsdp-db-use-persist-buf-on-alloc-fail",
    ):
        assert flag in message


def test_fsdp_cuda_graphs_double_buffer_forced_by_nccl_ub_counts():
    """megatron's validate_args turns the double buffer on for the max-pool allocator (and
    --use-nccl-ub); the rule sees it."""
    argv = fsdp_graphs_argv(
        "--fsdp-db-use-persist-buf-on-alloc-fail",
        "--megatron-fsdp-max-pool-double-buffer",
        double_buffer=(),
    )
    assert "fsdp-cuda-graphs-double-buffer" not in combination_failures(argv, 2)


@pytest.mark.parametrize(
    "extra, named",
    [
        (("--gradient-accumulation-fusion",), "--no-gradient-accumulation-fusion"),
        (("--megatron-fsdp-enable-fine-grained-param-gather",), "fine-grained-param-gather"),
        (
            ("--pipeline-model-parallel-size", "2", "--global-batch-size", "16"),
            "--pipeline-model-parallel-size 2",
        ),
        (("--cuda-graph-warmup-steps", "0"), "--cuda-graph-warmup-steps 0"),
    ],
)
def test_fsdp_cuda_graphs_supported(extra, named):
    argv = fsdp_graphs_argv(*extra)
    if "--gradient-accumulation-fusion" in extra:
        argv.remove("--no-gradient-accumulation-fusion")
        argv.remove("--gradient-accumulation-fusion")
    got = combination_failures(argv, 2)
    assert "fsdp-cuda-graphs-supported" in got, got
    assert named in got["fsdp-cuda-graphs-supported"]


def test_fsdp_cuda_graphs_supported_refuses_local_graphs():
    argv = tiny_argv(*FSDP, "--cuda-graph-impl", "local")
    message = combination_failures(argv, 1)["fsdp-cuda-graphs-supported"]
    assert "--cuda-graph-impl local" in message and "transformer_engine" in message
