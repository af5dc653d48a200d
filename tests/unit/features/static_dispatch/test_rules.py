"""The rules of --moe-static-dispatch, and the device-side counts' rule that it opens to EP >= 2."""

import pytest

from tests.unit.conftest import failures, tiny_argv

STATIC = (
    "--moe-grouped-gemm-impl",
    "torch",
    "--moe-expert-splits-on-device",
    "--moe-permute-fusion",
    "--moe-static-dispatch",
)
EP2 = ("--expert-model-parallel-size", "2")


def test_the_recipe_at_ep_2_passes_and_without_the_flag_the_counts_rule_names_it():
    assert failures(tiny_argv(*STATIC, *EP2), world_size=2) == {}
    got = failures(tiny_argv(*STATIC[:-1], *EP2), world_size=2)
    message = got["moe-expert-splits-on-device-requirements"]
    assert "--expert-model-parallel-size 1 (got 2" in message and "--moe-static-dispatch" in message


@pytest.mark.parametrize(
    "drop, extra, expected",
    [
        ("--moe-expert-splits-on-device", (), "--moe-grouped-gemm-impl torch --moe-expert-splits"),
        ("--moe-permute-fusion", (), "--moe-permute-fusion"),
        (None, ("--moe-token-dispatcher-type", "allgather"), "alltoall (got allgather)"),
        (None, ("--expert-tensor-parallel-size", "2"), "expert tensor parallel size 1 (got 2"),
        (None, ("--moe-expert-capacity-factor", "1.0"), "dropless MoE"),
        (None, ("--moe-router-padding-for-quantization",), "--moe-router-padding-for-quant"),
        (
            None,
            ("--moe-shared-expert-intermediate-size", "256", "--moe-shared-expert-overlap"),
            "--moe-shared-expert-overlap",
        ),
        (None, ("--overlap-moe-expert-parallel-comm",), "--overlap-moe-expert-parallel-comm"),
    ],
)
def test_what_the_static_path_does_not_implement_is_named(drop, extra, expected):
    argv = [a for a in tiny_argv(*STATIC, *EP2, *extra) if a != drop]
    got = failures(argv, world_size=4)
    assert expected in got.get("moe-static-dispatch-requirements", ""), got


def test_capacity_factor_below_one_is_refused():
    got = failures(tiny_argv(*STATIC, "--moe-static-dispatch-capacity-factor", "0.8"))
    assert "must be at least 1.0" in got["moe-static-dispatch-capacity-factor"]
    assert failures(tiny_argv(*STATIC, "--moe-static-dispatch-capacity-factor", "1.25")) == {}


def test_the_options_without_the_flag_are_refused():
    got = failures(tiny_argv("--moe-static-dispatch-capacity-factor", "1.5"))
    assert got == {
        "moe-static-dispatch-options": "--moe-static-dispatch-capacity-factor 1.5 acts only with "
        "--moe-static-dispatch: add it or drop it."
    }
    got = failures(tiny_argv("--moe-static-dispatch-on-overflow", "fail"))
    assert (
        "--moe-static-dispatch-on-overflow fail acts only with"
        in got["moe-static-dispatch-options"]
    )
    assert failures(tiny_argv(*STATIC, "--moe-static-dispatch-on-overflow", "fail")) == {}
    got = failures(tiny_argv("--moe-static-dispatch-dedup", "--moe-static-dispatch-chunks", "2"))
    assert got == {
        "moe-static-dispatch-options": "--moe-static-dispatch-dedup, "
        "--moe-static-dispatch-chunks 2 act only with --moe-static-dispatch: add it or drop them."
    }
    assert failures(tiny_argv(*STATIC, *EP2, "--moe-static-dispatch-dedup"), world_size=2) == {}


@pytest.mark.parametrize("value", ["1e305", "1.7e308"])
def test_a_factor_too_large_for_a_capacity_is_refused(value):
    """The capacity is ceil(factor x tokens x top-k / EP): a factor whose product with the rows
    overflows to inf stopped the dispatcher with an OverflowError."""
    got = failures(tiny_argv(*STATIC, *EP2, "--moe-static-dispatch-capacity-factor", value), 2)
    message = got["moe-static-dispatch-capacity-factor"]
    assert message.startswith(f"--moe-static-dispatch-capacity-factor {float(value)} is too large")
    assert "a factor of 2 (the expert-parallel size)" in message
    assert (
        failures(tiny_argv(*STATIC, *EP2, "--moe-static-dispatch-capacity-factor", "1e6"), 2) == {}
    )


CHUNKS = ("--moe-static-dispatch-chunks",)


def test_chunks_pass_with_the_recipe_and_act_only_with_the_static_dispatch():
    assert failures(tiny_argv(*STATIC, *EP2, *CHUNKS, "2"), world_size=2) == {}
    got = failures(tiny_argv(*CHUNKS, "2"))
    assert got == {
        "moe-static-dispatch-options": "--moe-static-dispatch-chunks 2 acts only with "
        "--moe-static-dispatch: add it or drop it."
    }


@pytest.mark.parametrize(
    "extra, expected",
    [
        (("--moe-static-dispatch-chunks", "0"), "--moe-static-dispatch-chunks 0: must be at least"),
        (("--moe-static-dispatch-chunks", "3"), "divides the 1024 tokens of a sequence"),
        (
            ("--moe-static-dispatch-chunks", "2", "--recompute-granularity", "selective")
            + ("--recompute-modules", "moe"),
            "no --recompute-modules moe",
        ),
        (("--moe-static-dispatch-chunks", "2", "--delay-wgrad-compute"), "--delay-wgrad-compute"),
    ],
)
def test_what_chunks_cannot_take_is_named(extra, expected):
    got = failures(tiny_argv(*STATIC, *EP2, *extra), world_size=2)
    assert expected in got.get("moe-static-dispatch-chunks", ""), got
