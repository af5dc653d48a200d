#!/usr/bin/env bash
# MoE pretraining with megatron-core's paged stashing on Hopper in bf16: flex dispatch into a
# static per-rank receive budget (no CPU sync), TE op-fuser experts, and the experts' saved
# activations kept in fixed-size pages sized from the expected (not the budgeted) token count.
# TransformerEngine partial CUDA graphs capture attention, the router and MoE preprocessing.
#
#   bash examples/pretrain_moe_paged_stash.sh                       # tiny config, EP=2 on 2 GPUs, ncclep
#   BACKEND=hybridep bash examples/pretrain_moe_paged_stash.sh      # DeepEP's HybridEP instead
#   GRAPHS=0 bash examples/pretrain_moe_paged_stash.sh              # eager
#   STASH=0 bash examples/pretrain_moe_paged_stash.sh               # static budget, no paging
#   CPU_FACTOR=1.0 CUDA_FACTOR=0.5 bash examples/pretrain_moe_paged_stash.sh   # spill to host
#   DATA_PATH=/data/my_text_document bash examples/pretrain_moe_paged_stash.sh # real data
#   DRY_RUN=1 bash examples/pretrain_moe_paged_stash.sh             # check the flags, no GPU
#
# BACKEND=ncclep (default): TransformerEngine 2.20's NCCL EP with --moe-ncclep-static-shape (the
# experts take the whole [budget, hidden] receive buffer). Needs NCCL >= 2.32.3 loaded
# (LD_PRELOAD=<libnccl.so.2>) and its headers for NCCL EP's kernel JIT (NCCL_INCLUDE=<include dir>,
# exported here as NCCL_EP_JIT_BUILD_INCLUDE_DIR); the launch checks both. NCCL EP cannot drop
# tokens (exceeding the budget traps the kernel), hence the larger default CAPACITY.
# BACKEND=hybridep: DeepEP's hybrid-ep branch built from source (tools/build/build_deepep.sh, on
# PYTHONPATH); takes fp32 router probabilities.
# When a step overflows the stash (or HybridEP's receive budget), megatron re-runs it without
# paging (HybridEP: and without the budget) and the run prints a line starting
# "megatron-patchset: paged stash: OVERFLOW".
#
# Every knob is an environment variable with a default. DATA_PATH is megatron's --data-path (a
# prefix, or a blend "0.3 /data/a 0.7 /data/b"); unset, the config's mock data. With it
# TOKENIZER_TYPE (default HuggingFaceTokenizer), TOKENIZER_MODEL (default Qwen/Qwen3-30B-A3B) or
# VOCAB_FILE and MERGE_FILE (GPT2BPETokenizer) choose the tokenizer. PYTHON, DRY_RUN and EXTRA:
# see examples/lib/launch.sh.
set -euo pipefail
# shellcheck source=examples/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"

# ---- knobs (the paged_stash recipe's: EP, BACKEND, CAPACITY, STASH, PAGE_SIZE, CUDA_FACTOR,
# CPU_FACTOR, GRAPHS; docs/recipes.md) ---------------------------------------------------
CONFIG=${CONFIG:-examples/configs/tiny_moe.args}
NGPUS=${NGPUS:-2}
TRAIN_ITERS=${TRAIN_ITERS:-50}
int_knobs 1 NGPUS TRAIN_ITERS

# ---- arguments, by group -------------------------------------------------------------
read_config "$CONFIG"
TRAINING_ARGS=(--train-iters "$TRAIN_ITERS")
recipe_args paged_stash   # exports NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 unless set

# ---- environment and launch (DRY_RUN=1: the --dry-run of the same flags) ----------------
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}   # HybridEP and NCCL EP compile kernels with nvcc at run time
if [ "${BACKEND:-ncclep}" = ncclep ] && [ -n "${NCCL_INCLUDE:-}" ]; then
  export NCCL_EP_JIT_BUILD_INCLUDE_DIR=${NCCL_EP_JIT_BUILD_INCLUDE_DIR:-$NCCL_INCLUDE}
fi
launch_local "$NGPUS" "paged_stash recipe, EP=${EP:-2}, ${BACKEND:-ncclep}, paged stash ${STASH:-1}, graphs ${GRAPHS:-1}" \
  "${CONFIG_ARGS[@]}" "${TRAINING_ARGS[@]}" "${RECIPE_ARGS[@]}"
