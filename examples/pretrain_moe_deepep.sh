#!/usr/bin/env bash
# MoE pretraining with the flex token dispatcher: DeepEP (default), HybridEP or TransformerEngine's
# NCCL EP instead of megatron's all-to-all, on the GPUs of one machine.
#
#   bash examples/pretrain_moe_deepep.sh                       # DeepEP, EP = number of GPUs
#   BACKEND=ncclep bash examples/pretrain_moe_deepep.sh        # TE NCCL EP (needs NCCL >= 2.32.3)
#   BACKEND=alltoall bash examples/pretrain_moe_deepep.sh      # megatron's all-to-all, for comparison
#   DATA_PATH=/data/my_text_document bash examples/pretrain_moe_deepep.sh   # real data
#   DRY_RUN=1 bash examples/pretrain_moe_deepep.sh             # check the flags, no GPU
#
# DeepEP is built from source, never installed from a registry (docs/deepep.md):
#   bash tools/build/build_deepep.sh <DeepEP 567632d source or archive> /opt/deepep && DEEPEP_PATH=/opt/deepep ...
# NCCL EP: NCCL_LIB=<path to libnccl.so.2 of nvidia-nccl-cu13 2.32.3> is preloaded in place of torch's,
# and NCCL_INCLUDE=<folder with that NCCL's nccl.h and nccl_device.h> is exported as
# NCCL_EP_JIT_BUILD_INCLUDE_DIR: NCCL EP compiles its kernels with nvcc at the first dispatch.
# Without it TE looks for an nccl.h of the loaded version next to libnccl.so.2 (e.g. the wheel's
# nvidia/nccl/include beside nvidia/nccl/lib); the launch fails at validation if there is none.
# DRY_RUN=1 runs with the same environment (PYTHONPATH, LD_PRELOAD) as the launch.
#
# Every knob is an environment variable with a default. NGPUS defaults to the GPUs nvidia-smi
# lists, or 2 when it lists fewer (or there is no nvidia-smi). DATA_PATH is megatron's --data-path
# (a prefix, or a blend "0.3 /data/a 0.7 /data/b"); unset, the config's mock data. With it
# TOKENIZER_TYPE (default HuggingFaceTokenizer), TOKENIZER_MODEL (default Qwen/Qwen3-30B-A3B) or
# VOCAB_FILE and MERGE_FILE (GPT2BPETokenizer) choose the tokenizer. PYTHON, DRY_RUN and EXTRA:
# see examples/lib/launch.sh.
set -euo pipefail
# shellcheck source=examples/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"

# ---- knobs (the flex_dispatch recipe's: BACKEND, NUM_SMS, RANK_CAPACITY, EP; docs/recipes.md) --
CONFIG=${CONFIG:-examples/configs/tiny_moe.args}
TRAIN_ITERS=${TRAIN_ITERS:-50}
DEEPEP_PATH=${DEEPEP_PATH:-}        # DEST of tools/build/build_deepep.sh
NCCL_LIB=${NCCL_LIB:-}              # libnccl.so.2 >= 2.32.3 for ncclep
NCCL_INCLUDE=${NCCL_INCLUDE:-}      # ncclep: NCCL headers of NCCL_LIB's version (NCCL EP's kernel JIT)
int_knobs 1 TRAIN_ITERS EP
recipe_args flex_dispatch                  # the knobs set so far, checked before anything prints
default_ngpus 2 2
EP=${EP:-$NGPUS}                    # expert model parallel: the flex group is TP x EP (>= 2)

# ---- arguments -----------------------------------------------------------------------
read_config "$CONFIG"
TRAINING_ARGS=(--train-iters "$TRAIN_ITERS")
recipe_args flex_dispatch

# ---- environment and launch (DRY_RUN=1: the --dry-run of the same flags) ----------------
if [ -n "$DEEPEP_PATH" ]; then export PYTHONPATH="$DEEPEP_PATH${PYTHONPATH:+:$PYTHONPATH}"; fi
if [ -n "$NCCL_LIB" ]; then export LD_PRELOAD="$NCCL_LIB${LD_PRELOAD:+:$LD_PRELOAD}"; fi
if [ -n "$NCCL_INCLUDE" ]; then export NCCL_EP_JIT_BUILD_INCLUDE_DIR="$NCCL_INCLUDE"; fi
launch_local "$NGPUS" "flex_dispatch recipe, EP=$EP, backend ${BACKEND:-deepep}" \
  "${CONFIG_ARGS[@]}" "${TRAINING_ARGS[@]}" "${RECIPE_ARGS[@]}"
