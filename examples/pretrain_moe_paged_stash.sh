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
#   DRY_RUN=1 bash examples/pretrain_moe_paged_stash.sh             # check the flags, no GPU
#
# BACKEND=ncclep (default): TransformerEngine 2.20's NCCL EP with --moe-ncclep-static-shape (the
# experts take the whole [budget, hidden] receive buffer). Needs NCCL >= 2.32.3 loaded
# (LD_PRELOAD=<libnccl.so.2>) and its headers for NCCL EP's kernel JIT (NCCL_INCLUDE=<include dir>,
# exported here as NCCL_EP_JIT_BUILD_INCLUDE_DIR); the launch checks both. NCCL EP cannot drop
# tokens (exceeding the budget traps the kernel), hence the larger default CAPACITY.
# BACKEND=hybridep: DeepEP's hybrid-ep branch built from source (tools/build_deepep.sh, on
# PYTHONPATH); takes fp32 router probabilities.
# When a step overflows the stash (or HybridEP's receive budget), megatron re-runs it without
# paging (HybridEP: and without the budget) and the run prints a line starting
# "megatron-patchset: paged stash: OVERFLOW".
# Every knob is an environment variable with a default.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---- knobs ---------------------------------------------------------------------------
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
CONFIG=${CONFIG:-examples/configs/tiny_moe.args}
NGPUS=${NGPUS:-2}
EP=${EP:-2}                           # expert model parallel
BACKEND=${BACKEND:-ncclep}            # flex dispatcher backend: ncclep or hybridep
case "$BACKEND" in
  ncclep) DEFAULT_CAPACITY=2.0 ;;     # exceeding NCCL EP's budget traps: be generous
  hybridep) DEFAULT_CAPACITY=1.5 ;;   # HybridEP drops over-budget tokens; megatron re-runs the step
  *) echo "BACKEND must be ncclep or hybridep (got $BACKEND)" >&2; exit 2 ;;
esac
CAPACITY=${CAPACITY:-$DEFAULT_CAPACITY}  # --moe-expert-rank-capacity-factor (receive budget / balanced)
STASH=${STASH:-1}                     # --moe-paged-stash
PAGE_SIZE=${PAGE_SIZE:-64}            # tokens per page
CUDA_FACTOR=${CUDA_FACTOR:-1.1}       # GPU stash size relative to the expected tokens
CPU_FACTOR=${CPU_FACTOR:-0.0}         # pinned host pages (0: none)
GRAPHS=${GRAPHS:-1}                   # TE graphs of attn, moe_router, moe_preprocess
TRAIN_ITERS=${TRAIN_ITERS:-50}
EXTRA=${EXTRA:-}

# ---- arguments, by group -------------------------------------------------------------
MODEL_ARGS=($(grep -v '^ *#' "$CONFIG"))
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

# megatron admits SwiGLU experts to TE's op fuser only with this set; on Hopper TE still runs its
# basic grouped-linear/SwiGLU ops (the fused kernel it names is Blackwell-only).
export NVTE_CUTEDSL_FUSED_GROUPED_MLP=${NVTE_CUTEDSL_FUSED_GROUPED_MLP:-1}

# shellcheck disable=SC2206  # EXTRA is split into flags on purpose
ALL_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MOE_ARGS[@]}" "${STASH_ARGS[@]}"
          "${GRAPH_ARGS[@]}" ${EXTRA})

if [ -n "${DRY_RUN:-}" ]; then
  echo "DRY_RUN: validating for world size $NGPUS (EP=$EP, $BACKEND, paged stash $STASH, graphs $GRAPHS)"
  exec "$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size "$NGPUS" "${ALL_ARGS[@]}"
fi

# ---- launch --------------------------------------------------------------------------
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}   # HybridEP and NCCL EP compile kernels with nvcc at run time
if [ "$BACKEND" = ncclep ] && [ -n "${NCCL_INCLUDE:-}" ]; then
  export NCCL_EP_JIT_BUILD_INCLUDE_DIR=${NCCL_EP_JIT_BUILD_INCLUDE_DIR:-$NCCL_INCLUDE}
fi
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPUS" pretrain_gpt.py \
  "${ALL_ARGS[@]}"
