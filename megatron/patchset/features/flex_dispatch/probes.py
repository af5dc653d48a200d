"""Probes of the flex token dispatcher's backends on megatron-core 0.19.2: DeepEP, HybridEP, NCCL
EP.

``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend {deepep,hybridep,ncclep}``
hands the MoE all-to-all to an external library. megatron-core probes those libraries once, when
``megatron.core.transformer.moe.fused_a2a`` is imported, with ``except ImportError``: a library
that is installed but broken (missing ``libnvshmem_host.so.3``, an undefined symbol, DeepEP 2.x
whose ``deep_ep.utils`` no longer exports ``EventOverlap``) is then reported as "not installed"
when the first MoE layer is built, and the reason is lost. This module probes each backend itself
(:func:`probe_deep_ep`, :func:`probe_nccl_ep`) and reports the original exception, the API
megatron calls that is missing, the runtime that is too old, or (NCCL EP) NCCL headers that its
kernel JIT will not find. The feature's rules run the probes before any GPU work, and its patches
(:mod:`.manager_checks`) run them again where megatron builds the backend's manager, so that a
model built outside ``pretrain_gpt.py`` fails with the same message. A requested backend is
never replaced by the all-to-all dispatcher.

Pinned DeepEP revisions (docs/deepep.md): :data:`DEEPEP_REVISION` for ``deepep`` and
:data:`HYBRIDEP_REVISION` (branch ``hybrid-ep``, provides both) for ``hybridep``.
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
import os
import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

BACKENDS = ("deepep", "hybridep", "ncclep")
DEEPEP_REPOSITORY = "https://github.com/deepseek-ai/DeepEP"
# The last commit of DeepEP 1.x on main: its Buffer API is the one megatron-core 0.19.2's
# fused_a2a.py calls, and it builds against NVSHMEM 3.4 from pip with CUDA 13 (docs/deepep.md).
DEEPEP_REVISION = "567632dd59810d77b3cc05553df953cc0f779799"
# Branch hybrid-ep: the same Buffer plus HybridEPBuffer (with fused permute-dispatch).
HYBRIDEP_REVISION = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"
# Group sizes (TP x EP) DeepEP's normal kernels have a tuned config for
# (Buffer.get_dispatch_config).
DEEPEP_GROUP_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)

# TransformerEngine 2.20's NCCL EP. TE's Python side asks for NCCL >= 2.30.4, but the
# libnccl_ep.so in the transformer-engine-cu13 2.20.2 wheel was built against NCCL 2.32.3 and its
# ncclEpCreateGroup refuses any older runtime ("build NCCL 2.32.3 and runtime NCCL ... are
# incompatible"), so 2.32.3 is the real floor for the pinned stack.
NCCL_EP_MIN_NCCL = (2, 32, 3)
NCCL_EP_NCCL_WHEEL = "nvidia-nccl-cu13==2.32.3"
# NCCL EP JIT-compiles its kernels with nvcc at the first dispatch, against the headers of NCCL
# (nccl.h and the device API nccl_device.h + nccl_device/). Where they come from:
# NCCL_EP_JIT_BUILD_INCLUDE_DIR, else $NCCL_HOME/include, else TE 2.20.2 looks for an nccl.h
# whose version equals the loaded NCCL's (see nccl_jit_include_dir; docs/deepep.md).
NCCL_INCLUDE_ENV = "NCCL_EP_JIT_BUILD_INCLUDE_DIR"
NCCL_HOME_ENV = "NCCL_HOME"
NCCL_JIT_HEADERS = ("nccl.h", "nccl_device.h")
# Searched by TE after the folders around libnccl.so.2 and libtransformer_engine.so.
NCCL_INCLUDE_FALLBACKS = ("/opt/nvidia/nccl/include", "/usr/local/nccl/include", "/usr/include")

# What megatron-core 0.19.2 calls (fused_a2a.py): callable -> keyword parameters it passes.
_DEEPEP_BUFFER_API = {
    "__init__": ("group", "num_nvl_bytes", "num_rdma_bytes"),
    "get_dispatch_config": (),
    "get_combine_config": (),
    "set_num_sms": (),
    "get_dispatch_layout": (
        "topk_idx",
        "num_experts",
        "previous_event",
        "async_finish",
        "allocate_on_comm_stream",
    ),
    "dispatch": (
        "x",
        "handle",
        "num_tokens_per_rank",
        "num_tokens_per_rdma_rank",
        "is_token_in_rank",
        "num_tokens_per_expert",
        "topk_idx",
        "topk_weights",
        "previous_event",
        "async_finish",
        "allocate_on_comm_stream",
    ),
    "combine": (
        "x",
        "handle",
        "topk_weights",
        "previous_event",
        "async_finish",
        "allocate_on_comm_stream",
    ),
}
_HYBRIDEP_API = {
    "__init__": (
        "group",
        "hidden_dim",
        "max_num_of_tokens_per_rank",
        "num_local_experts",
        "use_fp8",
    ),
    "dispatch_with_permute": (
        "hidden",
        "routing_map",
        "probs",
        "scaling_factor",
        "num_of_experts_per_rank",
        "pad_multiple",
        "num_permuted_tokens",
        "non_blocking",
    ),
    "combine_with_unpermute": ("hidden", "handle", "pad_multiple"),
}
_TE_EP_API = ("ep_bootstrap", "EpBuffer", "ep_dispatch", "ep_combine", "ep_finalize")


class FlexBackendError(RuntimeError):
    """A requested flex dispatcher backend cannot run here; the message says why and how to fix
    it."""


def requested_backend(args: Any) -> str | None:
    """The flex backend the arguments ask for, or None (another dispatcher, or no arguments)."""
    if args is None or getattr(args, "moe_token_dispatcher_type", None) != "flex":
        return None
    if not getattr(args, "num_experts", None):
        return None
    return getattr(args, "moe_flex_dispatcher_backend", None) or "deepep"


def _missing_parameters(func: Any, names: tuple[str, ...]) -> list[str]:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # a C++ callable without a signature: cannot tell
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [name for name in names if name not in params]


def _api_gaps(cls: Any, api: dict[str, tuple[str, ...]]) -> list[str]:
    gaps = []
    for method, keywords in api.items():
        func = getattr(cls, method, None)
        if func is None:
            gaps.append(f"{cls.__name__}.{method} is missing")
            continue
        missing = _missing_parameters(func, keywords)
        if missing:
            gaps.append(f"{cls.__name__}.{method} has no parameter(s) {', '.join(missing)}")
    return gaps


def _exception_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) not in text:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


def _build_hint(backend: str) -> str:
    revision = HYBRIDEP_REVISION if backend == "hybridep" else DEEPEP_REVISION
    branch = " (branch hybrid-ep)" if backend == "hybridep" else ""
    return (
        f"Build DeepEP {revision[:7]}{branch} from {DEEPEP_REPOSITORY} with `bash "
        "tools/build/build_deepep.sh <source> <dest>` and put <dest> on PYTHONPATH (docs/deepep.md)"
    )


def probe_deep_ep(backend: str = "deepep") -> str | None:
    """None when DeepEP offers what megatron-core 0.19.2 calls for ``backend`` (deepep or
    hybridep), else why not, with the original exception text."""
    hint = _build_hint(backend)
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as exc:  # noqa: BLE001 - any import failure, reported verbatim
        if isinstance(exc, ModuleNotFoundError) and exc.name in ("deep_ep",):
            return f"DeepEP is not installed (`import deep_ep`: {_exception_text(exc)}). {hint}."
        return f"DeepEP is installed but does not import: {_exception_text(exc)}. {hint}."
    version = str(getattr(deep_ep, "__version__", "") or "")
    where = getattr(deep_ep, "__file__", None) or "?"
    try:
        from deep_ep.utils import EventHandle, EventOverlap  # noqa: F401  (megatron's import)
    except Exception as exc:  # noqa: BLE001
        v2 = (
            " DeepEP 2.x (EPv2) moved them;"
            if version.startswith("2") or "EventHandle" in str(exc)
            else ""
        )
        return (
            f"DeepEP at {where} lacks `from deep_ep.utils import EventHandle, EventOverlap`, which "
            f"megatron-core 0.19.2 imports ({_exception_text(exc)}).{v2} megatron would report it "
            f"as not installed. {hint}."
        )
    gaps = []
    buffer = getattr(deep_ep, "Buffer", None)
    if buffer is None:
        gaps.append("deep_ep.Buffer is missing")
    else:
        gaps += _api_gaps(buffer, _DEEPEP_BUFFER_API)
    if backend == "hybridep":
        hybrid = getattr(deep_ep, "HybridEPBuffer", None)
        if hybrid is None:
            gaps.append(
                "deep_ep.HybridEPBuffer is missing (it exists only on DeepEP's hybrid-ep branch)"
            )
        else:
            gaps += _api_gaps(hybrid, _HYBRIDEP_API)
    if gaps:
        return (
            f"DeepEP at {where} does not have the API megatron-core 0.19.2 calls: "
            f"{'; '.join(gaps)}. {hint}."
        )
    return None


def deep_ep_group_size_problem(group_size: int) -> str | None:
    """None when DeepEP's normal kernels support a TP x EP group of ``group_size`` ranks."""
    try:
        from deep_ep import Buffer

        Buffer.get_dispatch_config(group_size)
        Buffer.get_combine_config(group_size)
        return None
    except AssertionError:
        pass
    except Exception:  # noqa: BLE001 - fall back to the table of 567632d
        if group_size in DEEPEP_GROUP_SIZES:
            return None
    return (
        f"DeepEP has no dispatch/combine configuration for a group of {group_size} ranks (tensor x "
        f"expert parallel); supported: {', '.join(map(str, DEEPEP_GROUP_SIZES))}"
    )


def nccl_runtime_version() -> tuple[int, int, int] | None:
    """Version of the libnccl.so.2 this process loads (the one torch loaded, or LD_PRELOAD's)."""
    try:
        lib = ctypes.CDLL("libnccl.so.2", mode=getattr(ctypes, "RTLD_GLOBAL", 0))
        code = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    value = code.value
    return value // 10000, (value // 100) % 100, value % 100


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def nccl_upgrade_hint() -> str:
    return (
        f"install {NCCL_EP_NCCL_WHEEL} (or any NCCL >= {_fmt(NCCL_EP_MIN_NCCL)}) and load it in "
        "place of torch's: LD_PRELOAD=<site-packages>/nvidia/nccl/lib/libnccl.so.2 (docs/deepep.md)"
    )


def _env_value(environ: Mapping[str, str], name: str) -> str | None:
    """The variable's value; TE treats an empty value like an unset one."""
    value = environ.get(name)
    return value if value else None


_DEFINE = {
    field: re.compile(r"#define\s*NCCL_" + field + r"\s*([+-]?\d+)")
    for field in ("MAJOR", "MINOR", "PATCH")
}


def nccl_header_version(include_dir: str) -> int | None:
    """The version code (major * 10000 + minor * 100 + patch, as ``ncclGetVersion`` reports it)
    that ``include_dir/nccl.h`` defines, or None when there is no such file or a field is missing.
    The first ``#define NCCL_MAJOR/MINOR/PATCH <n>`` at the start of a line counts."""
    found: dict = {}
    try:
        with open(os.path.join(include_dir, "nccl.h"), errors="replace") as header:
            for line in header:
                for field, pattern in _DEFINE.items():
                    if field not in found:
                        match = pattern.match(line)
                        if match:
                            found[field] = int(match.group(1))
    except OSError:
        return None
    if len(found) < 3 or min(found.values()) < 0:
        return None
    return found["MAJOR"] * 10000 + found["MINOR"] * 100 + found["PATCH"]


def _library_of_symbol(library: str, symbol: str) -> str | None:
    """The file (as the loader names it) that provides ``symbol`` of ``library`` in this process."""

    class _DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        address = ctypes.cast(getattr(ctypes.CDLL(library), symbol), ctypes.c_void_p).value
        try:
            dladdr = ctypes.CDLL(None).dladdr
        except AttributeError:  # glibc < 2.34 keeps it in libdl
            dladdr = ctypes.CDLL("libdl.so.2").dladdr
        info = _DlInfo()
        if (
            not address
            or not dladdr(ctypes.c_void_p(address), ctypes.byref(info))
            or not info.dli_fname
        ):
            return None
    except (OSError, AttributeError):
        return None
    return os.path.join(os.getcwd(), os.fsdecode(info.dli_fname))


def _mapped_library(prefix: str) -> str | None:
    """Path of the first shared object mapped into this process whose file name starts with
    prefix."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[5:]
                if path and os.path.basename(path[0]).startswith(prefix):
                    return path[0]
    except OSError:
        pass
    return None


def _ancestor_include_dirs(library: str | None) -> list[str]:
    """For the folder of ``library`` and each folder above it (not ``/``): ``<dir>/include`` and
    ``<dir>/nvidia/nccl/include`` (a pip ``nvidia-nccl-*`` wheel's layout)."""
    if not library:
        return []
    out = []
    directory = PurePosixPath(library).parent
    while str(directory) not in ("", "."):
        parent = directory.parent
        if parent == directory:
            break
        out += [str(directory / "include"), str(directory / "nvidia" / "nccl" / "include")]
        directory = parent
    return out


_DISCOVER = object()


def nccl_include_candidates(
    nccl_library: Any = _DISCOVER, te_library: Any = _DISCOVER
) -> list[str]:
    """Where TE 2.20.2 looks for nccl.h when neither NCCL_EP_JIT_BUILD_INCLUDE_DIR nor NCCL_HOME
    is set, in its order: around the libnccl.so.2 that provides ``ncclGetVersion`` (with
    LD_PRELOAD, the preloaded one), around libtransformer_engine.so, then the fixed folders."""
    if nccl_library is _DISCOVER:
        nccl_library = _library_of_symbol("libnccl.so.2", "ncclGetVersion")
    if te_library is _DISCOVER:
        te_library = _mapped_library("libtransformer_engine.so")
    out: list[str] = []
    for path in (
        _ancestor_include_dirs(nccl_library)
        + _ancestor_include_dirs(te_library)
        + list(NCCL_INCLUDE_FALLBACKS)
    ):
        if path not in out:
            out.append(path)
    return out


def _missing_headers(include_dir: str) -> list[str]:
    return [
        name for name in NCCL_JIT_HEADERS if not os.path.isfile(os.path.join(include_dir, name))
    ]


def _code(version: tuple[int, int, int]) -> int:
    return version[0] * 10000 + version[1] * 100 + version[2]


def nccl_jit_include_dir(
    version: tuple[int, int, int],
    environ: Mapping[str, str] | None = None,
    nccl_library: Any = _DISCOVER,
    te_library: Any = _DISCOVER,
) -> tuple[str | None, str]:
    """The NCCL include folder NCCL EP's JIT will compile against, and how it was chosen, or
    (None, why not). ``version`` is the loaded NCCL's.

    NCCL_EP_JIT_BUILD_INCLUDE_DIR wins, then ``$NCCL_HOME/include`` (TE checks neither's version);
    otherwise TE 2.20.2 (nccl_ep_provider.cpp, configure_nccl_include_dir) takes the first of
    :func:`nccl_include_candidates` whose nccl.h has exactly the loaded version, and fails at
    ``ep_initialize`` when there is none."""
    environ = os.environ if environ is None else environ
    explicit = _env_value(environ, NCCL_INCLUDE_ENV)
    if explicit:
        return explicit, f"{NCCL_INCLUDE_ENV}={explicit}"
    home = _env_value(environ, NCCL_HOME_ENV)
    if home:
        return os.path.join(home, "include"), f"{NCCL_HOME_ENV}={home}"
    candidates = nccl_include_candidates(nccl_library, te_library)
    wanted = _code(version)
    others = []
    for candidate in candidates:
        found = nccl_header_version(candidate)
        if found == wanted:
            return candidate, f"TE's search found nccl.h {_fmt(version)} there"
        if found is not None:
            others.append(f"{candidate} ({found // 10000}.{found // 100 % 100}.{found % 100})")
    where = (
        f"the folders (and their parents) of {nccl_library or 'libnccl.so.2 (not located)'} and "
        f"{te_library or 'libtransformer_engine.so (not loaded)'}, each with include/ and "
        f"nvidia/nccl/include/, then {', '.join(NCCL_INCLUDE_FALLBACKS)}"
    )
    other = f"; nccl.h of other versions: {', '.join(others)}" if others else ""
    return None, f"no nccl.h of NCCL {_fmt(version)} in {where}{other}"


def nccl_jit_include_problem(
    version: tuple[int, int, int],
    environ: Mapping[str, str] | None = None,
    nccl_library: Any = _DISCOVER,
    te_library: Any = _DISCOVER,
) -> str | None:
    """None when NCCL EP's JIT will find NCCL headers (nccl.h and nccl_device.h), else why not and
    what to set. Checked before launch: TE only fails at the first dispatch (ep_initialize)."""
    include_dir, how = nccl_jit_include_dir(version, environ, nccl_library, te_library)
    fix = (
        f"set {NCCL_INCLUDE_ENV} to the folder holding nccl.h and nccl_device.h of NCCL "
        f"{_fmt(version)} (the nvidia/nccl/include folder of the {NCCL_EP_NCCL_WHEEL} wheel), or "
        f"{NCCL_HOME_ENV} to the folder above that include/ (docs/deepep.md)"
    )
    if include_dir is None:
        return (
            "TransformerEngine's NCCL EP compiles its kernels with nvcc at the first dispatch and "
            f"needs the NCCL headers matching the loaded NCCL {_fmt(version)}, but "
            f"{NCCL_INCLUDE_ENV} and {NCCL_HOME_ENV} are unset and there is {how}; TE would stop "
            "in ep_initialize with 'Could not find NCCL headers matching runtime NCCL "
            f"{_fmt(version)}'. {fix[0].upper()}{fix[1:]}."
        )
    missing = _missing_headers(include_dir)
    if missing:
        return (
            f"TransformerEngine's NCCL EP JIT-compiles against the NCCL headers in {include_dir} "
            f"({how}), but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            f"there; {fix}."
        )
    return None


def probe_nccl_ep(check_runtime: bool = True) -> str | None:
    """None when TransformerEngine's NCCL EP can run here, else why not.

    Checks that ``transformer_engine.pytorch.ep`` imports (original exception otherwise), that TE
    found its ``libnccl_ep.so``, and (``check_runtime``) that the loaded NCCL is new enough and
    that NCCL EP's JIT will find that NCCL's headers (:func:`nccl_jit_include_problem`).
    """
    try:
        te_ep = importlib.import_module("transformer_engine.pytorch.ep")
    except Exception as exc:  # noqa: BLE001
        return (
            "TransformerEngine's NCCL EP (transformer_engine.pytorch.ep) does not import: "
            f"{_exception_text(exc)}. It needs transformer-engine 2.20 with its torch extension."
        )
    missing = [name for name in _TE_EP_API if not hasattr(te_ep, name)]
    if missing:
        return (
            f"transformer_engine.pytorch.ep lacks {', '.join(missing)}, which megatron-core 0.19.2 "
            "calls."
        )
    try:
        import transformer_engine

        library = transformer_engine._nccl_ep_library_installed()
    except Exception:  # noqa: BLE001 - older TE without the helper: let the bootstrap decide
        library = True
    if not library:
        return (
            "TransformerEngine has no libnccl_ep.so (the transformer-engine-cu13 wheel ships it "
            "in transformer_engine/wheel_lib; a source build needs NVTE_WITH_NCCL_EP=1)."
        )
    if check_runtime:
        found = nccl_runtime_version()
        if found is None:
            return f"libnccl.so.2 cannot be loaded to check its version; {nccl_upgrade_hint()}."
        if found < NCCL_EP_MIN_NCCL:
            return (
                f"NCCL {_fmt(found)} is loaded, but TransformerEngine 2.20.2's libnccl_ep.so was "
                f"built against NCCL {_fmt(NCCL_EP_MIN_NCCL)} and refuses an older runtime; "
                f"{nccl_upgrade_hint()}."
            )
        problem = nccl_jit_include_problem(found)
        if problem:
            return problem
    return None


def check_backend(backend: str, *, check_runtime: bool = True) -> None:
    """Raise :class:`FlexBackendError` when ``backend`` cannot run here."""
    if backend not in BACKENDS:
        raise FlexBackendError(
            f"unknown flex dispatcher backend {backend!r}; one of {', '.join(BACKENDS)}"
        )
    problem = probe_nccl_ep(check_runtime) if backend == "ncclep" else probe_deep_ep(backend)
    if problem:
        raise FlexBackendError(f"--moe-flex-dispatcher-backend {backend}: {problem}")
