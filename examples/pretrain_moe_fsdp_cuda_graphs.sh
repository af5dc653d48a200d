#!/usr/bin/env bash
# MoE pretraining with Megatron-FSDP and TransformerEngine per-layer (partial) CUDA graphs: the
# fsdp_cuda_graphs recipe (docs/recipes.md#fsdp_cuda_graphs), Megatron-FSDP's double buffer at
# fixed parameter-buffer addresses and TE graphs over each scope of --cuda-graph-modules.
#
# The fork takes Megatron-FSDP's hooks off each graphed layer for capture, runs FSDP's inner
# handlers through TE's capture_time_hooks and puts the hooks back, so that replay gathers and
# releases each layer's parameters as eager FSDP does (losses bit-identical to eager).
#
# Default: 2 GPUs of one machine, parameters sharded over DP=2, the tiny MoE config.
#
#   bash examples/pretrain_moe_fsdp_cuda_graphs.sh
#   EP=2 bash examples/pretrain_moe_fsdp_cuda_graphs.sh                  # experts over 2 GPUs
#   SCOPES="moe_router" bash examples/pretrain_moe_fsdp_cuda_graphs.sh   # router graph only
#   GRAPHS=0 bash examples/pretrain_moe_fsdp_cuda_graphs.sh              # eager FSDP, same flags else
#   DATA_PATH=/data/my_text_document bash examples/pretrain_moe_fsdp_cuda_graphs.sh   # real data
#   DRY_RUN=1 bash examples/pretrain_moe_fsdp_cuda_graphs.sh             # check the flags, no GPU
#
# Every knob is an environment variable with a default. DATA_PATH is megatron's --data-path (a
# prefix, or a blend "0.3 /data/a 0.7 /data/b"); unset, the config's mock data. With it
# TOKENIZER_TYPE (default HuggingFaceTokenizer), TOKENIZER_MODEL (default Qwen/Qwen3-30B-A3B) or
# VOCAB_FILE and MERGE_FILE (GPT2BPETokenizer) choose the tokenizer. PYTHON, DRY_RUN and EXTRA:
# see examples/lib/launch.sh.
set -euo pipefail
# shellcheck source=examples/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"

# ---- knobs (the fsdp_cuda_graphs recipe's: EP, GRAPHS, SCOPES, WARMUP_STEPS; docs/recipes.md) --
CONFIG=${CONFIG:-examples/configs/tiny_moe.args}
NGPUS=${NGPUS:-2}
TRAIN_ITERS=${TRAIN_ITERS:-50}
int_knobs 1 NGPUS TRAIN_ITERS

# ---- arguments, by group -------------------------------------------------------------
read_config "$CONFIG"
TRAINING_ARGS=(--train-iters "$TRAIN_ITERS")
recipe_args fsdp_cuda_graphs   # exports CUDA_DEVICE_MAX_CONNECTIONS=8 unless set

# ---- launch (DRY_RUN=1: the --dry-run of the same flags) -------------------------------
launch_local "$NGPUS" "fsdp_cuda_graphs recipe, EP=${EP:-1}, graphs ${GRAPHS:-1}" \
  "${CONFIG_ARGS[@]}" "${TRAINING_ARGS[@]}" "${RECIPE_ARGS[@]}"
