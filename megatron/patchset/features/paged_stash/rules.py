"""Rules for MoE paged stashing and the static receive budget on Hopper.

Rules for --moe-paged-stash and the static HybridEP / NCCL EP receive budget
(--moe-expert-rank-capacity-factor, --moe-ncclep-static-shape). They run before megatron's own
checks so that every
problem is reported at once and names its flags. Rules marked "mirrors megatron" restate
megatron-core 0.19.2's requirements (TransformerConfig.__post_init__, and the assertion in
TEGroupedMLP.__init__ that TE's op fuser supports the expert MLP) with the fix spelled out;
the others are the fork's own, for what fails later or silently on Hopper in bf16.
"""

from __future__ import annotations

import os

from megatron.patchset.core.predicates import graph_scope_names, stash_or_budget
from megatron.patchset.core.rules import listed, rule
from megatron.patchset.features.paged_stash.flags import CUTEDSL_ENV, ncclep, requested

_STASH_OFFLOAD_CONFLICTS = ("expert_fc1", "moe_act", "fused_group_mlp")


@rule(
    "paged-stash-requirements",
    phase="layout",
    flags=(
        "--moe-paged-stash",
        "--moe-expert-rank-capacity-factor",
        "--use-transformer-engine-op-fuser",
        "--cpu-offloading-num-layers",
        "--offload-modules",
        "--num-experts",
    ),
)
def _paged_stash_requirements(args):
    """Mirrors megatron: paged stashing needs a receive budget and no CPU/expert offloading.
    Fork: it needs MoE layers and the TE op-fuser expert MLP (the only place megatron stashes)."""
    if not requested(args):
        return None
    problems = []
    if getattr(args, "num_experts", None) is None:
        problems.append("a MoE model (--num-experts): only expert activations are paged")
    if getattr(args, "moe_expert_rank_capacity_factor", None) is None:
        problems.append(
            "--moe-expert-rank-capacity-factor (e.g. 1.5): the static per-rank receive budget "
            "whose slack paged stashing avoids storing; megatron refuses --moe-paged-stash "
            "without it"
        )
    if not getattr(args, "use_transformer_engine_op_fuser", False):
        problems.append(
            "--use-transformer-engine-op-fuser: megatron pages activations only in the TE "
            "op-fuser expert MLP; without it nothing would be paged"
        )
    if (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0:
        problems.append(
            f"no --cpu-offloading-num-layers (got {args.cpu_offloading_num_layers}; megatron "
            "refuses both)"
        )
    conflict = sorted(
        set(getattr(args, "offload_modules", None) or []) & set(_STASH_OFFLOAD_CONFLICTS)
    )
    if conflict:
        problems.append(
            f"--offload-modules without {', '.join(conflict)} (paged stashing already covers the "
            "expert activations; megatron refuses both)"
        )
    return listed("--moe-paged-stash needs ", problems)


@rule(
    "rank-capacity-factor-backend",
    phase="layout",
    flags=(
        "--moe-expert-rank-capacity-factor",
        "--moe-token-dispatcher-type",
        "--moe-flex-dispatcher-backend",
        "--use-transformer-engine-op-fuser",
    ),
)
def _rank_capacity_factor_backend(args):
    """Mirrors megatron: a receive budget needs the hybridep or ncclep flex backend, and hybridep
    needs the TE op fuser. Fork: the flex dispatcher must be selected for the backend to act."""
    factor = getattr(args, "moe_expert_rank_capacity_factor", None)
    if factor is None:
        return None
    problems = []
    if factor <= 0:
        problems.append(
            f"a positive factor (got {factor}; 1.0 is the perfectly balanced receive count)"
        )
    if args.moe_token_dispatcher_type != "flex":
        problems.append(f"--moe-token-dispatcher-type flex (got {args.moe_token_dispatcher_type})")
    backend = getattr(args, "moe_flex_dispatcher_backend", None)
    if backend not in ("hybridep", "ncclep"):
        problems.append(f"--moe-flex-dispatcher-backend hybridep or ncclep (got {backend})")
    if backend == "hybridep" and not getattr(args, "use_transformer_engine_op_fuser", False):
        problems.append(
            "--use-transformer-engine-op-fuser with hybridep (megatron refuses the budget without "
            "it)"
        )
    return listed(f"--moe-expert-rank-capacity-factor {factor} needs ", problems)


@rule(
    "ncclep-static-shape",
    phase="layout",
    flags=(
        "--moe-ncclep-static-shape",
        "--moe-ncclep-zero-copy",
        "--moe-flex-dispatcher-backend",
        "--use-transformer-engine-op-fuser",
        "--moe-grouped-gemm",
    ),
)
def _ncclep_static_shape(args):
    """Mirrors megatron: _NCCLEPManager refuses the static receive shape without the op fuser and
    grouped GEMM, and zero-copy without the static shape. Fork: the flags act only with ncclep."""
    static = bool(getattr(args, "moe_ncclep_static_shape", False))
    zero_copy = bool(getattr(args, "moe_ncclep_zero_copy", False))
    if not (static or zero_copy):
        return None
    flag = "--moe-ncclep-static-shape" if static else "--moe-ncclep-zero-copy"
    problems = []
    if not ncclep(args):
        problems.append(
            "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ncclep (the flag acts "
            "on the NCCL EP dispatcher only)"
        )
    if zero_copy and not static:
        problems.append(
            "--moe-ncclep-static-shape (zero-copy uses fixed [budget, hidden] buffers; megatron "
            "refuses it without)"
        )
    if static and not (
        getattr(args, "use_transformer_engine_op_fuser", False) and args.moe_grouped_gemm
    ):
        problems.append(
            "--use-transformer-engine-op-fuser and --moe-grouped-gemm (the experts must take "
            "device-side per-expert counts over a static buffer; megatron refuses it otherwise)"
        )
    return listed(f"{flag} needs ", problems)


@rule(
    "paged-stash-ncclep-static-shape",
    phase="layout",
    flags=("--moe-paged-stash", "--moe-flex-dispatcher-backend", "--moe-ncclep-static-shape"),
)
def _paged_stash_ncclep_static_shape(args):
    """Fork: with ncclep and no static shape the experts get the receive buffer narrowed to the
    received rows (host sync), and megatron sizes the stash from that count divided by the rank
    capacity factor, so the stash is too small and (almost) every step overflows and re-runs."""
    if not (requested(args) and ncclep(args)) or getattr(args, "moe_ncclep_static_shape", False):
        return None
    return (
        "--moe-paged-stash with --moe-flex-dispatcher-backend ncclep needs "
        "--moe-ncclep-static-shape: without it NCCL EP hands the experts only the received rows "
        "(after a host sync), and megatron sizes the paged stash from that count divided by "
        "--moe-expert-rank-capacity-factor, so the stash would overflow and every step would be "
        "re-run without paging. With it the experts take the static [budget, hidden] receive "
        "buffer (bf16 on Hopper: TE's op fuser, the fork's slack-row patch)."
    )


@rule(
    "paged-stash-op-fuser-expert-mlp",
    phase="layout",
    flags=(
        "--use-transformer-engine-op-fuser",
        "--transformer-impl",
        "--moe-grouped-gemm",
        "--expert-tensor-parallel-size",
        "--moe-apply-probs-on-input",
        "--swiglu",
        "--squared-relu",
        "--use-fused-weighted-squared-relu",
        "--moe-single-grouped-weight",
        "--moe-single-grouped-bias",
        "--recompute-modules",
        f"env {CUTEDSL_ENV}",
    ),
)
def _paged_stash_op_fuser(args):
    """Mirrors megatron: TEGroupedMLP asserts, with no reason given, that TE's op fuser can build
    the expert MLP (TE layers, grouped GEMM, expert TP 1, probabilities applied after the
    activation, SwiGLU/quick-GEGLU only with NVTE_CUTEDSL_FUSED_GROUPED_MLP set, or weighted
    squared ReLU). Fork: what TE's basic ops refuse on Hopper (single grouped parameters with
    cuBLASLt < 13.4, moe_act recomputation outside the Blackwell fused kernel)."""
    if not (stash_or_budget(args) and getattr(args, "use_transformer_engine_op_fuser", False)):
        return None
    problems = []
    if args.transformer_impl != "transformer_engine":
        problems.append(f"--transformer-impl transformer_engine (got {args.transformer_impl})")
    if not args.moe_grouped_gemm:
        problems.append("--moe-grouped-gemm (the op fuser runs TE's GroupedLinear experts)")
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if etp != 1:
        problems.append(
            f"expert tensor parallel size 1 (--expert-tensor-parallel-size 1; got {etp})"
        )
    if getattr(args, "moe_apply_probs_on_input", False):
        problems.append(
            "no --moe-apply-probs-on-input (the op fuser scales by the router probabilities after "
            "the activation)"
        )
    glu = bool(args.swiglu or getattr(args, "quick_geglu", False))
    if glu:
        try:
            cutedsl = int(os.environ.get(CUTEDSL_ENV, "0"))
        except ValueError:
            cutedsl = 0
        if cutedsl <= 0:
            problems.append(
                f"the environment variable {CUTEDSL_ENV}=1 with "
                f"{'--swiglu' if args.swiglu else '--quick-geglu'} (megatron admits a gated "
                "activation to the op fuser only with it; on Hopper TE still runs its basic ops, "
                "the Blackwell kernel it names is not used)"
            )
    elif not (
        getattr(args, "squared_relu", False)
        and getattr(args, "use_fused_weighted_squared_relu", False)
    ):
        problems.append(
            "an activation the op fuser implements: --swiglu, --quick-geglu, or --squared-relu "
            "with --use-fused-weighted-squared-relu"
        )
    single = [
        f
        for f, on in (
            ("--moe-single-grouped-weight", getattr(args, "moe_single_grouped_weight", False)),
            ("--moe-single-grouped-bias", getattr(args, "moe_single_grouped_bias", False)),
        )
        if on
    ]
    if single:
        problems.append(
            f"no {' / '.join(single)} (on Hopper TE's bf16 grouped GEMM takes the split path, "
            "which has no single grouped parameters, unless cuBLASLt >= 13.4; torch 2.11's cu130 "
            "wheels ship 13.1)"
        )
    if "moe_act" in (getattr(args, "recompute_modules", None) or []):
        problems.append(
            "no moe_act in --recompute-modules (TE's op-fuser activation recomputes only in its "
            "Blackwell fused kernel)"
        )
    return listed(
        "--moe-paged-stash / --moe-expert-rank-capacity-factor run the experts through TE's op "
        "fuser (--use-transformer-engine-op-fuser), which needs: ",
        problems,
    )


@rule(
    "paged-stash-precision",
    phase="layout",
    flags=("--moe-paged-stash", "--fp8-format", "--fp4-format"),
)
def _paged_stash_precision(args):
    """Fork: pages bf16/fp16 activations; FP8/FP4 on Hopper quantize per expert on the split path
    (nothing pageable), and upstream's MXFP8/NVFP4 paging is Blackwell-only."""
    if not requested(args):
        return None
    low = [
        f
        for f, on in (
            ("--fp8-format", getattr(args, "fp8", None)),
            ("--fp4-format", getattr(args, "fp4", None)),
        )
        if on
    ]
    if low:
        return (
            f"--moe-paged-stash with {' and '.join(low)}: on Hopper TE quantizes the expert inputs "
            "per expert, which megatron's paged stash cannot page (its MXFP8/NVFP4 paging needs "
            "Blackwell's fused grouped MLP). Train in bf16 (--bf16) with paged stashing, or drop "
            "--moe-paged-stash."
        )
    return None


@rule(
    "paged-stash-recompute",
    phase="layout",
    flags=("--moe-paged-stash", "--recompute-granularity", "--recompute-modules"),
)
def _paged_stash_recompute(args):
    """Fork: recomputing the experts re-enters the stash schedule inside backward, which
    megatron's paged stash asserts against (schedule mismatch); upstream never tested it."""
    if not requested(args):
        return None
    problems = []
    if args.recompute_granularity == "full":
        problems.append("--recompute-granularity full")
    if "moe" in (getattr(args, "recompute_modules", None) or []):
        problems.append("moe in --recompute-modules")
    if problems:
        return (
            f"--moe-paged-stash with {' and '.join(problems)}: recomputing the MoE layers re-runs "
            "the experts' forward inside backward, which breaks paged stashing's per-layer "
            "schedule. Use selective recomputation of other modules, or drop --moe-paged-stash."
        )
    return None


@rule(
    "paged-stash-cuda-graphs",
    phase="layout",
    flags=(
        "--moe-paged-stash",
        "--moe-expert-rank-capacity-factor",
        "--cuda-graph-impl",
        "--cuda-graph-modules",
        "--cuda-graph-warmup-steps",
        "--moe-pad-expert-input-to-capacity",
        "--moe-hybridep-pad-uneven-dispatch-inputs",
    ),
)
def _paged_stash_cuda_graphs(args):
    """Mirrors megatron: per-layer graphs of whole MoE layers need drop-and-pad. Fork: with a
    receive budget on Hopper the experts cannot be captured (split-path GEMM reads split sizes on
    the host), full-iteration graphs likewise; graphed preprocessing cannot all-reduce the
    uneven-input padding; paged stashing sizes its buffers in the second step."""
    if not stash_or_budget(args):
        return None
    impl = args.cuda_graph_impl
    if impl in (None, "none"):
        return None
    what = "--moe-paged-stash" if requested(args) else "--moe-expert-rank-capacity-factor"
    problems = []
    if impl in ("transformer_engine", "local"):
        scopes = graph_scope_names(args)
        if (not scopes or "moe" in scopes) and not args.moe_pad_expert_input_to_capacity:
            problems.append(
                f"--cuda-graph-modules {' '.join(sorted(scopes)) or '(empty: whole layers)'} "
                "captures the experts: megatron captures whole MoE layers only with drop-and-pad, "
                "and on Hopper the bf16 expert GEMM reads the per-expert token counts on the host "
                "(cuBLASLt < 13.4). Capture 'attn moe_router moe_preprocess' (experts, dispatch "
                "and combine then run eagerly)"
            )
        if "moe_preprocess" in scopes and getattr(
            args, "moe_hybridep_pad_uneven_dispatch_inputs", False
        ):
            problems.append(
                "no --moe-hybridep-pad-uneven-dispatch-inputs with moe_preprocess graphs (its "
                "all-reduce and host read would be captured once and replayed stale)"
            )
    elif impl == "full_iteration":
        problems.append(
            "--cuda-graph-impl full_iteration captures the experts, whose bf16 grouped GEMM on "
            "Hopper reads the per-expert token counts on the host unless cuBLASLt >= 13.4 (torch "
            "2.11's cu130 wheels ship 13.1); use --cuda-graph-impl transformer_engine "
            "--cuda-graph-modules attn moe_router moe_preprocess"
        )
        if requested(args) and (args.cuda_graph_warmup_steps or 0) < 2:
            problems.append(
                f"--cuda-graph-warmup-steps 2 or more (got {args.cuda_graph_warmup_steps}): paged "
                "stashing measures in step 1 and allocates its buffers in step 2, which must not "
                "be captured"
            )
    return listed(f"{what} with CUDA graphs: ", problems)


@rule(
    "paged-stash-buffer-sizes",
    phase="layout",
    flags=(
        "--moe-paged-stash-page-size",
        "--moe-paged-stash-buffer-size-factor-cuda",
        "--moe-paged-stash-buffer-size-factor-cpu",
    ),
)
def _paged_stash_buffer_sizes(args):
    """Fork: a page holds at least one token, and a stash with neither GPU nor host pages would
    overflow, and re-run, every step."""
    if not requested(args):
        return None
    problems = []
    page = args.moe_paged_stash_page_size
    if page is None or page < 1:
        problems.append(
            f"--moe-paged-stash-page-size {page}: a page holds 1 or more tokens (default 64)"
        )
    cuda, cpu = (
        args.moe_paged_stash_buffer_size_factor_cuda,
        args.moe_paged_stash_buffer_size_factor_cpu,
    )
    if not cuda and not cpu:
        problems.append(
            f"--moe-paged-stash-buffer-size-factor-cuda {cuda} and "
            f"--moe-paged-stash-buffer-size-factor-cpu {cpu}: no stash pages at all, so every step "
            "would overflow and be re-run without paging. Size the GPU stash relative to the "
            "expected tokens (default 1.1), or give host pages (e.g. -cpu 1.0)"
        )
    return listed("", problems)
