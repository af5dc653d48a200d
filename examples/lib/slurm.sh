# shellcheck shell=bash
# Shared by the Slurm scripts in examples/slurm/ (sourced, not run): everything of
# examples/lib/launch.sh (PYTHON, DRY_RUN, DATA_PATH and the tokenizer knobs, EXTRA), the job's
# size and the launch: after a --dry-run of the same flags, srun starts one torchrun per node.
#
# Knobs every Slurm script takes besides those of examples/lib/launch.sh:
#   NODES, GPUS_PER_NODE  the job's size (each script's default; NODES: the job's node count)
#   MASTER_PORT           torchrun's rendezvous port on the first node (default 6000)

# shellcheck source=examples/lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

MASTER_PORT=${MASTER_PORT:-6000}
int_knobs 1 MASTER_PORT

# slurm_world: checks NODES and GPUS_PER_NODE and sets WORLD_SIZE, their product.
slurm_world() {
  int_knobs 1 NODES GPUS_PER_NODE
  WORLD_SIZE=$((NODES * GPUS_PER_NODE))
}

# launch_slurm ABOUT FLAG...: pretrain_gpt.py with the flags and EXTRA on NODES x GPUS_PER_NODE
# GPUs: srun starts one torchrun per node, which meet at the first node's MASTER_PORT. With
# DRY_RUN=1 the --dry-run of the same flags instead, here and without Slurm. A job checks the
# flags with --dry-run before it starts the GPU processes and stops on an invalid combination.
launch_slurm() {
  local about=$1 checked first_node
  shift
  slurm_world
  if [ "$DRY_RUN" = 1 ]; then exec_dry_run "$WORLD_SIZE" "$about" "$@" "${EXTRA_ARGS[@]}"; fi
  [ -n "${SLURM_JOB_ID:-}" ] \
    || bad_knob "Not inside a Slurm job: submit the script with sbatch, or set DRY_RUN=1 to check the flags here."
  if ! checked=$("$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size "$WORLD_SIZE" "$@" \
    "${EXTRA_ARGS[@]}" 2>&1); then
    echo "$checked" >&2
    echo "invalid flag combination (above); DRY_RUN=1 shows it without Slurm" >&2
    exit 1
  fi
  mkdir -p "$CHECKPOINT_DIR"
  first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  exec srun --kill-on-bad-exit=1 --nodes "$NODES" --ntasks-per-node=1 --export=ALL --chdir "$REPO" \
    "$PYTHON" -m torch.distributed.run --nnodes "$NODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$first_node:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
    pretrain_gpt.py "$@" "${EXTRA_ARGS[@]}"
}
