#!/usr/bin/env bash
# Fetches the wheels that scripts/gpu_check.sh installs on a GPU machine with no registry: Liger's kernels (its
# rope kernel is a baseline of `scripts/bench.py --device cuda`), for that machine's Python 3.12, into .whl/ at
# the repository root (ignored by git). Its needs (torch, triton) are on that machine already. Then send .whl
# along with the command that runs scripts/gpu_check.sh (docs/cuda.md says how).
set -euo pipefail
cd "$(dirname "$0")/.."
LIGER=${LIGER:-liger-kernel==0.8.5}
grep -qx '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
  || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "$LIGER"
ls -l .whl
