"""Shared flag sets and stand-ins of the paged-stash tests."""

import pytest

from megatron.patchset.features.paged_stash import flags as stash_flags

STASH = (
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "flex",
    "--moe-flex-dispatcher-backend",
    "hybridep",
    "--moe-expert-rank-capacity-factor",
    "1.5",
    "--use-transformer-engine-op-fuser",
    "--moe-router-dtype",
    "fp32",
    "--moe-paged-stash",
)


GRAPHS = (
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-modules",
    "attn",
    "moe_router",
    "moe_preprocess",
)


@pytest.fixture(autouse=True)
def cutedsl_env(monkeypatch):
    monkeypatch.setenv(stash_flags.CUTEDSL_ENV, "1")
