"""Flex token dispatch: DeepEP, HybridEP or NCCL EP in place of megatron's alltoall.

The flex dispatcher's group is TP x EP (at least 2 GPUs). DeepEP, HybridEP and NCCL EP take fp32
routing weights (megatron casts others, with a warning); NCCL EP receives into a budget of
``RANK_CAPACITY`` times the balanced share. ``BACKEND=alltoall`` runs megatron's own dispatcher
for comparison. The packages come from the launcher's environment (``docs/deepep.md``).
"""

from megatron.patchset.recipes import recipe as r


def _build(k) -> r.Built:
    flags = ["--expert-model-parallel-size", str(k.ep)]
    if k.backend == "alltoall":
        return r.Built(tuple(flags + ["--moe-token-dispatcher-type", "alltoall"]))
    flags += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", k.backend]
    flags += ["--moe-router-dtype", "fp32"]
    if k.num_sms:
        flags += ["--moe-flex-dispatcher-num-sms", str(k.num_sms)]
    if k.backend == "ncclep":
        flags += ["--moe-expert-rank-capacity-factor", f"{k.rank_capacity:g}"]
    return r.Built(tuple(flags))


RECIPE = r.Recipe(
    name="flex_dispatch",
    summary="megatron's flex token dispatcher with DeepEP, HybridEP or NCCL EP",
    knobs=(
        r.whole("EP", 2, "expert-parallel size (the flex group is TP x EP, at least 2)"),
        r.choice("BACKEND", "deepep", ("deepep", "hybridep", "ncclep", "alltoall"), "dispatcher"),
        r.whole("NUM_SMS", 0, "--moe-flex-dispatcher-num-sms (0: the backend's default)", 0),
        r.number("RANK_CAPACITY", 2.0, "NCCL EP: --moe-expert-rank-capacity-factor"),
    ),
    build=_build,
)
