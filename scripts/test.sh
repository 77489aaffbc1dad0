#!/usr/bin/env bash
# Every test, C++ and Python: the GoogleTest suite (incl. the TorchScript round trip), the C++ programs built
# with find_package(posenc) against the installed package, and pytest (incl. the reference libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
# pytest and the reference libraries the tests compare with (pinned in tests/requirements.txt).
"$PYTHON" -m pip install -q -r tests/requirements.txt
# qemu-user runs the library on emulated CPUs (one without AVX-512, one without AVX) in test_capabilities.py.
if ! command -v qemu-x86_64 >/dev/null && [ "$(uname -m)" = x86_64 ]; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq qemu-user
fi

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

# The tests above ran the best CPU capability; the kernel tests run again under every lower one this CPU has
# (test_capabilities.py also compares every capability's bits, natively and on emulated CPUs).
best=$("$PYTHON" -c 'import posenc; print(posenc.cpu_capability())')
kernel_tests=(tests/python/test_sinusoidal.py tests/python/test_learned.py tests/python/test_rope.py
              tests/python/test_alibi.py tests/python/test_t5.py tests/python/test_multiaxis.py)
for capability in default avx2; do
  [ "$capability" = "$best" ] && break
  echo "== Kernel tests under POSENC_CPU_CAPABILITY=$capability"
  POSENC_CPU_CAPABILITY=$capability "$PYTHON" -m pytest -q -p no:cacheprovider "${kernel_tests[@]}"
done
# and, on a CPU with AVX-512 BF16, as the AVX-512 kernels run on one without it (QK-norm and the resampled tables
# too: their bf16 rows have paths of their own there)
if [ "$best" = avx512 ] && grep -qw avx512_bf16 /proc/cpuinfo; then
  echo "== Kernel tests under POSENC_AVX512_BF16=0"
  POSENC_AVX512_BF16=0 "$PYTHON" -m pytest -q -p no:cacheprovider "${kernel_tests[@]}" tests/python/test_qk_norm.py \
    tests/python/test_resample.py
fi
