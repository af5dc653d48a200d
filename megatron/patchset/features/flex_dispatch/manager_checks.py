"""The backend probes where megatron builds a flex backend's manager, and the fix of megatron's
call into TransformerEngine 2.20's NCCL EP bootstrap.

``fused_a2a.ensure_nccl_ep_bootstrapped`` calls ``te_ep.ep_bootstrap`` without its required
``num_topk`` argument (a ``TypeError`` at the first dispatch); two patches pass the manager's
top-k through, and the bootstrap repairs TE's EP custom ops for torch 2.11 first
(:mod:`.op_repair`).
"""

from __future__ import annotations

import importlib
import threading

from megatron.patchset.core.registry import patch
from megatron.patchset.features.flex_dispatch.op_repair import (
    TE_EP_OP_NAMESPACE,
    repair_mutable_default_kernels,
)
from megatron.patchset.features.flex_dispatch.probes import (
    FlexBackendError,
    _fmt,
    check_backend,
    nccl_runtime_version,
    requested_backend,
)

_TD = "megatron.core.transformer.moe.token_dispatcher"


def _backend_is(name: str):
    return lambda args: requested_backend(args) == name


# Backends found usable in this process. megatron builds one manager per MoE layer; the
# probe (imports, signatures, NCCL version, header search) is the same for each, so it runs until
# it passes once.
_CHECKED: set = set()


def backend_origin(backend: str) -> str:
    """Where the backend's library was loaded from (for the run's log)."""
    name = "transformer_engine.pytorch.ep" if backend == "ncclep" else "deep_ep"
    module = importlib.import_module(name)
    origin = getattr(module, "__file__", "?")
    if backend == "ncclep":
        version = nccl_runtime_version()
        return f"{origin}, NCCL {_fmt(version) if version else '?'}"
    return origin


def checked_init(original, backend: str):
    """The manager's ``__init__``: probes ``backend`` (once per process) before upstream's."""

    def __init__(self, *args, **kwargs):
        if backend not in _CHECKED:
            check_backend(backend)
            _CHECKED.add(backend)
            # one line per process: the GPU tests look for it
            print(
                f"megatron-patchset: flex dispatcher backend {backend} from "
                f"{backend_origin(backend)}",
                flush=True,
            )
        return original(self, *args, **kwargs)

    return __init__


@patch(
    "flex_dispatch.deepep_check",
    f"{_TD}._DeepepManager.__init__",
    reason="megatron reports any failure to import deep_ep (broken build, DeepEP 2.x) as 'not "
    "installed'; re-probe DeepEP and raise with the original error and the pinned revision",
    upstream_pr="fork-only (diagnostics)",
    flags=("--moe-flex-dispatcher-backend deepep",),
    enabled=_backend_is("deepep"),
    kind="compat",
)
def _deepep_check(original):
    return checked_init(original, "deepep")


@patch(
    "flex_dispatch.hybridep_check",
    f"{_TD}._HybridEPManager.__init__",
    reason="same as flex_dispatch.deepep_check, for DeepEP's HybridEPBuffer (branch hybrid-ep)",
    upstream_pr="fork-only (diagnostics)",
    flags=("--moe-flex-dispatcher-backend hybridep",),
    enabled=_backend_is("hybridep"),
    kind="compat",
)
def _hybridep_check(original):
    return checked_init(original, "hybridep")


@patch(
    "flex_dispatch.ncclep_check",
    f"{_TD}._NCCLEPManager.__init__",
    reason="TE's NCCL EP fails late (first dispatch) on an old NCCL or a TE without libnccl_ep.so; "
    "check both when the layer is built",
    upstream_pr="fork-only (diagnostics)",
    flags=("--moe-flex-dispatcher-backend ncclep",),
    enabled=_backend_is("ncclep"),
    kind="compat",
)
def _ncclep_check(original):
    return checked_init(original, "ncclep")


# The top-k of the manager whose _ensure_bootstrap is running (bootstrap is collective and happens
# once per process, from the first MoE layer's first dispatch).
_BOOTSTRAP = threading.local()


@patch(
    "flex_dispatch.ncclep_bootstrap_topk",
    f"{_TD}._NCCLEPManager._ensure_bootstrap",
    reason="records the manager's router top-k for flex_dispatch.ncclep_bootstrap, which must "
    "pass it to TE 2.20's ep_bootstrap",
    upstream_pr="fork-only (TE 2.20.2 made ep_bootstrap's num_topk required)",
    flags=("--moe-flex-dispatcher-backend ncclep",),
    enabled=_backend_is("ncclep"),
    kind="compat",
)
def _ensure_bootstrap_factory(original):
    def _ensure_bootstrap(self):
        _BOOTSTRAP.topk = self.router_topk
        try:
            return original(self)
        finally:
            _BOOTSTRAP.topk = None

    return _ensure_bootstrap


@patch(
    "flex_dispatch.ncclep_bootstrap",
    f"{_TD}.ensure_nccl_ep_bootstrapped",
    reason="megatron-core 0.19.2 calls te_ep.ep_bootstrap without num_topk, which "
    "TransformerEngine 2.20's signature requires (TypeError at the first dispatch); also replaces "
    "the ADInplaceOrView kernels of TE's EP custom ops that index mutated arguments torch 2.11 "
    "dropped for equalling their defaults (IndexError at the first bf16 dispatch)",
    upstream_pr="fork-only (TE 2.20.2 made ep_bootstrap's num_topk required)",
    flags=("--moe-flex-dispatcher-backend ncclep",),
    enabled=_backend_is("ncclep"),
    kind="compat",
)
def _bootstrap_factory(_original):
    return ensure_nccl_ep_bootstrapped


def ensure_nccl_ep_bootstrapped(
    ep_group,
    num_experts,
    max_tokens_per_rank,
    recv_capacity_per_rank,
    hidden_dim,
    num_sms=0,
    zero_copy=False,
):
    """Bootstrap TE's NCCL EP once per process (collective over ``ep_group``), passing the top-k
    of the MoE layer whose first dispatch triggers it."""
    from transformer_engine.pytorch import ep as te_ep

    if te_ep.is_ep_bootstrapped():
        return
    topk = getattr(_BOOTSTRAP, "topk", None)
    if topk is None:
        raise FlexBackendError(
            "ensure_nccl_ep_bootstrapped was called outside _NCCLEPManager._ensure_bootstrap, so "
            "the router top-k that TE's ep_bootstrap needs is unknown"
        )
    check_backend("ncclep")
    repair_mutable_default_kernels(TE_EP_OP_NAMESPACE)
    te_ep.ep_bootstrap(
        ep_group,
        num_experts=num_experts,
        max_tokens_per_rank=max_tokens_per_rank,
        hidden_dim=hidden_dim,
        num_topk=topk,
        recv_capacity_per_rank=recv_capacity_per_rank,
        max_num_sms=num_sms,
        zero_copy=zero_copy,
    )
