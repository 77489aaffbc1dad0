#!/usr/bin/env bash
# Builds posenc against the torch of another virtual environment and runs the CPU tests there: the GoogleTest
# suite, pytest against the installed package, and a find_package(posenc) consumer.
#
#   bash scripts/check_torch.sh VENV [TORCH]
#   bash scripts/check_torch.sh /work/venvs/torch214 torch==2.14.1
#
# VENV is made (without system site packages) where it does not exist; TORCH, a pip requirement, is installed
# into it. A CUDA build of torch needs no CUDA toolkit for posenc's CPU library, so the build runs with no
# CUDA toolkit to be found: nvcc off PATH, CUDA_HOME/CUDA_PATH/CUDACXX unset and, where `unshare` can (as
# root), /usr/local/cuda* hidden behind empty folders. The consumer is then configured and built with this
# machine's CUDA (whatever part of a toolkit it has) in sight, CUDA_PATH pointing at it. The build folder is
# build/torch-<version>, apart from build/.
set -euo pipefail
step() { echo "== $* (${SECONDS} s in)"; }
VENV=$(realpath -m "${1:?usage: scripts/check_torch.sh VENV [TORCH]}")
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$ROOT}

step "venv $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
py=$(cd "$VENV/bin" && pwd)/python
if [ $# -ge 2 ]; then
  "$py" -m pip install -q "$2"
fi
torch_version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null)
torch_prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
echo "torch==${torch_version%%+*}" > "$VENV/posenc-constraints.txt"   # nothing may move torch
# setuptools 70.1 builds wheels by itself (a venv's own setuptools may be older and need the package wheel).
"$py" -m pip install -q -c "$VENV/posenc-constraints.txt" "setuptools>=70.1" -r tests/requirements.txt
build_dir=$ROOT/build/torch-$torch_version

# Runs "$@" where no CUDA toolkit can be found.
EMPTY=$(mktemp -d)
trap 'rmdir "$EMPTY"' EXIT
without_cuda() {
  local path
  path=$(printf %s "$PATH" | tr : '\n' | while read -r dir; do [ -x "$dir/nvcc" ] || printf '%s:' "$dir"; done)
  local hide='for dir in /usr/local/cuda*; do [ -d "$dir" ] && mount --bind "$EMPTY" "$dir"; done; exec "$@"'
  if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
    EMPTY=$EMPTY env -u CUDA_HOME -u CUDA_PATH -u CUDACXX PATH="${path%:}" unshare -m bash -c "$hide" _ "$@"
  else
    env -u CUDA_HOME -u CUDA_PATH -u CUDACXX PATH="${path%:}" "$@"
  fi
}

step "build against torch $torch_version with no CUDA toolkit in sight"
without_cuda bash -c '! command -v nvcc && ! [ -e /usr/local/cuda/include/cuda.h ]' >/dev/null \
  || echo "check_torch.sh: /usr/local/cuda stays in sight (hiding it takes root and unshare)"
without_cuda env POSENC_BUILD_DIR="$build_dir" POSENC_BUILD_TESTS=1 \
  "$py" -m pip install --no-build-isolation --no-deps --force-reinstall -q .
# setuptools leaves its metadata (posenc.egg-info, requiring this torch) in the source tree, where Python run from
# the tree would find it before the metadata of the tree's own install: it belongs to the venv's copy only.
rm -rf "$ROOT/posenc.egg-info"
if grep -q '^CUDA_TOOLKIT_ROOT_DIR\|^CUDAToolkit' "$build_dir/CMakeCache.txt"; then
  echo "check_torch.sh: CMake looked for a CUDA toolkit"; exit 1
fi

step "C++ tests (ctest)"
ctest --test-dir "$build_dir" --output-on-failure -j2

step "Python tests (pytest, the installed package)"
# The C++ programs the tests run (the study's, the AOTInductor runner) are this build's, linked to this torch.
(cd "$VENV" && POSENC_STUDY_CPP="$build_dir/scripts/study_cpp/posenc_study" POSENC_BUILD_DIR="$build_dir" \
  "$py" -m pytest "$ROOT/tests/python" -q -p no:cacheprovider)

step "C++ consumer: find_package(posenc), with this machine's CUDA in sight"
cuda=$(ls -d /usr/local/cuda 2>/dev/null || true)
cmake --install "$build_dir" --prefix "$build_dir/install" >/dev/null
CUDA_PATH=${CUDA_PATH:-$cuda} cmake -S scripts/cpp_example -B "$build_dir/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$build_dir/install;$torch_prefix" >/dev/null
cmake --build "$build_dir/consumer"
(cd "$VENV" && "$py" "$ROOT/scripts/train_tiny.py" --steps 60 --out "$build_dir/consumer/model")
"$build_dir/consumer/posenc_run_model" "$build_dir/consumer/model/model.pt" "$build_dir/consumer/model/sample.txt"

step "posenc's own configure, with this machine's CUDA in sight"
CUDA_PATH=${CUDA_PATH:-$cuda} cmake -S . -B "$build_dir/cuda-in-sight" -G Ninja -DCMAKE_PREFIX_PATH="$torch_prefix" \
  -DPOSENC_BUILD_TESTS=OFF -DPOSENC_BUILD_EXAMPLES=OFF >/dev/null
echo "check_torch.sh: posenc builds and passes its tests against torch $torch_version (${SECONDS} s)"
