#!/usr/bin/env bash
# One run that answers whether posenc's CUDA kernels work and how fast they are, on a machine with a GPU and its
# own torch (no internet needed), in order of information per second: builds posenc with its CUDA kernels, runs
# every op once against the CPU (plain, then under compute-sanitizer), the CUDA tests, the GPU benchmark, then the
# whole test suite with every op call re-run on the GPU. Everything stays within about 8 minutes (each step has a
# time budget, cut short if the run is late), and every result lands in OUTDIR as it is produced (8 files: the
# device tool brings back 8 at most, so a command that runs this script must write nothing else there):
#
#   bash scripts/gpu_check.sh OUTDIR
#
#   env.txt            GPU, driver, torch, nvcc, cmake
#   build.log          CMake configure and build (build/gpu: sm_90 by default, CUDAARCHS overrides), then ctest
#   smoke.log          scripts/gpu_smoke.py: every op's sample on CUDA against the CPU (first differing index and
#                      its ULP error), then the same under compute-sanitizer memcheck, then racecheck on the ops
#                      whose kernels use shared memory (rope, alibi)
#   test_cuda.log      pytest tests/python/test_cuda.py: every op on CUDA against the CPU kernels
#   bench.log          scripts/bench.py --device cuda
#   bench_cuda.json    its rows (`scripts/bench.py --from-json bench_cuda.json --markdown F` makes the table)
#   suite.log          pytest tests/python with POSENC_SHADOW=cuda (each op call re-run on CUDA and compared)
#   summary.json       what passed, what failed, how long each step took (written even when the run is cut short)
#
# A second, shorter run (the device time left after a first one) picks its steps and narrows the CUDA tests:
#
#   POSENC_GPU_CHECK_STEPS="test_cuda suite" POSENC_GPU_TEST_ARGS="-k graph_capture" bash scripts/gpu_check.sh OUTDIR
#
# runs the build (always: quick where the machine kept build/gpu) and only the steps named, and passes the extra
# pytest arguments to test_cuda and suite (pytest's -x, -k, --tb=long...).
#
# The C++ tests (ctest) build and run too where GoogleTest is installed. A folder .whl/ of wheels (Liger's
# rope kernel for the benchmark, rotary-embedding-torch for the tests: scripts/gpu_wheels.sh makes it) is
# installed into a scratch folder first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:?usage: scripts/gpu_check.sh OUTDIR}" && cd "$1" && pwd)
PYTHON=${PYTHON:-python3}
BUILD=build/gpu
export PYTHONUNBUFFERED=1 CUDAARCHS=${CUDAARCHS:-90}
DEADLINE=${POSENC_GPU_CHECK_SECONDS:-480}
STEPS=" ${POSENC_GPU_CHECK_STEPS:-build smoke memcheck test_cuda bench racecheck ctest suite} "
STEPS=${STEPS//,/ }
read -r -a TEST_ARGS <<<"${POSENC_GPU_TEST_ARGS:-}"
declare -A STATUS SECONDS_TAKEN

# Whether this run runs step $1: the build always, the others where POSENC_GPU_CHECK_STEPS names them.
selected() {
  [ "$1" = build ] || [[ "$STEPS" == *" $1 "* ]]
}

# Runs a step with at most its budget of seconds, or what is left before the deadline.
step() {
  local name=$1 budget=$2 log=$3
  shift 3
  selected "$name" || return 0
  local left=$((DEADLINE - SECONDS))
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -le 10 ]; then
    echo "== $name: no time left" | tee -a "$log"
    STATUS[$name]="not run (no time left)"
    return 1
  fi
  echo "== $name (at most ${budget}s)"
  local start=$SECONDS
  timeout --kill-after=10 "$budget" "$@" >>"$log" 2>&1
  local rc=$?
  SECONDS_TAKEN[$name]=$((SECONDS - start))
  case $rc in
    0) STATUS[$name]=passed ;;
    124|137) STATUS[$name]="timed out after ${budget}s" ;;
    *) STATUS[$name]="failed (exit $rc)" ;;
  esac
  echo "   ${STATUS[$name]} in ${SECONDS_TAKEN[$name]}s"
  tail -n 3 "$log" | sed 's/^/   | /'
  return $rc
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  "$PYTHON" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' 2>&1
  # The reference libraries' versions (the tests that patch Hugging Face models follow transformers').
  "$PYTHON" - <<'PY' 2>&1
import importlib.metadata as metadata
versions = []
for name in ("transformers", "diffusers", "timm", "pytest", "hypothesis"):
    try:
        versions.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        versions.append(f"{name} absent")
print(", ".join(versions))
PY
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  nvcc --version 2>&1 | tail -n 1
  cmake --version | head -n 1
} >"$OUT/env.txt"
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
# The system's gcc and g++, whose libstdc++ is the one the process loads, build posenc and host nvcc: the GPU
# machine's environment names another compiler (CC/CXX=/opt/gcc), and a libposenc.so built with it crashed in
# Python at the first number an iostream parsed or formatted, inside a copy of libstdc++'s code of its own.
if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
echo "CC=${CC:-} CXX=${CXX:-} ($("${CXX:-c++}" --version | head -n 1))" >>"$OUT/env.txt"
cat "$OUT/env.txt"

# Wheels carried to the machine (no registry there): installed into a scratch folder, never over its packages.
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/posenc-wheels .whl/*.whl >>"$OUT/env.txt" 2>&1 \
    && export PYTHONPATH=/tmp/posenc-wheels${PYTHONPATH:+:$PYTHONPATH}
fi

# The library with its CUDA kernels and the package staged beside it (scripts/cuda_build.sh), with the C++ tests
# where GoogleTest is installed.
gtest=OFF
if [ -e /usr/include/gtest/gtest.h ] || [ -d /usr/lib/x86_64-linux-gnu/cmake/GTest ] || [ -d /usr/local/lib/cmake/GTest ]; then
  gtest=ON
fi
step build 220 "$OUT/build.log" bash scripts/cuda_build.sh "$BUILD" "$PYTHON" -DPOSENC_BUILD_TESTS=$gtest
built=$?
export PYTHONPATH=$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}

if [ $built = 0 ]; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  step smoke 40 "$OUT/smoke.log" "$PYTHON" scripts/gpu_smoke.py
  step memcheck 90 "$OUT/smoke.log" "$sanitizer" --tool memcheck --error-exitcode 1 --print-limit 20 \
    "$PYTHON" scripts/gpu_smoke.py
  step test_cuda 120 "$OUT/test_cuda.log" "$PYTHON" -m pytest tests/python/test_cuda.py -q -p no:cacheprovider -rfE \
    "${TEST_ARGS[@]}"
  step bench 150 "$OUT/bench.log" "$PYTHON" scripts/bench.py --device cuda --repeat 20 --json "$OUT/bench_cuda.json"
  step racecheck 45 "$OUT/smoke.log" "$sanitizer" --tool racecheck --racecheck-report hazard --error-exitcode 1 \
    "$PYTHON" scripts/gpu_smoke.py --only rope,alibi
  [ $gtest = ON ] && step ctest 40 "$OUT/build.log" ctest --test-dir "$BUILD" --output-on-failure -j 8
  step suite 180 "$OUT/suite.log" env POSENC_SHADOW=cuda "$PYTHON" -m pytest tests/python -q -p no:cacheprovider \
    -rfE --ignore=tests/python/test_cuda.py "${TEST_ARGS[@]}"
fi

# pytest's closing line of each test log, and every step's status, as JSON.
"$PYTHON" - "$OUT" "$SECONDS" <<EOF
import json, os, re, sys
out, total = sys.argv[1], int(sys.argv[2])
status = {$(for k in "${!STATUS[@]}"; do printf '"%s": "%s", ' "$k" "${STATUS[$k]}"; done)}
seconds = {$(for k in "${!SECONDS_TAKEN[@]}"; do printf '"%s": %s, ' "$k" "${SECONDS_TAKEN[$k]}"; done)}
tests = {}
for name in ("test_cuda", "suite"):
    path = os.path.join(out, name + ".log")
    if os.path.exists(path):
        lines = [l for l in open(path, errors="replace") if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", l)]
        tests[name] = lines[-1].strip(" =\n") if lines else "no pytest summary"
        # -rfE's short summary: each failing test with the first line of its error, here too should the log itself
        # not come back.
        failures = [l.strip()[:400] for l in open(path, errors="replace") if l.startswith(("FAILED ", "ERROR "))]
        if failures:
            tests[name + " failures"] = failures[:30]
path = os.path.join(out, "smoke.log")
if os.path.exists(path):  # "N failed" after each of the plain, memcheck and racecheck runs
    tests["smoke"] = [l.strip() for l in open(path, errors="replace") if re.fullmatch(r"\d+ failed\n?", l)]
summary = {"status": status, "seconds": seconds, "total_seconds": total, "tests": tests,
           "env": open(os.path.join(out, "env.txt")).read().splitlines()}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
EOF
for name in build smoke memcheck test_cuda bench racecheck suite; do
  selected "$name" || continue
  [ "${STATUS[$name]:-}" = passed ] || exit 1
done
