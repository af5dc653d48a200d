"""The compile rules: options, combinations refused, recompute granularity, forced biased
routing."""

import pytest

from megatron.patchset.core import rules
from tests.unit.conftest import parse, tiny_argv, validated
from tests.unit.features.torch_compile.training import COMPILED


def failures(argv, phase="layout", world_size=1):
    args = parse(argv, world_size) if phase == "layout" else validated(argv, world_size)
    try:
        rules.validate(args, phase)
    except rules.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures}
    return {}


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            ("--compile-transformer-layers-mode", "max-autotune-no-cudagraphs"),
            "only act with --compile-transformer-layers",
        ),
        (
            (
                "--compile-transformer-layers",
                "--compile-transformer-layers-mode",
                "reduce-overhead",
            ),
            "CUDA graph trees",
        ),
        (
            ("--compile-transformer-layers", "--compile-transformer-layers-mode", "max-autotune"),
            "CUDA graph trees",
        ),
        (
            COMPILED + ("--compile-transformer-layers-mode", "max-autotune-no-cudagraphs"),
            "is an inductor mode",
        ),
        (
            ("--compile-transformer-layers", "--compile-transformer-layers-warmup-iters", "0"),
            "at least 1",
        ),
    ],
)
def test_options_rule(extra, fragment):
    problems = failures(tiny_argv(*extra))
    assert fragment in problems["compile-transformer-layers-options"]


@pytest.mark.parametrize(
    "extra, rule_name, fragment",
    [
        (
            ("--cuda-graph-impl", "transformer_engine"),
            "compile-transformer-layers-not-cuda-graphed",
            "--cuda-graph-impl transformer_engine",
        ),
        (
            ("--cuda-graph-impl", "local"),
            "compile-transformer-layers-not-cuda-graphed",
            "--cuda-graph-impl local",
        ),
        (
            ("--overlap-moe-expert-parallel-comm",),
            "compile-transformer-layers-not-cuda-graphed",
            "would never run",
        ),
        (
            ("--use-distributed-optimizer", "--overlap-param-gather"),
            "compile-transformer-layers-hooks",
            "--overlap-param-gather",
        ),
        (
            ("--use-megatron-fsdp", "--megatron-fsdp-enable-fine-grained-param-gather"),
            "compile-transformer-layers-hooks",
            "fine-grained",
        ),
        (("--nvtx-ranges",), "compile-transformer-layers-hooks", "--nvtx-ranges"),
    ],
)
def test_refused_combinations(extra, rule_name, fragment):
    problems = failures(tiny_argv("--compile-transformer-layers", *extra))
    assert fragment in problems[rule_name]
    # The same flags without compilation are none of this rule's business.
    assert rule_name not in failures(tiny_argv(*extra))


def test_megatron_fsdp_param_gather_is_fine():
    problems = failures(
        tiny_argv("--compile-transformer-layers", "--use-megatron-fsdp", "--overlap-param-gather")
    )
    assert "compile-transformer-layers-hooks" not in problems


@pytest.mark.parametrize(
    "recompute, refused",
    [
        (("--recompute-granularity", "selective"), "core_attn"),
        (("--recompute-granularity", "selective", "--recompute-modules", "moe"), "moe"),
        (("--recompute-granularity", "selective", "--recompute-modules", "moe_act"), None),
        (
            (
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ),
            None,
        ),
    ],
)
def test_recompute_rule(recompute, refused):
    problems = failures(
        tiny_argv("--compile-transformer-layers", "--no-gradient-accumulation-fusion", *recompute),
        phase="combination",
    )
    message = problems.get("compile-transformer-layers-recompute")
    if refused is None:
        assert message is None
    else:
        assert f"{refused} checkpoint inside the compiled layer" in message


def test_force_biased_is_refused_with_compile():
    from tests.unit.conftest import failures

    got = failures(tiny_argv("--compile-transformer-layers", "--moe-router-force-biased", "0.5"))
    assert "--moe-router-force-biased 0.5" in got["compile-transformer-layers-router-force-biased"]
    assert "compile-transformer-layers-router-force-biased" not in failures(
        tiny_argv("--compile-transformer-layers", "--moe-router-force-load-balancing")
    )
