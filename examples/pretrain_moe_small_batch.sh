#!/usr/bin/env bash
# Small-micro-batch MoE training out of the host-overhead regime:
#   --moe-grouped-gemm-impl torch    the experts' forward, dgrad and wgrad as one grouped GEMM each
#   --moe-expert-splits-on-device    the per-expert token counts stay on the GPU (no host sync)
#   --moe-static-dispatch            with EP > 1: the all-to-all in fixed-size slots, no host sync
#   --cuda-graph-impl full_iteration the whole forward and backward replayed as one CUDA graph
#   --optimizer-cuda-graph           the optimizer step replayed as a second graph
#   --adam-impl triton               the clipped AdamW step and the bf16 copy in one Triton kernel
#   --cross-entropy-triton           the fused loss in two Triton kernels (needs TP = 1)
# plus megatron's --cross-entropy-loss-fusion and --manual-gc. On the reference config (one H200)
# the step runs 85.5 ms at 1 x 4096 tokens and 187.6 ms at 4 x 4096, 3.62x and 2.24x upstream with
# its own TE graphs and the same cross-entropy fusion in the same runs (docs/benchmarks.md, Peers).
# The reference config at 4 x 4096 tokens peaks at 81 GiB: an 80 GB GPU takes 1 x 4096. EP > 1 is
# not yet measured.
#
#   bash examples/pretrain_moe_small_batch.sh                         # reference config, 1 GPU
#   MICRO_BATCH=4 bash examples/pretrain_moe_small_batch.sh           # 4 x 4096 tokens per step
#   GRAPHS=layer bash examples/pretrain_moe_small_batch.sh            # per-layer TE graphs instead
#   GRAPHS=none bash examples/pretrain_moe_small_batch.sh             # the same GEMMs, no graphs
#   KERNELS=0 bash examples/pretrain_moe_small_batch.sh               # megatron's Adam and loss
#   NGPUS=2 EP=2 bash examples/pretrain_moe_small_batch.sh            # experts over 2 GPUs
#   DATA_PATH=/data/my_text_document TOKENIZER_MODEL=Qwen/Qwen3-30B-A3B bash ...
#   DRY_RUN=1 bash examples/pretrain_moe_small_batch.sh               # check the flags, no GPU
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
CONFIG=${CONFIG:-examples/configs/reference_moe.args}
NGPUS=${NGPUS:-1}               # GPUs (measured: 1)
EP=${EP:-1}                     # expert-parallel size; > 1 uses the static all-to-all
CAPACITY_FACTOR=${CAPACITY_FACTOR:-2.0}  # per-peer slots of the static all-to-all (EP > 1)
OPTIMIZER_GRAPH=${OPTIMIZER_GRAPH:-1}    # 1: --optimizer-cuda-graph with GRAPHS=full
KERNELS=${KERNELS:-1}           # 1: --adam-impl triton --cross-entropy-triton with GRAPHS=full
MICRO_BATCH=${MICRO_BATCH:-1}
int_knobs 1 NGPUS EP MICRO_BATCH
number_knobs CAPACITY_FACTOR
switch_knobs OPTIMIZER_GRAPH KERNELS
GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * NGPUS))}
GRAPHS=${GRAPHS:-full}          # full: --cuda-graph-impl full_iteration; layer: TE graphs of attention,
                                # router and preprocessing; none: eager
TRAIN_ITERS=${TRAIN_ITERS:-50}
int_knobs 1 GLOBAL_BATCH TRAIN_ITERS
choice_knob GRAPHS full layer none

# ---- arguments, by group -------------------------------------------------------------
read_config "$CONFIG"
TRAINING_ARGS=(--micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
               --manual-gc --cross-entropy-loss-fusion)
EXPERT_ARGS=(--expert-model-parallel-size "$EP" --moe-grouped-gemm-impl torch)
GRAPH_ARGS=()
case "$GRAPHS" in
  full)
    # The token counts must stay on the GPU for the capture; megatron's NaN check and its level-1/2
    # timers synchronise inside the step, so they are off (the fork's rules say so otherwise).
    EXPERT_ARGS+=(--moe-expert-splits-on-device)
    if [ "$EP" -gt 1 ]; then
      EXPERT_ARGS+=(--moe-static-dispatch --moe-static-dispatch-capacity-factor "$CAPACITY_FACTOR")
    fi
    GRAPH_ARGS=(--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2
                --no-check-for-nan-in-loss-and-grad --timing-log-level 0)
    if [ "$OPTIMIZER_GRAPH" = 1 ]; then GRAPH_ARGS+=(--optimizer-cuda-graph); fi
    if [ "$KERNELS" = 1 ]; then GRAPH_ARGS+=(--adam-impl triton --cross-entropy-triton); fi ;;
  layer)
    GRAPH_ARGS=(--cuda-graph-impl transformer_engine --cuda-graph-warmup-steps 2
                --cuda-graph-modules attn moe_router moe_preprocess) ;;
esac

# ---- launch (DRY_RUN=1: the --dry-run of the same flags) -------------------------------
launch_local "$NGPUS" "GRAPHS=$GRAPHS, EP=$EP, micro-batch $MICRO_BATCH" \
  "${CONFIG_ARGS[@]}" "${TRAINING_ARGS[@]}" "${EXPERT_ARGS[@]}" "${GRAPH_ARGS[@]}"
