"""The paged-stash and receive-budget rules with megatron's real parser."""

import pytest

from megatron.patchset.core import features, rules
from megatron.patchset.features.paged_stash import flags as stash_flags
from tests.unit.conftest import parse, tiny_argv
from tests.unit.features.paged_stash.conftest import GRAPHS, STASH

OURS = {
    "paged-stash-requirements",
    "rank-capacity-factor-backend",
    "paged-stash-op-fuser-expert-mlp",
    "paged-stash-precision",
    "paged-stash-recompute",
    "paged-stash-cuda-graphs",
    "paged-stash-buffer-sizes",
    "ncclep-static-shape",
    "paged-stash-ncclep-static-shape",
}


NCCLEP_STASH = (
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "flex",
    "--moe-flex-dispatcher-backend",
    "ncclep",
    "--moe-ncclep-static-shape",
    "--moe-expert-rank-capacity-factor",
    "2.0",
    "--use-transformer-engine-op-fuser",
    "--moe-paged-stash",
)


def failures(*extra, world_size=2, base=STASH):
    args = parse(tiny_argv(*base, *extra), world_size)
    try:
        rules.validate(args, "layout")
    except rules.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures if rule.name in OURS}
    return {}


def test_reference_paged_stash_configs_are_valid():
    assert failures() == {}
    assert failures(*GRAPHS) == {}
    assert (
        failures(
            "--moe-paged-stash-buffer-size-factor-cuda",
            "0.5",
            "--moe-paged-stash-buffer-size-factor-cpu",
            "1.0",
        )
        == {}
    )
    # the static budget alone (no stash) with graphs is fine too
    assert failures(*GRAPHS, base=STASH[:-1]) == {}


def test_ncclep_paged_stash_configs_are_valid():
    assert failures(base=NCCLEP_STASH) == {}
    assert failures(*GRAPHS, base=NCCLEP_STASH) == {}
    # the static budget alone (no stash), with and without the static shape
    assert failures(*GRAPHS, base=NCCLEP_STASH[:-1]) == {}
    assert failures(base=[a for a in NCCLEP_STASH[:-1] if a != "--moe-ncclep-static-shape"]) == {}


def test_ncclep_paged_stash_needs_static_shape():
    base = [a for a in NCCLEP_STASH if a != "--moe-ncclep-static-shape"]
    msg = failures(base=base)["paged-stash-ncclep-static-shape"]
    assert "needs --moe-ncclep-static-shape" in msg and "overflow" in msg
    assert set(failures(base=base)) == {"paged-stash-ncclep-static-shape"}


def test_ncclep_static_shape_requirements():
    base = [a for a in NCCLEP_STASH[:-1] if a != "--use-transformer-engine-op-fuser"]
    msg = failures(base=base)["ncclep-static-shape"]
    assert (
        msg.startswith("--moe-ncclep-static-shape needs")
        and "--use-transformer-engine-op-fuser" in msg
    )
    base = [a for a in NCCLEP_STASH if a != "--moe-ncclep-static-shape"][:-1] + [
        "--moe-ncclep-zero-copy"
    ]
    assert "--moe-ncclep-static-shape (zero-copy" in failures(base=base)["ncclep-static-shape"]
    msg = failures("--moe-ncclep-static-shape")["ncclep-static-shape"]  # on hybridep
    assert "--moe-flex-dispatcher-backend ncclep" in msg


def test_paged_stash_requirements():
    base = [
        a
        for a in STASH
        if a
        not in ("--moe-expert-rank-capacity-factor", "1.5", "--use-transformer-engine-op-fuser")
    ]
    got = failures(base=base)
    msg = got["paged-stash-requirements"]
    assert "--moe-expert-rank-capacity-factor" in msg and "--use-transformer-engine-op-fuser" in msg
    got = failures("--cpu-offloading-num-layers", "1", "--offload-modules", "expert_fc1", "moe_act")
    msg = got["paged-stash-requirements"]
    assert "--cpu-offloading-num-layers" in msg and "expert_fc1, moe_act" in msg


def test_rank_capacity_factor_backend():
    base = list(STASH[:-1])
    base[base.index("hybridep")] = "deepep"
    got = failures(base=base)
    assert (
        "--moe-flex-dispatcher-backend hybridep or ncclep (got deepep)"
        in got["rank-capacity-factor-backend"]
    )
    base = [a for a in STASH[:-1] if a != "--use-transformer-engine-op-fuser"]
    assert (
        "--use-transformer-engine-op-fuser with hybridep"
        in failures(base=base)["rank-capacity-factor-backend"]
    )
    base = list(STASH[:-1])
    base[base.index("flex")] = "alltoall"
    assert (
        "--moe-token-dispatcher-type flex (got alltoall)"
        in failures(base=base)["rank-capacity-factor-backend"]
    )
    base = list(STASH)
    base[base.index("1.5")] = "0"
    assert "a positive factor" in failures(base=base)["rank-capacity-factor-backend"]


def test_op_fuser_expert_mlp(monkeypatch):
    monkeypatch.delenv(stash_flags.CUTEDSL_ENV)
    msg = failures()["paged-stash-op-fuser-expert-mlp"]
    assert f"{stash_flags.CUTEDSL_ENV}=1 with --swiglu" in msg
    monkeypatch.setenv(stash_flags.CUTEDSL_ENV, "1")
    got = failures(
        "--expert-tensor-parallel-size",
        "2",
        "--moe-single-grouped-weight",
        "--moe-apply-probs-on-input",
        world_size=4,
    )
    msg = got["paged-stash-op-fuser-expert-mlp"]
    assert "--expert-tensor-parallel-size 1; got 2" in msg
    assert "--moe-single-grouped-weight" in msg and "--moe-apply-probs-on-input" in msg
    argv = [a for a in STASH] + [
        "--recompute-granularity",
        "selective",
        "--recompute-modules",
        "moe_act",
    ]
    assert "moe_act" in failures(base=argv)["paged-stash-op-fuser-expert-mlp"]
    no_swiglu = [a for a in tiny_argv(*STASH) if a != "--swiglu"]
    args = parse(no_swiglu, 2)
    with pytest.raises(rules.PatchsetArgumentError) as err:
        rules.validate(args, "layout")
    assert "an activation the op fuser implements" in str(err.value)


def test_paged_stash_precision():
    msg = failures("--fp8-format", "hybrid")["paged-stash-precision"]
    assert "--fp8-format" in msg and "--bf16" in msg


def test_paged_stash_recompute():
    msg = failures(
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    )["paged-stash-recompute"]
    assert "--recompute-granularity full" in msg
    msg = failures("--recompute-granularity", "selective", "--recompute-modules", "moe")[
        "paged-stash-recompute"
    ]
    assert "moe in --recompute-modules" in msg


def test_paged_stash_cuda_graphs():
    msg = failures(
        "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe"
    )["paged-stash-cuda-graphs"]
    assert "captures the experts" in msg and "attn moe_router moe_preprocess" in msg
    msg = failures("--cuda-graph-impl", "transformer_engine")["paged-stash-cuda-graphs"]
    assert "whole layers" in msg
    msg = failures(*GRAPHS, "--moe-hybridep-pad-uneven-dispatch-inputs")["paged-stash-cuda-graphs"]
    assert "--moe-hybridep-pad-uneven-dispatch-inputs" in msg
    msg = failures("--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "1")[
        "paged-stash-cuda-graphs"
    ]
    assert "full_iteration" in msg and "--cuda-graph-warmup-steps 2 or more (got 1)" in msg


def test_paged_stash_buffer_sizes():
    msg = failures(
        "--moe-paged-stash-page-size", "0", "--moe-paged-stash-buffer-size-factor-cuda", "0"
    )["paged-stash-buffer-sizes"]
    assert "--moe-paged-stash-page-size 0" in msg and "every step would overflow" in msg
    assert (
        failures(
            "--moe-paged-stash-buffer-size-factor-cuda",
            "0",
            "--moe-paged-stash-buffer-size-factor-cpu",
            "1",
        )
        == {}
    )


def test_rules_are_silent_without_the_feature():
    assert failures(base=("--expert-model-parallel-size", "2", "--fp8-format", "hybrid")) == {}


def test_feature_listed():
    args = parse(tiny_argv(*STASH), 2)
    assert "paged_stash" in [f.name for f in features.enabled(args)]
    assert "paged_stash" not in [f.name for f in features.enabled(parse(tiny_argv(), 1))]
