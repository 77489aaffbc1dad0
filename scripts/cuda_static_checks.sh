#!/usr/bin/env bash
# Static checks of the CUDA kernels on a machine with nvcc and no GPU (docs/cuda.md, "Static checks"):
#   1. every csrc/cuda/*.cu compiled for sm_90 with the build tree's own nvcc command (`ninja -t commands`) plus
#      -Xptxas -v: a hot kernel (rotary, additive, embedding_backward, ALiBi and T5 bias, forward and backward)
#      with a stack frame or a spill fails;
#   2. the SASS (cuobjdump -sass): every vectorized instantiation (a kernel templated on the vector width V, with
#      V elements = 16 bytes) must have 128-bit global loads and stores (LDG.E.128*, STG.E.128*), and no
#      narrower global store (those kernels write only through store_vec);
#   3. a table of every kernel and a report, also written to REPORT when given; exit 0 only if all checks pass.
# The work is in scripts/cuda_static_checks.py.
#
#   bash scripts/cuda_static_checks.sh [REPORT]
#
# Environment (each made where it does not exist, reused where it does):
#   POSENC_CUDA_VENV       the venv with a CUDA build of torch (default /work/venvs/cuda214); where it does not
#                          exist, python3 -m venv and POSENC_CUDA_TORCH (default torch==2.14.1), as
#                          scripts/check_cuda_build.sh makes it (without the test requirements)
#   POSENC_CUDA_BUILD_DIR  a build tree configured with POSENC_CUDA=ON for sm_90 (default
#                          build/cuda-torch-<torch version>, check_cuda_build.sh's); only configured here, as
#                          scripts/cuda_build.sh configures it: nothing of the library is built
#   POSENC_CUDA_TOOLS      where cuobjdump and nvdisasm are installed from their PyPI wheels, pinned below
#                          (default VENV/posenc-tools)
#   POSENC_STATIC_CHECKS_DIR  fatbinaries, ptxas logs and SASS (default BUILD_DIR/static-checks)
#   POSENC_STATIC_CHECKS_JOBS nvcc processes at once (default: the number of CPUs)
#   POSENC_STATIC_CHECKS_FRESH=1  recompile every file (by default a file whose fatbinary is newer than every
#                          file it includes, made by the same command, is not compiled again)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
REPORT=${1:-}
[ -z "$REPORT" ] || REPORT=$(cd "$(dirname "$REPORT")" && pwd)/$(basename "$REPORT")
CUDA_BINUTILS=13.2.51   # nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm: read nvcc 13.0's sm_90 code
start=$SECONDS

command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
command -v nvcc >/dev/null || { echo "cuda_static_checks.sh: no nvcc on PATH or in /usr/local/cuda/bin"; exit 1; }
for tool in cmake ninja c++filt python3; do
  command -v $tool >/dev/null || { echo "cuda_static_checks.sh: needs $tool"; exit 1; }
done

# The venv and its CUDA torch (the headers and CMake package the kernels compile against).
VENV=${POSENC_CUDA_VENV:-/work/venvs/cuda214}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
py=$(cd "$VENV/bin" && pwd)/python
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "== installing ${POSENC_CUDA_TORCH:-torch==2.14.1} into $VENV"
  "$py" -m pip install -q "${POSENC_CUDA_TORCH:-torch==2.14.1}"
fi
read -r torch_version torch_cuda prefix < <("$py" -c \
  'import torch; print(torch.__version__, torch.version.cuda, torch.utils.cmake_prefix_path)' 2>/dev/null) || true
[ -n "${prefix:-}" ] || { echo "cuda_static_checks.sh: $py cannot import torch"; exit 1; }
[ "$torch_cuda" != None ] || { echo "cuda_static_checks.sh: torch $torch_version in $VENV is no CUDA build"; exit 1; }

# The build tree: configured as scripts/cuda_build.sh configures it (CUDAARCHS 90), or brought up to date.
BUILD=${POSENC_CUDA_BUILD_DIR:-$ROOT/build/cuda-torch-$torch_version}
export CUDAARCHS=${CUDAARCHS:-90} CCACHE_BASEDIR=${CCACHE_BASEDIR:-$ROOT}
if [ ! -f "$BUILD/build.ninja" ]; then
  echo "== configuring $BUILD (POSENC_CUDA=ON, CUDAARCHS=$CUDAARCHS) against torch $torch_version"
  mkdir -p "$BUILD"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$py" \
    -DPOSENC_CUDA=ON -DPOSENC_BUILD_TESTS=OFF -DPOSENC_BUILD_EXAMPLES=OFF >"$BUILD/configure.log" 2>&1 ||
    { tail -n 30 "$BUILD/configure.log"; echo "cuda_static_checks.sh: configure failed"; exit 1; }
else
  echo "== reusing $BUILD"
  ninja -C "$BUILD" build.ninja >/dev/null   # re-runs CMake only where CMakeLists or csrc/cuda's files changed
fi
grep -q "posenc_cuda.dir" "$BUILD/build.ninja" ||
  { echo "cuda_static_checks.sh: $BUILD has no CUDA kernels (configure it with -DPOSENC_CUDA=ON)"; exit 1; }

# cuobjdump (and the nvdisasm it runs), pinned, from PyPI.
TOOLS=${POSENC_CUDA_TOOLS:-$VENV/posenc-tools}/cuda-binutils-$CUDA_BINUTILS
if [ ! -x "$(find "$TOOLS" -name cuobjdump -type f 2>/dev/null | head -n 1)" ]; then
  echo "== installing cuobjdump and nvdisasm $CUDA_BINUTILS into $TOOLS"
  "$py" -m pip install -q --target "$TOOLS" "nvidia-cuda-cuobjdump==$CUDA_BINUTILS" \
    "nvidia-cuda-nvdisasm==$CUDA_BINUTILS"
fi
cuobjdump=$(find "$TOOLS" -name cuobjdump -type f | head -n 1)
nvdisasm=$(find "$TOOLS" -name nvdisasm -type f | head -n 1)
[ -x "$cuobjdump" ] && [ -x "$nvdisasm" ] || { echo "cuda_static_checks.sh: no cuobjdump/nvdisasm in $TOOLS"; exit 1; }
export PATH=$(dirname "$nvdisasm"):$PATH   # cuobjdump -sass runs nvdisasm
echo "   torch $torch_version, cuobjdump $CUDA_BINUTILS; set up in $((SECONDS - start)) s"

extra=()
[ -z "$REPORT" ] || extra=(--report "$REPORT")
[ "${POSENC_STATIC_CHECKS_FRESH:-0}" = 0 ] || extra+=(--fresh)
status=0
"$py" scripts/cuda_static_checks.py --root "$ROOT" --build "$BUILD" \
  --work "${POSENC_STATIC_CHECKS_DIR:-$BUILD/static-checks}" --cuobjdump "$cuobjdump" \
  --jobs "${POSENC_STATIC_CHECKS_JOBS:-$(nproc)}" "${extra[@]}" || status=$?
echo "cuda_static_checks.sh: $([ $status = 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s"
exit $status
