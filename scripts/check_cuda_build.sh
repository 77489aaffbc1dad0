#!/usr/bin/env bash
# Builds posenc with its CUDA kernels against a CUDA build of torch, on a machine with nvcc but no GPU, loads
# the library and runs the Python tests with it (the CPU kernels run; the CUDA comparisons skip with no GPU):
# the CUDA sources compile, link and register every op at the CUDA key, and the CUDA build changes nothing on
# the CPU.
#
#   bash scripts/check_cuda_build.sh VENV [TORCH]
#   bash scripts/check_cuda_build.sh /work/venvs/cuda214 torch==2.14.1
#
# VENV is made where it does not exist; TORCH, a pip requirement, is installed into it (with the test
# requirements, torch pinned). The build folder is build/cuda-torch-<version> (POSENC_CUDA_BUILD_DIR overrides;
# scripts/cuda_build.sh; CUDAARCHS defaults to 90).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${1:?usage: scripts/check_cuda_build.sh VENV [TORCH]}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
py=$(cd "$VENV/bin" && pwd)/python
if [ $# -ge 2 ]; then
  "$py" -m pip install -q "$2"
fi
torch_version=$("$py" -c 'import torch; print(torch.__version__)')
"$py" -c 'import torch; assert torch.version.cuda, "check_cuda_build.sh needs a CUDA build of torch"'
echo "torch==${torch_version%%+*}" > "$VENV/posenc-constraints.txt"   # nothing may move torch
"$py" -m pip install -q -c "$VENV/posenc-constraints.txt" -r tests/requirements.txt
build=${POSENC_CUDA_BUILD_DIR:-$ROOT/build/cuda-torch-$torch_version}

echo "== build with CUDA kernels against torch $torch_version"
start=$SECONDS
bash scripts/cuda_build.sh "$build" "$py"
echo "   built in $((SECONDS - start))s"

echo "== load: every op has a CUDA kernel, linked against c10_cuda and the CUDA runtime"
ldd "$build/libposenc.so" | grep -E "libc10_cuda|libcudart" || { echo "check_cuda_build.sh: no CUDA libraries linked"; exit 1; }
PYTHONPATH=$build/python "$py" - <<'PY'
import torch
import posenc  # noqa: F401
# Every op with a tensor argument has a kernel of its own at the CUDA key; the others (frequencies, slopes,
# zigzag_positions) run their CompositeExplicitAutograd kernel on every device.
schemas = {s.name: s for s in torch._C._jit_get_all_schemas() if s.name.startswith("posenc::")}
tensor_ops = sorted(n for n, s in schemas.items() if any("Tensor" in str(a.type) for a in s.arguments))
missing = [n for n in tensor_ops if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA")]
assert not missing, f"no CUDA kernel for {missing}"
others = sorted(set(schemas) - set(tensor_ops) - {"posenc::cpu_capability"})
unreachable = [n for n in others if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "CompositeExplicitAutograd")]
assert not unreachable, f"no kernel for CUDA calls of {unreachable}"
print(f"   {len(tensor_ops)} ops with CUDA kernels, {len(others)} composite ({', '.join(n[8:] for n in others)});"
      f" torch.cuda.is_available() = {torch.cuda.is_available()}")
PY
if command -v cuobjdump >/dev/null || [ -x /usr/local/cuda/bin/cuobjdump ]; then
  "$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)" --list-elf "$build/libposenc.so" | sed 's/^/   /' | head -n 12
fi

echo "== Python tests with the CUDA-enabled library"
(cd "$VENV" && PYTHONPATH=$build/python "$py" -m pytest "$ROOT/tests/python" -q -p no:cacheprovider)
echo "check_cuda_build.sh: posenc builds with CUDA kernels against torch $torch_version and passes its tests"
