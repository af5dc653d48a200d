#!/usr/bin/env bash
# Download torchtitan and the packages its model, trainer components and compile/CUDA-graph
# helpers import (tools/bench/peers/torchtitan_runner.py's import closure, torch excluded) as wheels
# into .gpu/peers, for a GPU machine that reaches no package registry. There:
#
#   pip install --no-index --no-deps --target /tmp/site .gpu/peers/*.whl
#
# (/tmp/site is on the PYTHONPATH of the GPU machines' environment; in a virtual environment
# use `pip install --no-index --no-deps .gpu/peers/*.whl`). torchtitan's full dependency list
# (datasets, pyarrow, tensorboard, wandb, ... about 130 MB) is for its own data loaders, tokenizer
# and loggers, which the runner does not use; `pip install .[bench-peers]` installs all of it on
# a machine with a registry.
#
#   bash tools/bench/peers/prepare_wheels.sh            # into .gpu/peers
#   OUT=/some/dir bash tools/bench/peers/prepare_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
OUT=${OUT:-.gpu/peers}
PIP=${PIP:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo pip )}
PACKAGES=(
  torchtitan==0.3.0
  spmd_types==0.2.3
  tyro==1.0.17
  docstring_parser==0.18.0
  typeguard==4.6.1
)
mkdir -p "$OUT"
"$PIP" download --no-deps --only-binary=:all: --python-version 3.12 -d "$OUT" "${PACKAGES[@]}"
if [ "$OUT" = .gpu/peers ] && ! grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null; then
  echo '/.gpu/' >> .git/info/exclude
fi
total=$(du -sk "$OUT" | cut -f1)
echo "tools/bench/peers/prepare_wheels.sh: $(ls "$OUT"/*.whl | wc -l) wheels, $((total / 1024)) MiB in $OUT"
if [ "$total" -gt $((64 * 1024)) ]; then
  echo "tools/bench/peers/prepare_wheels.sh: more than 64 MiB: one copy to the GPU machine cannot carry it" >&2
  exit 1
fi
