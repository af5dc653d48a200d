"""Pretrain a GPT or Mixture-of-Experts GPT with megatron-core 0.19.2 and megatron-patchset.

Usage is Megatron-LM's: ``torchrun --nproc-per-node N pretrain_gpt.py <megatron flags>``,
plus the fork's flags (``python -m megatron.patchset --list`` shows what they patch).
``pretrain_gpt.py --dry-run <flags>`` checks a flag combination without a GPU.

Start-up order:
  1. megatron's parser with the fork's flags; the fork's layout rules (parallel sizes against
     the world size), before megatron's own checks so that errors name the flag; the checkpoint
     that --load names (metadata and file sizes);
  2. megatron's ``parse_and_validate_args``; what a fork flag leaves to be chosen from the
     validated layout (``--memory-budget``'s levers);
  3. the model config (``TransformerConfig.__post_init__`` checks) and the fork's
     combination rules;
  4. the patches the flags ask for;
  5. megatron's ``pretrain``.
Everything up to 4 runs before any GPU memory is touched.
"""

import time

_PROGRAM_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from functools import partial  # noqa: E402

if os.environ.get("RANK", "0") not in ("", "0"):  # one copy of library warnings, not one per rank
    warnings.simplefilter("ignore")

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (  # noqa: E402
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.transformer.multi_token_prediction import (  # noqa: E402
    get_mtp_ranks,
    mtp_on_this_rank,
)
from megatron.core.utils import (  # noqa: E402
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_timers, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args, parse_args  # noqa: E402
from megatron.training.utils import (  # noqa: E402
    get_blend_and_blend_per_split,
    is_first_or_last_pipeline_stage,
)

from megatron.patchset import __version__ as patchset_version  # noqa: E402
from megatron.patchset.core import (  # noqa: E402
    checkpoint_check,
    dry_run,
    model_hooks,
    preflight,
    registry,
    rules,
    versions,
)
from megatron.patchset.core.errors import PatchsetError  # noqa: E402
from megatron.patchset.core.flags import add_patchset_args  # noqa: E402
from megatron.patchset.core.observe import metrics  # noqa: E402

# A loss this many times the largest seen so far is reported as a spike (--check-for-spiky-loss).
SPIKY_LOSS_FACTOR = 10

_BATCH_FIELDS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


_TRANSFORMER_CONFIG = None


def _transformer_config():
    """The run's TransformerConfig, built once (get_batch runs for every micro-batch)."""
    global _TRANSFORMER_CONFIG
    if _TRANSFORMER_CONFIG is None:
        _TRANSFORMER_CONFIG = core_transformer_config_from_args(get_args())
    return _TRANSFORMER_CONFIG


def _mtp_here(config, vp_stage):
    return mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator, vp_stage=None):
    """The micro-batch for this rank: (tokens, labels, loss_mask, attention_mask, position_ids).

    TP rank 0 reads the data loader and broadcasts to its tensor-parallel peers; the sequence
    is then split across context-parallel ranks. Pipeline stages that hold neither the
    embedding nor the loss (nor MTP layers) need no data and get Nones.
    """
    args = get_args()
    mtp_here = _mtp_here(_transformer_config(), vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return (None,) * len(_BATCH_FIELDS)

    batch = {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if tp_rank == 0:
        raw = next(data_iterator)
        for key in _BATCH_FIELDS:
            value = raw.get(key)
            batch[key] = value.cuda(non_blocking=True) if value is not None else None
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group()
    )
    return tuple(batch.get(key) for key in _BATCH_FIELDS)


def dataset_config_from_args(args) -> GPTDatasetConfig:
    """Megatron's GPT dataset config for mock data or indexed (``--data-path``) datasets."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as handle:
            sequences_per_dataset = json.load(handle)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        sequences_per_dataset=sequences_per_dataset,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def is_dataset_built_on_rank(vp_stage=None):
    """Datasets are read by TP rank 0 of the stages that consume tokens or labels."""
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return is_first_or_last_pipeline_stage(vp_stage) or _mtp_here(_transformer_config(), vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build the train, validation and test datasets (mock or indexed)."""
    args = get_args()
    dataset_cls = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets ({dataset_cls.__name__}) ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_cls,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        dataset_config_from_args(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Megatron builds data iterators on every rank and lets the provider decide (core datasets).
train_valid_test_datasets_provider.is_distributed = True


# ---------------------------------------------------------------------------------------
# Loss and forward step
# ---------------------------------------------------------------------------------------


def loss_func(loss_mask, output_tensor, model=None):
    """Sum of the masked per-token losses, the token count, and the report for the logs.

    Returns (loss, num_tokens, {'lm loss': [loss, num_tokens]}); megatron divides by the
    token count after reducing across data-parallel ranks.
    """
    args = get_args()
    per_token = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = (per_token * mask).sum()
    num_tokens = mask.sum().detach().to(torch.int)

    checker = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            checker.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    if args.check_for_spiky_loss:
        checker.validate_result(
            result=loss,
            rejection_func=partial(
                checker.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
    report = torch.stack([loss.detach(), num_tokens.to(loss.dtype)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch forward: returns the output and the loss function to apply to it.

    With ``return_schedule_plan`` (megatron's fine-grained EP-overlap schedule,
    ``--overlap-moe-expert-parallel-comm``) the model's schedule plan is returned instead.
    """
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()

    if return_schedule_plan:
        if not args.overlap_moe_expert_parallel_comm:
            raise RuntimeError("a schedule plan needs --overlap-moe-expert-parallel-comm")
        plan = model.build_schedule_plan(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        )
        return plan, partial(loss_func, loss_mask, model=model)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask, model=model)


def get_embedding_ranks(pp_ranks):
    """Ranks holding word embeddings: the first stage, the last one when tied, and MTP's."""
    args = get_args()
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        if not args.untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, _transformer_config()))
    return sorted(ranks)


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


def model_config_from_args(args):
    """The GPT/MoE model config: megatron's TransformerConfig (its ``__post_init__`` checks
    run here), checked by the fork's combination rules, wrapped in megatron's GPTModelConfig.

    The layer spec is megatron's default for the flags: TransformerEngine layers with
    ``--transformer-impl transformer_engine`` (MoE layers through the decoder block spec, with
    grouped GEMM when ``--moe-grouped-gemm``), plain PyTorch layers with ``--transformer-impl
    local``; ``--spec`` overrides it as upstream.
    """
    transformer_config = preflight.megatron_validated(
        lambda: core_transformer_config_from_args(args)
    )
    rules.validate(args, "combination", config=transformer_config)
    model_hooks.configure_transformer_config(args, transformer_config)
    return gpt_config_from_args(args, config=transformer_config)


def _check_packages(args) -> None:
    """Fail before launch when the packages that the flags need are missing."""
    missing = [
        f"{package} (needed for {why})"
        for package, why in dry_run.required_packages(args)
        if not dry_run.installed(package)
    ]
    if missing:
        raise preflight.PreflightError("megatron-patchset: missing packages: " + "; ".join(missing))


def preflight_args():
    """Everything before ``pretrain``, each failure one message without a traceback: the
    launcher's environment; what needs no flags (compat patches, e.g. for --help); the fork's
    layout rules; the checkpoint --load names (before megatron reads it, also with
    --use-checkpoint-args); the GPU (before megatron asks the driver); megatron's validation; the
    arguments the fork's flags choose from the validated layout; the model config and the fork's
    combination rules; the packages; the patches."""
    preflight.check_environment()
    registry.apply(None)
    raw = parse_args(add_patchset_args)
    rules.validate(raw, "layout")
    checkpoint = checkpoint_check.check(raw)
    if checkpoint:
        print_rank_0(f"> megatron-patchset checkpoint: {checkpoint}")
    preflight.require_gpu()
    args = preflight.megatron_validated(
        lambda: parse_and_validate_args(extra_args_provider=add_patchset_args)
    )
    for line in model_hooks.resolve_arguments(args):
        print_rank_0(f"> megatron-patchset {line}")
    model_config = model_config_from_args(args)
    _check_packages(args)
    applied = registry.apply(args)
    return args, model_config, applied


def main() -> None:
    if "--dry-run" in sys.argv[1:]:
        sys.exit(dry_run.run())
    print_rank_0(
        f"> megatron-patchset {patchset_version} on megatron-core "
        f"{versions.installed_mcore_version()}, torch {torch.__version__}, transformer-engine "
        f"{versions.installed_te_version() or 'not installed'}"
    )
    try:
        args, model_config, applied = preflight_args()
    except (rules.PatchsetArgumentError, PatchsetError) as exc:
        sys.exit(str(exc))
    print_rank_0(f"> megatron-patchset patches applied: {', '.join(applied) or 'none'}")
    pretrain(
        pretrain_cfg_container_from_args(args, model_config),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        get_embedding_ranks=get_embedding_ranks,
    )
    metrics.write_summary()


if __name__ == "__main__":
    main()
