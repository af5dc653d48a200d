#!/usr/bin/env bash
# Quick start: train the tiny MoE config (examples/configs/tiny_moe.args) on mock data with all
# local GPUs (expert parallelism over them). On a machine without an NVIDIA GPU (none that
# nvidia-smi lists, or no nvidia-smi) it checks the configuration with --dry-run instead and says
# that training needs a GPU.
#
#   bash examples/train_tiny_moe.sh                 # all local GPUs, EP = number of GPUs
#   NGPUS=1 bash examples/train_tiny_moe.sh         # one GPU
#   EXTRA="--train-iters 200" bash examples/train_tiny_moe.sh
#   DATA_PATH=/data/my_text_document bash examples/train_tiny_moe.sh   # real data
#   DRY_RUN=1 bash examples/train_tiny_moe.sh       # check the flags, no GPU
#
# Every knob is an environment variable with a default: NGPUS (the GPUs here), EP (NGPUS).
# DATA_PATH is megatron's --data-path (a prefix, or a blend "0.3 /data/a 0.7 /data/b"); unset, the
# config's mock data. With it TOKENIZER_TYPE (default HuggingFaceTokenizer), TOKENIZER_MODEL
# (default Qwen/Qwen3-30B-A3B) or VOCAB_FILE and MERGE_FILE (GPT2BPETokenizer) choose the
# tokenizer. PYTHON, DRY_RUN and EXTRA: see examples/lib/launch.sh.
set -euo pipefail
# shellcheck source=examples/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"

int_knobs 1 NGPUS EP
if [ -z "${NGPUS:-}" ]; then
  NGPUS=$(gpus_here)
  if [ "$NGPUS" -eq 0 ]; then
    echo "No NVIDIA GPU visible: checking the tiny MoE configuration with --dry-run."
    echo "Training needs an NVIDIA GPU (and TransformerEngine for the default layer spec)."
    NGPUS=1
    DRY_RUN=1
  fi
fi
EP=${EP:-$NGPUS}

read_config examples/configs/tiny_moe.args
PARALLEL_ARGS=(--expert-model-parallel-size "$EP")
SPEC_ARGS=()
if [ "$DRY_RUN" = 0 ] && ! "$PYTHON" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
  echo "TransformerEngine is not installed: training with the local (PyTorch) layer spec."
  echo "For the TransformerEngine spec: pip install -e '.[te]'"
  config_without --moe-grouped-gemm 0
  SPEC_ARGS=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm
             --no-gradient-accumulation-fusion)
fi

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
launch_local "$NGPUS" "EP=$EP" "${CONFIG_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${SPEC_ARGS[@]}"
