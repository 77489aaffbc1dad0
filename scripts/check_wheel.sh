#!/usr/bin/env bash
# Builds posenc's wheel with this environment's torch, installs it in a new virtual environment that holds
# nothing else (no system site packages) but the same torch release and the test requirements, and runs the
# pytest suite there, from a folder where `import posenc` can only find the installed wheel.
#
#   bash scripts/check_wheel.sh [WORK]      WORK: where the wheel and the venv go (default build/wheel-check)
#
# The wheel reuses the CMake build folder (POSENC_BUILD_DIR, default build/): after scripts/setup.sh it
# compiles nothing. Set KEEP_VENV=1 to keep the venv afterwards.
set -euo pipefail
step() { echo "== $* (${SECONDS} s in)"; }
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
WORK=$(mkdir -p "${1:-build/wheel-check}" && cd "${1:-build/wheel-check}" && pwd)
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$ROOT}
rm -rf "$WORK/dist" "$WORK/venv"

step "wheel"
"$PYTHON" -m pip wheel --no-build-isolation --no-deps -q -w "$WORK/dist" .
wheel=$(ls "$WORK"/dist/posenc-*.whl)
"$PYTHON" -m zipfile -l "$wheel"

step "a new venv with torch $("$PYTHON" -c 'import torch; print(torch.__version__)') and the wheel"
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
echo "torch==$torch_version" > "$WORK/constraints.txt"   # nothing may move torch
"$PYTHON" -m venv "$WORK/venv"
venv_python=$WORK/venv/bin/python
"$venv_python" -m pip install -q -c "$WORK/constraints.txt" "torch==$torch_version"
"$venv_python" -m pip install -q -c "$WORK/constraints.txt" "$wheel" -r tests/requirements.txt

step "pytest against the installed wheel"
cd "$WORK"
"$venv_python" - "$WORK/venv" <<'EOF'
import importlib.metadata
import sys
from pathlib import Path

import posenc
import torch

venv = Path(sys.argv[1]).resolve()
assert Path(posenc.__file__).resolve().is_relative_to(venv), f"posenc imported from {posenc.__file__}, not {venv}"
release = ".".join(posenc.built_torch_version.split(".")[:2])
assert importlib.metadata.requires("posenc") == [f"torch=={release}.*"], importlib.metadata.requires("posenc")
print(f"posenc {posenc.__version__} from {Path(posenc.__file__).parent}, built for torch {posenc.built_torch_version}"
      f", requires torch=={release}.*, running torch {torch.__version__}")
EOF
"$venv_python" -m pytest "$ROOT/tests/python" -q -p no:cacheprovider
[ "${KEEP_VENV:-0}" = 1 ] || rm -rf "$WORK/venv"
echo "check_wheel.sh: the wheel installs and passes the tests in a new venv (${SECONDS} s)"
