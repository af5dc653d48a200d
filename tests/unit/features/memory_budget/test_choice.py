"""The budget's choice for the recorded shapes, its refusal, how it sets megatron's arguments, its
rules and the dry-run's report."""

import contextlib
import io
import os

import pytest

from megatron.patchset.features.memory_budget import choice, estimate
from megatron.patchset.features.memory_budget.choice import BudgetError, choose
from tests.unit.conftest import ROOT, combination_failures, failures, tiny_argv, validated
from tests.unit.features.memory_budget import records
from tests.unit.features.memory_budget.records import (
    L1_1X4096,
    L1_2X4096,
    L2_1X4096,
    MEMORY_80G,
    MOMENTS,
    NONE,
    REF_4X4096,
    record_text,
    shape,
)

# The measured step times the order comes from (reference config, 4x4096 tokens, one H200).
LEVERS_RECORD = "2026-11-27-reference-4x4096-memory-levers-h200.md"


def measured(run, levers):
    return next(gib for _, r, lv, gib in records.MEASURED if r == run and lv == levers)


def test_the_order_is_the_levers_records_step_times_after_no_lever():
    text = record_text(LEVERS_RECORD)
    step = {
        name: float(line.split("|")[2])
        for line in text.splitlines()
        for name in ("bf16-moments", "small-batch:MEMORY=80G", "recompute-moe-act ")
        if line.startswith(f"| {name}")
    }
    moments, both, act = (
        step["bf16-moments"],
        step["small-batch:MEMORY=80G"],
        step["recompute-moe-act "],
    )
    order = choice.COMBINATIONS
    assert order[0] == NONE
    assert moments < both < act
    assert (
        order.index(MOMENTS)
        < order.index(MEMORY_80G)
        < order.index(estimate.Levers(recompute=("moe_act",)))
    )


def test_l1_at_1x4096_on_80g_takes_the_measured_fit_and_on_141g_no_lever():
    """Qwen3 L1 rank, 1x4096: no lever (76.20 GiB measured) and bf16 moments alone (72.64) are
    above the 72 GiB an 80G budget allows; bf16 moments with moe_act recomputed (68.14 on an
    H200, 68.21 on an H100, where it ran) is the fastest that fits. 141G takes no lever."""
    at_80 = choose(shape(L1_1X4096), "80G")
    assert at_80.allowed_gib == pytest.approx(72.0)
    assert at_80.chosen.levers == MEMORY_80G
    assert measured(L1_1X4096, NONE) > at_80.allowed_gib
    assert measured(L1_1X4096, MOMENTS) > at_80.allowed_gib
    assert measured(L1_1X4096, MEMORY_80G) < at_80.allowed_gib
    assert choose(shape(L1_1X4096), "141G").chosen.levers == NONE


def test_the_reference_config_at_4x4096_on_80g_takes_bf16_moments():
    """Reference config, 4x4096 tokens: 81.58 GiB without levers does not fit an 80 GB card;
    bf16 moments alone (67.66 GiB, the fastest row of the levers record) do."""
    picked = choose(shape(REF_4X4096), "80G").chosen
    assert picked.levers == MOMENTS
    assert measured(REF_4X4096, MOMENTS) < 80 * 0.9 < measured(REF_4X4096, NONE)


@pytest.mark.parametrize(
    "run, page, says",
    [
        (
            L1_2X4096,
            "benchmarks/2026-11-27-emulated-qwen3-l1-2x4096-h100-oom.md",
            "small-batch:EP=8,DIST_OPT=1,MEMORY=80G | FAILED | torch.OutOfMemoryError",
        ),
        (L2_1X4096, "benchmarks.md", "On an H100, L2 at 1x4096 runs out of memory"),
    ],
)
def test_what_ran_out_of_memory_on_an_h100_is_refused_at_80g_and_fits_141g(run, page, says):
    """Runs the records saw run out of memory on an 80 GB H100 even with bf16 moments and
    moe_act recomputed (L1 2x4096; L2 1x4096) are refused at 80G; a 141G budget takes them."""
    with open(os.path.join(ROOT, "docs", page)) as handle:
        assert says in " ".join(handle.read().split())
    at_80 = choose(shape(run), "80G")
    assert at_80.chosen is None
    assert choose(shape(run), "141G").chosen is not None
    args = records.validated_args(run)
    message = choice.refusal(at_80, args)
    assert "\n" not in message
    assert message.startswith("megatron-patchset: MEMORY=80G (--memory-budget 80G): ")
    assert f"needs about {at_80.leanest.gib:.1f} GiB per rank" in message
    assert "moe_act and layernorm recomputed" in message  # the leanest
    assert "--expert-model-parallel-size (now 8;" in message
    # a smaller micro-batch only where there is one; the static dispatch's padding where it pads
    assert (f"--micro-batch-size (now {run.micro_batch})" in message) is (run.micro_batch > 1)
    padded = args.moe_static_dispatch and args.moe_static_dispatch_capacity_factor > 1
    assert ("--moe-static-dispatch-capacity-factor (now" in message) is bool(padded)
    assert message.endswith(".") and " or " in message


def test_without_bf16_moments_the_budget_recomputes_with_fp32_moments():
    """megatron's own Adam without the distributed optimizer has no bf16 moments: the candidates
    are the recomputations."""
    args = validated(tiny_argv("--memory-budget", "80G"))
    assert choice.moments_lever(args) is None
    assert all(not c.bf16_moments for c in choice.candidates(args))
    assert choice.candidates(args)[1] == estimate.Levers(recompute=("moe_act",))


def _tiny_budget(levers_wanted, *extra):
    """A budget (text) between the tiny config's estimate with ``levers_wanted`` and that of every
    combination tried before it."""
    from megatron.patchset.core.dry_run import target_device

    args = validated(tiny_argv(*extra, "--memory-budget", "80G"))
    args.rank = 0
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        shape = choice.shape_of(args)
    order = choice.candidates(args)
    gib = [estimate.estimate(shape, c).gib for c in order]
    wanted = gib[order.index(levers_wanted)]
    before = min(gib[: order.index(levers_wanted)])
    assert wanted < before
    return f"{(wanted + before) / 2 / (1 - choice.HEADROOM):.4f}G"


@pytest.mark.parametrize(
    "extra, levers",
    [
        ((), estimate.Levers(recompute=("moe_act",))),
        (("--adam-impl", "triton"), MEMORY_80G),
        (("--use-distributed-optimizer",), estimate.Levers(True, ("moe_act", "layernorm"))),
    ],
)
def test_the_chosen_levers_are_set_and_pass_megatrons_and_the_forks_checks(extra, levers):
    import torch

    from megatron.patchset.core.dry_run import target_device

    budget = _tiny_budget(levers, *extra)
    argv = tiny_argv(*extra, "--memory-budget", budget)
    args = validated(argv)
    args.rank = 0
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        line = choice.resolve(args)
    assert line.startswith(f"memory budget {budget}: {levers.describe()} (estimated peak ")
    assert args.recompute_granularity == "selective"
    assert args.recompute_modules == list(levers.recompute)
    if "--adam-impl" in extra:
        assert args.adam_moments_dtype == "bf16" and not args.use_precision_aware_optimizer
    elif levers.bf16_moments:
        assert args.use_precision_aware_optimizer
        assert args.exp_avg_dtype == args.exp_avg_sq_dtype == torch.bfloat16
    else:
        assert args.adam_moments_dtype == "fp32" and not args.use_precision_aware_optimizer
    # the same levers given as flags pass megatron's validation, config and the fork's rules
    flags = ["--recompute-granularity", "selective", "--recompute-modules", *levers.recompute]
    assert not combination_failures(tiny_argv(*extra, *flags), 1)


def test_a_budget_that_fits_changes_nothing():
    args = validated(tiny_argv("--memory-budget", "80G"))
    args.rank = 0
    from megatron.patchset.core.dry_run import target_device

    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        line = choice.resolve(args)
    assert line.startswith("memory budget 80G: no lever (estimated peak ")
    assert args.recompute_granularity is None and args.adam_moments_dtype == "fp32"


@pytest.mark.parametrize(
    "extra, rule",
    [
        (("--recompute-granularity", "selective"), "memory-budget-chooses-the-levers"),
        (
            ("--adam-impl", "triton", "--adam-moments-dtype", "bf16"),
            "memory-budget-chooses-the-levers",
        ),
        (("--exp-avg-dtype", "bf16"), "memory-budget-chooses-the-levers"),
        (("--pipeline-model-parallel-size", "2"), "memory-budget-layout"),
    ],
)
def test_the_rules_refuse_levers_given_with_a_budget_and_other_layouts(extra, rule):
    found = failures(tiny_argv("--memory-budget", "80G", *extra), world_size=2)
    assert rule in found, found
    assert "--memory-budget 80G" in found[rule]
    assert rule not in failures(tiny_argv(*extra), world_size=2)


@pytest.mark.parametrize("value", ["80", "80GB", "0G", "-1G"])
def test_a_bad_budget_is_refused_by_the_parser(value, capsys):
    from tests.unit.conftest import parse

    with pytest.raises(SystemExit):
        parse(tiny_argv("--memory-budget", value))
    assert "--memory-budget" in capsys.readouterr().err


def _dry_run(argv):
    from megatron.patchset.core import dry_run

    out = io.StringIO()
    with contextlib.redirect_stderr(io.StringIO()):
        code = dry_run.run(argv, out=out)
    return code, out.getvalue()


def test_the_dry_run_reports_the_choice_and_the_levers_it_set():
    code, out = _dry_run(REF_4X4096.argv() + ["--memory-budget", "80G"])
    assert code == 0, out
    assert "memory_budget (--memory-budget 80G)" in out
    assert "torch_adam (--adam-impl triton, --adam-moments-dtype bf16)" in out
    assert "72.0 GiB allowed (10% headroom):" in out
    lines = out[out.index("memory budget 80G") :].splitlines()[1:7]
    assert [line.split()[2] for line in lines] == ["too", "chosen", "fits", "fits", "too", "too"]
    assert lines[1].endswith("bf16 Adam moments")
    assert out.rstrip().endswith("dry-run: OK")


def test_the_dry_run_refuses_what_no_lever_fits_in_one_line():
    code, out = _dry_run(REF_4X4096.argv() + ["--memory-budget", "40G"])
    assert code == 2
    message = [line for line in out.splitlines() if "MEMORY=40G" in line]
    assert len(message) == 1 and "needs about" in message[0] and "36.0 GiB" in message[0]
    assert "dry-run: INVALID" in out


def test_a_launch_is_refused_before_training_when_nothing_fits():
    """pretrain_gpt.py resolves the budget before the model config and exits with the one line
    (a PatchsetError) when no combination fits."""
    from megatron.patchset.core import model_hooks
    from megatron.patchset.core.dry_run import target_device

    args = validated(tiny_argv("--memory-budget", "0.01G"))
    args.rank = 0
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(
            BudgetError, match=r"^megatron-patchset: MEMORY=0.01G \(--memory-budget"
        ):
            model_hooks.resolve_arguments(args)
    assert args.recompute_granularity is None
