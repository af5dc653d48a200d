#!/usr/bin/env bash
# MoE pretraining with the flex token dispatcher: DeepEP (default), HybridEP or TransformerEngine's
# NCCL EP instead of megatron's all-to-all, on the GPUs of one machine.
#
#   bash examples/pretrain_moe_deepep.sh                       # DeepEP, EP = number of GPUs
#   BACKEND=ncclep bash examples/pretrain_moe_deepep.sh        # TE NCCL EP (needs NCCL >= 2.32.3)
#   BACKEND=alltoall bash examples/pretrain_moe_deepep.sh      # megatron's all-to-all, for comparison
#   DRY_RUN=1 bash examples/pretrain_moe_deepep.sh             # check the flags, no GPU
#
# DeepEP is built from source, never installed from a registry (docs/deepep.md):
#   bash tools/build_deepep.sh <DeepEP 567632d source or archive> /opt/deepep && DEEPEP_PATH=/opt/deepep ...
# NCCL EP: NCCL_LIB=<path to libnccl.so.2 of nvidia-nccl-cu13 2.32.3> is preloaded in place of torch's,
# and NCCL_INCLUDE=<folder with that NCCL's nccl.h and nccl_device.h> is exported as
# NCCL_EP_JIT_BUILD_INCLUDE_DIR: NCCL EP compiles its kernels with nvcc at the first dispatch.
# Without it TE looks for an nccl.h of the loaded version next to libnccl.so.2 (e.g. the wheel's
# nvidia/nccl/include beside nvidia/nccl/lib); the launch fails at validation if there is none.
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
if [ -z "${NGPUS:-}" ]; then
  NGPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [ "${NGPUS:-0}" -ge 2 ] || NGPUS=2
fi
EP=${EP:-$NGPUS}                    # expert model parallel: the flex group is TP x EP (>= 2)
BACKEND=${BACKEND:-deepep}          # deepep | hybridep | ncclep | alltoall
NUM_SMS=${NUM_SMS:-}                # --moe-flex-dispatcher-num-sms (DeepEP default 20)
RANK_CAPACITY=${RANK_CAPACITY:-2.0} # ncclep/hybridep: --moe-expert-rank-capacity-factor
TRAIN_ITERS=${TRAIN_ITERS:-50}
DEEPEP_PATH=${DEEPEP_PATH:-}        # DEST of tools/build_deepep.sh
NCCL_LIB=${NCCL_LIB:-}              # libnccl.so.2 >= 2.32.3 for ncclep
NCCL_INCLUDE=${NCCL_INCLUDE:-}      # ncclep: NCCL headers of NCCL_LIB's version (NCCL EP's kernel JIT)
EXTRA=${EXTRA:-}

# ---- arguments -----------------------------------------------------------------------
MODEL_ARGS=($(grep -v '^ *#' "$CONFIG"))
TRAINING_ARGS=(--train-iters "$TRAIN_ITERS")
PARALLEL_ARGS=(--expert-model-parallel-size "$EP")

# DeepEP and NCCL EP take fp32 routing weights (megatron casts others, with a warning).
DISPATCH_ARGS=()
case "$BACKEND" in
  alltoall) DISPATCH_ARGS=(--moe-token-dispatcher-type alltoall) ;;
  deepep|hybridep|ncclep)
    DISPATCH_ARGS=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend "$BACKEND" --moe-router-dtype fp32)
    [ -n "$NUM_SMS" ] && DISPATCH_ARGS+=(--moe-flex-dispatcher-num-sms "$NUM_SMS")
    [ "$BACKEND" = ncclep ] && DISPATCH_ARGS+=(--moe-expert-rank-capacity-factor "$RANK_CAPACITY")
    ;;
  *) echo "BACKEND must be deepep, hybridep, ncclep or alltoall, not '$BACKEND'" >&2; exit 2 ;;
esac

# shellcheck disable=SC2206  # EXTRA is split into flags on purpose
ALL_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DISPATCH_ARGS[@]}" ${EXTRA})

if [ -n "${DRY_RUN:-}" ]; then
  echo "DRY_RUN: validating for world size $NGPUS (EP=$EP, backend $BACKEND)"
  exec "$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size "$NGPUS" "${ALL_ARGS[@]}"
fi

# ---- launch --------------------------------------------------------------------------
[ -n "$DEEPEP_PATH" ] && export PYTHONPATH="$DEEPEP_PATH${PYTHONPATH:+:$PYTHONPATH}"
[ -n "$NCCL_LIB" ] && export LD_PRELOAD="$NCCL_LIB${LD_PRELOAD:+:$LD_PRELOAD}"
[ -n "$NCCL_INCLUDE" ] && export NCCL_EP_JIT_BUILD_INCLUDE_DIR="$NCCL_INCLUDE"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPUS" pretrain_gpt.py \
  "${ALL_ARGS[@]}"
