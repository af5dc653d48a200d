"""Upstream's best flags for a dropless MoE step, the baseline of every benchmark.

Unpatched megatron-core with its own TransformerEngine per-layer CUDA graphs over attention, the
router and the MoE preprocessing, the fused cross entropy and manual garbage collection; the
alltoall dispatcher with grouped GEMM, permute and router fusion comes from the flag file
(``examples/configs/*.args``). Megatron's NaN check is off as in the fork's recipe, whose capture
requires it: the check costs a host synchronisation per step.
"""

from megatron.patchset.recipes import recipe as r
from megatron.patchset.recipes.small_batch import _LAYER_GRAPHS


def _build(k) -> r.Built:
    flags = ["--manual-gc", "--cross-entropy-loss-fusion", "--no-check-for-nan-in-loss-and-grad"]
    flags += ["--expert-model-parallel-size", str(k.ep)]
    if k.dist_opt:
        flags += ["--use-distributed-optimizer"]
    if k.graphs:
        flags += list(_LAYER_GRAPHS)
    return r.Built(tuple(flags))


RECIPE = r.Recipe(
    name="upstream_best",
    summary="unpatched megatron-core with its TE per-layer graphs and fusions: the baseline",
    knobs=(
        r.switch("GRAPHS", True, "TE per-layer graphs of attention, router and preprocessing"),
        r.whole("EP", 1, "expert-parallel size"),
        r.switch("DIST_OPT", False, "megatron's distributed optimizer"),
    ),
    build=_build,
    baseline=True,
)
