"""Stand-in DeepEP packages (the 1.x API megatron-core 0.19.2 calls, DeepEP 2.x, broken builds)
written to a temporary folder, and the flag sets of the flex-dispatcher tests."""

import sys
import textwrap
import types

import pytest

from megatron.patchset.features.flex_dispatch import probes
from tests.unit.conftest import tiny_argv

_V1_BUFFER = """
class Buffer:
    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False):
        pass
    @staticmethod
    def get_dispatch_config(num_ranks):
        assert num_ranks in (2, 4, 8), f"Unsupported number of EP ranks: {num_ranks}"
        return object()
    @staticmethod
    def get_combine_config(num_ranks):
        assert num_ranks in (2, 4, 8), f"Unsupported number of EP ranks: {num_ranks}"
        return object()
    @staticmethod
    def set_num_sms(n):
        pass
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        pass
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None,
                 async_finish=False, allocate_on_comm_stream=False):
        pass
    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        pass
"""


PACKAGES = {
    "v1": {
        "deep_ep/__init__.py": "from .utils import EventOverlap\nfrom .buffer import Buffer\n",
        "deep_ep/utils.py": "class EventHandle: pass\nclass EventOverlap: pass\n",
        "deep_ep/buffer.py": _V1_BUFFER,
    },
    # DeepEP 2.x: deep_ep.utils became a package exporting only EventHandle.
    "v2": {
        "deep_ep/__init__.py": "__version__ = '2.1.0'\nfrom .utils import EventHandle\nfrom "
        ".buffers.legacy import Buffer\nclass EventOverlap: pass\n",
        "deep_ep/utils/__init__.py": "from .event import EventHandle\n",
        "deep_ep/utils/event.py": "class EventHandle: pass\n",
        "deep_ep/buffers/__init__.py": "",
        "deep_ep/buffers/legacy.py": _V1_BUFFER,
    },
    # Installed, but the compiled extension does not load.
    "broken": {
        "deep_ep/__init__.py": "raise ImportError('libnvshmem_host.so.3: cannot open shared object "
        "file: No such file or directory')\n",
    },
    # An old API: dispatch without the keywords megatron passes.
    "old_api": {
        "deep_ep/__init__.py": "from .utils import EventOverlap\nfrom .buffer import Buffer\n",
        "deep_ep/utils.py": "class EventHandle: pass\nclass EventOverlap: pass\n",
        "deep_ep/buffer.py": _V1_BUFFER.replace(
            "allocate_on_comm_stream=False):\n        pass\n    def combine",
            "):\n        pass\n    def combine",
        ).replace("previous_event=None,\n                 async_finish=False, ", ""),
    },
}


@pytest.fixture
def deep_ep_package(tmp_path, monkeypatch):
    """Make one of the stand-in packages importable as ``deep_ep``."""

    def install(kind):
        root = tmp_path / kind
        for rel, text in PACKAGES[kind].items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        monkeypatch.syspath_prepend(str(root))
        for name in [m for m in sys.modules if m == "deep_ep" or m.startswith("deep_ep.")]:
            monkeypatch.delitem(sys.modules, name)
        return root

    yield install
    for name in [m for m in sys.modules if m == "deep_ep" or m.startswith("deep_ep.")]:
        del sys.modules[name]


def flex_argv(backend, *extra):
    return tiny_argv(
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "flex",
        "--moe-flex-dispatcher-backend",
        backend,
        *extra,
    )


def _fake_te(monkeypatch, *, library=True):
    te = types.ModuleType("transformer_engine")
    te._nccl_ep_library_installed = lambda: library
    pytorch = types.ModuleType("transformer_engine.pytorch")
    ep = types.ModuleType("transformer_engine.pytorch.ep")
    for name in probes._TE_EP_API:
        setattr(ep, name, lambda *a, **k: None)
    ep.calls = []
    ep.is_ep_bootstrapped = lambda: False

    def ep_bootstrap(
        ep_group,
        num_experts,
        max_tokens_per_rank,
        hidden_dim,
        num_topk,
        recv_capacity_per_rank=None,
        max_num_sms=0,
        zero_copy=False,
    ):
        ep.calls.append(
            dict(
                num_experts=num_experts,
                max_tokens_per_rank=max_tokens_per_rank,
                hidden_dim=hidden_dim,
                num_topk=num_topk,
                recv_capacity_per_rank=recv_capacity_per_rank,
                max_num_sms=max_num_sms,
            )
        )

    ep.ep_bootstrap = ep_bootstrap
    pytorch.ep = ep
    te.pytorch = pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.ep", ep)
    return ep


def write_nccl_headers(folder, version=(2, 32, 3), device=True):
    """A stand-in NCCL include folder: nccl.h defining the version (and nccl_device.h)."""
    folder.mkdir(parents=True, exist_ok=True)
    major, minor, patch = version
    (folder / "nccl.h").write_text(
        f"#ifndef NCCL_H_\n#define NCCL_H_\n\n#define NCCL_MAJOR {major}\n"
        f"#define NCCL_MINOR {minor}\n#define NCCL_PATCH  {patch}\n"
        f'#define NCCL_SUFFIX ""\n#define NCCL_VERSION_CODE 0\n#endif\n'
    )
    if device:
        (folder / "nccl_device.h").write_text("#pragma once\n")
    return folder


@pytest.fixture
def nccl_jit_env(tmp_path, monkeypatch):
    """NCCL EP's JIT pointed at stand-in NCCL 2.32.3 headers."""
    monkeypatch.delenv("NCCL_HOME", raising=False)
    folder = write_nccl_headers(tmp_path / "nccl-include")
    monkeypatch.setenv("NCCL_EP_JIT_BUILD_INCLUDE_DIR", str(folder))
    return folder
