"""``pretrain_gpt.py --dry-run``: check a flag combination on a login node, without a GPU.

It runs what a real launch runs before it touches a GPU (megatron's argument parsing and
validation, the model's ``TransformerConfig`` with its ``__post_init__`` checks, and the fork's
rules) for the world size given by ``--dry-run-world-size`` or ``WORLD_SIZE``, then prints
the parallel layout, the fork features and patches the run would use, megatron's parameter
count and theoretical memory estimate, and the packages the run needs.

The check is about the combination, not the installation: where no GPU or no
TransformerEngine is present, megatron's device and version queries answer as on the fork's
target (a Hopper GPU, sm_90, with TransformerEngine 2.20.2) for the duration of the check.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator

from megatron.patchset.core import (
    checkpoint_check,
    features,
    flags,
    model_hooks,
    preflight,
    registry,
    rules,
    versions,
)
from megatron.patchset.core.errors import PatchsetError

TARGET_CAPABILITY = (9, 0)
TARGET_DEVICE_NAME = "NVIDIA H100 80GB HBM3 (dry-run target)"
TARGET_TE_VERSION = versions.SUPPORTED_TE_RANGE[0]


# Module attributes that megatron sets to None when TransformerEngine is missing and that
# TransformerConfig.__post_init__ checks for.
_TE_KERNELS = (
    ("megatron.core.models.common.embeddings.rope_utils", ("fused_apply_rotary_pos_emb",)),
    (
        "megatron.core.transformer.moe.moe_utils",
        (
            "fused_permute",
            "fused_permute_with_probs",
            "fused_sort_chunks_by_index",
            "fused_sort_chunks_by_index_with_probs",
            "fused_unpermute",
        ),
    ),
)


def _not_on_this_machine(*_args, **_kwargs):
    raise RuntimeError("dry-run stand-in for a TransformerEngine kernel was called")


@contextlib.contextmanager
def target_device() -> Iterator[list[str]]:
    """Answer megatron's device/TE queries as the target machine would, if this one can't.

    Yields the list of emulated facts (empty on a machine with a GPU and TE).
    """
    import megatron.core.utils as mcore_utils
    import torch

    emulated: list[str] = []
    saved: list[tuple[object, str, object]] = []

    def swap(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if not torch.cuda.is_available():
        props = types.SimpleNamespace(
            major=TARGET_CAPABILITY[0],
            minor=TARGET_CAPABILITY[1],
            name=TARGET_DEVICE_NAME,
            total_memory=80 * 1024**3,
            multi_processor_count=132,
        )
        swap(torch.cuda, "get_device_capability", lambda *a, **k: TARGET_CAPABILITY)
        swap(torch.cuda, "get_device_properties", lambda *a, **k: props)
        emulated.append(
            f"GPU: sm_{TARGET_CAPABILITY[0]}{TARGET_CAPABILITY[1]} ({TARGET_DEVICE_NAME})"
        )
    if importlib.util.find_spec("transformer_engine") is None:
        from packaging.version import Version

        swap(mcore_utils, "_te_version", Version(TARGET_TE_VERSION))
        # TransformerConfig checks that TE's fused kernels imported (RoPE fusion is on by
        # default; --moe-permute-fusion); stand in for them while the config is built.
        for module, names in _TE_KERNELS:
            owner = importlib.import_module(module)
            for name in names:
                if getattr(owner, name, None) is None:
                    swap(owner, name, _not_on_this_machine)
        emulated.append(f"transformer-engine {TARGET_TE_VERSION}")
    try:
        yield emulated
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def required_packages(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(package, why) for everything the run will import beyond torch and megatron-core."""
    need = [("megatron-core==" + versions.SUPPORTED_MCORE_VERSION, "pinned upstream")]
    te = f"transformer-engine[pytorch]=={TARGET_TE_VERSION}"
    if args.transformer_impl == "transformer_engine":
        need.append((te, "--transformer-impl transformer_engine"))
    tokenizer_pkgs = {
        "SentencePieceTokenizer": "sentencepiece",
        "GPTSentencePieceTokenizer": "sentencepiece",
        "Llama2Tokenizer": "sentencepiece",
        "TikTokenizer": "tiktoken",
        "HuggingFaceTokenizer": "transformers",
        "GPT2BPETokenizer": "transformers",
        "BertWordPieceLowerCase": "transformers",
        "BertWordPieceCase": "transformers",
    }
    if args.tokenizer_type in tokenizer_pkgs:
        need.append(
            (tokenizer_pkgs[args.tokenizer_type], f"--tokenizer-type {args.tokenizer_type}")
        )
    if getattr(args, "gradient_accumulation_fusion", False):
        # megatron's own ColumnParallelLinear (the output layer, also with the TE spec) then
        # needs apex's fused_weight_gradient_mlp_cuda extension.
        need.append(
            (
                "apex (fused_weight_gradient_mlp_cuda extension)",
                "gradient accumulation fusion, on by default; or pass "
                "--no-gradient-accumulation-fusion",
            )
        )
    if getattr(args, "save", None):
        need.append(("psutil", "--save (megatron-core's checkpoint writer)"))
    if getattr(args, "wandb_project", None):
        need.append(("wandb", "--wandb-project"))
    if getattr(args, "tensorboard_dir", None):
        need.append(("tensorboard", "--tensorboard-dir"))
    for feature in features.enabled(args):
        need.extend(feature.packages(args))
    return need


def _import_name(package: str) -> str | None:
    base = package.split("[")[0].split("=")[0].split(" ")[0].strip()
    if base == "apex":
        return "fused_weight_gradient_mlp_cuda"
    return {
        "megatron-core": "megatron.core",
        "transformer-engine": "transformer_engine",
        "deep_ep": "deep_ep",
    }.get(base, base.replace("-", "_"))


def installed(package: str) -> bool:
    """Whether a package of :func:`required_packages` imports on this machine."""
    name = _import_name(package)
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _layout_lines(args: argparse.Namespace) -> list[str]:
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    ep = args.expert_model_parallel_size
    pp = args.pipeline_model_parallel_size
    expert_dp = args.world_size // (etp * ep * pp)
    vpp = args.virtual_pipeline_model_parallel_size
    return [
        f"  world size ........................ {args.world_size}",
        f"  tensor model parallel (TP) ........ {args.tensor_model_parallel_size}",
        f"  pipeline model parallel (PP) ...... {pp}",
        f"  virtual pipeline stages (VPP) ..... {vpp if vpp is not None else '-'}",
        f"  context parallel (CP) ............. {args.context_parallel_size}",
        f"  expert model parallel (EP) ........ {ep}",
        f"  expert tensor parallel (ETP) ...... {etp}",
        f"  data parallel (DP) ................ {args.data_parallel_size}",
        f"  expert data parallel .............. {expert_dp}",
        "  micro-batches per step ............ "
        f"{args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)} (global "
        f"{args.global_batch_size}, micro {args.micro_batch_size})",
    ]


def count_parameters(args: argparse.Namespace, config) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model, built on the meta device.

    The model is built unsharded (all parallel sizes 1) with the local layer spec, which has the
    same parameters as TransformerEngine's; nothing is allocated. Active parameters count
    ``moe_router_topk`` of the ``num_moe_experts`` routed experts.
    """
    dense, expert = parameter_split(args, config)
    total = dense + expert
    active = dense
    if config.num_moe_experts:
        active += expert * config.moe_router_topk // config.num_moe_experts
    return total, active


def parameter_split(args: argparse.Namespace, config) -> tuple[int, int]:
    """(dense, expert) parameters of the whole model, built on the meta device: expert
    parameters are the routed experts' (megatron shards them over the expert-parallel group and
    their optimizer state over the expert data-parallel group), dense ones everything else
    (shared experts, router, attention, norms, embeddings and output layer).

    The model is built unsharded (all parallel sizes 1) with the local layer spec, which has the
    same parameters as TransformerEngine's; nothing is allocated. The counts are kept per model
    shape (the dry-run and ``--memory-budget`` both ask).
    """
    import dataclasses

    key = (
        args.padded_vocab_size,
        args.max_position_embeddings,
        args.position_embedding_type,
        args.untie_embeddings_and_output_weights,
        tuple(
            (field.name, repr(getattr(config, field.name)))
            for field in dataclasses.fields(config)
            if not callable(getattr(config, field.name))
        ),
    )
    if key not in _SPLITS:
        _SPLITS[key] = _build_and_split(args, config)
    return _SPLITS[key]


_SPLITS: dict[tuple, tuple[int, int]] = {}


def _build_and_split(args: argparse.Namespace, config) -> tuple[int, int]:
    import dataclasses

    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if torch.distributed.is_initialized():
        raise RuntimeError("count_parameters builds its own single-process group")
    single = dataclasses.replace(
        config,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        sequence_parallel=False,
        pipeline_model_parallel_layout=None,
        num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        mtp_num_layers=None,
        # the dispatcher holds no parameters; all-gather's needs no CUDA stream at build time
        moe_token_dispatcher_type="allgather",
        # the config default: the ncclep/hybridep checks need the flex dispatcher
        moe_flex_dispatcher_backend="deepep",
        moe_expert_rank_capacity_factor=None,
        moe_paged_stash=False,
        # schedule options that require expert parallelism, which the unsharded build drops
        overlap_moe_expert_parallel_comm=False,
        delay_wgrad_compute=False,
        ep_overlap_early_attn_memory_release=False,
        # the MoE layer's weight-gradient stream and event hold no parameters and need a GPU
        overlap_dispatch_backward_with_experts_wgrad=False,
        # CUDA graphs hold no parameters; megatron's local ones need the GPU and the RNG tracker
        # of a launch to be built
        cuda_graph_impl="none",
        inference_cuda_graph_scope=None,
    )
    # megatron's model constructor sets TransformerEngine's attention-backend variables; a launch
    # (--memory-budget) builds its real model later and sets them itself
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("NVTE_")}
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        parallel_state.initialize_model_parallel()
        if single.num_moe_experts:
            spec = get_gpt_decoder_block_spec(single, use_transformer_engine=False)
        else:
            spec = get_gpt_layer_local_spec()
        logging.disable(logging.WARNING)  # GPTModel's deprecation notice
        with torch.device("meta"):
            model = GPTModel(
                config=single,
                transformer_layer_spec=spec,
                vocab_size=args.padded_vocab_size,
                max_sequence_length=args.max_position_embeddings,
                position_embedding_type=args.position_embedding_type,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            )
        dense = expert = 0
        for name, param in model.named_parameters():
            if ".experts." in name and "shared_experts" not in name:
                expert += param.numel()
            else:
                dense += param.numel()
        return dense, expert
    finally:
        logging.disable(logging.NOTSET)
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        for name in [k for k in os.environ if k.startswith("NVTE_")]:
            if name not in saved_env:
                del os.environ[name]
        os.environ.update(saved_env)


def fill_padded_vocab_size(args: argparse.Namespace) -> str | None:
    """Set ``args.padded_vocab_size`` (unless set) as megatron's tokenizer set-up would, for
    megatron's parsed and validated arguments: the dry-run and the peers of
    ``tools/bench/bench.py`` size the embedding with it. Returns a note when the tokenizer cannot
    be loaded here but will be at launch (a Hugging Face hub id), else None. Raises
    :class:`preflight.PreflightError` for a tokenizer that cannot be built at all."""
    if getattr(args, "padded_vocab_size", None):
        return None
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    if args.vocab_size:
        vocab = args.vocab_size
    else:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

        try:
            with contextlib.redirect_stdout(io.StringIO()):
                vocab = build_tokenizer(args).vocab_size
        except Exception as exc:  # noqa: BLE001 - any loader failure is reported with its flags
            model = getattr(args, "tokenizer_model", None) or ""
            if args.tokenizer_type == "HuggingFaceTokenizer" and not os.path.exists(model):
                return (
                    f"--tokenizer-model {model} is not on this machine (a Hugging Face hub id is "
                    "downloaded at launch); the parameter count and the data's token ids are not "
                    "checked"
                )
            raise preflight.PreflightError(
                f"--tokenizer-type {args.tokenizer_type}"
                + (f" --tokenizer-model {model}" if model else "")
                + f": the tokenizer cannot be built ({type(exc).__name__}: {exc})"
            ) from exc
    args.padded_vocab_size = vocab_size_with_padding(vocab, args, logging_enabled=False)
    return None


def _checked_args(extra_args_provider: Callable):
    """Everything a launch checks before touching a GPU: (args, config, patches, notes, the
    checkpoint --load would load); raises ``PatchsetArgumentError``, ``PreflightError`` or
    ``PatchsetError``."""
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(extra_args_provider)
    args.dry_run = True  # also when run() is called without --dry-run in argv
    if args.dry_run_world_size is not None:
        args.world_size = args.dry_run_world_size
    args.rank = 0
    rules.validate(args, "layout")
    checkpoint = checkpoint_check.check(args, read_metadata=True)
    with contextlib.redirect_stdout(io.StringIO()):
        preflight.megatron_validated(lambda: validate_args(args, {}))
    notes = [note for note in [fill_padded_vocab_size(args)] if note]
    model_hooks.resolve_arguments(args)  # the dry-run prints each feature's report instead
    with contextlib.redirect_stdout(io.StringIO()):
        config = preflight.megatron_validated(lambda: core_transformer_config_from_args(args))
    rules.validate(args, "combination", config=config)
    patches = registry.selected(args)
    return args, config, patches, notes, checkpoint


def run(
    argv: list[str] | None = None,
    extra_args_provider: Callable = flags.add_patchset_args,
    out=None,
) -> int:
    """Run the dry-run check; returns the process exit code (0 = valid, 2 = invalid; argparse's
    own errors and --help exit as argparse does)."""
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)

    def say(line=""):
        print(line, file=out, flush=True)

    def invalid(message: str) -> int:
        say(message)
        say("dry-run: INVALID")
        return 2

    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "pretrain_gpt.py"] + argv
    early: list[str] = []
    try:
        try:
            preflight.check_environment()
            # what needs no flags (--help's percent signs), as the launch applies it before parsing
            early = registry.apply_patches([p for p in registry.wanted(None) if p.kind == "compat"])
        except PatchsetError as exc:
            return invalid(str(exc))
        with target_device() as emulated:
            try:
                args, config, patches, notes, checkpoint = _checked_args(extra_args_provider)
                with contextlib.redirect_stdout(io.StringIO()):
                    counted = (
                        count_parameters(args, config)
                        if getattr(args, "padded_vocab_size", None)
                        else None
                    )
            except (rules.PatchsetArgumentError, PatchsetError) as exc:
                return invalid(str(exc))
            except Exception as exc:  # noqa: BLE001 - the model does not build: report it
                return invalid(
                    "the model cannot be built with these flags: "
                    + preflight.describe_megatron_failure(exc).removeprefix(
                        "megatron-core refused the flags: "
                    )
                )
            _report(args, config, patches, notes, checkpoint, counted, emulated, say)
            return 0
    finally:
        sys.argv = saved_argv
        registry.revert(early)


def _report(args, config, patches, notes, checkpoint, counted, emulated, say) -> None:
    say("=" * 72)
    say(f"megatron-patchset dry-run (megatron-core {versions.installed_mcore_version()})")
    if emulated:
        say("  checked as on the target machine: " + "; ".join(emulated))
    say("parallel layout:")
    for line in _layout_lines(args):
        say(line)
    enabled = features.enabled(args)
    say("fork features enabled: " + ("; ".join(f.describe(args) for f in enabled) or "none"))
    say(f"patches that would apply ({len(patches)}):")
    width = max(len(p.name) for p in patches)
    for p in patches:
        say(f"  {p.name:<{width}} {p.target}")
    say(f"data: {_data_line(args)}")
    if checkpoint:
        say(f"checkpoint: {checkpoint}")
    say(
        f"model: {type(config).__name__}, {args.num_layers} layers, hidden "
        f"{args.hidden_size}, {args.num_experts or 0} experts "
        f"(top-{args.moe_router_topk if args.num_experts else 0}), params "
        f"{str(config.params_dtype).replace('torch.', '')}"
    )
    if counted is not None:
        total, active = counted
        say(
            f"parameters: {total:,} in total, {active:,} active per token (padded "
            f"vocabulary {args.padded_vocab_size:,})"
        )
    for note in notes:
        say(f"note: {note}")
    for line in _memory_lines(args):
        say(line)
    for feature in enabled:
        for line in feature.report(args) if feature.report is not None else []:
            say(line)
    say("packages the run needs:")
    for package, why in required_packages(args):
        here = "installed here" if installed(package) else "not installed here"
        say(f"  {package:<52} ({why}; {here})")
    say("dry-run: OK")


def _memory_lines(args) -> list[str]:
    """megatron's theoretical memory estimate, or one line saying why there is none."""
    if not getattr(args, "padded_vocab_size", None):
        model = getattr(args, "tokenizer_model", None)
        return [
            "theoretical memory estimate unavailable: the vocabulary size is not known here (the "
            "tokenizer"
            + (f" --tokenizer-model {model}" if model else "")
            + " is not on this machine)"
        ]
    try:
        from megatron.training.theoretical_memory_usage import report_theoretical_memory

        num_micro = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        estimate = io.StringIO()
        with contextlib.redirect_stdout(estimate):
            report_theoretical_memory(args, num_microbatches=num_micro, verbose=True)
    except Exception as exc:  # noqa: BLE001 - an estimate failure must not hide a valid layout
        return [
            "theoretical memory estimate unavailable: megatron's estimate does not cover these "
            f"flags ({type(exc).__name__}: {exc})"
        ]
    return ["megatron's parameter count and theoretical memory (per GPU):"] + [
        "  " + line.strip()
        for line in estimate.getvalue().splitlines()
        if line.strip() and "compute_activation_memory" not in line
    ]


def _data_line(args) -> str:
    if args.mock_data:
        return "mock data (--mock-data)"
    from megatron.patchset.core.layout_rules.data import data_prefixes

    found, _ = data_prefixes(args)
    shown = ", ".join(prefix for _, prefix in found[:4]) + (" ..." if len(found) > 4 else "")
    return f"{len(found)} indexed dataset(s): {shown} (--tokenizer-type {args.tokenizer_type})"


def main() -> None:  # pragma: no cover - exercised through pretrain_gpt.py
    sys.exit(run())
