"""The exported tree on one GPU: every exportable feature exported onto megatron-core's installed
source, run with the overlay's feature patches off (``MEGATRON_PATCHSET=off``) and the tree on
``PYTHONPATH``, trains exactly as the overlay under ``--deterministic-mode``.

* FSDP + TE per-layer graphs: eager Megatron-FSDP and graphed (``--cuda-graph-modules attn``)
  runs on the exported tree are bit-identical to each other and to the overlay's graphed run,
  losses and gradient norms, for every iteration.
* The full-iteration recipe (experts as torch grouped GEMMs, token counts on the GPU,
  ``--cuda-graph-impl full_iteration``): its graphed run on the exported tree matches the
  overlay's bit for bit; it runs when its feature (grouped_mm) is exportable and skips otherwise.
"""

import os
import subprocess
import sys

import pytest

from megatron.patchset.core import features
from megatron.patchset.export import export
from megatron.patchset.export.plan import exportability
from tests.gpu.conftest import (
    DETERMINISTIC,
    GROUPED_MM_GRAPHED,
    ROOT,
    first_difference,
    launch_many,
    tiny_argv,
)
from tests.gpu.features.fsdp_cuda_graphs.test_cuda_graphs_fsdp import ENV as FSDP_ENV
from tests.gpu.features.fsdp_cuda_graphs.test_cuda_graphs_fsdp import FSDP, NUMERICS

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

ITERS = 13
GRAPHS = (
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-warmup-steps",
    "3",
    "--cuda-graph-modules",
    "attn",
)
FULL_ITERATION = (
    *DETERMINISTIC,
    "--no-check-for-nan-in-loss-and-grad",
    *GROUPED_MM_GRAPHED,
    "--logging-level",
    "20",
)


def _installed_source() -> str:
    import megatron.core

    return os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__)))
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tree = str(tmp_path_factory.mktemp("exported"))
    result = export(_installed_source(), tree)
    # The tree goes first; what the environment already has on the path (TransformerEngine and
    # megatron-core's other dependencies, wherever they are installed) stays behind it.
    inherited = os.environ.get("PYTHONPATH", "")
    upstream_env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [tree, inherited])),
        "MEGATRON_PATCHSET": "off",
    }
    provided = subprocess.run(
        [
            sys.executable,
            "-c",
            "from megatron.patchset.core.provided import provided_features as p;"
            "print(','.join(sorted(p())))",
        ],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, tree, inherited])),
            "MEGATRON_PATCHSET": "off",
        },
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()
    assert provided.split(",") == sorted(result.exported)
    tmp = tmp_path_factory.mktemp("export_runs")
    fsdp = tiny_argv("--train-iters", str(ITERS), *NUMERICS, *FSDP)
    jobs = [
        dict(tmp_path=tmp, name="overlay_graphs", nproc=1, argv=fsdp + list(GRAPHS), env=FSDP_ENV),
        dict(
            tmp_path=tmp,
            name="exported_eager",
            nproc=1,
            argv=fsdp,
            env={**FSDP_ENV, **upstream_env},
        ),
        dict(
            tmp_path=tmp,
            name="exported_graphs",
            nproc=1,
            argv=fsdp + list(GRAPHS),
            env={**FSDP_ENV, **upstream_env},
        ),
    ]
    if "grouped_mm" in result.exported:
        full = tiny_argv("--train-iters", str(ITERS), *FULL_ITERATION)
        jobs += [
            dict(tmp_path=tmp, name="overlay_full_iteration", nproc=1, argv=full),
            dict(
                tmp_path=tmp, name="exported_full_iteration", nproc=1, argv=full, env=upstream_env
            ),
        ]
    return result, launch_many(jobs)


def test_fsdp_te_graphs_on_the_exported_tree_match_the_overlay_bitwise(runs):
    result, done = runs
    assert "fsdp_cuda_graphs" in result.exported
    overlay, eager, graphed = (
        done[n] for n in ("overlay_graphs", "exported_eager", "exported_graphs")
    )
    assert "megatron-patchset: CUDA graph capture with Megatron-FSDP" in graphed.log_text()
    assert "MEGATRON_PATCHSET=off" not in graphed.log_text()
    assert len(overlay.losses) == len(eager.losses) == len(graphed.losses) == ITERS
    for a, b in ((graphed, eager), (graphed, overlay)):
        assert first_difference(a.losses, b.losses) is None, (a.name, b.name)
        assert first_difference(a.grad_norms, b.grad_norms) is None, (a.name, b.name)


def test_full_iteration_recipe_on_the_exported_tree_matches_the_overlay_bitwise(runs):
    result, done = runs
    reason = exportability(features.get("grouped_mm"))
    if "grouped_mm" not in result.exported:
        pytest.skip(f"grouped_mm is not exportable: {reason}")
    overlay, exported = done["overlay_full_iteration"], done["exported_full_iteration"]
    assert "CUDA graph capture done for training" in exported.log_text()
    assert len(overlay.losses) == len(exported.losses) == ITERS
    assert first_difference(exported.losses, overlay.losses) is None
    assert first_difference(exported.grad_norms, overlay.grad_norms) is None
