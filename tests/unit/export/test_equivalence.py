"""The exported tree behaves as the overlay: every exportable feature exported onto
megatron-core 0.19.2's own source, run with the overlay's feature patches off
(``MEGATRON_PATCHSET=off``) and that tree first on ``PYTHONPATH``, gives the same ``--dry-run``
rule outcomes (the same rules fire, naming the same flags), the same classes under each patched
upstream name, the same FSDP hook bookkeeping, the same schedule plan and bit-identical outputs
and gradients of megatron's TEGroupedMLP over the grouped-GEMM linears
(:mod:`tests.unit.export.scenarios`)."""

import json
import os
import subprocess
import sys

import pytest

from tests.unit.conftest import ROOT

# The package fixture `exported` is built once: test_export.py and test_equivalence.py run in
# one xdist worker.
pytestmark = pytest.mark.xdist_group("exported-installed-source")


def _scenarios(tmp_path, name, env):
    out = tmp_path / f"{name}.json"
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "WORLD_SIZE", "MEGATRON_PATCHSET")
        and not k.startswith("SLURM_")
    }
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.export.scenarios", str(out)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with open(out) as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def both(exported, tmp_path_factory):
    folder, result = exported
    tmp = tmp_path_factory.mktemp("scenarios")
    overlay = _scenarios(tmp, "overlay", {"PYTHONPATH": ROOT})
    upstream = _scenarios(
        tmp,
        "exported",
        {"PYTHONPATH": folder + os.pathsep + ROOT, "MEGATRON_PATCHSET": "off"},
    )
    return overlay, upstream, result


def test_the_exported_run_uses_the_exported_tree(both):
    overlay, upstream, result = both
    assert overlay["provided"] == []
    assert upstream["provided"] == sorted(result.exported)


# Runs that set none of a feature's flags: the overlay's rules refuse them, the exported tree
# checks them as upstream does (a feature's exported rules run for its users only).
WITHOUT_FEATURE_FLAGS = {
    "full_iteration_dropless": "full-iteration-graphs-dropless-moe",
    "fsdp_local_graphs": "fsdp-cuda-graphs-supported",
}


@pytest.mark.parametrize("part", ["dry_run", "fsdp_cuda_graphs", "p2p_overlap", "grouped_mm"])
def test_exported_tree_matches_the_overlay(both, part):
    overlay, upstream, _ = both
    mine, theirs = dict(upstream["observed"][part]), dict(overlay["observed"][part])
    if part == "dry_run":
        for run, rule in WITHOUT_FEATURE_FLAGS.items():
            assert mine.pop(run) == {"code": 0, "rules": {}}
            assert rule in theirs.pop(run)["rules"]
    assert mine == theirs


def test_the_scenarios_exercise_the_features(both):
    """The comparison is not vacuous: rules fire, patched classes are in place."""
    observed = both[0]["observed"]
    runs = observed["dry_run"]
    assert runs["plain"] == {"code": 0, "rules": {}}
    assert runs["fsdp_graphs_valid"]["code"] == 0 and runs["p2p_valid"]["code"] == 0
    assert list(runs["fsdp_local_graphs"]["rules"]) == ["fsdp-cuda-graphs-supported"]
    assert (
        "--fsdp-double-buffer"
        in runs["fsdp_graphs_no_double_buffer"]["rules"]["fsdp-cuda-graphs-double-buffer"]
    )
    assert list(runs["p2p_layer_number_too_large"]["rules"]) == [
        "p2p-overlap-delayed-layer-number-range"
    ]
    fsdp = observed["fsdp_cuda_graphs"]
    assert fsdp["MegatronFSDP"] == ["CudaGraphAwareMegatronFSDP", "MegatronFSDP"]
    assert fsdp["hook_roles"] and fsdp["guarded_gradient_hooks"] > 0
    p2p = observed["p2p_overlap"]
    assert p2p["plan"][0] == "P2POverlapChunkSchedulePlan" and p2p["layer_run"] == "run_layer"
    assert p2p["options"]["overlap_p2p_with_transformer_layer_wgrad"] is True
    assert set(runs["grouped_mm_requirements"]["rules"]) == {
        "moe-grouped-gemm-impl-torch-requirements",
        "full-iteration-graphs-dropless-moe",
    }
    assert list(runs["grouped_mm_alignment"]["rules"]) == ["moe-grouped-gemm-impl-torch-alignment"]
    assert list(runs["splits_without_grouped_mm"]["rules"]) == [
        "moe-expert-splits-on-device-requirements"
    ]
    assert list(runs["full_iteration_timers"]["rules"]) == ["full-iteration-graphs-timers"]
    assert list(runs["full_iteration_dropless"]["rules"]) == ["full-iteration-graphs-dropless-moe"]
    experts = observed["grouped_mm"]
    assert experts["linears"][0] == [
        "GroupedMMColumnParallelGroupedLinear",
        "GroupedMMForward",
        "FakeTEGroupedLinear",
    ]
    assert experts["offsets_cache"] == 0 and len(experts["weight_grads"]) == 8
