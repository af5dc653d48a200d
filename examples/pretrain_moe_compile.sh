#!/usr/bin/env bash
# MoE pretraining with every TransformerLayer compiled by torch.compile (--compile-transformer-layers):
# the layer's forward is compiled in place, the MoE token dispatch, expert computation and combine
# run eagerly, and after the warm-up iterations a recompile of a compiled layer is an error. The log
# shows "> compile: ..." lines: the first iteration's (compile) time, graphs and graph breaks.
#
#   bash examples/pretrain_moe_compile.sh                      # tiny MoE config, EP over all local GPUs
#   FSDP=1 bash examples/pretrain_moe_compile.sh               # under Megatron-FSDP (EP=1, DP = GPUs)
#   MODE=max-autotune-no-cudagraphs bash examples/pretrain_moe_compile.sh
#   COMPILE=0 bash examples/pretrain_moe_compile.sh            # the same run eagerly
#   DATA_PATH=/data/my_text_document bash examples/pretrain_moe_compile.sh   # real data
#   DRY_RUN=1 bash examples/pretrain_moe_compile.sh            # check the flags, no GPU
#
# Every knob is an environment variable with a default. NGPUS defaults to the GPUs nvidia-smi
# lists, or 1 without nvidia-smi. DATA_PATH is megatron's --data-path (a prefix, or a blend
# "0.3 /data/a 0.7 /data/b"); unset, the config's mock data. With it TOKENIZER_TYPE (default
# HuggingFaceTokenizer), TOKENIZER_MODEL (default Qwen/Qwen3-30B-A3B) or VOCAB_FILE and MERGE_FILE
# (GPT2BPETokenizer) choose the tokenizer. PYTHON, DRY_RUN and EXTRA: see examples/lib/launch.sh.
set -euo pipefail
# shellcheck source=examples/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"

# ---- knobs (the compile recipe's: FSDP, COMPILE, MODE, WARMUP, EP; docs/recipes.md) ------
CONFIG=${CONFIG:-examples/configs/tiny_moe.args}
FSDP=${FSDP:-0}
TRAIN_ITERS=${TRAIN_ITERS:-50}
int_knobs 1 TRAIN_ITERS EP
recipe_args compile                  # the knobs set so far, checked before anything prints
default_ngpus 1
EP=${EP:-$([ "$FSDP" = 1 ] && echo 1 || echo "$NGPUS")}

# ---- arguments, by group -------------------------------------------------------------
read_config "$CONFIG"
TRAINING_ARGS=(--train-iters "$TRAIN_ITERS" --global-batch-size $((4 * NGPUS)))
recipe_args compile

# ---- launch (DRY_RUN=1: the --dry-run of the same flags) -------------------------------
launch_local "$NGPUS" "compile recipe, EP=$EP FSDP=$FSDP COMPILE=${COMPILE:-1}" \
  "${CONFIG_ARGS[@]}" "${TRAINING_ARGS[@]}" "${RECIPE_ARGS[@]}"
