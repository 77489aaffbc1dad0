#!/usr/bin/env bash
# Every test, C++ and Python: the GoogleTest suite (incl. the TorchScript round trip), the C++ programs built
# with find_package(posenc) against the installed package, and pytest (incl. the reference libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
# Reference libraries the tests compare with; pinned so that a new release cannot change the references.
"$PYTHON" -m pip install -q pytest transformers==5.24.0 rotary-embedding-torch==0.9.1

echo "== C++ tests (ctest)"
ctest --test-dir build --output-on-failure

echo "== C++ consumer: find_package(posenc) against the installed prefix"
cmake --install build --prefix build/install >/dev/null
torch_prefix=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S scripts/cpp_example -B build/consumer -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build/install;$torch_prefix" >/dev/null
cmake --build build/consumer
"$PYTHON" scripts/train_tiny.py --steps 60 --out build/consumer/model
build/consumer/posenc_run_model build/consumer/model/model.pt build/consumer/model/sample.txt
# The study's C++ program, built alone the same way, on a model from a short run of the study.
cmake -S scripts/study_cpp -B build/consumer_study -G Ninja \
  -DCMAKE_PREFIX_PATH="$PWD/build/install;$torch_prefix" >/dev/null
cmake --build build/consumer_study
"$PYTHON" scripts/study.py --preset quick --encodings alibi --out build/consumer_study/run \
  >build/consumer_study/run.log 2>&1 || { cat build/consumer_study/run.log; exit 1; }
build/consumer_study/posenc_study build/consumer_study/run/export

echo "== Python tests (pytest)"
"$PYTHON" -m pytest tests/python -q -p no:cacheprovider
