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

# ---- knobs ---------------------------------------------------------------------------
CONFIG=${CONFIG:-examples/configs/tiny_moe.args}
NGPUS=${NGPUS:-2}
EP=${EP:-2}                           # expert model parallel
BACKEND=${BACKEND:-ncclep}            # flex dispatcher backend: ncclep or hybridep
choice_knob BACKEND ncclep hybridep
case "$BACKEND" in
  ncclep) DEFAULT_CAPACITY=2.0 ;;     # exceeding NCCL EP's budget traps: be generous
  hybridep) DEFAULT_CAPACITY=1.5 ;;   # HybridEP drops over-budget tokens; megatron re-runs the step
esac
CAPACITY=${CAPACITY:-$DEFAULT_CAPACITY}  # --moe-expert-rank-capacity-factor (receive budget / balanced)
STASH=${STASH:-1}                     # --moe-paged-stash
PAGE_SIZE=${PAGE_SIZE:-64}            # tokens per page
CUDA_FACTOR=${CUDA_FACTOR:-1.1}       # GPU stash size relative to the expected tokens
CPU_FACTOR=${CPU_FACTOR:-0.0}         # pinned host pages (0: none)
GRAPHS=${GRAPHS:-1}                   # TE graphs of attn, moe_router, moe_preprocess
TRAIN_ITERS=${TRAIN_ITERS:-50}
int_knobs 1 NGPUS EP PAGE_SIZE TRAIN_ITERS
number_knobs CAPACITY CUDA_FACTOR CPU_FACTOR
switch_knobs STASH GRAPHS

# ---- arguments, by group -------------------------------------------------------------
read_config "$CONFIG"
TRAINING_ARGS=(--train-iters "$TRAIN_ITERS")
MOE_ARGS=(
  --expert-model-parallel-size "$EP"
  --moe-token-dispatcher-type flex
  --moe-flex-dispatcher-backend "$BACKEND"
  --use-transformer-engine-op-fuser     # megatron pages only the op-fuser expert MLP
  --moe-expert-rank-capacity-factor "$CAPACITY"
)
if [ "$BACKEND" = hybridep ]; then
  MOE_ARGS+=(--moe-router-dtype fp32)   # HybridEP takes fp32 probabilities
else
  MOE_ARGS+=(--moe-ncclep-static-shape) # experts take the static receive buffer (paging needs it)
fi
STASH_ARGS=()
if [ "$STASH" = 1 ]; then
  STASH_ARGS=(
    --moe-paged-stash
    --moe-paged-stash-page-size "$PAGE_SIZE"
    --moe-paged-stash-buffer-size-factor-cuda "$CUDA_FACTOR"
    --moe-paged-stash-buffer-size-factor-cpu "$CPU_FACTOR"
  )
fi
GRAPH_ARGS=()
if [ "$GRAPHS" = 1 ]; then
  GRAPH_ARGS=(--cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess
              --cuda-graph-warmup-steps 2)
fi

# ---- environment and launch (DRY_RUN=1: the --dry-run of the same flags) ----------------
# megatron admits SwiGLU experts to TE's op fuser only with this set; on Hopper TE still runs its
# basic grouped-linear/SwiGLU ops (the fused kernel it names is Blackwell-only).
export NVTE_CUTEDSL_FUSED_GROUPED_MLP=${NVTE_CUTEDSL_FUSED_GROUPED_MLP:-1}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}   # HybridEP and NCCL EP compile kernels with nvcc at run time
if [ "$BACKEND" = ncclep ] && [ -n "${NCCL_INCLUDE:-}" ]; then
  export NCCL_EP_JIT_BUILD_INCLUDE_DIR=${NCCL_EP_JIT_BUILD_INCLUDE_DIR:-$NCCL_INCLUDE}
fi
launch_local "$NGPUS" "EP=$EP, $BACKEND, paged stash $STASH, graphs $GRAPHS" \
  "${CONFIG_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MOE_ARGS[@]}" "${STASH_ARGS[@]}" "${GRAPH_ARGS[@]}"
