"""Flex dispatcher backends: the probes report the real cause, the rules refuse a backend that
cannot run (never falling back to all-to-all), and the NCCL EP bootstrap patch passes num_topk.

DeepEP packages are stand-ins written to a temporary folder: one with the 1.x API megatron-core
0.19.2 calls, one laid out like DeepEP 2.x (EPv2), one whose extension fails to load."""

import sys
import textwrap
import types

import pytest

from megatron.patchset import arguments as ps_args
from megatron.patchset import patches
from megatron.patchset import token_dispatcher as flex
from tests.unit.conftest import tiny_argv, validated

# --- stand-in DeepEP packages ---------------------------------------------------------------

_V1_BUFFER = '''
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
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None,
                 async_finish=False, allocate_on_comm_stream=False):
        pass
    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        pass
'''

PACKAGES = {
    "v1": {
        "deep_ep/__init__.py": "from .utils import EventOverlap\nfrom .buffer import Buffer\n",
        "deep_ep/utils.py": "class EventHandle: pass\nclass EventOverlap: pass\n",
        "deep_ep/buffer.py": _V1_BUFFER,
    },
    # DeepEP 2.x: deep_ep.utils became a package exporting only EventHandle.
    "v2": {
        "deep_ep/__init__.py": "__version__ = '2.1.0'\nfrom .utils import EventHandle\nfrom .buffers.legacy import Buffer\nclass EventOverlap: pass\n",
        "deep_ep/utils/__init__.py": "from .event import EventHandle\n",
        "deep_ep/utils/event.py": "class EventHandle: pass\n",
        "deep_ep/buffers/__init__.py": "",
        "deep_ep/buffers/legacy.py": _V1_BUFFER,
    },
    # Installed, but the compiled extension does not load.
    "broken": {
        "deep_ep/__init__.py": "raise ImportError('libnvshmem_host.so.3: cannot open shared object file: No such file or directory')\n",
    },
    # An old API: dispatch without the keywords megatron passes.
    "old_api": {
        "deep_ep/__init__.py": "from .utils import EventOverlap\nfrom .buffer import Buffer\n",
        "deep_ep/utils.py": "class EventHandle: pass\nclass EventOverlap: pass\n",
        "deep_ep/buffer.py": _V1_BUFFER.replace("allocate_on_comm_stream=False):\n        pass\n    def combine",
                                                 "):\n        pass\n    def combine").replace(
            "previous_event=None,\n                 async_finish=False, ", ""),
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
    return tiny_argv("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
                     "--moe-flex-dispatcher-backend", backend, *extra)


def combination_failures(argv, world_size=2):
    args = validated(argv, world_size)
    try:
        ps_args.validate(args, "combination", config=None)
    except ps_args.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures}
    return {}


# --- DeepEP probe ---------------------------------------------------------------------------


def test_probe_accepts_the_api_megatron_calls(deep_ep_package):
    deep_ep_package("v1")
    assert flex.probe_deep_ep("deepep") is None
    assert flex.deep_ep_group_size_problem(2) is None
    assert "no dispatch/combine configuration for a group of 6 ranks" in flex.deep_ep_group_size_problem(6)


def test_probe_reports_missing_package_with_the_pinned_revision(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError
    message = flex.probe_deep_ep("deepep")
    assert "import deep_ep" in message or "does not import" in message
    assert flex.DEEPEP_REVISION[:7] in message and "tools/build_deepep.sh" in message


def test_probe_surfaces_the_original_import_error(deep_ep_package):
    deep_ep_package("broken")
    message = flex.probe_deep_ep("deepep")
    assert message.startswith("DeepEP is installed but does not import")
    assert "libnvshmem_host.so.3: cannot open shared object file" in message


def test_probe_explains_deepep_2x(deep_ep_package):
    deep_ep_package("v2")
    message = flex.probe_deep_ep("deepep")
    assert "from deep_ep.utils import EventHandle, EventOverlap" in message
    assert "EventOverlap" in message and "2.x" in message
    # megatron-core's own import of the same package fails (and it then says "not installed"):
    with pytest.raises(ImportError):
        from deep_ep.utils import EventOverlap  # noqa: F401


def test_probe_names_missing_keywords(deep_ep_package):
    deep_ep_package("old_api")
    message = flex.probe_deep_ep("deepep")
    assert "Buffer.dispatch has no parameter(s) previous_event, async_finish" in message
    assert "Buffer.combine" not in message


def test_hybridep_needs_the_hybrid_ep_branch(deep_ep_package):
    deep_ep_package("v1")
    message = flex.probe_deep_ep("hybridep")
    assert "HybridEPBuffer is missing" in message and flex.HYBRIDEP_REVISION[:7] in message


# --- rules ------------------------------------------------------------------------------------


def test_rule_refuses_deepep_that_is_missing(deep_ep_package):
    deep_ep_package("broken")
    failures = combination_failures(flex_argv("deepep"))
    assert "flex-backend-installed" in failures
    assert "libnvshmem_host.so.3" in failures["flex-backend-installed"]
    assert "--moe-flex-dispatcher-backend deepep" in failures["flex-backend-installed"]


def test_rule_accepts_a_matching_deepep(deep_ep_package):
    deep_ep_package("v1")
    assert combination_failures(flex_argv("deepep")) == {}


def test_dry_run_checks_the_combination_not_the_installation(deep_ep_package):
    deep_ep_package("broken")
    failures = combination_failures(flex_argv("deepep", "--dry-run"))
    assert "flex-backend-installed" not in failures


def test_rule_group_size(deep_ep_package):
    deep_ep_package("v1")
    one = combination_failures(tiny_argv("--moe-token-dispatcher-type", "flex",
                                         "--moe-flex-dispatcher-backend", "deepep"), world_size=1)
    assert "TPxEP > 1" in one["flex-backend-group-size"]
    # 8 experts over EP=4 on 4 GPUs is a size the stand-in supports; EP=8 would be too, 6 is not.
    assert "flex-backend-group-size" not in combination_failures(
        tiny_argv("--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "flex"), world_size=4)


def test_other_dispatchers_are_not_checked(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    assert combination_failures(tiny_argv("--expert-model-parallel-size", "2")) == {}
    assert flex.requested_backend(None) is None


def test_ncclep_rules(monkeypatch):
    monkeypatch.setattr(flex, "probe_nccl_ep", lambda check_runtime=True: "NCCL 2.28.9 is loaded, but ...")
    failures = combination_failures(flex_argv("ncclep"))
    assert "--moe-expert-rank-capacity-factor" in failures["ncclep-needs-rank-capacity"]
    assert "NCCL 2.28.9" in failures["flex-backend-installed"]
    monkeypatch.setattr(flex, "probe_nccl_ep", lambda check_runtime=True: None)
    assert combination_failures(flex_argv("ncclep", "--moe-expert-rank-capacity-factor", "2.0")) == {}


# --- NCCL EP probe ----------------------------------------------------------------------------


def _fake_te(monkeypatch, *, library=True):
    te = types.ModuleType("transformer_engine")
    te._nccl_ep_library_installed = lambda: library
    pytorch = types.ModuleType("transformer_engine.pytorch")
    ep = types.ModuleType("transformer_engine.pytorch.ep")
    for name in flex._TE_EP_API:
        setattr(ep, name, lambda *a, **k: None)
    ep.calls = []
    ep.is_ep_bootstrapped = lambda: False

    def ep_bootstrap(ep_group, num_experts, max_tokens_per_rank, hidden_dim, num_topk,
                     recv_capacity_per_rank=None, max_num_sms=0, zero_copy=False):
        ep.calls.append(dict(num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank,
                             hidden_dim=hidden_dim, num_topk=num_topk,
                             recv_capacity_per_rank=recv_capacity_per_rank, max_num_sms=max_num_sms))

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
    (folder / "nccl.h").write_text(f"#ifndef NCCL_H_\n#define NCCL_H_\n\n#define NCCL_MAJOR {major}\n"
                                   f"#define NCCL_MINOR {minor}\n#define NCCL_PATCH  {patch}\n"
                                   f"#define NCCL_SUFFIX \"\"\n#define NCCL_VERSION_CODE 0\n#endif\n")
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


def test_nccl_ep_probe(monkeypatch, nccl_jit_env):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    assert "does not import" in flex.probe_nccl_ep()
    _fake_te(monkeypatch, library=False)
    assert "no libnccl_ep.so" in flex.probe_nccl_ep()
    _fake_te(monkeypatch)
    monkeypatch.setattr(flex, "nccl_runtime_version", lambda: (2, 28, 9))
    message = flex.probe_nccl_ep()
    assert "NCCL 2.28.9 is loaded" in message and "2.32.3" in message and "LD_PRELOAD" in message
    monkeypatch.setattr(flex, "nccl_runtime_version", lambda: (2, 32, 3))
    assert flex.probe_nccl_ep() is None


def test_nccl_runtime_version_reads_the_loaded_library():
    import torch  # noqa: F401  (loads torch's libnccl.so.2 when it links one)

    version = flex.nccl_runtime_version()
    assert version is None or (version[0] == 2 and version >= (2, 18, 0))


# --- NCCL headers for NCCL EP's kernel JIT ---------------------------------------------------


def test_nccl_header_version(tmp_path):
    assert flex.nccl_header_version(str(write_nccl_headers(tmp_path / "a", (2, 32, 3)))) == 23203
    assert flex.nccl_header_version(str(write_nccl_headers(tmp_path / "b", (2, 28, 9)))) == 22809
    assert flex.nccl_header_version(str(tmp_path / "none")) is None
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 32\n")  # no patch
    assert flex.nccl_header_version(str(tmp_path / "c")) is None
    (tmp_path / "d").mkdir()  # the first definition of each field counts; indented ones do not
    (tmp_path / "d" / "nccl.h").write_text("  #define NCCL_MAJOR 9\n#define NCCL_MAJOR 2\n#define NCCL_MINOR 30\n"
                                           "#define NCCL_PATCH 4\n#define NCCL_PATCH 7\n")
    assert flex.nccl_header_version(str(tmp_path / "d")) == 23004


def test_nccl_include_candidates_follow_te_order():
    got = flex.nccl_include_candidates("/data/x/nvidia/nccl/lib/libnccl.so.2", "/data/x/transformer_engine/libte.so")
    assert got[:6] == ["/data/x/nvidia/nccl/lib/include", "/data/x/nvidia/nccl/lib/nvidia/nccl/include",
                       "/data/x/nvidia/nccl/include", "/data/x/nvidia/nccl/nvidia/nccl/include",
                       "/data/x/nvidia/include", "/data/x/nvidia/nvidia/nccl/include"]
    assert "/include" not in got and "/nvidia/nccl/include" not in got  # never the root folder
    assert got.count("/data/x/include") == 1  # shared ancestors once, in the first library's place
    assert got.index("/data/x/include") < got.index("/data/x/transformer_engine/include")
    assert got[-3:] == ["/opt/nvidia/nccl/include", "/usr/local/nccl/include", "/usr/include"]
    # /opt's own nvidia/nccl/include is an ancestor candidate first, and listed once
    got = flex.nccl_include_candidates("/opt/nccl/lib/libnccl.so.2", None)
    assert got.index("/opt/nvidia/nccl/include") == 5 and got.count("/opt/nvidia/nccl/include") == 1
    assert flex.nccl_include_candidates(None, None) == list(flex.NCCL_INCLUDE_FALLBACKS)


def test_nccl_headers_found_next_to_the_loaded_nccl(tmp_path):
    lib = tmp_path / "site" / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    write_nccl_headers(tmp_path / "site" / "nvidia" / "nccl" / "include", (2, 28, 9))  # torch's, too old
    te = str(tmp_path / "site" / "transformer_engine" / "wheel_lib" / "libtransformer_engine.so")
    assert flex.nccl_jit_include_problem((2, 28, 9), {}, str(lib), te) is None
    message = flex.nccl_jit_include_problem((2, 32, 3), {}, str(lib), te)
    assert "NCCL_EP_JIT_BUILD_INCLUDE_DIR" in message and "NCCL_HOME" in message
    assert "matching runtime NCCL 2.32.3" in message and "(2.28.9)" in message and str(lib) in message
    good = write_nccl_headers(tmp_path / "site" / "include", (2, 32, 3))  # an ancestor's include/
    assert flex.nccl_jit_include_dir((2, 32, 3), {}, str(lib), te)[0] == str(good)
    assert flex.nccl_jit_include_problem((2, 32, 3), {}, str(lib), te) is None
    (good / "nccl_device.h").unlink()  # found by its version, but the JIT includes the device API
    assert "nccl_device.h is not there" in flex.nccl_jit_include_problem((2, 32, 3), {}, str(lib), te)


def test_nccl_header_variables_take_precedence(tmp_path):
    lib, te = str(tmp_path / "lib" / "libnccl.so.2"), None
    explicit = write_nccl_headers(tmp_path / "explicit", (2, 32, 3))
    home = write_nccl_headers(tmp_path / "home" / "include", (2, 32, 3)).parent
    env = {"NCCL_EP_JIT_BUILD_INCLUDE_DIR": str(explicit), "NCCL_HOME": str(tmp_path / "nowhere")}
    assert flex.nccl_jit_include_dir((2, 32, 3), env, lib, te)[0] == str(explicit)
    assert flex.nccl_jit_include_problem((2, 32, 3), env, lib, te) is None
    assert flex.nccl_jit_include_dir((2, 32, 3), {"NCCL_HOME": str(home)}, lib, te)[0] == str(home / "include")
    assert flex.nccl_jit_include_problem((2, 32, 3), {"NCCL_HOME": str(home)}, lib, te) is None
    message = flex.nccl_jit_include_problem((2, 32, 3), {"NCCL_HOME": str(tmp_path / "nowhere")}, lib, te)
    assert "nccl.h and nccl_device.h are not there" in message and "NCCL_HOME=" in message
    message = flex.nccl_jit_include_problem((2, 32, 3), {"NCCL_EP_JIT_BUILD_INCLUDE_DIR": str(tmp_path)}, lib, te)
    assert f"headers in {tmp_path} (NCCL_EP_JIT_BUILD_INCLUDE_DIR=" in message
    empty = {"NCCL_EP_JIT_BUILD_INCLUDE_DIR": "", "NCCL_HOME": ""}  # empty counts as unset, as in TE
    assert "are unset" in flex.nccl_jit_include_problem((2, 32, 3), empty, lib, te)


def test_nccl_ep_probe_reports_missing_headers_before_launch(monkeypatch, tmp_path):
    args = validated(flex_argv("ncclep", "--moe-expert-rank-capacity-factor", "2.0"), 2)  # before the fake TE
    _fake_te(monkeypatch)
    monkeypatch.setattr(flex, "nccl_runtime_version", lambda: (2, 32, 3))
    monkeypatch.delenv("NCCL_HOME", raising=False)
    monkeypatch.setenv("NCCL_EP_JIT_BUILD_INCLUDE_DIR", str(tmp_path / "missing"))
    assert "nccl.h and nccl_device.h are not there" in flex.probe_nccl_ep()
    assert flex.probe_nccl_ep(check_runtime=False) is None  # the dry run does not look at this machine
    with pytest.raises(ps_args.PatchsetArgumentError) as failed:
        ps_args.validate(args, "combination", config=None)
    failures = {rule.name: message for rule, message in failed.value.failures}
    assert "NCCL_EP_JIT_BUILD_INCLUDE_DIR" in failures["flex-backend-installed"]
    write_nccl_headers(tmp_path / "missing")
    assert flex.probe_nccl_ep() is None


def test_ncclep_bootstrap_patch_passes_num_topk(monkeypatch, nccl_jit_env):
    """megatron's _NCCLEPManager._ensure_bootstrap -> (patched) ensure_nccl_ep_bootstrapped ->
    TE's ep_bootstrap, which requires num_topk."""
    import torch
    from megatron.core.transformer.moe import token_dispatcher as upstream

    ep = _fake_te(monkeypatch)
    monkeypatch.setattr(flex, "nccl_runtime_version", lambda: flex.NCCL_EP_MIN_NCCL)
    names = ["token_dispatcher.ncclep_bootstrap_topk", "token_dispatcher.ncclep_bootstrap"]
    applied = patches.apply_patches([patches.get(n) for n in names], check=False)
    try:
        assert patches.patched_by(upstream.ensure_nccl_ep_bootstrapped) == "token_dispatcher.ncclep_bootstrap"
        manager = upstream._NCCLEPManager.__new__(upstream._NCCLEPManager)
        manager.__dict__.update(
            _bootstrapped=False, num_local_tokens=100, router_topk=4, rank_capacity_factor=2.0, alignment=0,
            group=object(), num_experts=16, hidden_dim=256, zero_copy=False,
            config=types.SimpleNamespace(moe_flex_dispatcher_num_sms=None),
        )
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False, raising=False)
        manager._ensure_bootstrap()
        assert ep.calls == [dict(num_experts=16, max_tokens_per_rank=128, hidden_dim=256, num_topk=4,
                                 recv_capacity_per_rank=128 * 4 * 2, max_num_sms=0)]
        with pytest.raises(flex.FlexBackendError, match="router top-k"):
            upstream.ensure_nccl_ep_bootstrapped(object(), 16, 128, 1024, 256)
    finally:
        patches.revert(applied)
    assert patches.patched_by(upstream.ensure_nccl_ep_bootstrapped) is None


def test_manager_construction_checks_the_backend(deep_ep_package):
    from megatron.core.transformer.moe import token_dispatcher as upstream

    deep_ep_package("broken")
    applied = patches.apply_patches([patches.get("token_dispatcher.deepep_check")], check=False)
    try:
        with pytest.raises(flex.FlexBackendError, match="libnvshmem_host.so.3"):
            upstream._DeepepManager(group=None, num_local_experts=4, router_topk=2, num_experts=8, config=None)
    finally:
        patches.revert(applied)


def test_manager_check_runs_once_per_process_until_it_passes(monkeypatch, capsys):
    """megatron builds a manager per MoE layer; the probe runs again only while it fails."""
    probes, built = [], []
    outcomes = iter([flex.FlexBackendError("not yet"), None, None])

    def check_backend(backend):
        probes.append(backend)
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(flex, "check_backend", check_backend)
    monkeypatch.setattr(flex, "backend_origin", lambda backend: "/site/deep_ep")
    monkeypatch.setattr(flex, "_CHECKED", set())
    init = flex._checked_init("deepep")(lambda self: built.append(self))
    with pytest.raises(flex.FlexBackendError, match="not yet"):
        init("layer 1")
    for layer in ("layer 1", "layer 2", "layer 3"):
        init(layer)
    assert probes == ["deepep", "deepep"]
    assert built == ["layer 1", "layer 2", "layer 3"]
    assert capsys.readouterr().out.count("flex dispatcher backend deepep from /site/deep_ep") == 1


def test_patches_are_wanted_only_for_their_backend():
    args = validated(flex_argv("ncclep", "--moe-expert-rank-capacity-factor", "2.0"), 2)
    names = {p.name for p in patches.wanted(args)}
    assert {"token_dispatcher.ncclep_check", "token_dispatcher.ncclep_bootstrap",
            "token_dispatcher.ncclep_bootstrap_topk"} <= names
    assert "token_dispatcher.deepep_check" not in names
    plain = {p.name for p in patches.wanted(validated(tiny_argv("--expert-model-parallel-size", "2"), 2))}
    assert not any(n.startswith("token_dispatcher.") for n in plain)
    assert all(patches.get(n).kind == "compat" for n in names if n.startswith("token_dispatcher."))


@pytest.mark.parametrize("backend", ["deepep", "ncclep"])
def test_example_launcher_flags_pass_the_dry_run(backend):
    from tests.unit.conftest import dry_run_example

    proc = dry_run_example("examples/pretrain_moe_deepep.sh", BACKEND=backend, NGPUS="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "expert model parallel (EP) ........ 2" in proc.stdout
    assert "fork features enabled: flex-dispatch-backend-checks" in proc.stdout
    expected = "deep_ep (DeepEP 567632d" if backend == "deepep" else "token_dispatcher.ncclep_bootstrap"
    assert expected in proc.stdout
    assert proc.stdout.rstrip().endswith("dry-run: OK")


# ---------------------------------------------------------------------------------------
# TE's NCCL EP custom ops: mutated arguments with defaults (torch 2.11)
# ---------------------------------------------------------------------------------------


def _define_ep_like_ops(namespace):
    """Ops shaped like transformer_engine_ep::prepare_and_dispatch: mutated outputs, the last
    one optional with default None; and one whose mutated arguments have no default."""
    from typing import Optional

    import torch

    @torch.library.custom_op(f"{namespace}::dispatch", mutates_args=("state", "out", "scale"), device_types="cpu")
    def dispatch(state: torch.Tensor, x: torch.Tensor, k: int, out: torch.Tensor,
                 scale: Optional[torch.Tensor] = None) -> None:
        out.copy_(x * k)
        state.add_(1)
        if scale is not None:
            scale.fill_(float(k))

    @torch.library.custom_op(f"{namespace}::plain", mutates_args=("out",), device_types="cpu")
    def plain(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    return dispatch, plain


def test_repair_of_custom_op_kernels_that_index_dropped_default_arguments():
    import torch

    ns = "ps_unit_ep"
    _define_ep_like_ops(ns)
    state, x, out = torch.zeros(2), torch.ones(3, requires_grad=True), torch.empty(3)
    # The defect on the pinned torch: the default None is dropped, the kernel indexes it.
    with pytest.raises(IndexError, match="tuple index out of range"):
        torch.ops.ps_unit_ep.dispatch(state, x, 2, out, None)

    assert flex.repair_mutable_default_kernels(ns) == [f"{ns}::dispatch"]  # plain has no defaults
    assert flex.repair_mutable_default_kernels(ns) == []  # idempotent
    before = out._version
    torch.ops.ps_unit_ep.dispatch(state, x, 2, out, None)
    assert out.tolist() == [2.0, 2.0, 2.0] and state.tolist() == [1.0, 1.0]
    assert out._version > before  # autograd still sees the mutation
    scale = torch.zeros(1)
    torch.ops.ps_unit_ep.dispatch(state, x, 3, out, scale)
    assert out.tolist() == [3.0, 3.0, 3.0] and scale.tolist() == [3.0] and state.tolist() == [2.0, 2.0]
    torch.ops.ps_unit_ep.plain(x.detach(), out)
    assert out.tolist() == [1.0, 1.0, 1.0]


def test_ncclep_bootstrap_repairs_te_ep_kernels_before_bootstrapping(monkeypatch):
    import sys
    import types

    calls = []
    te, te_pt, fake_ep = (types.ModuleType(n) for n in
                          ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ep"))
    fake_ep.is_ep_bootstrapped = lambda: False
    fake_ep.ep_bootstrap = lambda *a, **k: calls.append(("bootstrap", k["num_topk"]))
    te.pytorch, te_pt.ep = te_pt, fake_ep
    for module in (te, te_pt, fake_ep):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(flex, "check_backend", lambda backend: calls.append(("check", backend)))
    monkeypatch.setattr(flex, "repair_mutable_default_kernels", lambda ns: calls.append(("repair", ns)))
    flex._BOOTSTRAP.topk = 8
    try:
        flex.ensure_nccl_ep_bootstrapped(None, 128, 4096, 8192, 2048)
    finally:
        flex._BOOTSTRAP.topk = None
    assert calls == [("check", "ncclep"), ("repair", "transformer_engine_ep"), ("bootstrap", 8)]
