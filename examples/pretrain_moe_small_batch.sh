#!/usr/bin/env bash
# Small-micro-batch MoE training out of the host-overhead regime (issue 9 recipe), one GPU per
# data-parallel rank, no expert parallelism:
#   --moe-grouped-gemm-impl torch    the experts' forward, dgrad and wgrad as one grouped GEMM each
#   --moe-expert-splits-on-device    the per-expert token counts stay on the GPU (no host sync)
#   --cuda-graph-impl full_iteration the whole forward and backward replayed as one CUDA graph
# plus megatron's --cross-entropy-loss-fusion and --manual-gc. On the reference config (one H200,
# 1 x 4096 tokens per step) forward+backward runs 2.6x and the step 1.7x faster than upstream with
# its own TE graphs and the same cross-entropy fusion (docs/benchmarks.md, "Small micro-batches on
# one GPU"). The reference config at 4 x 4096 tokens peaks at 95 GiB: an 80 GB GPU takes 1 x 4096.
#
#   bash examples/pretrain_moe_small_batch.sh                         # reference config, 1 GPU
#   MICRO_BATCH=4 bash examples/pretrain_moe_small_batch.sh           # 4 x 4096 tokens per step
#   GRAPHS=layer bash examples/pretrain_moe_small_batch.sh            # per-layer TE graphs instead
#   GRAPHS=none bash examples/pretrain_moe_small_batch.sh             # the same GEMMs, no graphs
#   DATA_PATH=/data/my_text_document TOKENIZER_MODEL=Qwen/Qwen3-30B-A3B bash ...
#   DRY_RUN=1 bash examples/pretrain_moe_small_batch.sh               # check the flags, no GPU
#
# Every knob is an environment variable with a default.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---- knobs ---------------------------------------------------------------------------
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
CONFIG=${CONFIG:-examples/configs/reference_moe.args}
NGPUS=${NGPUS:-1}               # data-parallel ranks (measured: 1)
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * NGPUS))}
GRAPHS=${GRAPHS:-full}          # full: --cuda-graph-impl full_iteration; layer: TE graphs of attention,
                                # router and preprocessing; none: eager
TRAIN_ITERS=${TRAIN_ITERS:-50}
DATA_PATH=${DATA_PATH:-}        # megatron --data-path; unset: the config's mock data
TOKENIZER_MODEL=${TOKENIZER_MODEL:-Qwen/Qwen3-30B-A3B}
EXTRA=${EXTRA:-}

# ---- arguments, by group -------------------------------------------------------------
MODEL_ARGS=($(grep -v '^ *#' "$CONFIG"))
TRAINING_ARGS=(--micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
               --manual-gc --cross-entropy-loss-fusion)
EXPERT_ARGS=(--expert-model-parallel-size 1 --moe-grouped-gemm-impl torch)
case "$GRAPHS" in
  full)
    # The token counts must stay on the GPU for the capture; megatron's NaN check and its level-1/2
    # timers synchronise inside the step, so they are off (the fork's rules say so otherwise).
    EXPERT_ARGS+=(--moe-expert-splits-on-device)
    GRAPH_ARGS=(--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2
                --no-check-for-nan-in-loss-and-grad --timing-log-level 0) ;;
  layer)
    GRAPH_ARGS=(--cuda-graph-impl transformer_engine --cuda-graph-warmup-steps 2
                --cuda-graph-modules attn moe_router moe_preprocess) ;;
  none)
    GRAPH_ARGS=() ;;
  *)
    echo "GRAPHS must be full, layer or none (got $GRAPHS)" >&2; exit 2 ;;
esac
if [ -n "$DATA_PATH" ]; then
  # shellcheck disable=SC2206  # word-split on purpose: a blend is several words
  DATA_ARGS=(--data-path $DATA_PATH --split 990,8,2
             --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
  DATA_ARGS=()
fi

# shellcheck disable=SC2206  # EXTRA is split into flags on purpose
ALL_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${EXPERT_ARGS[@]}" "${GRAPH_ARGS[@]}" "${DATA_ARGS[@]}" ${EXTRA})

if [ -n "${DRY_RUN:-}" ]; then
  echo "DRY_RUN: validating for world size $NGPUS (GRAPHS=$GRAPHS, micro-batch $MICRO_BATCH)"
  exec "$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size "$NGPUS" "${ALL_ARGS[@]}"
fi

# ---- launch --------------------------------------------------------------------------
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPUS" pretrain_gpt.py \
  "${ALL_ARGS[@]}"
