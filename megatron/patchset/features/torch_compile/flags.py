"""The compile flags, their defaults, and the predicates of the parsed arguments that switch the
feature's patches on."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

FLAG = "--compile-transformer-layers"
MODE_FLAG = FLAG + "-mode"
BACKEND_FLAG = FLAG + "-backend"
WARMUP_FLAG = FLAG + "-warmup-iters"
TE_KERNELS_FLAG = FLAG + "-te-kernels"
FLAGS = (FLAG, MODE_FLAG, BACKEND_FLAG, WARMUP_FLAG, TE_KERNELS_FLAG)

MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
# Modes whose inductor CUDA graph trees this version refuses (see the validation rule).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
BACKENDS = ("inductor", "aot_eager", "eager")
DEFAULTS = {
    "compile_transformer_layers": False,
    "compile_transformer_layers_mode": "default",
    "compile_transformer_layers_backend": "inductor",
    "compile_transformer_layers_warmup_iters": 2,
    "compile_transformer_layers_te_kernels": False,
}


def requested(args: Any) -> bool:
    return bool(getattr(args, "compile_transformer_layers", False)) if args is not None else False


def traceable_substitutes(args: Any) -> bool:
    """TE's kernels run as torch code while tracing (not with
    --compile-transformer-layers-te-kernels)."""
    return requested(args) and not bool(
        getattr(args, "compile_transformer_layers_te_kernels", False)
    )


def traceable_router(args: Any) -> bool:
    return traceable_substitutes(args) and bool(getattr(args, "moe_router_fusion", False))


def te_attention_block_substitutes(args: Any) -> bool:
    return (
        traceable_substitutes(args)
        and getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"
    )


def traceable_permutation(args: Any) -> bool:
    return traceable_substitutes(args) and bool(getattr(args, "moe_permute_fusion", False))


def force_load_balancing(args: Any) -> bool:
    return requested(args) and bool(getattr(args, "moe_router_force_load_balancing", False))


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    mode: str = DEFAULTS["compile_transformer_layers_mode"]
    backend: str = DEFAULTS["compile_transformer_layers_backend"]
    warmup_iters: int = DEFAULTS["compile_transformer_layers_warmup_iters"]
    te_kernels: bool = DEFAULTS["compile_transformer_layers_te_kernels"]

    def compile_kwargs(self) -> dict:
        """``torch.compile`` keyword arguments (a mode only means something to inductor)."""
        kwargs: dict = {"backend": self.backend}
        if self.backend == "inductor" and self.mode != "default":
            kwargs["mode"] = self.mode
        return kwargs


def options_from_args(args: Any) -> CompileOptions:
    return CompileOptions(
        **{
            name[len("compile_transformer_layers_") :]: getattr(args, name, default)
            for name, default in DEFAULTS.items()
            if name != "compile_transformer_layers"
        }
    )


def flags_given(args: argparse.Namespace) -> list[str]:
    """The compile sub-flags set away from their defaults, as they were typed."""
    given = []
    for name, default in DEFAULTS.items():
        value = getattr(args, name, default)
        if name != "compile_transformer_layers" and value != default:
            given.append(f"--{name.replace('_', '-')} {value}")
    return given


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--compile-transformer-layers",
        action="store_true",
        default=False,
        help="torch.compile each TransformerLayer's forward (per layer, in place, before "
        "DDP/Megatron-FSDP wrapping, so their hooks stay outside the compiled code). The MoE "
        "token dispatch, expert computation and combine run eagerly (compile-disabled patches). "
        "After the warm-up iterations a recompile of a compiled layer is an error; dynamo's graph "
        "and graph-break counts are logged.",
    )
    group.add_argument(
        "--compile-transformer-layers-mode",
        choices=MODES,
        default=DEFAULTS["compile_transformer_layers_mode"],
        help="torch.compile mode for the layers (inductor backend). The CUDA-graph modes "
        "(reduce-overhead, max-autotune) are refused in this version; use --cuda-graph-impl "
        "without compilation for CUDA graphs.",
    )
    group.add_argument(
        "--compile-transformer-layers-backend",
        choices=BACKENDS,
        default=DEFAULTS["compile_transformer_layers_backend"],
        help="torch.compile backend: inductor (generated kernels), or aot_eager / eager to "
        "debug graph capture without code generation.",
    )
    group.add_argument(
        "--compile-transformer-layers-warmup-iters",
        type=int,
        default=DEFAULTS["compile_transformer_layers_warmup_iters"],
        help="Training iterations in which the compiled layers may compile and recompile "
        "(first-call and one-time guards); from the next one on a recompile of a compiled layer "
        "raises an error naming the failed guard.",
    )
    group.add_argument(
        "--compile-transformer-layers-te-kernels",
        action="store_true",
        default=False,
        help="Keep TransformerEngine's norm, RoPE, router-gating GEMM and fused-router kernels "
        "inside the compiled layers (each is a graph break). By default, while dynamo traces a "
        "layer, these run as torch code (megatron's unfused paths), which inductor fuses; eager "
        "code keeps TE's kernels.",
    )
