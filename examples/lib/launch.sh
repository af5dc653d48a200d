# shellcheck shell=bash
# Shared by the launchers in examples/ (sourced, not run): it moves to the repository root, picks
# the interpreter, checks knob values, reads a flag file (examples/configs/*.args) with the data
# and tokenizer flags, and launches: torchrun on this machine, or with DRY_RUN=1 the
# pretrain_gpt.py --dry-run of exactly the same flags (no GPU needed).
#
# Knobs every launcher takes (environment variables):
#   PYTHON           interpreter; default: the repository's .venv/bin/python when present, else python3
#   DRY_RUN          1: print the command on a line "DRY_RUN: <command>" and run its --dry-run
#                    instead of training, with the environment the launch would have (no GPU
#                    needed); 0 or unset: launch
#   DATA_PATH        megatron --data-path: one indexed-dataset prefix (PREFIX.bin and PREFIX.idx,
#                    as Megatron-LM's tools/preprocess_data.py writes them) or a blend
#                    "0.3 /data/a 0.7 /data/b".
#                    Unset: the config's mock data. Set: the config's --mock-data, --tokenizer-type,
#                    --vocab-size and --split give way to --data-path DATA_PATH --split 990,8,2 and
#                    the tokenizer below
#   TOKENIZER_TYPE   with DATA_PATH: HuggingFaceTokenizer (default), GPT2BPETokenizer,
#                    SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer,
#                    TikTokenizer or NullTokenizer (token ids as stored, the config's --vocab-size)
#   TOKENIZER_MODEL  --tokenizer-model: name or path; HuggingFaceTokenizer's default
#                    Qwen/Qwen3-30B-A3B, required by the SentencePiece, Llama2 and TikToken types
#   VOCAB_FILE, MERGE_FILE  GPT2BPETokenizer's vocabulary and merge files (both required)
#   EXTRA            more megatron flags, split at white space and appended last (a repeated
#                    flag's last value counts)
# A bad knob value stops the launcher before anything runs: one line naming the knob and what it
# takes, exit code 2.

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
# shellcheck disable=SC2034  # the repository, for the Slurm scripts (srun --chdir, checkpoints)
REPO=$PWD

# ---- knob checks -------------------------------------------------------------------------------
# Each stops the launcher with exit code 2 and one line on stderr. int_knobs and number_knobs pass
# an empty knob: it stands for the launcher's default.

bad_knob() {
  echo "$1" >&2
  exit 2
}

# int_knobs MIN NAME...: each knob a whole number >= MIN.
int_knobs() {
  local min=$1 name value
  shift
  for name in "$@"; do
    value=${!name:-}
    if [ -n "$value" ] && { ! [[ $value =~ ^[0-9]+$ ]] || ((10#$value < min)); }; then
      bad_knob "$name must be a whole number >= $min (got '$value')"
    fi
  done
}

# number_knobs NAME...: each knob a number >= 0 (1, 0.5, 1.5e-1).
number_knobs() {
  local name value
  for name in "$@"; do
    value=${!name:-}
    if [ -n "$value" ] && ! is_number "$value"; then
      bad_knob "$name must be a number >= 0 (got '$value')"
    fi
  done
}

is_number() {
  [[ $1 =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]]
}

# choice_knob NAME CHOICE...: the knob one of the choices.
choice_knob() {
  local name=$1 value=${!1:-} choice
  shift
  for choice in "$@"; do
    if [ "$value" = "$choice" ]; then return 0; fi
  done
  local list=("$@")
  local last=${list[-1]}
  unset 'list[-1]'
  local allowed
  allowed=$(printf '%s, ' "${list[@]}")
  bad_knob "$name must be ${allowed%, } or $last (got '$value')"
}

# switch_knobs NAME...: each knob 0 or 1.
switch_knobs() {
  local name
  for name in "$@"; do
    choice_knob "$name" 0 1
  done
}

# ---- GPUs here -----------------------------------------------------------------------------------
# The GPUs nvidia-smi lists (no more than CUDA_VISIBLE_DEVICES names, when set); 0 without nvidia-smi.
gpus_here() {
  local count=0 visible
  if command -v nvidia-smi >/dev/null 2>&1; then
    count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
    if [ "${#visible[@]}" -lt "$count" ]; then count=${#visible[@]}; fi
  fi
  echo "$count"
}

# default_ngpus FALLBACK [MIN]: NGPUS when set; else the GPUs here when there are at least MIN
# (default 1); else FALLBACK, with a line saying so.
default_ngpus() {
  local fallback=$1 min=${2:-1} found why
  if [ -n "${NGPUS:-}" ]; then
    int_knobs 1 NGPUS
    return 0
  fi
  found=$(gpus_here)
  if [ "$found" -ge "$min" ]; then
    NGPUS=$found
    return 0
  fi
  NGPUS=$fallback
  if command -v nvidia-smi >/dev/null 2>&1; then
    why="nvidia-smi lists $found usable GPU(s)"
  else
    why="nvidia-smi is not on PATH"
  fi
  echo "NGPUS is not set and $why: using NGPUS=$NGPUS (set NGPUS to choose)."
}

# ---- shared knobs --------------------------------------------------------------------------------
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 \
  || bad_knob "PYTHON must name a Python interpreter with torch and megatron-core (got '$PYTHON')"
"$PYTHON" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("megatron.core")))' \
  2>/dev/null || bad_knob "PYTHON=$PYTHON cannot import torch and megatron.core: install the pinned stack \
(pip install -e '.[te]', or bash tools/ci/run_tests.sh, which creates .venv) or set PYTHON to an \
interpreter that has it"
DRY_RUN=${DRY_RUN:-0}
switch_knobs DRY_RUN
EXTRA=${EXTRA:-}
read -ra EXTRA_ARGS <<<"$EXTRA"
DATA_PATH=${DATA_PATH:-}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
VOCAB_FILE=${VOCAB_FILE:-}
MERGE_FILE=${MERGE_FILE:-}

# ---- data and tokenizer flags --------------------------------------------------------------------
# DATA_ARGS: the data and tokenizer flags of DATA_PATH and the tokenizer knobs (none without
# DATA_PATH). The knobs are checked here; the datasets and tokenizer files themselves by
# pretrain_gpt.py (its --dry-run too).
data_flags() {
  local name
  DATA_ARGS=()
  if [ -z "$DATA_PATH" ]; then return 0; fi
  choice_knob TOKENIZER_TYPE HuggingFaceTokenizer GPT2BPETokenizer SentencePieceTokenizer \
    GPTSentencePieceTokenizer Llama2Tokenizer TikTokenizer NullTokenizer
  read -ra DATA_ARGS <<<"$DATA_PATH"
  DATA_ARGS=(--data-path "${DATA_ARGS[@]}" --split "990,8,2" --tokenizer-type "$TOKENIZER_TYPE")
  case "$TOKENIZER_TYPE" in
    NullTokenizer) ;; # the config's --vocab-size
    GPT2BPETokenizer)
      for name in VOCAB_FILE MERGE_FILE; do
        [ -n "${!name}" ] || bad_knob "$name must be set for TOKENIZER_TYPE=GPT2BPETokenizer (a file)"
      done
      DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
      ;;
    *)
      if [ "$TOKENIZER_TYPE" = HuggingFaceTokenizer ]; then
        TOKENIZER_MODEL=${TOKENIZER_MODEL:-Qwen/Qwen3-30B-A3B}
      fi
      [ -n "$TOKENIZER_MODEL" ] \
        || bad_knob "TOKENIZER_MODEL must be set for TOKENIZER_TYPE=$TOKENIZER_TYPE (a name or a path)"
      DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
      ;;
  esac
}
data_flags

# ---- flag files ----------------------------------------------------------------------------------
# config_without FLAG N [FLAG N ...]: CONFIG_ARGS without each FLAG and its N values.
config_without() {
  local spec=("$@") kept=() i=0 j skip
  while [ "$i" -lt "${#CONFIG_ARGS[@]}" ]; do
    skip=-1
    for ((j = 0; j < ${#spec[@]}; j += 2)); do
      case "${CONFIG_ARGS[i]}" in
        "${spec[j]}") skip=${spec[j + 1]} ;;
        "${spec[j]}"=*) skip=0 ;;
      esac
    done
    if [ "$skip" -lt 0 ]; then
      kept+=("${CONFIG_ARGS[i]}")
      skip=0
    fi
    i=$((i + 1 + skip))
  done
  CONFIG_ARGS=("${kept[@]}")
}

# read_config FILE: CONFIG_ARGS, the flags of FILE (any number a line, '#' comments); with
# DATA_PATH its mock data and tokenizer give way to DATA_ARGS.
read_config() {
  local line words
  [ -f "$1" ] || bad_knob "CONFIG must be a flag file such as examples/configs/tiny_moe.args (got '$1')"
  CONFIG_ARGS=()
  while IFS= read -r line || [ -n "$line" ]; do
    read -ra words <<<"${line%%#*}"
    CONFIG_ARGS+=("${words[@]}")
  done <"$1"
  if [ -n "$DATA_PATH" ]; then
    if [ "$TOKENIZER_TYPE" = NullTokenizer ]; then
      config_without --mock-data 0 --tokenizer-type 1 --split 1
    else
      config_without --mock-data 0 --tokenizer-type 1 --split 1 --vocab-size 1
    fi
    CONFIG_ARGS+=("${DATA_ARGS[@]}")
  fi
}

# ---- recipes -------------------------------------------------------------------------------------
# recipe_args NAME: RECIPE_ARGS, the flags of the named recipe (megatron/patchset/recipes/NAME.py,
# docs/recipes.md) for the recipe's knobs as set here (a shell variable or the environment; unset
# or empty: the recipe's default), and the recipe's environment defaults exported where not set.
# A bad knob value stops the launcher with the recipe's one-line message and exit code 2.
recipe_args() {
  local name=$1 knob out line var settings=()
  out=$("$PYTHON" -m megatron.patchset recipe --knobs "$name") || exit 2
  for knob in $out; do
    if [ -n "${!knob:-}" ]; then settings+=("$knob=${!knob}"); fi
  done
  out=$("$PYTHON" -m megatron.patchset recipe --lines "$name" "${settings[@]}") || exit 2
  RECIPE_ARGS=()
  while IFS= read -r line; do
    case "$line" in
      "env "*)
        line=${line#env }
        var=${line%%=*}
        if [ -z "${!var:-}" ]; then export "$var=${line#*=}"; fi ;;
      ?*) RECIPE_ARGS+=("$line") ;;
    esac
  done <<<"$out"
}

# ---- launch --------------------------------------------------------------------------------------
# The arguments as one command line: a word with characters the shell treats specially is quoted.
command_line() {
  local word line=""
  for word in "$@"; do
    if [[ -z $word || $word =~ [^A-Za-z0-9_./:=,+@%-] ]]; then
      word="'${word//\'/\'\\\'\'}'"
    fi
    line+="${line:+ }$word"
  done
  echo "$line"
}

# exec_dry_run WORLD ABOUT FLAG...: pretrain_gpt.py --dry-run of the flags for world size WORLD,
# after a line on the layout (ABOUT) and the "DRY_RUN: " line with the whole command.
exec_dry_run() {
  local world=$1 about=$2
  shift 2
  local cmd=("$PYTHON" pretrain_gpt.py --dry-run --dry-run-world-size "$world" "$@")
  echo "Checking the flags for world size $world ($about) with pretrain_gpt.py --dry-run:"
  echo "DRY_RUN: $(command_line "${cmd[@]}")"
  exec "${cmd[@]}"
}

# launch_local WORLD ABOUT FLAG...: torchrun with WORLD processes on this machine running
# pretrain_gpt.py with the flags and EXTRA; with DRY_RUN=1 their --dry-run instead.
launch_local() {
  local world=$1 about=$2
  shift 2
  if [ "$DRY_RUN" = 1 ]; then exec_dry_run "$world" "$about" "$@" "${EXTRA_ARGS[@]}"; fi
  exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$world" pretrain_gpt.py \
    "$@" "${EXTRA_ARGS[@]}"
}
