#!/usr/bin/env bash
# MoE pretraining with the fine-grained 1F1B schedule (EP all-to-all overlapped with compute)
# in an interleaved pipeline, and the fork's backward-P2P overlap: the p2p_overlap recipe
# (docs/recipes.md#p2p_overlap), whose knobs BWD_ON_COMM, DELAYED_LAYERS and TL_WGRAD set
# --overlap-p2p-backward-on-comm-stream, --overlap-p2p-wgrad-delayed-layer-number and
# --overlap-p2p-with-transformer-layer-wgrad.
#
# Layout: PP=2 x VPP=2 x EP=2 on 4 GPUs of one machine (TP=1, DP=2), the tiny MoE config
# (examples/configs/tiny_moe.args) at 8 layers, i.e. 2 layers per model chunk.
#
#   bash examples/pretrain_moe_p2p_overlap.sh
#   DELAYED_LAYERS=1 TL_WGRAD=0 bash examples/pretrain_moe_p2p_overlap.sh   # attention only, 1 layer
#   P2P_OVERLAP=0 bash examples/pretrain_moe_p2p_overlap.sh                 # megatron's own schedule
#   DATA_PATH=/data/my_text_document bash examples/pretrain_moe_p2p_overlap.sh   # real data
#   DRY_RUN=1 bash examples/pretrain_moe_p2p_overlap.sh                     # check the flags, no GPU
#
# Every knob is an environment variable with a default. DATA_PATH is megatron's --data-path (a
# prefix, or a blend "0.3 /data/a 0.7 /data/b"); unset, the config's mock data. With it
# TOKENIZER_TYPE (default HuggingFaceTokenizer), TOKENIZER_MODEL (default Qwen/Qwen3-30B-A3B) or
# VOCAB_FILE and MERGE_FILE (GPT2BPETokenizer) choose the tokenizer. PYTHON, DRY_RUN and EXTRA:
# see examples/lib/launch.sh.
set -euo pipefail
# shellcheck source=examples/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"

# ---- knobs (the p2p_overlap recipe's: EP, P2P_OVERLAP, BWD_ON_COMM, DELAYED_LAYERS, TL_WGRAD;
# docs/recipes.md) and the layout's -------------------------------------------------------
CONFIG=${CONFIG:-examples/configs/tiny_moe.args}
NGPUS=${NGPUS:-4}
TP=${TP:-1}                     # tensor model parallel
PP=${PP:-2}                     # pipeline model parallel
VPP=${VPP:-2}                   # virtual pipeline stages (model chunks) per pipeline rank
NUM_LAYERS=${NUM_LAYERS:-8}     # NUM_LAYERS / PP / VPP layers per model chunk
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}  # 8 micro-batches per step at DP=2
TRAIN_ITERS=${TRAIN_ITERS:-50}
int_knobs 1 NGPUS TP PP VPP NUM_LAYERS MICRO_BATCH GLOBAL_BATCH TRAIN_ITERS

# ---- arguments, by group -------------------------------------------------------------
read_config "$CONFIG"
MODEL_ARGS=(--num-layers "$NUM_LAYERS")
TRAINING_ARGS=(--micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS")
PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
  --num-layers-per-virtual-pipeline-stage $((NUM_LAYERS / PP / VPP))
)
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
recipe_args p2p_overlap   # exports CUDA_DEVICE_MAX_CONNECTIONS=32 unless set

# ---- launch (DRY_RUN=1: the --dry-run of the same flags) -------------------------------
launch_local "$NGPUS" "p2p_overlap recipe, PP=$PP VPP=$VPP EP=${EP:-2} TP=$TP" \
  "${CONFIG_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${RECIPE_ARGS[@]}"
