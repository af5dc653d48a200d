#!/usr/bin/env bash
# MoE pretraining with Megatron-FSDP and TransformerEngine per-layer (partial) CUDA graphs:
#
#   --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
#   --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail   fixed parameter-buffer addresses
#   --cuda-graph-impl transformer_engine --cuda-graph-modules <scopes>
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
#   DRY_RUN=1 bash examples/pretrain_moe_fsdp_cuda_graphs.sh             # check the flags, no GPU
#
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
EP=${EP:-1}                       # expert model parallel
GRAPHS=${GRAPHS:-1}               # 0: eager Megatron-FSDP
SCOPES=${SCOPES:-attn moe_router moe_preprocess}   # --cuda-graph-modules
WARMUP_STEPS=${WARMUP_STEPS:-3}   # eager steps before capture
TRAIN_ITERS=${TRAIN_ITERS:-50}
EXTRA=${EXTRA:-}

# ---- arguments, by group -------------------------------------------------------------
MODEL_ARGS=($(grep -v '^ *#' "$CONFIG"))
TRAINING_ARGS=(--train-iters "$TRAIN_ITERS")
PARALLEL_ARGS=(--expert-model-parallel-size "$EP")

FSDP_ARGS=(
  --use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads_params
  --ckpt-format fsdp_dtensor
  --fsdp-double-buffer
  --fsdp-db-use-persist-buf-on-alloc-fail
)

GRAPH_ARGS=()
if [ "$GRAPHS" = 1 ]; then
  # shellcheck disable=SC2206  # SCOPES is a list of words
  GRAPH_ARGS=(--cuda-graph-impl transformer_engine --cuda-graph-warmup-steps "$WARMUP_STEPS"
              --cuda-graph-modules $SCOPES)
fi

# shellcheck disable=SC2206  # EXTRA is split into flags on purpose
ALL_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${FSDP_ARGS[@]}"
          "${GRAPH_ARGS[@]}" ${EXTRA})

if [ -n "${DRY_RUN:-}" ]; then
  echo "DRY_RUN: validating for world size $NGPUS (EP=$EP, graphs: ${GRAPHS/1/$SCOPES})"
  exec "$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size "$NGPUS" "${ALL_ARGS[@]}"
fi

# ---- launch --------------------------------------------------------------------------
# Megatron-FSDP overlaps its all-gathers and reduce-scatters with compute: it refuses
# CUDA_DEVICE_MAX_CONNECTIONS=1.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-8}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPUS" pretrain_gpt.py \
  "${ALL_ARGS[@]}"
