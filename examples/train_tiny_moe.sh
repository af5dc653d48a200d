#!/usr/bin/env bash
# Quick start: train the tiny MoE config (examples/configs/tiny_moe.args) on mock data with all
# local GPUs (expert parallelism over them). On a machine without an NVIDIA GPU it checks the
# configuration with --dry-run instead and says that training needs a GPU.
#
#   bash examples/train_tiny_moe.sh                 # all local GPUs, EP = number of GPUs
#   NGPUS=1 bash examples/train_tiny_moe.sh         # one GPU
#   EXTRA="--train-iters 200" bash examples/train_tiny_moe.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${NGPUS:-}" ]; then
  NGPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
fi
EP=${EP:-$NGPUS}
[ "$EP" -ge 1 ] || EP=1

CONFIG_ARGS=($(grep -v '^ *#' examples/configs/tiny_moe.args))
PARALLEL_ARGS=(--expert-model-parallel-size "$EP")
EXTRA_ARGS=(${EXTRA:-})

if [ "$NGPUS" -eq 0 ]; then
  echo "No NVIDIA GPU visible: checking the tiny MoE configuration with --dry-run."
  echo "Training needs an NVIDIA GPU (and TransformerEngine for the default layer spec)."
  exec "$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size 1 "${CONFIG_ARGS[@]}" "${EXTRA_ARGS[@]}"
fi

SPEC_ARGS=()
if ! "$PYTHON" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
  echo "TransformerEngine is not installed: training with the local (PyTorch) layer spec."
  echo "For the TransformerEngine spec: pip install -e '.[te]'"
  CONFIG_ARGS=(${CONFIG_ARGS[@]/--moe-grouped-gemm/})
  SPEC_ARGS=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm
             --no-gradient-accumulation-fusion)
fi

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPUS" pretrain_gpt.py \
  "${CONFIG_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${SPEC_ARGS[@]}" "${EXTRA_ARGS[@]}"
