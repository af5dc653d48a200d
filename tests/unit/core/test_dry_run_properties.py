"""A property of ``--dry-run`` over combinations of the fork's flags and the megatron flags they
interact with (hypothesis): it exits 0, or non-zero with a message that names a flag or a launcher
variable; never a traceback, never an empty message."""

import contextlib
import io
import os
import re

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
    "--overlap-p2p-wgrad-delayed-layer-number": st.sampled_from(["0", "1", "2", "9"]),
    "--compile-transformer-layers-mode": st.sampled_from(["default", "reduce-overhead"]),
    "--compile-transformer-layers-warmup-iters": st.sampled_from(["0", "2"]),
    "--recompute-granularity": st.sampled_from(["full", "selective"]),
    "--data-parallel-sharding-strategy": st.sampled_from(["no_shard", "optim_grads_params"]),
    "--moe-paged-stash-page-size": st.sampled_from(["0", "64"]),
    "--timing-log-level": st.sampled_from(["0", "1"]),
    "--lr-warmup-iters": st.sampled_from(["0", "100"]),
}
SWITCHES = [
    "--compile-transformer-layers",
    "--moe-expert-splits-on-device",
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
