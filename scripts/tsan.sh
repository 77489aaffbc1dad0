#!/usr/bin/env bash
# ThreadSanitizer: builds libposenc and the GoogleTest suite with -fsanitize=thread in their own tree
# (build-tsan/) and runs the concurrency tests (tests/cpp/test_concurrency.cpp: every op and module from 8
# std::threads at once).
#
# libtorch is not built with TSan. What that means here:
# - Races inside libtorch are not seen; races between our kernels' accesses are, as are accesses by our
#   kernels to memory libtorch frees or reuses (malloc and free are intercepted). libtorch's inline header code
#   is compiled into our library, so its races are seen: one, in autograd (Node::topological_nr, a plain store
#   of the same value from every thread that builds a graph on a shared leaf), is PyTorch's own and is
#   suppressed by scripts/tsan.supp in both runs.
# - Synchronisation done by uninstrumented code through atomics or futexes is invisible. libgomp (the OpenMP
#   runtime libtorch's at::parallel_for runs on) hands work to its pool threads and waits for them that way,
#   so every write a kernel makes inside a parallel region and the caller's later read of it look like a race:
#   a false positive. The first run therefore sets OMP_NUM_THREADS=1, where at::parallel_for runs inline on
#   the calling thread and the only threads are the test's 8 std::threads (synchronised through pthreads,
#   which TSan sees). That run must be clean.
# - The second run (--with-openmp) keeps libgomp's pool and suppresses reports whose stack passes through
#   libgomp (scripts/tsan-openmp.supp); it is informative, not a gate.
#
# Usage: bash scripts/tsan.sh [--with-openmp]
# Environment: POSENC_TSAN_BUILD_DIR (default build-tsan), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${POSENC_TSAN_BUILD_DIR:-build-tsan}
started=$(date +%s)

torch_prefix=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
echo "== configure and build $BUILD (TSan)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$torch_prefix" \
  -DPython3_EXECUTABLE="$(command -v "$PYTHON")" -DPOSENC_BUILD_TESTS=ON -DPOSENC_BUILD_EXAMPLES=OFF \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer -g" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" >/dev/null
cmake --build "$BUILD" --target posenc_tests --parallel 2
built=$(date +%s)

export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:history_size=4:suppressions=$PWD/scripts/tsan.supp"
echo "== concurrency tests, OpenMP pool off (OMP_NUM_THREADS=1): must be clean"
OMP_NUM_THREADS=1 "$BUILD/tests/cpp/posenc_tests" --gtest_filter='Concurrency.*'
if [ "${1:-}" = "--with-openmp" ]; then
  echo "== concurrency tests with libgomp's pool, its false positives suppressed (informative)"
  TSAN_OPTIONS="$TSAN_OPTIONS:halt_on_error=0:suppressions=$PWD/scripts/tsan-openmp.supp" OMP_NUM_THREADS=2 \
    "$BUILD/tests/cpp/posenc_tests" --gtest_filter='Concurrency.*' || true
fi
echo "== time: build $((built - started)) s, tests $(($(date +%s) - built)) s"
