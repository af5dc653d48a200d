"""The rules of the torch grouped-GEMM experts, the device-side token counts, and megatron's
full-iteration CUDA graphs over a MoE model."""

import pytest

from megatron.patchset.core import rules
from megatron.patchset.core.errors import PatchsetError
from tests.unit.conftest import failures, tiny_argv

TORCH = ("--moe-grouped-gemm-impl", "torch")


def test_rule_accepts_the_tiny_config():
    assert failures(tiny_argv(*TORCH)) == {}


@pytest.mark.parametrize(
    "extra, expected",
    [
        (("--transformer-impl", "local"), "--transformer-impl transformer_engine"),
        (("--delay-wgrad-compute",), "--delay-wgrad-compute"),
        (("--use-transformer-engine-op-fuser",), "--use-transformer-engine-op-fuser"),
        (("--cuda-graph-impl", "transformer_engine"), "leave the experts out"),
        (
            ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe"),
            "leave the experts out",
        ),
    ],
)
def test_rule_refuses_what_the_grouped_gemm_does_not_implement(extra, expected):
    got = failures(tiny_argv(*TORCH, *extra))
    assert expected in got["moe-grouped-gemm-impl-torch-requirements"]


def test_rule_allows_graphs_around_the_experts():
    argv = tiny_argv(
        *TORCH,
        "--cuda-graph-impl",
        "transformer_engine",
        "--cuda-graph-modules",
        "attn",
        "moe_router",
        "moe_preprocess",
    )
    assert "moe-grouped-gemm-impl-torch-requirements" not in failures(argv)


def test_rule_needs_bf16_grouped_gemm_and_no_bias():
    argv = [
        a
        for a in tiny_argv(*TORCH)
        if a not in ("--bf16", "--moe-grouped-gemm", "--disable-bias-linear")
    ]
    message = failures(argv)["moe-grouped-gemm-impl-torch-requirements"]
    assert (
        "--bf16" in message
        and "--moe-grouped-gemm" in message
        and "--disable-bias-linear" in message
    )


def test_alignment_rule_names_the_width():
    got = failures(tiny_argv(*TORCH, "--moe-ffn-hidden-size", "500"))
    assert (
        "--moe-ffn-hidden-size / expert tensor parallel size 1 = 500"
        in got["moe-grouped-gemm-impl-torch-alignment"]
    )
    assert "moe-grouped-gemm-impl-torch-alignment" not in failures(tiny_argv(*TORCH))


SPLITS_ON_DEVICE = ("--moe-expert-splits-on-device", "--moe-permute-fusion")


def test_splits_rule_accepts_the_single_gpu_alltoall_layout():
    assert failures(tiny_argv(*TORCH, *SPLITS_ON_DEVICE)) == {}
    full = tiny_argv(
        *TORCH,
        *SPLITS_ON_DEVICE,
        "--cuda-graph-impl",
        "full_iteration",
        "--no-check-for-nan-in-loss-and-grad",
    )
    assert failures(full) == {}


@pytest.mark.parametrize(
    "extra, expected",
    [
        ((), "--moe-grouped-gemm-impl torch"),
        (("--moe-token-dispatcher-type", "allgather"), "--moe-token-dispatcher-type alltoall"),
        (("--expert-model-parallel-size", "2"), "--expert-model-parallel-size 1"),
        (("--moe-expert-capacity-factor", "1.5"), "no --moe-expert-capacity-factor"),
    ],
)
def test_splits_rule_refuses_layouts_that_need_host_counts(extra, expected):
    torch_impl = TORCH if extra else ()
    got = failures(tiny_argv(*torch_impl, *SPLITS_ON_DEVICE, *extra), world_size=2)
    assert expected in got["moe-expert-splits-on-device-requirements"]


def test_splits_rule_needs_permute_fusion():
    got = failures(tiny_argv(*TORCH, "--moe-expert-splits-on-device"))
    assert "--moe-permute-fusion" in got["moe-expert-splits-on-device-requirements"]


def test_full_iteration_graphs_need_the_counts_on_the_device():
    argv = tiny_argv(
        *TORCH,
        "--moe-permute-fusion",
        "--cuda-graph-impl",
        "full_iteration",
        "--no-check-for-nan-in-loss-and-grad",
    )
    assert (
        "--moe-expert-splits-on-device for --cuda-graph-impl full_iteration"
        in failures(argv)["moe-grouped-gemm-impl-torch-requirements"]
    )


FULL = ("--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad")


def test_full_iteration_graphs_refuse_host_read_token_counts():
    got = failures(tiny_argv(*FULL))
    assert "--moe-expert-splits-on-device" in got["full-iteration-graphs-dropless-moe"]
    assert "full-iteration-graphs-dropless-moe" not in failures(
        tiny_argv(*TORCH, *SPLITS_ON_DEVICE, *FULL)
    )
    padded = ("--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity")
    assert "full-iteration-graphs-dropless-moe" not in failures(tiny_argv(*FULL, *padded))


def test_full_iteration_graphs_refuse_megatrons_timers():
    argv = tiny_argv(*TORCH, *SPLITS_ON_DEVICE, *FULL, "--timing-log-level", "1")
    assert "--timing-log-level 0" in failures(argv)["full-iteration-graphs-timers"]
    assert "full-iteration-graphs-timers" not in failures(tiny_argv("--timing-log-level", "2"))


def test_named_rules_can_be_skipped_for_negative_controls(monkeypatch, capsys):

    monkeypatch.setenv(rules.SKIP_RULES_ENV, "full-iteration-graphs-dropless-moe")
    assert failures(tiny_argv(*FULL)) == {}
    assert "rule full-iteration-graphs-dropless-moe skipped" in capsys.readouterr().out
    monkeypatch.setenv(rules.SKIP_RULES_ENV, "no-such-rule")
    with pytest.raises(PatchsetError, match="no-such-rule"):
        failures(tiny_argv())


@pytest.mark.parametrize(
    "extra, expected",
    [
        (("--expert-tensor-parallel-size", "2"), "expert tensor parallel size 1"),
        (("--moe-router-padding-for-quantization",), "no --moe-router-padding-for-quantization"),
        (
            (
                "--cuda-graph-impl",
                "transformer_engine",
                "--cuda-graph-modules",
                "attn",
                "moe_router",
                "moe_preprocess",
            ),
            "no per-layer CUDA graphs over the MoE router",
        ),
    ],
)
def test_splits_rule_refuses_host_counts_and_per_layer_graphs(extra, expected):
    got = failures(tiny_argv(*TORCH, *SPLITS_ON_DEVICE, *extra), world_size=2)
    assert expected in got["moe-expert-splits-on-device-requirements"]


def test_splits_rule_takes_a_negative_capacity_factor_as_dropless():
    assert "moe-expert-splits-on-device-requirements" not in failures(
        tiny_argv(*TORCH, *SPLITS_ON_DEVICE, "--moe-expert-capacity-factor", "-1")
    )


def test_full_iteration_graphs_need_an_eager_step_before_the_capture():
    argv = tiny_argv(*TORCH, *SPLITS_ON_DEVICE, *FULL, "--cuda-graph-warmup-steps", "0")
    assert (
        "--cuda-graph-warmup-steps 1 or more"
        in failures(argv)["moe-grouped-gemm-impl-torch-requirements"]
    )


def test_drop_and_pad_is_static_only_in_the_alltoall_dispatcher():
    padded = ("--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity")
    got = failures(tiny_argv(*FULL, *padded, "--moe-token-dispatcher-type", "allgather"))
    assert "--moe-token-dispatcher-type alltoall" in got["full-iteration-graphs-dropless-moe"]
