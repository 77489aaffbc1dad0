#!/usr/bin/env bash
# Installs what posenc needs on a fresh machine (torch 2.13 CPU when torch is absent, GoogleTest, CMake,
# Ninja, ccache; matplotlib and tqdm for the study's plot and progress bars) and builds everything once in
# build/: libposenc.so (installed editable as the Python package `posenc`), the GoogleTest suite and the C++
# programs (scripts/cpp_example, scripts/study_cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install torch==2.13.0
fi
# setuptools 70.1 and later build wheels by themselves; a venv's own copy may be older (Python 3.11's has 65).
"$PYTHON" -c "import setuptools.command.bdist_wheel" 2>/dev/null || "$PYTHON" -m pip install -q "setuptools>=70.1"
missing=()
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v ccache >/dev/null || missing+=(ccache)
command -v g++ >/dev/null || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# Pinned; neither depends on torch, so this cannot replace the CPU torch.
"$PYTHON" -m pip install -q matplotlib==3.11.2 tqdm==4.70.1
# Relative paths in ccache's keys: a fresh clone elsewhere reuses the objects compiled here.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
POSENC_BUILD_TESTS=1 "$PYTHON" -m pip install --no-build-isolation -q -e .
