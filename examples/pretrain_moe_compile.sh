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

# ---- knobs ---------------------------------------------------------------------------
CONFIG=${CONFIG:-examples/configs/tiny_moe.args}
FSDP=${FSDP:-0}                 # 1: Megatron-FSDP (optim_grads_params), no expert parallelism
COMPILE=${COMPILE:-1}           # 0: eager, for comparison
MODE=${MODE:-default}           # --compile-transformer-layers-mode
WARMUP=${WARMUP:-2}             # --compile-transformer-layers-warmup-iters
TRAIN_ITERS=${TRAIN_ITERS:-50}
switch_knobs FSDP COMPILE
choice_knob MODE default max-autotune-no-cudagraphs reduce-overhead max-autotune
int_knobs 0 WARMUP
int_knobs 1 TRAIN_ITERS EP
default_ngpus 1
EP=${EP:-$([ "$FSDP" = 1 ] && echo 1 || echo "$NGPUS")}

# ---- arguments, by group -------------------------------------------------------------
read_config "$CONFIG"
TRAINING_ARGS=(--train-iters "$TRAIN_ITERS" --global-batch-size $((4 * NGPUS)))
PARALLEL_ARGS=(--expert-model-parallel-size "$EP")
if [ "$FSDP" = 1 ]; then
  # Megatron-FSDP's hooks sit on whole TransformerLayers (its unit modules), outside the compiled
  # forward. It needs the fsdp_dtensor checkpoint format and more than one CUDA connection.
  PARALLEL_ARGS+=(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
                  --no-gradient-accumulation-fusion --ckpt-format fsdp_dtensor)
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-8}
fi
COMPILE_ARGS=()
if [ "$COMPILE" = 1 ]; then
  COMPILE_ARGS=(--compile-transformer-layers --compile-transformer-layers-mode "$MODE"
                --compile-transformer-layers-warmup-iters "$WARMUP")
fi

# ---- launch (DRY_RUN=1: the --dry-run of the same flags) -------------------------------
launch_local "$NGPUS" "EP=$EP FSDP=$FSDP COMPILE=$COMPILE" \
  "${CONFIG_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${COMPILE_ARGS[@]}"
