#!/usr/bin/env bash
# Fetches the wheels that scripts/gpu_check.sh installs on a GPU machine with no registry, for that machine's
# Python 3.12, into .whl/ at the repository root (ignored by git): Liger's kernels (its rope kernel is a baseline
# of `scripts/bench.py --device cuda`) and rotary-embedding-torch (a reference of the tests, pinned as in
# scripts/test.sh). Their needs (torch, triton, einops) are on that machine already. Then send .whl along with
# the command that runs scripts/gpu_check.sh (docs/cuda.md says how).
set -euo pipefail
cd "$(dirname "$0")/.."
LIGER=${LIGER:-liger-kernel==0.8.5}
ROTARY=rotary-embedding-torch==0.9.1
grep -qx '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
  || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "$LIGER" "$ROTARY"
ls -l .whl
