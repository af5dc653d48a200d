#!/usr/bin/env bash
# The small-micro-batch recipe (docs/recipes.md#small_batch) on this machine: MoE training out of
# the host-overhead regime, with the experts as grouped GEMMs whose token counts stay on the GPU,
# the whole forward and backward replayed as one CUDA graph, the optimizer step as a second, and
# the fork's Triton Adam and cross entropy. Its measured speed against upstream's best and
# torchtitan is in docs/benchmarks.md.
#
#   bash examples/pretrain_moe_small_batch.sh                         # reference config, 1 GPU
#   MICRO_BATCH=4 bash examples/pretrain_moe_small_batch.sh           # 4 x 4096 tokens per step
#   GRAPHS=layer bash examples/pretrain_moe_small_batch.sh            # per-layer TE graphs instead
#   GRAPHS=none bash examples/pretrain_moe_small_batch.sh             # the same GEMMs, no graphs
#   KERNELS=0 bash examples/pretrain_moe_small_batch.sh               # megatron's Adam and loss
#   NGPUS=2 EP=2 bash examples/pretrain_moe_small_batch.sh            # experts over 2 GPUs
#   MEMORY=80G MICRO_BATCH=4 bash examples/pretrain_moe_small_batch.sh  # fit an 80 GB H100
#   DATA_PATH=/data/my_text_document TOKENIZER_MODEL=Qwen/Qwen3-30B-A3B bash ...
#   DRY_RUN=1 bash examples/pretrain_moe_small_batch.sh               # check the flags, no GPU
#
# Every knob is an environment variable with a default: the recipe's knobs (GRAPHS, EP,
# CAPACITY_FACTOR, A2A_CHUNKS, DEDUP, WGRAD_OVERLAP, WGRAD_SMS, DP_OVERLAP, CUDNN_NORMS,
# SWIGLU_KERNELS, OPTIMIZER_GRAPH, KERNELS, DIST_OPT, MEMORY;
# `python -m megatron.patchset recipe --list`)
# and the run's: CONFIG, NGPUS, MICRO_BATCH, GLOBAL_BATCH, TRAIN_ITERS. DATA_PATH is megatron's
# --data-path (a prefix, or a blend "0.3 /data/a 0.7 /data/b"); unset, the config's mock data. With
# it TOKENIZER_TYPE (default HuggingFaceTokenizer), TOKENIZER_MODEL (default Qwen/Qwen3-30B-A3B) or
# VOCAB_FILE and MERGE_FILE (GPT2BPETokenizer) choose the tokenizer. PYTHON, DRY_RUN and EXTRA:
# see examples/lib/launch.sh.
set -euo pipefail
# shellcheck source=examples/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"

# ---- knobs ---------------------------------------------------------------------------
CONFIG=${CONFIG:-examples/configs/reference_moe.args}
NGPUS=${NGPUS:-1}
MICRO_BATCH=${MICRO_BATCH:-1}
int_knobs 1 NGPUS MICRO_BATCH
GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * NGPUS))}
TRAIN_ITERS=${TRAIN_ITERS:-50}
int_knobs 1 GLOBAL_BATCH TRAIN_ITERS

# ---- arguments, by group -------------------------------------------------------------
read_config "$CONFIG"
TRAINING_ARGS=(--micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS")
recipe_args small_batch   # exports its environment defaults (CUDA_DEVICE_MAX_CONNECTIONS, ...) unless set

# ---- launch (DRY_RUN=1: the --dry-run of the same flags) -------------------------------
launch_local "$NGPUS" "small_batch recipe, EP=${EP:-1}, micro-batch $MICRO_BATCH" \
  "${CONFIG_ARGS[@]}" "${TRAINING_ARGS[@]}" "${RECIPE_ARGS[@]}"
