#!/usr/bin/env bash
# The GPU test tier on this machine's GPUs (tests marked gpu skip when too few GPUs are visible).
#
#   bash tools/ci/run_gpu_tier.sh                         # all of tests/gpu
#   bash tools/ci/run_gpu_tier.sh tests/gpu/test_train_tiny.py -k one_gpu
#
# Every training run the tests launch records its exact metrics; REPORT_DIR (default
# gpu-report/) collects a JSON per run, pytest's log and a summary table (tools/ci/gpu_report.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-python3}
REPORT_DIR=${REPORT_DIR:-gpu-report}
mkdir -p "$REPORT_DIR/runs"
REPORT_DIR=$(cd "$REPORT_DIR" && pwd)
[ $# -eq 0 ] && set -- tests/gpu
export PATCHSET_GPU_REPORT="$REPORT_DIR/runs" PYTHONUNBUFFERED=1
"$PYTHON" -m pytest -v -s -rs -p no:cacheprovider "$@" 2>&1 | tee "$REPORT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
"$PYTHON" tools/ci/gpu_report.py "$REPORT_DIR/runs" | tee "$REPORT_DIR/summary.txt"
exit "$rc"
