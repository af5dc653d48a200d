#!/usr/bin/env bash
# The GPU test tier on this machine's GPUs (tests marked gpu skip when too few GPUs are visible).
#
#   bash tools/ci/run_gpu_tier.sh                         # all of tests/gpu
#   bash tools/ci/run_gpu_tier.sh --part 2/4              # part 2 of 4 [then pytest options]
#   bash tools/ci/run_gpu_tier.sh tests/gpu/test_train_tiny.py -k one_gpu
#
# The parts of 4 (tests/gpu/conftest.py's PARTS: whole files) each run in under 8 minutes on one
# H200 and together run every GPU test once; each is one command for a machine that stops
# commands after 10 minutes.
#
# Every training run the tests launch records its exact metrics; REPORT_DIR (default
# gpu-report/, gpu-report/part-N-of-M/ with --part) collects a JSON per run, pytest's log and a
# summary table (tools/ci/gpu_report.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-python3}
part=()
case "${1:-}" in
  --part) part=(--gpu-part "${2:-}"); shift $(( $# >= 2 ? 2 : 1 )) ;;
  --part=*) part=(--gpu-part "${1#--part=}"); shift ;;
esac
if [ ${#part[@]} -gt 0 ] && ! [[ "${part[1]}" =~ ^[0-9]+/[0-9]+$ ]]; then
  echo "tools/ci/run_gpu_tier.sh: --part takes N/M (part N of M), e.g. --part 2/4" >&2
  exit 2
fi
default_report=gpu-report
[ ${#part[@]} -gt 0 ] && default_report="gpu-report/part-${part[1]%/*}-of-${part[1]#*/}"
REPORT_DIR=${REPORT_DIR:-$default_report}
mkdir -p "$REPORT_DIR/runs"
REPORT_DIR=$(cd "$REPORT_DIR" && pwd)
# A part is a part of tests/gpu; what follows --part N/M are pytest options.
if [ ${#part[@]} -gt 0 ]; then
  set -- "${part[@]}" tests/gpu "$@"
elif [ $# -eq 0 ]; then
  set -- tests/gpu
fi
export PATCHSET_GPU_REPORT="$REPORT_DIR/runs" PYTHONUNBUFFERED=1
"$PYTHON" -m pytest -v -s -rs -p no:cacheprovider "$@" 2>&1 | tee "$REPORT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
"$PYTHON" tools/ci/gpu_report.py "$REPORT_DIR/runs" | tee "$REPORT_DIR/summary.txt"
exit "$rc"
