#!/usr/bin/env bash
# Builds libposenc.so with its CUDA kernels (POSENC_CUDA=ON) against the torch of PYTHON, into BUILD_DIR, and
# stages the Python package beside it (BUILD_DIR/python/posenc: the sources of ops/ with that library, and its
# metadata), so that PYTHONPATH=BUILD_DIR/python imports it without installing anything. Used by
# scripts/gpu_check.sh (on a GPU machine) and scripts/check_cuda_build.sh (here, with no GPU). Extra arguments go
# to CMake's configure.
#
#   bash scripts/cuda_build.sh BUILD_DIR PYTHON [-DCMAKE_ARG=...]
#
# CUDAARCHS (default 90: H100/H200) picks the GPU architectures; nvcc is looked for on PATH, then in
# /usr/local/cuda/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:?usage: scripts/cuda_build.sh BUILD_DIR PYTHON [cmake args]}
PYTHON=${2:?usage: scripts/cuda_build.sh BUILD_DIR PYTHON [cmake args]}
shift 2
export CUDAARCHS=${CUDAARCHS:-90} CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
prefix=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$(command -v "$PYTHON")" \
  -DPOSENC_CUDA=ON -DPOSENC_BUILD_TESTS=OFF -DPOSENC_BUILD_EXAMPLES=OFF "$@"
cmake --build "$BUILD" -j "$(nproc)"
rm -rf "$BUILD/python"
mkdir -p "$BUILD/python"
cp -r ops "$BUILD/python/posenc"
cp "$BUILD/libposenc.so" "$BUILD/python/posenc/"
# The build record `import posenc` may read (the package's version and the torch it was compiled against), and the
# metadata an installed wheel would carry (its version, and the torch release it requires), so that
# importlib.metadata answers for the staged package as for an installed one.
"$PYTHON" - "$BUILD/python" "$(cat VERSION 2>/dev/null || echo 0.1.0)" <<'PY'
import pathlib, sys, torch
python, version = pathlib.Path(sys.argv[1]), sys.argv[2]
(python / "posenc" / "_build_info.py").write_text(f"version = {version!r}\ntorch_version = {torch.__version__!r}\n")
major, minor = torch.__version__.split(".")[:2]
info = python / f"posenc-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: posenc\nVersion: {version}\n"
                               f"Requires-Dist: torch=={major}.{minor}.*\n")
PY
echo "cuda_build.sh: $BUILD/libposenc.so with CUDA kernels for architectures $CUDAARCHS; PYTHONPATH=$BUILD/python"
