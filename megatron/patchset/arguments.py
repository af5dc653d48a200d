"""The fork's command-line flags and the rules that validate flag combinations.

Flags are added to megatron's own parser through ``extra_args_provider`` (see
:func:`add_patchset_args`), in megatron's style: kebab-case, help text, defaults shown.

Validation is a table of :class:`Rule` objects. A rule is a function of the parsed arguments
that returns ``None`` when the combination is fine, or a message that names the offending
flags and says how to fix it. Rules run in two phases, both before any GPU work:

* ``layout``: on the freshly parsed arguments, *before* megatron's ``validate_args``, for the
  parallel layout against the world size (megatron either checks these late, at process-group
  creation, or with messages that do not name the flag);
* ``combination``: after megatron's ``validate_args`` (its derived values such as
  ``data_parallel_size`` are available) and after the model's ``TransformerConfig`` was built.

:func:`validate` runs every rule of a phase and reports all failures at once. No rule changes
an argument: a requested feature is either honoured or refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable, Optional

PHASES = ("layout", "combination")


class PatchsetArgumentError(ValueError):
    """One or more flag combinations are invalid; the message lists each with its fix."""

    def __init__(self, failures: list[tuple["Rule", str]]):
        self.failures = failures
        lines = [f"megatron-patchset: {len(failures)} invalid flag combination(s):"]
        for rule, message in failures:
            lines.append(f"  [{rule.name}] {message}")
        super().__init__("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class Rule:
    """A validation rule. ``check(args)`` in the layout phase, ``check(args, config)`` in the
    combination phase (``config`` is the model's TransformerConfig); returns None or a message."""

    name: str
    phase: str
    flags: tuple[str, ...]
    check: Callable[..., Optional[str]]
    doc: str


RULES: list[Rule] = []


@dataclasses.dataclass(frozen=True)
class Feature:
    """A fork feature as the dry-run and the README table present it."""

    name: str
    flags: tuple[str, ...]
    enabled: Callable[[argparse.Namespace], bool]
    packages: tuple[str, ...] = ()


FEATURES: list[Feature] = []


def enabled_features(args: argparse.Namespace) -> list[Feature]:
    return [f for f in FEATURES if f.enabled(args)]


def listed(lead: str, problems: list[str]) -> Optional[str]:
    """A rule's message: ``lead`` and the problems, "; "-separated; None when there are none."""
    return f"{lead}{'; '.join(problems)}." if problems else None


def rule(name: str, *, phase: str, flags: tuple[str, ...]) -> Callable:
    """Decorator adding a validation rule to :data:`RULES`."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")

    def decorate(fn: Callable[[argparse.Namespace], Optional[str]]):
        if any(r.name == name for r in RULES):
            raise ValueError(f"rule {name!r} defined twice")
        RULES.append(Rule(name, phase, tuple(flags), fn, (fn.__doc__ or "").strip()))
        return fn

    return decorate


# Negative controls (a GPU test showing what megatron itself does with a refused combination)
# name the rules to skip here; pretrain_gpt.py says so in its log.
SKIP_RULES_ENV = "MEGATRON_PATCHSET_SKIP_RULES"


def skipped_rules() -> set[str]:
    names = {n.strip() for n in os.environ.get(SKIP_RULES_ENV, "").split(",") if n.strip()}
    unknown = names - {r.name for r in RULES}
    if unknown:
        raise ValueError(f"{SKIP_RULES_ENV} names unknown rules: {', '.join(sorted(unknown))}")
    return names


def validate(args: argparse.Namespace, phase: str, config: Any = None) -> None:
    """Run every rule of ``phase`` (but those named in ``MEGATRON_PATCHSET_SKIP_RULES``); raise
    :class:`PatchsetArgumentError` listing all failures."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    failures = []
    skip = skipped_rules()
    for r in RULES:
        if r.phase != phase:
            continue
        if r.name in skip:
            print(f"megatron-patchset: rule {r.name} skipped ({SKIP_RULES_ENV})", flush=True)
            continue
        message = r.check(args) if phase == "layout" else r.check(args, config)
        if message:
            failures.append((r, message))
    if failures:
        raise PatchsetArgumentError(failures)


# ---------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------


def add_patchset_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for megatron's ``parse_args``: the fork's own flags."""
    group = parser.add_argument_group(title="megatron-patchset")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Validate the flag combination for the given world size without a GPU: run "
        "megatron's argument validation, build the model's TransformerConfig, run the "
        "fork's rules, print the parallel layout, fork features, patches, parameter count "
        "and theoretical memory, then exit (0 when the combination is valid).",
    )
    group.add_argument(
        "--dry-run-world-size",
        type=int,
        default=None,
        help="World size (number of GPUs) that --dry-run validates for. "
        "Default: the WORLD_SIZE environment variable, else 1.",
    )
    # --- P2P backward overlap (schedule_plan.py) ---
    group.add_argument(
        "--overlap-p2p-backward-on-comm-stream",
        action="store_true",
        default=False,
        help="In the interleaved 1F1B schedule with --overlap-moe-expert-parallel-comm, run the "
        "backward pipeline send/receive on the communication stream, as megatron already does "
        "for the forward one, so that it overlaps the next virtual stage's forward compute; the "
        "first forward layer's attention is issued before the backward receive is waited on. "
        "Needs --delay-wgrad-compute, pipeline parallelism with a virtual pipeline and P2P "
        "overlap (no --no-overlap-p2p-communication).",
    )
    group.add_argument(
        "--overlap-p2p-wgrad-delayed-layer-number",
        type=int,
        default=1,
        help="In the fine-grained 1F1B schedule (--overlap-moe-expert-parallel-comm with "
        "--delay-wgrad-compute), the last N backward layers of each model chunk defer their "
        "weight-gradient compute until after the backward pipeline send/receive, to overlap it. "
        "Between 1 and the number of layers in a model chunk; a chunk with fewer layers defers "
        "all of them. 1 is megatron's behaviour (only the last backward layer's attention "
        "weight gradient waits).",
    )
    group.add_argument(
        "--overlap-p2p-with-transformer-layer-wgrad",
        action="store_true",
        default=False,
        help="The layers deferred by --overlap-p2p-wgrad-delayed-layer-number defer both their "
        "attention and their MLP/expert weight gradients, not attention alone.",
    )
    # --- end P2P backward overlap ---
    # --- CUDA graphs + Megatron-FSDP (cuda_graphs.py, megatron_fsdp.py) ---
    # --- end CUDA graphs + Megatron-FSDP ---
    # --- per-layer torch.compile (compile.py) ---
    from megatron.patchset import compile as _compile_flags

    group.add_argument(
        "--compile-transformer-layers",
        action="store_true",
        default=False,
        help="torch.compile each TransformerLayer's forward (per layer, in place, before "
        "DDP/Megatron-FSDP wrapping, so their hooks stay outside the compiled code). The MoE "
        "token dispatch, expert computation and combine run eagerly (compile-disabled patches). "
        "After the warm-up iterations a recompile of a compiled layer is an error; dynamo's "
        "graph and graph-break counts are logged.",
    )
    group.add_argument(
        "--compile-transformer-layers-mode",
        choices=_compile_flags.MODES,
        default=_compile_flags.DEFAULTS["compile_transformer_layers_mode"],
        help="torch.compile mode for the layers (inductor backend). The CUDA-graph modes "
        "(reduce-overhead, max-autotune) are refused in this version; use --cuda-graph-impl "
        "without compilation for CUDA graphs.",
    )
    group.add_argument(
        "--compile-transformer-layers-backend",
        choices=_compile_flags.BACKENDS,
        default=_compile_flags.DEFAULTS["compile_transformer_layers_backend"],
        help="torch.compile backend: inductor (generated kernels), or aot_eager / eager to "
        "debug graph capture without code generation.",
    )
    group.add_argument(
        "--compile-transformer-layers-warmup-iters",
        type=int,
        default=_compile_flags.DEFAULTS["compile_transformer_layers_warmup_iters"],
        help="Training iterations in which the compiled layers may compile and recompile "
        "(first-call and one-time guards); from the next one on a recompile of a compiled "
        "layer raises an error naming the failed guard.",
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
    # --- end per-layer torch.compile ---
    # --- flex token dispatch backends (token_dispatcher.py) ---
    # --- end flex token dispatch backends ---
    # --- MoE paged stashing (paged_stash.py) ---
    # No flags of its own: paged stashing is switched on by megatron-core's --moe-paged-stash,
    # --moe-paged-stash-page-size, --moe-paged-stash-buffer-size-factor-cuda/-cpu and
    # --moe-expert-rank-capacity-factor; the fork's rules and patches follow those.
    # --- end MoE paged stashing ---
    # --- experts' grouped GEMM (experts.py) ---
    from megatron.patchset import experts as _experts_flags

    group.add_argument(
        _experts_flags.FLAG,
        choices=_experts_flags.IMPLS,
        default=_experts_flags.DEFAULT_IMPL,
        help="GEMMs of the grouped MoE experts (--moe-grouped-gemm with the TransformerEngine spec). "
        "te: TransformerEngine's GroupedLinear (on Hopper one cuBLAS GEMM per expert). torch: "
        "forward, data and weight gradient as one torch grouped_mm call each (CUTLASS, SM90, bf16), "
        "with the per-expert offsets on the device; TE's parameters and checkpoint format are kept.",
    )
    group.add_argument(
        _experts_flags.SPLITS_FLAG,
        action="store_true",
        default=False,
        help="Keep the per-expert token counts on the GPU: the all-to-all dispatcher neither copies "
        "them to the host nor waits for them, and the experts' grouped GEMMs read them there, so a "
        "dropless MoE layer runs without a host synchronisation and --cuda-graph-impl full_iteration "
        "can capture the whole forward and backward. Needs --moe-grouped-gemm-impl torch, the alltoall "
        "dispatcher with --moe-permute-fusion, one expert-parallel and expert-tensor-parallel rank, "
        "and no token dropping.",
    )
    # --- end experts' grouped GEMM ---
    return parser


# ---------------------------------------------------------------------------------------
# Helpers shared by rules
# ---------------------------------------------------------------------------------------


def world_size(args: argparse.Namespace) -> int:
    size = getattr(args, "world_size", None)
    if size is None:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    return size


def _etp(args: argparse.Namespace) -> int:
    return args.expert_tensor_parallel_size or args.tensor_model_parallel_size


def _model_parallel(args: argparse.Namespace) -> int:
    return args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size


def _layout_is_uneven(args: argparse.Namespace) -> bool:
    return (
        getattr(args, "pipeline_model_parallel_layout", None) is not None
        or getattr(args, "decoder_first_pipeline_num_layers", None) is not None
        or getattr(args, "decoder_last_pipeline_num_layers", None) is not None
        or getattr(args, "account_for_embedding_in_pipeline_split", False)
        or getattr(args, "account_for_loss_in_pipeline_split", False)
    )


# ---------------------------------------------------------------------------------------
# Layout rules (before megatron's validate_args)
# ---------------------------------------------------------------------------------------


@rule(
    "model-parallel-divides-world-size",
    phase="layout",
    flags=("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"),
)
def _model_parallel_divides_world(args):
    """TP x PP x CP must divide the number of GPUs."""
    mp, world = _model_parallel(args), world_size(args)
    if world % mp:
        return (
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} x "
            f"--context-parallel-size {args.context_parallel_size} = {mp} does not divide the "
            f"world size {world}. Pick sizes whose product divides the number of GPUs."
        )
    return None


@rule(
    "expert-parallel-divides-world-size",
    phase="layout",
    flags=("--expert-model-parallel-size", "--expert-tensor-parallel-size", "--pipeline-model-parallel-size"),
)
def _expert_parallel_divides_world(args):
    """ETP x EP x PP must divide the number of GPUs (MoE layers' own process grid)."""
    ep, etp, pp, world = args.expert_model_parallel_size, _etp(args), args.pipeline_model_parallel_size, world_size(args)
    if world % (ep * etp * pp):
        return (
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} x "
            f"--pipeline-model-parallel-size {pp} = {ep * etp * pp} does not divide the world "
            f"size {world}. Use an --expert-model-parallel-size that divides "
            f"{world // max(1, etp * pp) if world % (etp * pp) == 0 else world} "
            f"(the GPUs left per pipeline stage after expert tensor parallelism)."
        )
    return None


@rule("experts-divisible-by-expert-parallel", phase="layout", flags=("--num-experts", "--expert-model-parallel-size"))
def _experts_divisible(args):
    """Every expert-parallel rank must own the same number of experts."""
    ep = args.expert_model_parallel_size
    if ep > 1 and args.num_experts is None:
        return f"--expert-model-parallel-size {ep} needs a MoE model: set --num-experts."
    if args.num_experts is not None and args.num_experts % ep:
        return (
            f"--num-experts {args.num_experts} is not a multiple of "
            f"--expert-model-parallel-size {ep}; every expert-parallel rank must hold the same "
            f"number of experts."
        )
    return None


@rule("heads-divisible-by-tensor-parallel", phase="layout", flags=("--num-attention-heads", "--num-query-groups", "--tensor-model-parallel-size"))
def _heads_divisible(args):
    """Attention heads and query groups are split across tensor-parallel ranks."""
    tp = args.tensor_model_parallel_size
    problems = []
    if args.num_attention_heads is not None and args.num_attention_heads % tp:
        problems.append(f"--num-attention-heads {args.num_attention_heads}")
    if getattr(args, "group_query_attention", False) and args.num_query_groups and args.num_query_groups % tp:
        problems.append(f"--num-query-groups {args.num_query_groups}")
    if problems:
        return f"{' and '.join(problems)} not divisible by --tensor-model-parallel-size {tp}."
    return None


@rule("layers-divisible-by-pipeline", phase="layout", flags=("--num-layers", "--pipeline-model-parallel-size"))
def _layers_divisible(args):
    """An even pipeline split needs num_layers % PP == 0."""
    pp = args.pipeline_model_parallel_size
    if pp > 1 and args.num_layers is not None and not _layout_is_uneven(args) and args.num_layers % pp:
        return (
            f"--num-layers {args.num_layers} does not split evenly over "
            f"--pipeline-model-parallel-size {pp}; change either, or give an uneven split with "
            f"--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers or "
            f"--pipeline-model-parallel-layout."
        )
    return None


@rule("global-batch-divisible", phase="layout", flags=("--global-batch-size", "--micro-batch-size"))
def _global_batch_divisible(args):
    """The global batch must be a whole number of micro-batches on every data-parallel rank."""
    world, mp = world_size(args), _model_parallel(args)
    if args.global_batch_size is None or world % mp:
        return None
    dp = world // mp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        return (
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp} = {per_step}."
        )
    return None


@rule("pretrain-gpt-data-scope", phase="layout", flags=("--sft", "--dataloader-inter-document-masking"))
def _pretrain_scope(args):
    """This pretrain_gpt.py trains on packed pretraining samples (mock or indexed data)."""
    offending = [
        flag
        for flag, on in (
            ("--sft", getattr(args, "sft", False)),
            ("--dataloader-inter-document-masking", getattr(args, "dataloader_inter_document_masking", False)),
        )
        if on
    ]
    if offending:
        return (
            f"{', '.join(offending)}: variable-length (THD) batches are not supported by "
            f"megatron-patchset's pretrain_gpt.py yet; drop the flag."
        )
    return None


_FILE_TOKENIZERS = {
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    "BertWordPieceLowerCase": ("--vocab-file",),
    "BertWordPieceCase": ("--vocab-file",),
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "GPTSentencePieceTokenizer": ("--tokenizer-model",),
    "Llama2Tokenizer": ("--tokenizer-model",),
    "TikTokenizer": ("--tokenizer-model",),
    "HuggingFaceTokenizer": ("--tokenizer-model",),
}


@rule("data-and-tokenizer", phase="layout", flags=("--mock-data", "--data-path", "--tokenizer-type"))
def _data_and_tokenizer(args):
    """Training needs data (mock or indexed) and a tokenizer that can be built."""
    problems = []
    has_data = (
        args.mock_data
        or args.data_path
        or getattr(args, "data_args_path", None)
        or getattr(args, "per_split_data_args_path", None)
        or any(getattr(args, f"{s}_data_path", None) for s in ("train", "valid", "test"))
    )
    if not has_data:
        problems.append("no training data: pass --mock-data or --data-path (or --train-data-path ...).")
    tok = args.tokenizer_type
    if tok is None:
        problems.append(
            "--tokenizer-type is not set: use NullTokenizer with --vocab-size for mock data, "
            "or the tokenizer your data was preprocessed with."
        )
    elif tok == "NullTokenizer" and not args.vocab_size:
        problems.append("--tokenizer-type NullTokenizer needs --vocab-size.")
    for flag in _FILE_TOKENIZERS.get(tok or "", ()):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if not value:
            problems.append(f"--tokenizer-type {tok} needs {flag}.")
        elif flag != "--tokenizer-model" and not os.path.exists(value):
            problems.append(f"{flag} {value} does not exist.")
    return " ".join(problems) or None


@rule("eval-interval-set", phase="layout", flags=("--eval-interval", "--train-iters"))
def _eval_interval_set(args):
    """megatron 0.19.2 divides --train-iters by --eval-interval when sizing the validation set,
    even with --eval-iters 0; without it every rank fails after the model is built."""
    if args.train_iters and args.eval_interval is None and not args.full_validation and not args.skip_train:
        return (
            "--eval-interval is not set: megatron-core 0.19.2 needs it with --train-iters (it "
            "sizes the validation set from it even with --eval-iters 0). Set e.g. "
            "--eval-interval 1000."
        )
    return None


@rule("lr-warmup-shorter-than-decay", phase="layout", flags=("--lr-warmup-iters", "--lr-decay-iters", "--train-iters"))
def _lr_warmup_shorter_than_decay(args):
    """megatron's LR scheduler asserts warm-up < decay (decay defaults to --train-iters)."""
    if not args.train_iters or args.lr_warmup_fraction is not None:
        return None
    decay = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= decay:
        source = "--lr-decay-iters" if args.lr_decay_iters else "--train-iters"
        return (
            f"--lr-warmup-iters {args.lr_warmup_iters} is not shorter than the decay length "
            f"{decay} ({source}); megatron's scheduler refuses it after the model is built. "
            f"Shorten the warm-up or lengthen the run."
        )
    return None


# ---------------------------------------------------------------------------------------
# --- P2P backward overlap (schedule_plan.py) ---
# The three flags only act inside megatron's fine-grained (EP all-to-all overlapped) schedule
# plan, on the backward pipeline send/receive of the interleaved schedule. The rules refuse
# combinations where they would do nothing, and the combinations that the fine-grained
# schedule itself rejects (megatron asserts those late or without naming a flag).
# ---------------------------------------------------------------------------------------

from megatron.patchset import schedule_plan as _p2p  # noqa: E402  (cheap: no megatron import)


def _p2p_flags_given(args: argparse.Namespace) -> str:
    """The P2P-overlap flags set away from their defaults, as they were typed."""
    given = []
    for name, default in _p2p.DEFAULTS.items():
        value = getattr(args, name, default)
        if value != default:
            flag = "--" + name.replace("_", "-")
            given.append(flag if isinstance(default, bool) else f"{flag} {value}")
    return ", ".join(given)


def _requested_virtual_stages(args: argparse.Namespace) -> Optional[int]:
    """Virtual stages per pipeline rank that the raw flags ask for (None: no virtual pipeline).

    Mirrors megatron's derivation of ``virtual_pipeline_model_parallel_size`` closely enough
    to tell whether there is one; megatron's own checks still validate the numbers.
    """
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout)
        vpp = stages // pp if stages % pp == 0 else None
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        vpp = args.num_virtual_stages_per_pipeline_rank
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        layers = (args.num_layers or 0) + int(bool(args.account_for_embedding_in_pipeline_split)) + int(
            bool(args.account_for_loss_in_pipeline_split)
        )
        per_rank = layers // pp if pp else 0
        vpp = per_rank // args.num_layers_per_virtual_pipeline_stage if args.num_layers_per_virtual_pipeline_stage > 0 else None
    else:
        vpp = None
    return vpp if vpp is not None and vpp > 1 else None


@rule(
    "p2p-overlap-needs-ep-overlap-and-delayed-wgrad",
    phase="layout",
    flags=_p2p.FLAGS + ("--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"),
)
def _p2p_needs_fine_grained_schedule(args):
    """The P2P-overlap flags act in the fine-grained schedule plan, on delayed weight gradients."""
    if not _p2p.requested(args):
        return None
    missing = [
        flag
        for flag, on in (
            ("--overlap-moe-expert-parallel-comm", args.overlap_moe_expert_parallel_comm),
            ("--delay-wgrad-compute", args.delay_wgrad_compute),
        )
        if not on
    ]
    if missing:
        return (
            f"the P2P-overlap flags ({_p2p_flags_given(args)}) need {' and '.join(missing)}: they change megatron's "
            f"fine-grained 1F1B schedule (--overlap-moe-expert-parallel-comm) and defer weight "
            f"gradients, which TransformerEngine computes separately only with "
            f"--delay-wgrad-compute. Add {' '.join(missing)}, or drop the P2P-overlap flags."
        )
    return None


@rule(
    "p2p-overlap-needs-interleaved-pipeline",
    phase="layout",
    flags=_p2p.FLAGS
    + (
        "--pipeline-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
        "--no-overlap-p2p-communication",
    ),
)
def _p2p_needs_interleaved_pipeline(args):
    """The backward send/receive the flags overlap exists in the interleaved schedule with P2P overlap."""
    if not _p2p.requested(args):
        return None
    problems = []
    pp = args.pipeline_model_parallel_size
    if pp <= 1:
        problems.append(f"--pipeline-model-parallel-size {pp} (needs 2 or more)")
    if _requested_virtual_stages(args) is None:
        problems.append(
            "no virtual pipeline (set --num-layers-per-virtual-pipeline-stage or "
            "--num-virtual-stages-per-pipeline-rank for 2 or more model chunks per rank)"
        )
    if not args.overlap_p2p_comm:
        problems.append("--no-overlap-p2p-communication (the schedule then sends outside the plan)")
    if problems:
        return (
            f"the P2P-overlap flags ({_p2p_flags_given(args)}) act on the backward pipeline send/receive of the "
            f"interleaved 1F1B schedule, which this layout does not have: {'; '.join(problems)}."
        )
    return None


def _cuda_graph_scope_names(args: argparse.Namespace) -> set[str]:
    return {getattr(m, "name", str(m)) for m in (getattr(args, "cuda_graph_modules", None) or [])}


def _layer_graphs_capture(args: argparse.Namespace, scopes: set[str]) -> bool:
    """Per-layer CUDA graphs (local or TE) that capture any of ``scopes``: no
    --cuda-graph-modules means whole layers."""
    if args.cuda_graph_impl not in ("local", "transformer_engine"):
        return False
    names = _cuda_graph_scope_names(args)
    return not names or bool(names & scopes)


@rule(
    "p2p-overlap-fine-grained-schedule-limits",
    phase="layout",
    flags=_p2p.FLAGS
    + (
        "--expert-model-parallel-size",
        "--moe-token-dispatcher-type",
        "--recompute-granularity",
        "--recompute-method",
        "--recompute-num-layers",
        "--recompute-modules",
        "--bf16",
        "--fp16",
        "--moe-shared-expert-overlap",
        "--mtp-num-layers",
        "--cuda-graph-impl",
        "--cuda-graph-modules",
        "--transformer-impl",
        "--overlap-dispatch-backward-with-experts-wgrad",
        "--use-megatron-fsdp",
    ),
)
def _p2p_fine_grained_limits(args):
    """What megatron's fine-grained schedule and delayed weight gradients do not support."""
    if not _p2p.requested(args):
        return None
    from megatron.core import utils as mcore_utils

    problems = []
    if not mcore_utils.is_torch_min_version("2.6.0"):
        import torch

        problems.append(f"torch {torch.__version__} (the EP all-to-all overlap hangs before torch 2.6.0; upgrade torch)")
    if args.expert_model_parallel_size <= 1:
        problems.append(f"--expert-model-parallel-size {args.expert_model_parallel_size} (needs 2 or more)")
    if args.moe_token_dispatcher_type not in ("alltoall", "flex"):
        problems.append(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} (use alltoall or flex)")
    if args.recompute_granularity == "full":
        problems.append("--recompute-granularity full (use selective recomputation or none)")
    if args.recompute_method is not None:
        problems.append(f"--recompute-method {args.recompute_method} (drop it)")
    if args.recompute_num_layers is not None:
        problems.append(f"--recompute-num-layers {args.recompute_num_layers} (drop it)")
    if "moe" in (args.recompute_modules or []):
        problems.append("--recompute-modules with moe (recompute other modules only)")
    if not (args.bf16 or args.fp16):
        problems.append("fp32 parameters (add --bf16 or --fp16)")
    if args.moe_shared_expert_overlap:
        problems.append("--moe-shared-expert-overlap (drop it)")
    if (args.mtp_num_layers or 0) > 1:
        problems.append(f"--mtp-num-layers {args.mtp_num_layers} (at most 1)")
    if _layer_graphs_capture(args, {"moe", "mlp"}):
        problems.append(
            f"--cuda-graph-impl {args.cuda_graph_impl} capturing the MLP/MoE part "
            f"(--cuda-graph-modules {' '.join(sorted(_cuda_graph_scope_names(args))) or 'empty, i.e. whole layers'}; "
            f"capture attn and/or moe_router only)"
        )
    if args.transformer_impl != "transformer_engine":
        problems.append(
            f"--transformer-impl {args.transformer_impl} (weight-gradient deferral is a "
            f"TransformerEngine feature: use transformer_engine)"
        )
    if args.overlap_dispatch_backward_with_experts_wgrad:
        problems.append("--overlap-dispatch-backward-with-experts-wgrad (excludes both; drop it)")
    if args.use_megatron_fsdp:
        problems.append("--use-megatron-fsdp (the fine-grained schedule has no Megatron-FSDP with a virtual pipeline)")
    if problems:
        return (
            f"the P2P-overlap flags ({_p2p_flags_given(args)}) act in megatron's fine-grained 1F1B schedule, which does "
            f"not support: {'; '.join(problems)}."
        )
    return None


@rule(
    "p2p-overlap-delayed-layer-number-range",
    phase="combination",
    flags=("--overlap-p2p-wgrad-delayed-layer-number", "--num-layers", "--pipeline-model-parallel-size",
           "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"),
)
def _p2p_delayed_layer_number(args, config):
    """N counts backward layers of one model chunk: 1 up to the layers a chunk holds."""
    number = getattr(args, _p2p.WGRAD_DELAYED_LAYERS, _p2p.DEFAULTS[_p2p.WGRAD_DELAYED_LAYERS])
    if number < 1:
        return (
            f"--overlap-p2p-wgrad-delayed-layer-number {number}: give the number of backward "
            f"layers per model chunk whose weight gradients wait for the backward P2P, at least 1 "
            f"(1 is megatron's behaviour)."
        )
    if config is None or number == 1:
        return None
    counts = _p2p.chunk_layer_counts(config)
    largest = max(counts, default=0)
    if number > largest:
        vpp = args.virtual_pipeline_model_parallel_size
        sizes = sorted(set(counts))
        shape = (
            f"{largest} layers per model chunk (--num-layers {args.num_layers} over "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} x "
            f"{vpp or 1} virtual stages)"
            if len(sizes) == 1
            else f"model chunks of {', '.join(map(str, sizes))} layers"
        )
        return (
            f"--overlap-p2p-wgrad-delayed-layer-number {number} is more than the layers of any "
            f"model chunk: this layout has {shape}. Use 1 to {largest} ({largest} defers every "
            f"layer of a chunk)."
        )
    return None


FEATURES.append(
    Feature(
        name="p2p-backward-overlap",
        flags=_p2p.FLAGS,
        enabled=_p2p.requested,
    )
)
# --- end P2P backward overlap ---


# ---------------------------------------------------------------------------------------
# --- CUDA graphs + Megatron-FSDP (cuda_graphs.py, megatron_fsdp.py) ---
# ---------------------------------------------------------------------------------------

# Megatron-FSDP with TransformerEngine per-layer graphs (--cuda-graph-impl transformer_engine,
# any --cuda-graph-modules scope). The graphs replay reading and writing the parameter buffers
# at the addresses they had at capture: FSDP must gather every layer into the same fixed
# buffers each iteration. These rules run after megatron's validate_args, which may already
# have turned --fsdp-double-buffer on (--use-nccl-ub, --megatron-fsdp-max-pool-double-buffer).


def _fsdp_te_graphs(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "use_megatron_fsdp", False)) and args.cuda_graph_impl == "transformer_engine"


@rule(
    "fsdp-cuda-graphs-double-buffer",
    phase="combination",
    flags=("--use-megatron-fsdp", "--cuda-graph-impl", "--fsdp-double-buffer",
           "--fsdp-db-use-persist-buf-on-alloc-fail", "--data-parallel-sharding-strategy"),
)
def _fsdp_cuda_graphs_double_buffer(args, config):
    """Per-layer graphs under Megatron-FSDP need fixed parameter-buffer addresses."""
    if not _fsdp_te_graphs(args):
        return None
    problems = []
    if args.data_parallel_sharding_strategy != "optim_grads_params":
        problems.append(
            f"--data-parallel-sharding-strategy optim_grads_params (got {args.data_parallel_sharding_strategy}: "
            f"only with it are layers FSDP units, gathered into fixed double buffers; the other strategies "
            f"put hooks on submodules inside the graphed region)"
        )
    if not args.fsdp_double_buffer:
        problems.append(
            "--fsdp-double-buffer (without it each all-gather allocates a new parameter buffer, whose address "
            "changes between iterations while the graph keeps reading the old one: wrong results or an illegal "
            "memory access)"
        )
    if not getattr(args, "fsdp_db_use_persist_buf_on_alloc_fail", False):
        problems.append(
            "--fsdp-db-use-persist-buf-on-alloc-fail (without it a layer whose buffers do not fit the double "
            "buffer, e.g. a dense or MTP layer next to MoE layers, falls back to a dynamic buffer during replay: "
            "an illegal memory access)"
        )
    return listed(
        "TransformerEngine per-layer CUDA graphs (--cuda-graph-impl transformer_engine) with --use-megatron-fsdp "
        "replay at the parameter-buffer addresses seen at capture, so they need: ", problems
    )


@rule(
    "fsdp-cuda-graphs-supported",
    phase="combination",
    flags=("--use-megatron-fsdp", "--cuda-graph-impl", "--gradient-accumulation-fusion",
           "--megatron-fsdp-enable-fine-grained-param-gather", "--overlap-moe-expert-parallel-comm",
           "--delay-wgrad-compute", "--pipeline-model-parallel-size", "--num-distributed-optimizer-instances",
           "--fp8-param-gather", "--fine-grained-activation-offloading", "--cuda-graph-warmup-steps"),
)
def _fsdp_cuda_graphs_supported(args, config):
    """What the fork's FSDP + per-layer graph capture does not handle (rejected, not guessed)."""
    if not getattr(args, "use_megatron_fsdp", False) or args.cuda_graph_impl == "none":
        return None
    if args.cuda_graph_impl == "local":
        return (
            "--cuda-graph-impl local does not work with --use-megatron-fsdp (megatron's local graphs only know "
            "DDP's hooks and fail at the first graphed layer); use --cuda-graph-impl transformer_engine "
            "(per-layer, this fork) or full_iteration."
        )
    if args.cuda_graph_impl != "transformer_engine":
        return None
    problems = []
    if args.gradient_accumulation_fusion:
        problems.append(
            "gradient-accumulation fusion (add --no-gradient-accumulation-fusion: TE's fused weight-gradient "
            "kernel asks FSDP for its main-grad bucket inside the capture, baking an address FSDP does not keep)"
        )
    if getattr(args, "megatron_fsdp_enable_fine_grained_param_gather", False):
        problems.append("--megatron-fsdp-enable-fine-grained-param-gather (hooks on submodules inside the graph)")
    if getattr(args, "fp8_param_gather", False):
        problems.append("--fp8-param-gather (its transpose-buffer gathers are not handled by the capture)")
    if args.overlap_moe_expert_parallel_comm:
        problems.append("--overlap-moe-expert-parallel-comm (Megatron-FSDP refuses it with double buffering)")
    if args.delay_wgrad_compute:
        problems.append("--delay-wgrad-compute (its weight-gradient graphs bypass FSDP's gradient hooks)")
    if args.pipeline_model_parallel_size > 1:
        problems.append(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} (FSDP's root pre-backward hook "
            f"lands inside the last layer of non-last stages, where a graph cannot run it)"
        )
    if (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
        problems.append("--num-distributed-optimizer-instances > 1 (hybrid FSDP's outer gathers are not handled)")
    if getattr(args, "fine_grained_activation_offloading", False):
        problems.append("--fine-grained-activation-offloading (untested with FSDP graphs)")
    if args.cuda_graph_warmup_steps < 1:
        problems.append(
            "--cuda-graph-warmup-steps 0 (capture must follow at least one eager step, so that FSDP's buffers "
            "exist before TE records their addresses)"
        )
    return listed("TransformerEngine per-layer CUDA graphs with --use-megatron-fsdp do not support: ", problems)


FEATURES.append(
    Feature(
        name="cuda-graphs-megatron-fsdp",
        flags=("--use-megatron-fsdp", "--cuda-graph-impl transformer_engine", "--cuda-graph-modules"),
        enabled=_fsdp_te_graphs,
    )
)

# --- end CUDA graphs + Megatron-FSDP ---


# ---------------------------------------------------------------------------------------
# --- per-layer torch.compile (compile.py) ---
# --compile-transformer-layers compiles each TransformerLayer's forward. Refused: combinations
# where the compiled forward would never run (the fine-grained EP-overlap schedule calls the
# layer's parts directly), would be captured by megatron's CUDA graphs, or would have every
# submodule's hook or checkpoint boundary traced inside it (a graph break at each).
# ---------------------------------------------------------------------------------------

from megatron.patchset import compile as _compile  # noqa: E402  (cheap: no megatron import)


def _compile_given(args: argparse.Namespace) -> list[str]:
    """The compile sub-flags set away from their defaults, as they were typed."""
    given = []
    for name, default in _compile.DEFAULTS.items():
        value = getattr(args, name, default)
        if name != "compile_transformer_layers" and value != default:
            given.append(f"--{name.replace('_', '-')} {value}")
    return given


@rule("compile-transformer-layers-options", phase="layout", flags=_compile.FLAGS)
def _compile_options(args):
    """Mode, backend and warm-up: only with the flag, no inductor CUDA-graph modes."""
    given = _compile_given(args)
    if not _compile.requested(args):
        return f"{', '.join(given)} only act with {_compile.FLAG}: add it or drop them." if given else None
    problems = []
    mode, backend = args.compile_transformer_layers_mode, args.compile_transformer_layers_backend
    if mode in _compile.CUDA_GRAPH_MODES:
        problems.append(
            f"{_compile.MODE_FLAG} {mode} records inductor CUDA graph trees per compiled region, which "
            f"this version does not support next to the eager MoE regions and megatron's own graphs "
            f"(use default or max-autotune-no-cudagraphs; CUDA graphs: --cuda-graph-impl)"
        )
    if mode != "default" and backend != "inductor":
        problems.append(f"{_compile.MODE_FLAG} {mode} is an inductor mode, but {_compile.BACKEND_FLAG} is {backend}")
    if args.compile_transformer_layers_warmup_iters < 1:
        problems.append(
            f"{_compile.WARMUP_FLAG} {args.compile_transformer_layers_warmup_iters} (at least 1: the first "
            f"iteration compiles)"
        )
    return listed("", problems)


@rule(
    "compile-transformer-layers-not-cuda-graphed",
    phase="layout",
    flags=(_compile.FLAG, "--cuda-graph-impl", "--overlap-moe-expert-parallel-comm"),
)
def _compile_not_graphed(args):
    """A compiled layer must run through its forward, not a CUDA graph or the fine-grained plan."""
    if not _compile.requested(args):
        return None
    problems = []
    if args.cuda_graph_impl != "none":
        problems.append(
            f"--cuda-graph-impl {args.cuda_graph_impl} (megatron's capture calls the layers outside and "
            f"around their forward, and a capture of compiled code with eager MoE regions is untested)"
        )
    if args.overlap_moe_expert_parallel_comm:
        problems.append(
            "--overlap-moe-expert-parallel-comm (its schedule plan calls the layers' attention and MLP "
            "parts directly, so the compiled forward would never run)"
        )
    return listed(f"{_compile.FLAG} cannot be combined with: ", problems)


@rule(
    "compile-transformer-layers-hooks",
    phase="layout",
    flags=(_compile.FLAG, "--overlap-param-gather", "--megatron-fsdp-enable-fine-grained-param-gather",
           "--nvtx-ranges"),
)
def _compile_hooks(args):
    """Hooks on every submodule would run inside the compiled layer, one graph break each."""
    if not _compile.requested(args):
        return None
    problems = []
    fsdp = getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False)
    if getattr(args, "overlap_param_gather", False) and not fsdp:
        problems.append(
            "--overlap-param-gather (DDP then waits for parameter all-gathers in a forward pre-hook on "
            "every submodule, inside the compiled layer; drop it, or use --use-megatron-fsdp, whose "
            "hooks sit on whole layers)"
        )
    if getattr(args, "megatron_fsdp_enable_fine_grained_param_gather", False):
        problems.append("--megatron-fsdp-enable-fine-grained-param-gather (hooks on every submodule)")
    if getattr(args, "nvtx_ranges", False):
        problems.append(
            "--nvtx-ranges (the ranges inspect Python frames inside the layer, and switching them on at "
            "--profile-step-start recompiles every layer after warm-up)"
        )
    return listed(f"{_compile.FLAG} cannot be combined with: ", problems)


@rule(
    "compile-transformer-layers-recompute",
    phase="combination",
    flags=(_compile.FLAG, "--recompute-granularity", "--recompute-modules"),
)
def _compile_recompute(args, config):
    """Checkpoints inside a compiled layer are graph breaks; around it (full) they work."""
    if not _compile.requested(args) or args.recompute_granularity != "selective":
        return None
    inside = [m for m in (args.recompute_modules or ["core_attn"]) if m != "moe_act"]
    if inside:
        return (
            f"{_compile.FLAG} with --recompute-granularity selective --recompute-modules "
            f"{' '.join(args.recompute_modules or ['core_attn'])}: {', '.join(inside)} checkpoint inside "
            f"the compiled layer, a graph break at every boundary with the checkpointed part compiled "
            f"twice. Use --recompute-granularity full (checkpoints around the compiled layer) or "
            f"--recompute-modules moe_act (inside the eager expert region)."
        )
    return None


@rule(
    "compile-transformer-layers-router-force-biased",
    phase="layout",
    flags=(_compile.FLAG, "--moe-router-force-biased"),
)
def _compile_force_biased(args):
    """The biased random logits draw inside the RNG tracker's fork, with a per-layer cache."""
    if not _compile.requested(args) or getattr(args, "moe_router_force_biased", None) is None:
        return None
    return (
        f"{_compile.FLAG} with --moe-router-force-biased {args.moe_router_force_biased}: the router draws its "
        f"random bias inside the RNG tracker's fork (CUDA RNG state reads that dynamo does not trace) within "
        f"the MoE layer's try block, so dynamo would run the whole MoE body eagerly. Drop one of the two "
        f"(--moe-router-force-load-balancing is supported)."
    )


FEATURES.append(Feature(name="compile-transformer-layers", flags=_compile.FLAGS, enabled=_compile.requested))
# --- end per-layer torch.compile ---


# ---------------------------------------------------------------------------------------
# --- flex token dispatch backends (token_dispatcher.py) ---
# --moe-token-dispatcher-type flex hands the MoE all-to-all to DeepEP, HybridEP (DeepEP's
# hybrid-ep branch) or TransformerEngine's NCCL EP. megatron reports a missing or broken library
# only when the first MoE layer is built, and as "not installed" whatever the cause; these rules
# report the cause before any GPU work. The installation rule is skipped by --dry-run, which checks
# the combination on a login node and lists the packages the run needs instead.
# ---------------------------------------------------------------------------------------

from megatron.patchset import token_dispatcher as _flex  # noqa: E402  (cheap: no megatron import)


@rule(
    "flex-backend-installed",
    phase="combination",
    flags=("--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend"),
)
def _flex_backend_installed(args, config):
    """The requested flex backend imports, has the API megatron-core 0.19.2 calls, and (ncclep)
    runs on the loaded NCCL; never replaced by the all-to-all dispatcher."""
    backend = _flex.requested_backend(args)
    if backend is None or getattr(args, "dry_run", False):
        return None
    try:
        _flex.check_backend(backend)
    except _flex.FlexBackendError as exc:
        return f"--moe-token-dispatcher-type flex {exc}"
    return None


@rule(
    "flex-backend-group-size",
    phase="combination",
    flags=("--moe-flex-dispatcher-backend", "--tensor-model-parallel-size", "--expert-model-parallel-size"),
)
def _flex_backend_group_size(args, config):
    """deepep and ncclep communicate over the TP x EP group, which must have 2 or more ranks
    (and, for DeepEP, a size its kernels are tuned for)."""
    backend = _flex.requested_backend(args)
    if backend not in ("deepep", "ncclep"):
        return None
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    group = tp * ep
    flags = f"--tensor-model-parallel-size {tp} x --expert-model-parallel-size {ep} = {group}"
    if group < 2:
        return (
            f"--moe-flex-dispatcher-backend {backend} dispatches over the tensor x expert parallel "
            f"group, which has 1 rank ({flags}); megatron asserts TPxEP > 1. Use "
            f"--expert-model-parallel-size 2 or more, or --moe-token-dispatcher-type alltoall."
        )
    if backend == "deepep":
        problem = _flex.deep_ep_group_size_problem(group)
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
    if _flex.requested_backend(args) != "ncclep":
        return None
    if getattr(args, "moe_expert_rank_capacity_factor", None) is None:
        return (
            "--moe-flex-dispatcher-backend ncclep needs --moe-expert-rank-capacity-factor (e.g. 2.0): "
            "it sizes each rank's receive buffer as tokens x top-k x factor, and megatron refuses "
            "to build the MoE layer without it. A budget that is exceeded traps the kernel, so be generous."
        )
    return None


FEATURES.append(
    Feature(
        name="flex-dispatch-backend-checks",
        flags=("--moe-flex-dispatcher-backend",),
        enabled=lambda args: _flex.requested_backend(args) is not None,
    )
)
# --- end flex token dispatch backends ---


# ---------------------------------------------------------------------------------------
# --- MoE paged stashing (paged_stash.py) ---
# Rules for --moe-paged-stash and the static HybridEP / NCCL EP receive budget
# (--moe-expert-rank-capacity-factor, --moe-ncclep-static-shape). They run before megatron's own checks so that every
# problem is reported at once and names its flags. Rules marked "mirrors megatron" restate
# megatron-core 0.19.2's requirements (TransformerConfig.__post_init__, and the assertion in
# TEGroupedMLP.__init__ that TE's op fuser supports the expert MLP) with the fix spelled out;
# the others are the fork's own, for what fails later or silently on Hopper in bf16.
# ---------------------------------------------------------------------------------------

from megatron.patchset import paged_stash as _stash  # noqa: E402  (cheap: no megatron import)

_STASH_OFFLOAD_CONFLICTS = ("expert_fc1", "moe_act", "fused_group_mlp")


def _stash_or_budget(args: argparse.Namespace) -> bool:
    return _stash.requested(args) or getattr(args, "moe_expert_rank_capacity_factor", None) is not None


@rule(
    "paged-stash-requirements",
    phase="layout",
    flags=("--moe-paged-stash", "--moe-expert-rank-capacity-factor", "--use-transformer-engine-op-fuser",
           "--cpu-offloading-num-layers", "--offload-modules", "--num-experts"),
)
def _paged_stash_requirements(args):
    """Mirrors megatron: paged stashing needs a receive budget and no CPU/expert offloading.
    Fork: it needs MoE layers and the TE op-fuser expert MLP (the only place megatron stashes)."""
    if not _stash.requested(args):
        return None
    problems = []
    if getattr(args, "num_experts", None) is None:
        problems.append("a MoE model (--num-experts): only expert activations are paged")
    if getattr(args, "moe_expert_rank_capacity_factor", None) is None:
        problems.append(
            "--moe-expert-rank-capacity-factor (e.g. 1.5): the static per-rank receive budget whose slack "
            "paged stashing avoids storing; megatron refuses --moe-paged-stash without it"
        )
    if not getattr(args, "use_transformer_engine_op_fuser", False):
        problems.append(
            "--use-transformer-engine-op-fuser: megatron pages activations only in the TE op-fuser "
            "expert MLP; without it nothing would be paged"
        )
    if (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0:
        problems.append(f"no --cpu-offloading-num-layers (got {args.cpu_offloading_num_layers}; megatron refuses both)")
    conflict = sorted(set(getattr(args, "offload_modules", None) or []) & set(_STASH_OFFLOAD_CONFLICTS))
    if conflict:
        problems.append(
            f"--offload-modules without {', '.join(conflict)} (paged stashing already covers the "
            f"expert activations; megatron refuses both)"
        )
    return listed("--moe-paged-stash needs ", problems)


@rule(
    "rank-capacity-factor-backend",
    phase="layout",
    flags=("--moe-expert-rank-capacity-factor", "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend",
           "--use-transformer-engine-op-fuser"),
)
def _rank_capacity_factor_backend(args):
    """Mirrors megatron: a receive budget needs the hybridep or ncclep flex backend, and hybridep
    needs the TE op fuser. Fork: the flex dispatcher must be selected for the backend to act."""
    factor = getattr(args, "moe_expert_rank_capacity_factor", None)
    if factor is None:
        return None
    problems = []
    if factor <= 0:
        problems.append(f"a positive factor (got {factor}; 1.0 is the perfectly balanced receive count)")
    if args.moe_token_dispatcher_type != "flex":
        problems.append(f"--moe-token-dispatcher-type flex (got {args.moe_token_dispatcher_type})")
    backend = getattr(args, "moe_flex_dispatcher_backend", None)
    if backend not in ("hybridep", "ncclep"):
        problems.append(f"--moe-flex-dispatcher-backend hybridep or ncclep (got {backend})")
    if backend == "hybridep" and not getattr(args, "use_transformer_engine_op_fuser", False):
        problems.append("--use-transformer-engine-op-fuser with hybridep (megatron refuses the budget without it)")
    return listed(f"--moe-expert-rank-capacity-factor {factor} needs ", problems)


@rule(
    "ncclep-static-shape",
    phase="layout",
    flags=("--moe-ncclep-static-shape", "--moe-ncclep-zero-copy", "--moe-flex-dispatcher-backend",
           "--use-transformer-engine-op-fuser", "--moe-grouped-gemm"),
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
    if not _stash.ncclep(args):
        problems.append("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ncclep (the flag "
                        "acts on the NCCL EP dispatcher only)")
    if zero_copy and not static:
        problems.append("--moe-ncclep-static-shape (zero-copy uses fixed [budget, hidden] buffers; megatron refuses it without)")
    if static and not (getattr(args, "use_transformer_engine_op_fuser", False) and args.moe_grouped_gemm):
        problems.append("--use-transformer-engine-op-fuser and --moe-grouped-gemm (the experts must take "
                        "device-side per-expert counts over a static buffer; megatron refuses it otherwise)")
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
    if not (_stash.requested(args) and _stash.ncclep(args)) or getattr(args, "moe_ncclep_static_shape", False):
        return None
    return (
        "--moe-paged-stash with --moe-flex-dispatcher-backend ncclep needs --moe-ncclep-static-shape: without "
        "it NCCL EP hands the experts only the received rows (after a host sync), and megatron sizes the paged "
        "stash from that count divided by --moe-expert-rank-capacity-factor, so the stash would overflow and "
        "every step would be re-run without paging. With it the experts take the static [budget, hidden] "
        "receive buffer (bf16 on Hopper: TE's op fuser, the fork's slack-row patch)."
    )


@rule(
    "paged-stash-op-fuser-expert-mlp",
    phase="layout",
    flags=("--use-transformer-engine-op-fuser", "--transformer-impl", "--moe-grouped-gemm",
           "--expert-tensor-parallel-size", "--moe-apply-probs-on-input", "--swiglu", "--squared-relu",
           "--use-fused-weighted-squared-relu", "--moe-single-grouped-weight", "--moe-single-grouped-bias",
           "--recompute-modules", f"env {_stash.CUTEDSL_ENV}"),
)
def _paged_stash_op_fuser(args):
    """Mirrors megatron: TEGroupedMLP asserts, with no reason given, that TE's op fuser can build
    the expert MLP (TE layers, grouped GEMM, expert TP 1, probabilities applied after the
    activation, SwiGLU/quick-GEGLU only with NVTE_CUTEDSL_FUSED_GROUPED_MLP set, or weighted
    squared ReLU). Fork: what TE's basic ops refuse on Hopper (single grouped parameters with
    cuBLASLt < 13.4, moe_act recomputation outside the Blackwell fused kernel)."""
    if not (_stash_or_budget(args) and getattr(args, "use_transformer_engine_op_fuser", False)):
        return None
    problems = []
    if args.transformer_impl != "transformer_engine":
        problems.append(f"--transformer-impl transformer_engine (got {args.transformer_impl})")
    if not args.moe_grouped_gemm:
        problems.append("--moe-grouped-gemm (the op fuser runs TE's GroupedLinear experts)")
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if etp != 1:
        problems.append(f"expert tensor parallel size 1 (--expert-tensor-parallel-size 1; got {etp})")
    if getattr(args, "moe_apply_probs_on_input", False):
        problems.append("no --moe-apply-probs-on-input (the op fuser scales by the router probabilities after the activation)")
    glu = bool(args.swiglu or getattr(args, "quick_geglu", False))
    if glu:
        try:
            cutedsl = int(os.environ.get(_stash.CUTEDSL_ENV, "0"))
        except ValueError:
            cutedsl = 0
        if cutedsl <= 0:
            problems.append(
                f"the environment variable {_stash.CUTEDSL_ENV}=1 with {'--swiglu' if args.swiglu else '--quick-geglu'} "
                f"(megatron admits a gated activation to the op fuser only with it; on Hopper TE still "
                f"runs its basic ops, the Blackwell kernel it names is not used)"
            )
    elif not (getattr(args, "squared_relu", False) and getattr(args, "use_fused_weighted_squared_relu", False)):
        problems.append("an activation the op fuser implements: --swiglu, --quick-geglu, or --squared-relu with --use-fused-weighted-squared-relu")
    single = [f for f, on in (("--moe-single-grouped-weight", getattr(args, "moe_single_grouped_weight", False)),
                              ("--moe-single-grouped-bias", getattr(args, "moe_single_grouped_bias", False))) if on]
    if single:
        problems.append(
            f"no {' / '.join(single)} (on Hopper TE's bf16 grouped GEMM takes the split path, which has no "
            f"single grouped parameters, unless cuBLASLt >= 13.4; torch 2.11's cu130 wheels ship 13.1)"
        )
    if "moe_act" in (getattr(args, "recompute_modules", None) or []):
        problems.append("no moe_act in --recompute-modules (TE's op-fuser activation recomputes only in its Blackwell fused kernel)")
    return listed(
        "--moe-paged-stash / --moe-expert-rank-capacity-factor run the experts through TE's op fuser "
        "(--use-transformer-engine-op-fuser), which needs: ", problems
    )


@rule("paged-stash-precision", phase="layout", flags=("--moe-paged-stash", "--fp8-format", "--fp4-format"))
def _paged_stash_precision(args):
    """Fork: pages bf16/fp16 activations; FP8/FP4 on Hopper quantize per expert on the split path
    (nothing pageable), and upstream's MXFP8/NVFP4 paging is Blackwell-only."""
    if not _stash.requested(args):
        return None
    low = [f for f, on in (("--fp8-format", getattr(args, "fp8", None)), ("--fp4-format", getattr(args, "fp4", None))) if on]
    if low:
        return (
            f"--moe-paged-stash with {' and '.join(low)}: on Hopper TE quantizes the expert inputs per "
            f"expert, which megatron's paged stash cannot page (its MXFP8/NVFP4 paging needs Blackwell's "
            f"fused grouped MLP). Train in bf16 (--bf16) with paged stashing, or drop --moe-paged-stash."
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
    if not _stash.requested(args):
        return None
    problems = []
    if args.recompute_granularity == "full":
        problems.append("--recompute-granularity full")
    if "moe" in (getattr(args, "recompute_modules", None) or []):
        problems.append("moe in --recompute-modules")
    if problems:
        return (
            f"--moe-paged-stash with {' and '.join(problems)}: recomputing the MoE layers re-runs the "
            f"experts' forward inside backward, which breaks paged stashing's per-layer schedule. Use "
            f"selective recomputation of other modules, or drop --moe-paged-stash."
        )
    return None


@rule(
    "paged-stash-cuda-graphs",
    phase="layout",
    flags=("--moe-paged-stash", "--moe-expert-rank-capacity-factor", "--cuda-graph-impl", "--cuda-graph-modules",
           "--cuda-graph-warmup-steps", "--moe-pad-expert-input-to-capacity",
           "--moe-hybridep-pad-uneven-dispatch-inputs"),
)
def _paged_stash_cuda_graphs(args):
    """Mirrors megatron: per-layer graphs of whole MoE layers need drop-and-pad. Fork: with a
    receive budget on Hopper the experts cannot be captured (split-path GEMM reads split sizes on
    the host), full-iteration graphs likewise; graphed preprocessing cannot all-reduce the
    uneven-input padding; paged stashing sizes its buffers in the second step."""
    if not _stash_or_budget(args):
        return None
    impl = args.cuda_graph_impl
    if impl in (None, "none"):
        return None
    what = "--moe-paged-stash" if _stash.requested(args) else "--moe-expert-rank-capacity-factor"
    problems = []
    if impl in ("transformer_engine", "local"):
        scopes = _stash.graph_scope_names(args)
        if (not scopes or "moe" in scopes) and not args.moe_pad_expert_input_to_capacity:
            problems.append(
                f"--cuda-graph-modules {' '.join(sorted(scopes)) or '(empty: whole layers)'} captures the experts: "
                f"megatron captures whole MoE layers only with drop-and-pad, and on Hopper the bf16 expert GEMM "
                f"reads the per-expert token counts on the host (cuBLASLt < 13.4). Capture "
                f"'attn moe_router moe_preprocess' (experts, dispatch and combine then run eagerly)"
            )
        if "moe_preprocess" in scopes and getattr(args, "moe_hybridep_pad_uneven_dispatch_inputs", False):
            problems.append(
                "no --moe-hybridep-pad-uneven-dispatch-inputs with moe_preprocess graphs (its all-reduce and "
                "host read would be captured once and replayed stale)"
            )
    elif impl == "full_iteration":
        problems.append(
            "--cuda-graph-impl full_iteration captures the experts, whose bf16 grouped GEMM on Hopper reads the "
            "per-expert token counts on the host unless cuBLASLt >= 13.4 (torch 2.11's cu130 wheels ship 13.1); "
            "use --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess"
        )
        if _stash.requested(args) and (args.cuda_graph_warmup_steps or 0) < 2:
            problems.append(
                f"--cuda-graph-warmup-steps 2 or more (got {args.cuda_graph_warmup_steps}): paged stashing "
                f"measures in step 1 and allocates its buffers in step 2, which must not be captured"
            )
    return listed(f"{what} with CUDA graphs: ", problems)


@rule(
    "paged-stash-buffer-sizes",
    phase="layout",
    flags=("--moe-paged-stash-page-size", "--moe-paged-stash-buffer-size-factor-cuda",
           "--moe-paged-stash-buffer-size-factor-cpu"),
)
def _paged_stash_buffer_sizes(args):
    """Fork: a page holds at least one token, and a stash with neither GPU nor host pages would
    overflow, and re-run, every step."""
    if not _stash.requested(args):
        return None
    problems = []
    page = args.moe_paged_stash_page_size
    if page is None or page < 1:
        problems.append(f"--moe-paged-stash-page-size {page}: a page holds 1 or more tokens (default 64)")
    cuda, cpu = args.moe_paged_stash_buffer_size_factor_cuda, args.moe_paged_stash_buffer_size_factor_cpu
    if not cuda and not cpu:
        problems.append(
            f"--moe-paged-stash-buffer-size-factor-cuda {cuda} and --moe-paged-stash-buffer-size-factor-cpu "
            f"{cpu}: no stash pages at all, so every step would overflow and be re-run without paging. Size "
            f"the GPU stash relative to the expected tokens (default 1.1), or give host pages (e.g. -cpu 1.0)"
        )
    return listed("", problems)


FEATURES.append(
    Feature(
        name="moe-paged-stash-hopper",
        flags=_stash.FLAGS + ("--moe-expert-rank-capacity-factor",),
        enabled=lambda args: _stash.requested(args) or _stash.static_budget(args),
    )
)
# --- end MoE paged stashing ---


# ---------------------------------------------------------------------------------------
# Experts' grouped GEMM (experts.py)
# ---------------------------------------------------------------------------------------

from megatron.patchset import experts as _experts  # noqa: E402  (cheap: no megatron import)


@rule(
    "moe-grouped-gemm-impl-torch-requirements",
    phase="layout",
    flags=(_experts.FLAG, "--num-experts", "--moe-grouped-gemm", "--transformer-impl", "--bf16", "--fp8-format",
           "--fp4-format", "--disable-bias-linear", "--delay-wgrad-compute",
           "--overlap-dispatch-backward-with-experts-wgrad", "--use-transformer-engine-op-fuser",
           "--moe-single-grouped-weight", "--use-megatron-fsdp", "--use-torch-fsdp2", "--cuda-graph-impl",
           "--cuda-graph-modules", "--cuda-graph-warmup-steps", _experts.SPLITS_FLAG),
)
def _grouped_gemm_impl_torch(args):
    """What the torch grouped GEMM replaces (TE's per-linear forward) and what it does not implement."""
    if not _experts.requested(args):
        return None
    problems = []
    if not args.num_experts:
        problems.append("an MoE model (--num-experts)")
    if not args.moe_grouped_gemm:
        problems.append("--moe-grouped-gemm (without it the experts are a SequentialMLP, not grouped linears)")
    if args.transformer_impl != "transformer_engine":
        problems.append(f"--transformer-impl transformer_engine (it replaces TE's grouped linears; got {args.transformer_impl})")
    if not args.bf16:
        problems.append("--bf16 (the grouped GEMM kernels take bf16)")
    if args.fp8 or getattr(args, "fp4", None):
        problems.append("no --fp8-format/--fp4-format (quantized expert GEMMs stay TE's)")
    if args.add_bias_linear:
        problems.append("--disable-bias-linear (expert biases are not implemented)")
    if args.delay_wgrad_compute or args.overlap_dispatch_backward_with_experts_wgrad:
        problems.append(
            "no --delay-wgrad-compute / --overlap-dispatch-backward-with-experts-wgrad (the deferred weight "
            "gradient is TE's; these GEMMs compute it in backward)"
        )
    if args.use_transformer_engine_op_fuser:
        problems.append("no --use-transformer-engine-op-fuser (its fused grouped MLP bypasses these linears)")
    if getattr(args, "moe_single_grouped_weight", False):
        problems.append("no --moe-single-grouped-weight (the GEMMs read the per-expert weight0..weightN)")
    if args.use_megatron_fsdp or getattr(args, "use_torch_fsdp2", False):
        problems.append("no --use-megatron-fsdp / --use-torch-fsdp2 (sharded expert weights are not tested with it)")
    if args.cuda_graph_impl == "full_iteration" and not _experts.splits_on_device(args):
        problems.append(
            f"{_experts.SPLITS_FLAG} for --cuda-graph-impl full_iteration (without it the per-expert token "
            "counts reach these GEMMs from the host, which a graph cannot capture)"
        )
    if args.cuda_graph_impl == "full_iteration" and (args.cuda_graph_warmup_steps or 0) < 1:
        problems.append(
            f"--cuda-graph-warmup-steps 1 or more with --cuda-graph-impl full_iteration (got "
            f"{args.cuda_graph_warmup_steps}: the first backward probes the grouped GEMM, which a capture cannot run)"
        )
    if _layer_graphs_capture(args, {"moe"}):
        problems.append(
            "per-layer CUDA graphs that leave the experts out (--cuda-graph-modules attn moe_router "
            "moe_preprocess): megatron captures the MoE layer per layer only with drop-and-pad; to capture "
            f"the experts too use {_experts.SPLITS_FLAG} with --cuda-graph-impl full_iteration"
        )
    return listed(f"{_experts.FLAG} torch needs: ", problems)


@rule(
    "moe-grouped-gemm-impl-torch-alignment",
    phase="layout",
    flags=(_experts.FLAG, "--hidden-size", "--moe-latent-size", "--moe-ffn-hidden-size",
           "--expert-tensor-parallel-size"),
)
def _grouped_gemm_impl_torch_alignment(args):
    """Rows of every GEMM operand must start on 16-byte boundaries: bf16 widths a multiple of 8."""
    if not _experts.requested(args) or not args.num_experts:
        return None
    etp = _etp(args)
    widths = {
        "--moe-latent-size" if args.moe_latent_size else "--hidden-size": args.moe_latent_size or args.hidden_size,
        f"--moe-ffn-hidden-size / expert tensor parallel size {etp}": (args.moe_ffn_hidden_size or args.ffn_hidden_size) // etp,
    }
    bad = [f"{name} = {value}" for name, value in widths.items() if value % _experts.ALIGNMENT]
    if bad:
        return (
            f"{_experts.FLAG} torch: the expert GEMM widths must be multiples of {_experts.ALIGNMENT} "
            f"(16-byte rows in bf16): {', '.join(bad)}. Use {_experts.FLAG} te."
        )
    return None


def _capacity_limited(args: argparse.Namespace) -> bool:
    """An expert capacity is set (megatron treats a negative --moe-expert-capacity-factor as none)."""
    factor = getattr(args, "moe_expert_capacity_factor", None)
    return factor is not None and factor >= 0


@rule(
    "moe-expert-splits-on-device-requirements",
    phase="layout",
    flags=(_experts.SPLITS_FLAG, _experts.FLAG, "--num-experts", "--moe-token-dispatcher-type",
           "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--tensor-model-parallel-size",
           "--moe-expert-capacity-factor", "--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8",
           "--moe-permute-fusion", "--cuda-graph-impl", "--cuda-graph-modules"),
)
def _expert_splits_on_device(args):
    """The token counts can stay on the device only where nothing on the host needs them: no all-to-all
    or all-gather with host split sizes, a static permuted token count, and the fused chunk sort
    (the same conditions the dispatcher patch checks when a layer runs)."""
    if not _experts.splits_on_device(args):
        return None
    problems = []
    if not _experts.requested(args):
        problems.append(f"{_experts.FLAG} torch (TE's grouped linear splits its input on the host)")
    if not args.num_experts:
        problems.append("an MoE model (--num-experts)")
    if args.moe_token_dispatcher_type != "alltoall":
        problems.append(f"--moe-token-dispatcher-type alltoall (got {args.moe_token_dispatcher_type})")
    if args.expert_model_parallel_size != 1:
        problems.append(
            f"--expert-model-parallel-size 1 (got {args.expert_model_parallel_size}: the all-to-all takes "
            "its split sizes from the host)"
        )
    if _etp(args) != 1:
        problems.append(f"expert tensor parallel size 1 (got {_etp(args)}: the all-gather takes host split sizes)")
    if _capacity_limited(args):
        problems.append("no --moe-expert-capacity-factor (dropped tokens make the permuted token count dynamic)")
    if getattr(args, "moe_router_padding_for_quantization", False) or getattr(args, "moe_router_padding_for_fp8", False):
        problems.append("no --moe-router-padding-for-quantization (the padded token count is dynamic)")
    if not getattr(args, "moe_permute_fusion", False):
        problems.append("--moe-permute-fusion (the unfused chunk sort splits its input on the host)")
    if _layer_graphs_capture(args, {"moe_router", "moe_preprocess", "moe", "mlp"}):
        problems.append(
            "no per-layer CUDA graphs over the MoE router or preprocessing (megatron copies the graph's token "
            "counts to the host after each replay anyway); use --cuda-graph-impl full_iteration or no graphs"
        )
    return listed(f"{_experts.SPLITS_FLAG} needs: ", problems)


@rule(
    "full-iteration-graphs-timers",
    phase="layout",
    flags=("--cuda-graph-impl", "--timing-log-level"),
)
def _full_iteration_graphs_timers(args):
    """Megatron's level-1 and level-2 timers run inside forward_backward_func and synchronise the
    device at start and stop (and barrier with --barrier-with-L1-time): inside the capture of a
    full-iteration graph that fails."""
    if args.cuda_graph_impl != "full_iteration" or (args.timing_log_level or 0) < 1:
        return None
    return (
        f"--cuda-graph-impl full_iteration with --timing-log-level {args.timing_log_level}: megatron's "
        "forward-backward timer (and the level-2 timers) synchronise the device inside the captured step, and "
        "the capture fails (\"operation not permitted when stream is capturing\"). Use --timing-log-level 0; "
        "tools/bench.py --time-fwd-bwd times forward-backward around the graph."
    )


@rule(
    "full-iteration-graphs-dropless-moe",
    phase="layout",
    flags=("--cuda-graph-impl", "--num-experts", "--moe-expert-capacity-factor",
           "--moe-pad-expert-input-to-capacity", "--moe-token-dispatcher-type", _experts.SPLITS_FLAG),
)
def _full_iteration_graphs_dropless_moe(args):
    """Dropless MoE reads the per-expert token counts on the host inside the step (the all-to-all
    dispatcher's device-to-host copy and wait, TEGroupedMLP's .tolist()), which a capture refuses;
    the fork's device-side counts remove both. Drop-and-pad is static only in the all-to-all
    dispatcher. Paged stashing has its own rule."""
    if args.cuda_graph_impl != "full_iteration" or not args.num_experts or _stash_or_budget(args):
        return None
    if _experts.splits_on_device(args):
        return None
    padded = _capacity_limited(args) and args.moe_pad_expert_input_to_capacity
    if padded and args.moe_token_dispatcher_type == "alltoall":  # static counts, built on the host
        return None
    if padded:
        return (
            f"--cuda-graph-impl full_iteration with the {args.moe_token_dispatcher_type} dispatcher: it reads "
            "the token counts on the host inside the step even with drop-and-pad (the allgather dispatcher's "
            ".cpu()/.item()), which the capture refuses. Use --moe-token-dispatcher-type alltoall."
        )
    return (
        "--cuda-graph-impl full_iteration with a dropless MoE: the dispatcher copies the per-expert token "
        "counts to the host and waits for them inside the step (the experts split their input on the host), "
        "which the capture refuses. With one expert-parallel rank use --moe-grouped-gemm-impl torch "
        f"{_experts.SPLITS_FLAG} (the counts stay on the GPU); else use per-layer graphs "
        "(--cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess)."
    )


FEATURES.append(Feature(name="moe-grouped-gemm-torch", flags=(f"{_experts.FLAG} torch",), enabled=_experts.requested))
FEATURES.append(Feature(name="moe-expert-splits-on-device", flags=(_experts.SPLITS_FLAG,), enabled=_experts.splits_on_device))
# --- end experts' grouped GEMM ---
