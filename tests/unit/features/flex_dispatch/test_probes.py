"""The DeepEP, HybridEP and NCCL EP probes report the real cause (the original import error, the
missing API, an old NCCL, NCCL headers the kernel JIT will not find), never "not installed"."""

import sys

import pytest

from megatron.patchset.core import rules
from megatron.patchset.features.flex_dispatch import probes
from tests.unit.conftest import validated
from tests.unit.features.flex_dispatch.conftest import _fake_te, flex_argv, write_nccl_headers


def test_probe_accepts_the_api_megatron_calls(deep_ep_package):
    deep_ep_package("v1")
    assert probes.probe_deep_ep("deepep") is None
    assert probes.deep_ep_group_size_problem(2) is None
    assert (
        "no dispatch/combine configuration for a group of 6 ranks"
        in probes.deep_ep_group_size_problem(6)
    )


def test_probe_reports_missing_package_with_the_pinned_revision(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError
    message = probes.probe_deep_ep("deepep")
    assert "import deep_ep" in message or "does not import" in message
    assert probes.DEEPEP_REVISION[:7] in message and "tools/build/build_deepep.sh" in message


def test_probe_surfaces_the_original_import_error(deep_ep_package):
    deep_ep_package("broken")
    message = probes.probe_deep_ep("deepep")
    assert message.startswith("DeepEP is installed but does not import")
    assert "libnvshmem_host.so.3: cannot open shared object file" in message


def test_probe_explains_deepep_2x(deep_ep_package):
    deep_ep_package("v2")
    message = probes.probe_deep_ep("deepep")
    assert "from deep_ep.utils import EventHandle, EventOverlap" in message
    assert "EventOverlap" in message and "2.x" in message
    # megatron-core's own import of the same package fails (and it then says "not installed"):
    with pytest.raises(ImportError):
        from deep_ep.utils import EventOverlap  # noqa: F401


def test_probe_names_missing_keywords(deep_ep_package):
    deep_ep_package("old_api")
    message = probes.probe_deep_ep("deepep")
    assert "Buffer.dispatch has no parameter(s) previous_event, async_finish" in message
    assert "Buffer.combine" not in message


def test_hybridep_needs_the_hybrid_ep_branch(deep_ep_package):
    deep_ep_package("v1")
    message = probes.probe_deep_ep("hybridep")
    assert "HybridEPBuffer is missing" in message and probes.HYBRIDEP_REVISION[:7] in message


def test_nccl_ep_probe(monkeypatch, nccl_jit_env):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    assert "does not import" in probes.probe_nccl_ep()
    _fake_te(monkeypatch, library=False)
    assert "no libnccl_ep.so" in probes.probe_nccl_ep()
    _fake_te(monkeypatch)
    monkeypatch.setattr(probes, "nccl_runtime_version", lambda: (2, 28, 9))
    message = probes.probe_nccl_ep()
    assert "NCCL 2.28.9 is loaded" in message and "2.32.3" in message and "LD_PRELOAD" in message
    monkeypatch.setattr(probes, "nccl_runtime_version", lambda: (2, 32, 3))
    assert probes.probe_nccl_ep() is None


def test_nccl_runtime_version_reads_the_loaded_library():
    import torch  # noqa: F401  (loads torch's libnccl.so.2 when it links one)

    version = probes.nccl_runtime_version()
    assert version is None or (version[0] == 2 and version >= (2, 18, 0))


def test_nccl_header_version(tmp_path):
    assert probes.nccl_header_version(str(write_nccl_headers(tmp_path / "a", (2, 32, 3)))) == 23203
    assert probes.nccl_header_version(str(write_nccl_headers(tmp_path / "b", (2, 28, 9)))) == 22809
    assert probes.nccl_header_version(str(tmp_path / "none")) is None
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "nccl.h").write_text(
        "#define NCCL_MAJOR 2\n#define NCCL_MINOR 32\n"
    )  # no patch
    assert probes.nccl_header_version(str(tmp_path / "c")) is None
    (tmp_path / "d").mkdir()  # the first definition of each field counts; indented ones do not
    (tmp_path / "d" / "nccl.h").write_text(
        "  #define NCCL_MAJOR 9\n#define NCCL_MAJOR 2\n#define NCCL_MINOR 30\n#define NCCL_PATCH "
        "4\n#define NCCL_PATCH 7\n"
    )
    assert probes.nccl_header_version(str(tmp_path / "d")) == 23004


def test_nccl_include_candidates_follow_te_order():
    got = probes.nccl_include_candidates(
        "/data/x/nvidia/nccl/lib/libnccl.so.2", "/data/x/transformer_engine/libte.so"
    )
    assert got[:6] == [
        "/data/x/nvidia/nccl/lib/include",
        "/data/x/nvidia/nccl/lib/nvidia/nccl/include",
        "/data/x/nvidia/nccl/include",
        "/data/x/nvidia/nccl/nvidia/nccl/include",
        "/data/x/nvidia/include",
        "/data/x/nvidia/nvidia/nccl/include",
    ]
    assert "/include" not in got and "/nvidia/nccl/include" not in got  # never the root folder
    assert got.count("/data/x/include") == 1  # shared ancestors once, in the first library's place
    assert got.index("/data/x/include") < got.index("/data/x/transformer_engine/include")
    assert got[-3:] == ["/opt/nvidia/nccl/include", "/usr/local/nccl/include", "/usr/include"]
    # /opt's own nvidia/nccl/include is an ancestor candidate first, and listed once
    got = probes.nccl_include_candidates("/opt/nccl/lib/libnccl.so.2", None)
    assert got.index("/opt/nvidia/nccl/include") == 5 and got.count("/opt/nvidia/nccl/include") == 1
    assert probes.nccl_include_candidates(None, None) == list(probes.NCCL_INCLUDE_FALLBACKS)


def test_nccl_headers_found_next_to_the_loaded_nccl(tmp_path):
    lib = tmp_path / "site" / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    write_nccl_headers(
        tmp_path / "site" / "nvidia" / "nccl" / "include", (2, 28, 9)
    )  # torch's, too old
    te = str(tmp_path / "site" / "transformer_engine" / "wheel_lib" / "libtransformer_engine.so")
    assert probes.nccl_jit_include_problem((2, 28, 9), {}, str(lib), te) is None
    message = probes.nccl_jit_include_problem((2, 32, 3), {}, str(lib), te)
    assert "NCCL_EP_JIT_BUILD_INCLUDE_DIR" in message and "NCCL_HOME" in message
    assert (
        "matching runtime NCCL 2.32.3" in message and "(2.28.9)" in message and str(lib) in message
    )
    good = write_nccl_headers(tmp_path / "site" / "include", (2, 32, 3))  # an ancestor's include/
    assert probes.nccl_jit_include_dir((2, 32, 3), {}, str(lib), te)[0] == str(good)
    assert probes.nccl_jit_include_problem((2, 32, 3), {}, str(lib), te) is None
    (good / "nccl_device.h").unlink()  # found by its version, but the JIT includes the device API
    assert "nccl_device.h is not there" in probes.nccl_jit_include_problem(
        (2, 32, 3), {}, str(lib), te
    )


def test_nccl_header_variables_take_precedence(tmp_path):
    lib, te = str(tmp_path / "lib" / "libnccl.so.2"), None
    explicit = write_nccl_headers(tmp_path / "explicit", (2, 32, 3))
    home = write_nccl_headers(tmp_path / "home" / "include", (2, 32, 3)).parent
    env = {"NCCL_EP_JIT_BUILD_INCLUDE_DIR": str(explicit), "NCCL_HOME": str(tmp_path / "nowhere")}
    assert probes.nccl_jit_include_dir((2, 32, 3), env, lib, te)[0] == str(explicit)
    assert probes.nccl_jit_include_problem((2, 32, 3), env, lib, te) is None
    assert probes.nccl_jit_include_dir((2, 32, 3), {"NCCL_HOME": str(home)}, lib, te)[0] == str(
        home / "include"
    )
    assert probes.nccl_jit_include_problem((2, 32, 3), {"NCCL_HOME": str(home)}, lib, te) is None
    message = probes.nccl_jit_include_problem(
        (2, 32, 3), {"NCCL_HOME": str(tmp_path / "nowhere")}, lib, te
    )
    assert "nccl.h and nccl_device.h are not there" in message and "NCCL_HOME=" in message
    message = probes.nccl_jit_include_problem(
        (2, 32, 3), {"NCCL_EP_JIT_BUILD_INCLUDE_DIR": str(tmp_path)}, lib, te
    )
    assert f"headers in {tmp_path} (NCCL_EP_JIT_BUILD_INCLUDE_DIR=" in message
    empty = {
        "NCCL_EP_JIT_BUILD_INCLUDE_DIR": "",
        "NCCL_HOME": "",
    }  # empty counts as unset, as in TE
    assert "are unset" in probes.nccl_jit_include_problem((2, 32, 3), empty, lib, te)


def test_nccl_ep_probe_reports_missing_headers_before_launch(monkeypatch, tmp_path):
    args = validated(
        flex_argv("ncclep", "--moe-expert-rank-capacity-factor", "2.0"), 2
    )  # before the fake TE
    _fake_te(monkeypatch)
    monkeypatch.setattr(probes, "nccl_runtime_version", lambda: (2, 32, 3))
    monkeypatch.delenv("NCCL_HOME", raising=False)
    monkeypatch.setenv("NCCL_EP_JIT_BUILD_INCLUDE_DIR", str(tmp_path / "missing"))
    assert "nccl.h and nccl_device.h are not there" in probes.probe_nccl_ep()
    assert (
        probes.probe_nccl_ep(check_runtime=False) is None
    )  # the dry run does not look at this machine
    with pytest.raises(rules.PatchsetArgumentError) as failed:
        rules.validate(args, "combination", config=None)
    failures = {rule.name: message for rule, message in failed.value.failures}
    assert "NCCL_EP_JIT_BUILD_INCLUDE_DIR" in failures["flex-backend-installed"]
    write_nccl_headers(tmp_path / "missing")
    assert probes.probe_nccl_ep() is None
