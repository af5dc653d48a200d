"""Megatron-FSDP with TransformerEngine per-layer CUDA graphs: bit-identical to eager FSDP.

The tiny MoE config is trained with eager Megatron-FSDP and with Megatron-FSDP plus TE partial
graphs (``--cuda-graph-modules`` attn / attn moe_router moe_preprocess / moe_router), on one
GPU, on two GPUs with the parameters sharded across DP=2, and on two GPUs with EP=2. Graphs are
captured after 3 eager steps; the following 10 iterations replay them. Losses and gradient norms
must be bit-identical (atol = rtol = 0) to eager for all 13 iterations. Both runs use
``--deterministic-mode`` (fixed kernel arithmetic run to run), TE's RNG tracker (which megatron
forces for graphs) and no dropout.

The negative control runs Megatron-LM's own pretrain_gpt.py (core_r0.19.0, unpatched: only the
fork's compat/metrics patches) with the same flags.

All runs start at once (they share the GPUs): this checks numerics, the benchmark measures time.
"""

import os

import pytest

from tests.gpu.conftest import (
    DETERMINISTIC,
    UPSTREAM_ENTRY,
    UPSTREAM_SCRIPT,
    first_difference,
    gpu_count,
    launch_many,
    tiny_argv,
)

pytestmark = pytest.mark.gpu

ITERS = 13
WARMUP = 3
FSDP = (
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--ckpt-format",
    "fsdp_dtensor",
    "--fsdp-double-buffer",
    "--fsdp-db-use-persist-buf-on-alloc-fail",
)
NUMERICS = DETERMINISTIC
SCOPES = {
    "attn": ("attn",),
    "attn_router_preprocess": ("attn", "moe_router", "moe_preprocess"),
    "router": ("moe_router",),
}
LAYOUTS = {
    "1gpu": (1, ()),
    "dp2": (2, ()),
    "ep2": (2, ("--expert-model-parallel-size", "2")),
}
# Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1 (the GPU tests' default).
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}


def argv(layout, scope=None):
    _, extra = LAYOUTS[layout]
    args = tiny_argv("--train-iters", str(ITERS), *NUMERICS, *FSDP, *extra)
    if scope is not None:
        args += [
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-warmup-steps",
            str(WARMUP),
            "--cuda-graph-modules",
            *SCOPES[scope],
        ]
    return args


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module, launched together."""
    tmp = tmp_path_factory.mktemp("fsdp_graphs")
    jobs = []
    for layout, (nproc, _) in LAYOUTS.items():
        if gpu_count() < nproc:
            continue
        jobs.append(
            dict(tmp_path=tmp, name=f"eager_{layout}", nproc=nproc, argv=argv(layout), env=ENV)
        )
        for scope in SCOPES:
            jobs.append(
                dict(
                    tmp_path=tmp,
                    name=f"graphs_{layout}_{scope}",
                    nproc=nproc,
                    argv=argv(layout, scope),
                    env=ENV,
                )
            )
    if os.path.exists(UPSTREAM_SCRIPT):
        jobs.append(
            dict(
                tmp_path=tmp,
                name="graphs_1gpu_attn_upstream",
                nproc=1,
                argv=argv("1gpu", "attn"),
                env=ENV,
                entry=[UPSTREAM_ENTRY, UPSTREAM_SCRIPT],
                check=False,
            )
        )
    return launch_many(jobs)


@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("1gpu", marks=pytest.mark.gpus(1)),
        pytest.param("dp2", marks=pytest.mark.gpus(2)),
        pytest.param("ep2", marks=pytest.mark.gpus(2)),
    ],
)
def test_fsdp_partial_graphs_match_eager_bitwise(runs, layout, scope):
    eager, graphed = runs[f"eager_{layout}"], runs[f"graphs_{layout}_{scope}"]
    log = graphed.log_text()
    # The fork's capture ran (hooks rerouted to TE) before the replayed iterations.
    assert "megatron-patchset: CUDA graph capture with Megatron-FSDP" in log, (
        "capture log line missing"
    )
    assert "Modules must not have hooks" not in log
    assert len(eager.losses) == len(graphed.losses) == ITERS
    assert first_difference(eager.losses, graphed.losses) is None, (
        f"losses differ at {first_difference(eager.losses, graphed.losses)}"
    )
    assert first_difference(eager.grad_norms, graphed.grad_norms) is None, (
        f"grad norms differ at {first_difference(eager.grad_norms, graphed.grad_norms)}"
    )
    print(
        f"\n{layout} {scope}: {ITERS} iterations bit-identical to eager FSDP ({ITERS - WARMUP} "
        f"replayed); losses {graphed.losses[0]!r} ... {graphed.losses[-1]!r}; last grad norm "
        f"{graphed.grad_norms[-1]!r}"
    )


@pytest.mark.gpus(1)
def test_unpatched_upstream_fails_or_diverges(runs):
    """What the patches fix: Megatron-LM's own pretrain_gpt.py with the same flags."""
    if "graphs_1gpu_attn_upstream" not in runs:
        pytest.skip(f"Megatron-LM's pretrain_gpt.py not found at {UPSTREAM_SCRIPT}")
    eager, upstream = runs["eager_1gpu"], runs["graphs_1gpu_attn_upstream"]
    log = upstream.log_text()
    if upstream.returncode != 0:
        errors = sorted(
            {
                line.strip()[:300]
                for line in log.splitlines()
                if ("Error" in line or "error" in line)
                and "error_injection" not in line
                and "error-injection" not in line
            }
        )[:6]
        print(f"\nunpatched upstream: exit code {upstream.returncode}; errors: {errors}")
        assert errors, "upstream failed without an error message"
    else:
        diff = first_difference(eager.losses, upstream.losses)
        print(f"\nunpatched upstream ran; first loss difference vs eager: {diff}")
        assert diff is not None, (
            "unpatched upstream matched eager: the negative control shows nothing"
        )
