#!/usr/bin/env bash
# The main job: set up, train a tiny transformer with posenc's sinusoidal op, export it with TorchScript,
# and run the exported model (forward and backward) from the C++ example program.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
"$PYTHON" scripts/train_tiny.py --steps 300 --out build/demo
build/scripts/cpp_example/posenc_run_model build/demo/model.pt build/demo/sample.txt
