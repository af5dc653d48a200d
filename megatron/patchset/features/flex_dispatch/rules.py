"""Rules for the flex token dispatcher's backends.

--moe-token-dispatcher-type flex hands the MoE all-to-all to DeepEP, HybridEP (DeepEP's
hybrid-ep branch) or TransformerEngine's NCCL EP. megatron reports a missing or broken library
only when the first MoE layer is built, and as "not installed" whatever the cause; these rules
report the cause before any GPU work. The installation rule is skipped by --dry-run, which checks
the combination on a login node and lists the packages the run needs instead.
"""

from __future__ import annotations

from megatron.patchset.core.rules import rule
from megatron.patchset.features.flex_dispatch.probes import (
    FlexBackendError,
    check_backend,
    deep_ep_group_size_problem,
    requested_backend,
)


@rule(
    "flex-backend-installed",
    phase="combination",
    flags=("--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend"),
)
def _flex_backend_installed(args, config):
    """The requested flex backend imports, has the API megatron-core 0.19.2 calls, and (ncclep)
    runs on the loaded NCCL; never replaced by the all-to-all dispatcher."""
    backend = requested_backend(args)
    if backend is None or getattr(args, "dry_run", False):
        return None
    try:
        check_backend(backend)
    except FlexBackendError as exc:
        return f"--moe-token-dispatcher-type flex {exc}"
    return None


@rule(
    "flex-backend-group-size",
    phase="combination",
    flags=(
        "--moe-flex-dispatcher-backend",
        "--tensor-model-parallel-size",
        "--expert-model-parallel-size",
    ),
)
def _flex_backend_group_size(args, config):
    """deepep and ncclep communicate over the TP x EP group, which must have 2 or more ranks
    (and, for DeepEP, a size its kernels are tuned for)."""
    backend = requested_backend(args)
    if backend not in ("deepep", "ncclep"):
        return None
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    group = tp * ep
    flags = f"--tensor-model-parallel-size {tp} x --expert-model-parallel-size {ep} = {group}"
    if group < 2:
        return (
            f"--moe-flex-dispatcher-backend {backend} dispatches over the tensor x expert parallel "
            f"group, which has 1 rank ({flags}); megatron asserts TPxEP > 1. Use "
            "--expert-model-parallel-size 2 or more, or --moe-token-dispatcher-type alltoall."
        )
    if backend == "deepep":
        problem = deep_ep_group_size_problem(group)
        if problem:
            return f"--moe-flex-dispatcher-backend deepep: {problem} ({flags})."
    return None


@rule(
    "ncclep-needs-rank-capacity",
    phase="combination",
    flags=("--moe-flex-dispatcher-backend", "--moe-expert-rank-capacity-factor"),
)
def _ncclep_needs_rank_capacity(args, config):
    """NCCL EP sizes its receive buffer from --moe-expert-rank-capacity-factor."""
    if requested_backend(args) != "ncclep":
        return None
    if getattr(args, "moe_expert_rank_capacity_factor", None) is None:
        return (
            "--moe-flex-dispatcher-backend ncclep needs --moe-expert-rank-capacity-factor (e.g. "
            "2.0): it sizes each rank's receive buffer as tokens x top-k x factor, and megatron "
            "refuses to build the MoE layer without it. A budget that is exceeded traps the "
            "kernel, so be generous."
        )
    return None
