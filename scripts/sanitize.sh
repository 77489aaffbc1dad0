#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer: builds libposenc and the GoogleTest suite instrumented in their
# own tree (build-asan/), runs ctest, then a pytest subset through the instrumented library (POSENC_LIBRARY
# makes `import posenc` load it; the ASan runtime is preloaded into Python, which is not instrumented).
# Every report, from any process (pytest's subprocesses included), is written to build-asan/reports/ and
# fails the script. libtorch itself is not instrumented: memory it reads or writes on its own is not checked,
# but every access our kernels make to tensor memory (allocated through the intercepted malloc) is.
#
# Usage: bash scripts/sanitize.sh [pytest arguments replacing the default subset]
# Environment: POSENC_ASAN_BUILD_DIR (default build-asan), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${POSENC_ASAN_BUILD_DIR:-build-asan}
started=$(date +%s)

# The pytest subset: every test file but the ones that compile (torch.compile runs a C++ compiler under the
# preloaded runtime), export, or run whole Hugging Face models, which would take long under ASan and exercise
# our kernels no differently than the rest, and the emulated CPUs (qemu-user cannot map ASan's shadow memory:
# the emulated process is killed).
DEFAULT_TESTS=(tests/python -k "not compile and not export and not hugging_face and not bloom and not gpt2 and not opt_learned and not t5_model and not rotary_embedding_torch and not emulated")

flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g"
torch_prefix=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
echo "== configure and build $BUILD (ASan + UBSan)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$torch_prefix" \
  -DPython3_EXECUTABLE="$(command -v "$PYTHON")" -DPOSENC_BUILD_TESTS=ON -DPOSENC_BUILD_EXAMPLES=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$BUILD" --parallel 2
built=$(date +%s)

reports="$PWD/$BUILD/reports"
rm -rf "$reports" && mkdir -p "$reports"
# The ASan runtime must be the first library a process loads; libstdc++ right after it, so that ASan finds the
# real __cxa_throw when it starts (Python itself does not link libstdc++: without it, the first C++ exception,
# i.e. the first error an op raises, aborts with "CHECK failed ... real___cxa_throw").
asan_runtime="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
# detect_leaks=0: CPython and libtorch keep allocations alive until exit by design, so leak reports would be
# theirs. alloc_dealloc_mismatch=0: libtorch (not instrumented) pairs its own new/delete in ways ASan cannot
# see. Each report goes to a file named after the process.
export ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"

echo "== ctest ($BUILD)"
status=0
# The fixture step runs Python on the instrumented library, so it needs the runtime preloaded too.
LD_PRELOAD="$asan_runtime" ctest --test-dir "$BUILD" --output-on-failure -j2 || status=1
tested_cpp=$(date +%s)

echo "== pytest through $BUILD/libposenc.so"
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=("${DEFAULT_TESTS[@]}")
LD_PRELOAD="$asan_runtime" POSENC_LIBRARY="$PWD/$BUILD/libposenc.so" \
  "$PYTHON" -m pytest -q -p no:cacheprovider "${tests[@]}" || status=1
finished=$(date +%s)

echo "== time: build $((built - started)) s, ctest $((tested_cpp - built)) s, pytest $((finished - tested_cpp)) s"
if compgen -G "$reports/*" >/dev/null; then
  echo "== sanitizer reports ($reports):"
  for report in "$reports"/*; do
    echo "--- $report"
    head -60 "$report"
  done
  exit 1
fi
echo "== no sanitizer report"
exit $status
