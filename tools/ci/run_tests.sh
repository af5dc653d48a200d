#!/usr/bin/env bash
# The test command: create .venv (Python >= 3.12 with the pinned CPU stack) when it is missing
# or stale, install this project into it (editable: the tools import megatron.patchset as an
# installed package), then run ruff (lint and format check, the repository's config) and the CPU
# test tier.
# Extra arguments go to pytest (and skip ruff), e.g.
#   bash tools/ci/run_tests.sh -k registry          # a subset
#   bash tools/ci/run_tests.sh tests/gpu            # the GPU tier (skips without GPUs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

version_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && version_ok "$(command -v "$candidate")"; then
      command -v "$candidate"; return 0
    fi
  done
  local root
  root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  for candidate in "$root"/versions/3.1[2-9]*/bin/python3.1[2-9] /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
    if [ -x "$candidate" ] && version_ok "$candidate"; then echo "$candidate"; return 0; fi
  done
  return 1
}

stamp=$(cat requirements/ci.txt | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ] || ! version_ok .venv/bin/python || [ "$(cat .venv/.requirements-stamp 2>/dev/null)" != "$stamp" ]; then
  py=$(find_python) || { echo "tools/ci/run_tests.sh: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
  # The pinned torch is a CUDA build: about 4.7 GB in the venv. Say so before pip runs out of space.
  free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
  if [ "${free_kb:-0}" -lt $((6 * 1024 * 1024)) ]; then
    echo "tools/ci/run_tests.sh: $(( ${free_kb:-0} / 1024 )) MiB free on $(df -P . | awk 'NR==2 {print $6}'); the venv needs about 6 GiB" >&2
    exit 1
  fi
  echo "tools/ci/run_tests.sh: creating .venv with $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
  # No pip cache: it would hold a second copy of the torch wheel (2.5 GB) next to the venv.
  .venv/bin/python -m pip install -q --no-cache-dir --upgrade pip
  .venv/bin/python -m pip install -q --no-cache-dir -r requirements/ci.txt
  echo "$stamp" > .venv/.requirements-stamp
fi

# The project, editable (megatron.patchset from this checkout, beside the wheel's megatron.core
# and megatron.training), again whenever its packaging changes: an existing .venv picks it up.
project=$(cat setup.py pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat .venv/.project-stamp 2>/dev/null)" != "$project" ]; then
  .venv/bin/python -m pip install -q --no-cache-dir --no-deps --no-build-isolation -e .
  echo "$project" > .venv/.project-stamp
fi

# Inductor's cache (the compile tests) stays inside the venv instead of growing in /tmp.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.venv/inductor-cache}"
# One intra-op thread per process: the pytest workers and the training processes the tests start
# already fill the cores, and OpenMP's threads waiting on each other's cores slow every process
# down.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ $# -eq 0 ]; then
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  # The whole tier in PYTEST_WORKERS processes (pytest-xdist; default 2): most of its time is
  # subprocesses that import megatron, which two cores run side by side. The tests on the
  # Megatron-LM snapshots share one worker (--dist loadgroup), which builds each tree once. The
  # slowest tests last.
  set -- -n "${PYTEST_WORKERS:-2}" --dist loadgroup --durations=15 tests/unit
fi
exec .venv/bin/python -m pytest -q "$@"
