#!/usr/bin/env bash
# Build DeepEP (the flex dispatcher's `deepep`/`hybridep` backends) from a source checkout or a
# source archive, for the local torch, against the NVSHMEM pip wheel that torch cu13 installs,
# and install it into DEST (put DEST on PYTHONPATH). See docs/deepep.md.
#
#   bash tools/build/build_deepep.sh SRC DEST
#
#   SRC   a DeepEP source tree, or a .tar/.tar.gz of one (e.g. `git archive` output: its commit
#         is read from the archive and checked against DEEPEP_EXPECT_REVISION when that is set)
#   DEST  folder that receives the `deep_ep` package and the `deep_ep_cpp` extension
#
# Environment (defaults in brackets):
#   PYTHON [python3]             the interpreter (its torch) the extension is built for
#   CUDA_HOME [/usr/local/cuda]  a CUDA 13 toolkit with nvcc
#   TORCH_CUDA_ARCH_LIST [9.0]   Hopper; DeepEP's sm90 features stay on
#   MAX_JOBS [number of CPUs]    parallel nvcc jobs (about 2 GB of memory each)
#   RDMA_HEADERS                 rdma-core headers (a folder with infiniband/mlx5dv.h, or a .tar.gz
#                                of one) for machines without libibverbs-dev; NVSHMEM 3.4's headers
#                                include <infiniband/mlx5dv.h>. Nothing from rdma-core is linked.
#   BUILD_DIR [/tmp/deepep-build] scratch folder (the source is unpacked and compiled here)
#   DEEPEP_EXPECT_REVISION       refuse a source archive of another commit
#
# Never build DeepEP main (EPv2, 2.x) for megatron-core 0.19.2: its `deep_ep.utils` no longer
# exports EventOverlap, and megatron then reports DeepEP as "not installed".
set -euo pipefail

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -eq 2 ] || usage
SRC=$1
DEST=$2
PYTHON=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export CUDA_HOME
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
BUILD_DIR=${BUILD_DIR:-/tmp/deepep-build}
started=$(date +%s)

say() { echo "build_deepep: $*"; }
die() { echo "tools/build/build_deepep.sh: error: $*" >&2; exit 1; }

[ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc at CUDA_HOME=$CUDA_HOME/bin/nvcc (set CUDA_HOME to a CUDA 13 toolkit)"
command -v "$PYTHON" >/dev/null || die "python interpreter '$PYTHON' not found (set PYTHON)"
rm -rf "$BUILD_DIR"
mkdir -p "$BUILD_DIR" "$DEST"
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
DEST=$(cd "$DEST" && pwd)

# --- 1. the source --------------------------------------------------------------------------
revision=unknown
if [ -d "$SRC" ]; then
    cp -a "$SRC" "$BUILD_DIR/src"
    revision=$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)
elif [ -f "$SRC" ]; then
    # Unpack with Python's tarfile (works without git); a `git archive` carries its commit id
    # in the pax global header.
    revision=$("$PYTHON" - "$SRC" "$BUILD_DIR/src" <<'PY'
import os, sys, tarfile
archive, dest = sys.argv[1], sys.argv[2]
with tarfile.open(archive) as tar:
    commit = tar.pax_headers.get("comment", "unknown")
    members = tar.getmembers()
    tops = {m.name.split("/", 1)[0] for m in members}
    tar.extractall(dest + ".unpack", filter="data")
inner = dest + ".unpack"
if len(tops) == 1 and os.path.isdir(os.path.join(inner, next(iter(tops)))):
    inner = os.path.join(inner, next(iter(tops)))
os.rename(inner, dest)
print(commit)
PY
)
else
    die "source $SRC is neither a folder nor an archive"
fi
[ -f "$BUILD_DIR/src/setup.py" ] && [ -d "$BUILD_DIR/src/csrc" ] || die "$SRC does not look like a DeepEP source tree (no setup.py/csrc)"
if [ -n "${DEEPEP_EXPECT_REVISION:-}" ] && [ "$revision" != "unknown" ] && [ "${revision#"$DEEPEP_EXPECT_REVISION"}" = "$revision" ]; then
    die "source is DeepEP $revision, expected $DEEPEP_EXPECT_REVISION"
fi
version=$(grep -o "version='[^']*'" "$BUILD_DIR/src/setup.py" | head -1 | cut -d"'" -f2)
case "$version" in
    2.*) die "DeepEP $version (EPv2) does not match megatron-core 0.19.2's fused_a2a.py; use 567632d (see docs/deepep.md)";;
esac
say "DeepEP source: revision $revision, setup.py version ${version:-?}"

# --- 2. toolchain facts ---------------------------------------------------------------------
site=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
facts=$("$PYTHON" - <<'PY'
import importlib.util
from importlib import metadata
import torch
def version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
spec = importlib.util.find_spec("nvidia.nvshmem")
where = list(spec.submodule_search_locations)[0] if spec else "none"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); nvidia-nvshmem-cu13 {version('nvidia-nvshmem-cu13')} at {where}; "
      f"nvidia-nccl-cu13 {version('nvidia-nccl-cu13')}")
PY
)
say "$facts"
say "nvcc: $("$CUDA_HOME/bin/nvcc" --version | tail -1)"
"$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("nvidia.nvshmem") is None)' \
    || die "the NVSHMEM pip wheel (nvidia-nvshmem-cu13, a dependency of torch cu13) is not installed; DeepEP's setup.py finds it through nvidia.nvshmem"

# --- 3. include and link paths the pip-wheel toolchain lacks ----------------------------------
includes=()
# CUDA 13 moved CCCL (cuda/std/...) under include/cccl, which nvcc finds and g++ does not; the
# host compiler reaches it through NVSHMEM's headers included by deep_ep.cpp.
[ -d "$CUDA_HOME/include/cccl" ] && includes+=("$CUDA_HOME/include/cccl")
# A minimal toolkit without the math-library headers torch's extension headers include.
if [ ! -f "$CUDA_HOME/include/cusparse.h" ] && [ -f "$site/nvidia/cu13/include/cusparse.h" ]; then
    includes+=("$site/nvidia/cu13/include")
fi
# rdma-core headers for NVSHMEM's IBGDA headers.
if ! echo '#include <infiniband/mlx5dv.h>' | g++ -E -x c++ - >/dev/null 2>&1; then
    [ -n "${RDMA_HEADERS:-}" ] || die "<infiniband/mlx5dv.h> not found: install libibverbs-dev or set RDMA_HEADERS (docs/deepep.md)"
    if [ -d "$RDMA_HEADERS" ]; then
        rdma=$RDMA_HEADERS
    else
        mkdir -p "$BUILD_DIR/rdma"
        tar -xzf "$RDMA_HEADERS" -C "$BUILD_DIR/rdma"
        rdma=$BUILD_DIR/rdma
        [ -d "$rdma/include" ] && rdma=$rdma/include
    fi
    [ -f "$rdma/infiniband/mlx5dv.h" ] || die "RDMA_HEADERS=$RDMA_HEADERS has no infiniband/mlx5dv.h"
    includes+=("$rdma")
    say "rdma-core headers from $RDMA_HEADERS"
fi
for dir in "${includes[@]}"; do
    CPLUS_INCLUDE_PATH="$dir${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
done
export CPLUS_INCLUDE_PATH=${CPLUS_INCLUDE_PATH:-}
# setup.py links with -lcuda: use the toolkit's stub, else the driver's libcuda.so.1.
links=$BUILD_DIR/links
mkdir -p "$links"
if ! echo 'int main(){return 0;}' | gcc -x c - -o "$links/probe" -lcuda ${LIBRARY_PATH:+-L${LIBRARY_PATH//:/ -L}} >/dev/null 2>&1; then
    stub=""
    for candidate in "$CUDA_HOME/lib64/stubs/libcuda.so" "$CUDA_HOME/targets/x86_64-linux/lib/stubs/libcuda.so" \
                     "$site/nvidia/cu13/lib/stubs/libcuda.so"; do
        [ -f "$candidate" ] && { stub=$candidate; break; }
    done
    if [ -z "$stub" ]; then
        stub=$( (ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}') || true)
    fi
    if [ -z "$stub" ]; then
        for candidate in /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so.1; do
            [ -f "$candidate" ] && { stub=$candidate; break; }
        done
    fi
    [ -n "$stub" ] || die "no libcuda.so to link against (no driver, no $CUDA_HOME/lib64/stubs); set LIBRARY_PATH"
    ln -sf "$stub" "$links/libcuda.so"
    export LIBRARY_PATH="$links${LIBRARY_PATH:+:$LIBRARY_PATH}"
    say "linking -lcuda against $stub"
fi
# Keep libcuda.so.1 NEEDED even when linked against a symbol-less stub.
export LDFLAGS="-Wl,--no-as-needed${LDFLAGS:+ $LDFLAGS}"
say "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CPLUS_INCLUDE_PATH=$CPLUS_INCLUDE_PATH"

# --- 4. build and install ---------------------------------------------------------------------
# DISABLE_SM90_FEATURES stays 0 (Hopper), TOPK_IDX_BITS unset (64-bit topk_idx, as megatron passes).
unset DISABLE_SM90_FEATURES TOPK_IDX_BITS NVSHMEM_DIR
cd "$BUILD_DIR/src"
"$PYTHON" setup.py build > "$BUILD_DIR/build.log" 2>&1 || { tail -40 "$BUILD_DIR/build.log" >&2; die "compilation failed (full log: $BUILD_DIR/build.log)"; }
lib=$(ls -d build/lib.* | head -1)
[ -d "$lib/deep_ep" ] && ls "$lib"/deep_ep_cpp*.so >/dev/null 2>&1 || die "build produced no deep_ep package/extension in $lib"
rm -rf "$DEST/deep_ep" "$DEST"/deep_ep_cpp*.so
cp -a "$lib"/deep_ep "$lib"/deep_ep_cpp*.so "$DEST/"
elapsed=$(( $(date +%s) - started ))
cat > "$DEST/DEEPEP_BUILD.txt" <<EOF
revision $revision
version ${version:-?}
$facts
nvcc $("$CUDA_HOME/bin/nvcc" --version | tail -1)
TORCH_CUDA_ARCH_LIST $TORCH_CUDA_ARCH_LIST
MAX_JOBS $MAX_JOBS
seconds $elapsed
EOF
say "installed deep_ep ($revision) into $DEST in ${elapsed}s; use: export PYTHONPATH=$DEST:\$PYTHONPATH"
