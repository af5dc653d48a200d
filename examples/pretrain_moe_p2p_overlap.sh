#!/usr/bin/env bash
# MoE pretraining with the fine-grained 1F1B schedule (EP all-to-all overlapped with compute)
# in an interleaved pipeline, and the fork's backward-P2P overlap:
#
#   --overlap-p2p-backward-on-comm-stream        backward send/receive on the comm stream
#   --overlap-p2p-wgrad-delayed-layer-number N   last N backward layers of a chunk defer wgrad
#   --overlap-p2p-with-transformer-layer-wgrad   ... MLP/expert wgrad as well as attention's
#
# Layout: PP=2 x VPP=2 x EP=2 on 4 GPUs of one machine (TP=1, DP=2), the tiny MoE config
# (examples/configs/tiny_moe.args) at 8 layers, i.e. 2 layers per model chunk.
#
#   bash examples/pretrain_moe_p2p_overlap.sh
#   DELAYED_LAYERS=1 TL_WGRAD=0 bash examples/pretrain_moe_p2p_overlap.sh   # attention only, 1 layer
#   P2P_OVERLAP=0 bash examples/pretrain_moe_p2p_overlap.sh                 # megatron's own schedule
#   DRY_RUN=1 bash examples/pretrain_moe_p2p_overlap.sh                     # check the flags, no GPU
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
NGPUS=${NGPUS:-4}
TP=${TP:-1}                     # tensor model parallel
PP=${PP:-2}                     # pipeline model parallel
VPP=${VPP:-2}                   # virtual pipeline stages (model chunks) per pipeline rank
EP=${EP:-2}                     # expert model parallel
NUM_LAYERS=${NUM_LAYERS:-8}     # NUM_LAYERS / PP / VPP layers per model chunk
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}  # 8 micro-batches per step at DP=2
TRAIN_ITERS=${TRAIN_ITERS:-50}
P2P_OVERLAP=${P2P_OVERLAP:-1}   # 0: none of the fork's three flags
BWD_ON_COMM=${BWD_ON_COMM:-1}   # --overlap-p2p-backward-on-comm-stream
DELAYED_LAYERS=${DELAYED_LAYERS:-2}  # --overlap-p2p-wgrad-delayed-layer-number
TL_WGRAD=${TL_WGRAD:-1}         # --overlap-p2p-with-transformer-layer-wgrad
EXTRA=${EXTRA:-}

LAYERS_PER_CHUNK=$((NUM_LAYERS / PP / VPP))

# ---- arguments, by group -------------------------------------------------------------
MODEL_ARGS=($(grep -v '^ *#' "$CONFIG"))
MODEL_ARGS+=(--num-layers "$NUM_LAYERS")

TRAINING_ARGS=(
  --micro-batch-size "$MICRO_BATCH"
  --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS"
)

PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
  --num-layers-per-virtual-pipeline-stage "$LAYERS_PER_CHUNK"
)
[ "$TP" -gt 1 ] && PARALLEL_ARGS+=(--sequence-parallel)

# The fine-grained schedule: EP all-to-all overlapped with the other micro-batch's compute,
# weight gradients computed separately (TransformerEngine) so that they can be deferred.
MOE_ARGS=(
  --expert-model-parallel-size "$EP"
  --overlap-moe-expert-parallel-comm
  --delay-wgrad-compute
)

P2P_ARGS=()
if [ "$P2P_OVERLAP" = 1 ]; then
  [ "$BWD_ON_COMM" = 1 ] && P2P_ARGS+=(--overlap-p2p-backward-on-comm-stream)
  P2P_ARGS+=(--overlap-p2p-wgrad-delayed-layer-number "$DELAYED_LAYERS")
  [ "$TL_WGRAD" = 1 ] && P2P_ARGS+=(--overlap-p2p-with-transformer-layer-wgrad)
fi

# shellcheck disable=SC2206  # EXTRA is split into flags on purpose
ALL_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MOE_ARGS[@]}"
          "${P2P_ARGS[@]}" ${EXTRA})

if [ -n "${DRY_RUN:-}" ]; then
  echo "DRY_RUN: validating for world size $NGPUS (PP=$PP VPP=$VPP EP=$EP TP=$TP)"
  exec "$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size "$NGPUS" "${ALL_ARGS[@]}"
fi

# ---- launch --------------------------------------------------------------------------
# The all-to-all overlap runs kernels on two streams at once: allow several hardware queues.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPUS" pretrain_gpt.py \
  "${ALL_ARGS[@]}"
