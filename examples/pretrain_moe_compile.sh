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
#   DRY_RUN=1 bash examples/pretrain_moe_compile.sh            # check the flags, no GPU
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
NGPUS=${NGPUS:-$(nvidia-smi -L 2>/dev/null | wc -l | tr -d ' ')}
[ "${NGPUS:-0}" -gt 0 ] || NGPUS=2
FSDP=${FSDP:-0}                 # 1: Megatron-FSDP (optim_grads_params), no expert parallelism
EP=${EP:-$([ "$FSDP" = 1 ] && echo 1 || echo "$NGPUS")}
COMPILE=${COMPILE:-1}           # 0: eager, for comparison
MODE=${MODE:-default}           # --compile-transformer-layers-mode
WARMUP=${WARMUP:-2}             # --compile-transformer-layers-warmup-iters
TRAIN_ITERS=${TRAIN_ITERS:-50}
EXTRA=${EXTRA:-}

# ---- arguments, by group -------------------------------------------------------------
MODEL_ARGS=($(grep -v '^ *#' "$CONFIG"))
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

# shellcheck disable=SC2206  # EXTRA is split into flags on purpose
ALL_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${COMPILE_ARGS[@]}" ${EXTRA})

if [ -n "${DRY_RUN:-}" ]; then
  echo "DRY_RUN: validating for world size $NGPUS (EP=$EP FSDP=$FSDP COMPILE=$COMPILE)"
  exec "$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size "$NGPUS" "${ALL_ARGS[@]}"
fi

# ---- launch --------------------------------------------------------------------------
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPUS" pretrain_gpt.py \
  "${ALL_ARGS[@]}"
