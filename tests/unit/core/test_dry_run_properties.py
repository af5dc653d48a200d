"""A property of ``--dry-run`` over combinations of the fork's flags and the megatron flags they
interact with (hypothesis): it exits 0, or non-zero with a message that names a flag or a launcher
variable; never a traceback, never an empty message. The values include nan and inf for the fork's
numeric flags, and the fork's flags that act only with another are drawn without it; two plain
tests go over every such flag."""

import contextlib
import io
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.patchset.core import dry_run
from tests.unit.conftest import tiny_argv

SIZES = st.sampled_from(["-1", "0", "1", "2", "3", "4", "8"])

# flag -> values (None: a switch given without a value)
OPTIONS = {
    "--tensor-model-parallel-size": SIZES,
    "--pipeline-model-parallel-size": SIZES,
    "--context-parallel-size": SIZES,
    "--expert-model-parallel-size": SIZES,
    "--expert-tensor-parallel-size": SIZES,
    "--dry-run-world-size": SIZES,
    "--micro-batch-size": SIZES,
    "--global-batch-size": st.sampled_from(["0", "4", "16", "17", "64"]),
    "--num-layers": st.sampled_from(["0", "2", "3", "4", "8"]),
    "--hidden-size": st.sampled_from(["-8", "128", "250", "256"]),
    "--num-attention-heads": st.sampled_from(["0", "3", "8"]),
    "--num-query-groups": st.sampled_from(["0", "1", "2", "3"]),
    "--seq-length": st.sampled_from(["0", "512", "1024"]),
    "--num-experts": st.sampled_from(["1", "2", "8", "16"]),
    "--moe-router-topk": st.sampled_from(["0", "1", "2", "9"]),
    "--vocab-size": st.sampled_from(["-5", "1", "4096"]),
    "--num-layers-per-virtual-pipeline-stage": st.sampled_from(["0", "1", "2"]),
    "--moe-token-dispatcher-type": st.sampled_from(["alltoall", "allgather", "flex"]),
    "--moe-flex-dispatcher-backend": st.sampled_from(["deepep", "hybridep", "ncclep"]),
    "--moe-expert-rank-capacity-factor": st.sampled_from(["-1", "0", "1.5"]),
    "--moe-expert-capacity-factor": st.sampled_from(["-1", "1.0"]),
    "--cuda-graph-impl": st.sampled_from(["none", "local", "transformer_engine", "full_iteration"]),
    "--cuda-graph-modules": st.sampled_from(["attn", "moe", "moe_router moe_preprocess"]),
    "--moe-grouped-gemm-impl": st.sampled_from(["te", "torch"]),
    "--overlap-p2p-wgrad-delayed-layer-number": st.sampled_from(["0", "1", "2", "9", "nan", "inf"]),
    "--compile-transformer-layers-mode": st.sampled_from(["default", "reduce-overhead"]),
    "--compile-transformer-layers-backend": st.sampled_from(["inductor", "eager"]),
    "--compile-transformer-layers-warmup-iters": st.sampled_from(["0", "2", "inf"]),
    "--moe-static-dispatch-capacity-factor": st.sampled_from(
        ["nan", "inf", "-inf", "1e305", "0.5", "1.5"]
    ),
    "--moe-static-dispatch-on-overflow": st.sampled_from(["rerun", "fail"]),
    "--recompute-granularity": st.sampled_from(["full", "selective"]),
    "--data-parallel-sharding-strategy": st.sampled_from(["no_shard", "optim_grads_params"]),
    "--moe-paged-stash-page-size": st.sampled_from(["0", "64"]),
    "--timing-log-level": st.sampled_from(["0", "1"]),
    "--lr-warmup-iters": st.sampled_from(["0", "100"]),
}
SWITCHES = [
    "--compile-transformer-layers",
    "--compile-transformer-layers-te-kernels",
    "--moe-expert-splits-on-device",
    "--moe-static-dispatch",
    "--load-allow-missing",
    "--overlap-p2p-backward-on-comm-stream",
    "--overlap-p2p-with-transformer-layer-wgrad",
    "--overlap-moe-expert-parallel-comm",
    "--delay-wgrad-compute",
    "--use-megatron-fsdp",
    "--moe-paged-stash",
    "--moe-permute-fusion",
    "--use-transformer-engine-op-fuser",
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--fp16",
    "--moe-pad-expert-input-to-capacity",
    "--no-check-for-nan-in-loss-and-grad",
    "--deterministic-mode",
]
NAMES_A_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]+|\b(WORLD_SIZE|RANK|MEGATRON_PATCHSET\w*)\b")


@st.composite
def flag_sets(draw):
    chosen = draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=5, unique=True))
    argv = []
    for flag in chosen:
        argv += [flag, *draw(OPTIONS[flag]).split()]
    argv += draw(st.lists(st.sampled_from(SWITCHES), max_size=4, unique=True))
    return argv


@settings(
    max_examples=int(os.environ.get("DRY_RUN_EXAMPLES", "60")),
    deadline=None,
    derandomize=not os.environ.get("DRY_RUN_EXAMPLES"),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(flag_sets())
def test_dry_run_answers_every_combination_with_a_message_naming_a_flag(extra):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = dry_run.run(tiny_argv(*extra), out=out)
        except SystemExit as exc:  # argparse: an invalid value of a flag
            code = exc.code
    text = out.getvalue() + err.getvalue()
    assert "Traceback" not in text, (extra, text)
    if code == 0:
        assert out.getvalue().rstrip().endswith("dry-run: OK"), (extra, text)
        return
    assert code == 2, (extra, code, text)
    # the dry-run's message (stdout), or argparse's (stderr), without library warnings
    ours = out.getvalue() if out.getvalue().strip() else err.getvalue()
    lines = [
        line
        for line in ours.splitlines()
        if line.strip() and "dry-run: INVALID" not in line and "warn" not in line.lower()
    ]
    assert lines, (extra, "empty message")
    message = "\n".join(lines[-6:])
    assert not message.rstrip().endswith(":"), (extra, message)  # e.g. "AssertionError: "
    assert NAMES_A_FLAG.search(message), (extra, message)


def _dry_run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = dry_run.run(argv, out=out)
        except SystemExit as exc:  # argparse: an invalid value of a flag
            code = exc.code
    return code, out.getvalue() + err.getvalue()


def _fork_actions():
    """The argparse actions of the fork's flag group (the features' flags and the core's)."""
    import argparse

    from megatron.patchset.core.flags import GROUP_TITLE, add_patchset_args

    parser = add_patchset_args(argparse.ArgumentParser(add_help=False))
    (group,) = [g for g in parser._action_groups if g.title == GROUP_TITLE]
    return group._group_actions


NUMERIC = sorted(
    max(a.option_strings, key=len)
    for a in _fork_actions()
    if a.type is not None and a.choices is None and a.nargs is None
)


def test_the_fork_has_numeric_flags_to_check():
    assert "--moe-static-dispatch-capacity-factor" in NUMERIC
    assert "--overlap-p2p-wgrad-delayed-layer-number" in NUMERIC


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("flag", NUMERIC)
def test_every_numeric_fork_flag_refuses_nan_and_inf_by_name(flag, value):
    code, text = _dry_run(tiny_argv(flag, value))
    assert code == 2, text
    assert f"argument {flag}: " in text and "Traceback" not in text


def _only_with_another():
    """(flag, value) of every fork flag that acts only with another flag: a feature's flags
    other than its switches, given a value other than their default."""
    from megatron.patchset.core import features

    actions = {max(a.option_strings, key=len): a for a in _fork_actions()}
    found = [("--load-allow-missing", None)]
    for feature in features.load():
        switches = {s.split()[0] for s in feature.switches}
        for flag in feature.flags:
            if flag in switches:
                continue
            action = actions[flag]
            if action.nargs == 0:
                found.append((flag, None))
            elif action.choices:
                found.append((flag, next(c for c in action.choices if c != action.default)))
            else:
                found.append((flag, str(action.type(str(action.default)) + 1)))
    return found


def test_the_flags_that_act_only_with_another_are_found():
    flags = [flag for flag, _ in _only_with_another()]
    for flag in (
        "--moe-static-dispatch-capacity-factor",
        "--moe-static-dispatch-on-overflow",
        "--compile-transformer-layers-mode",
        "--moe-expert-splits-on-device",
    ):
        assert flag in flags


@pytest.mark.parametrize("flag, value", _only_with_another())
def test_a_flag_that_acts_only_with_another_is_refused_without_it(flag, value):
    code, text = _dry_run(tiny_argv(flag, *([value] if value is not None else [])))
    assert code == 2, text
    assert flag in text.strip().splitlines()[-2] and "Traceback" not in text
