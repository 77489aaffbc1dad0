"""Every op once on the GPU against the CPU: each op's small registry sample (tests/python/op_registry.py), forward
and, where it has inputs that take gradients, backward, in every floating dtype; one line per op and dtype, and
for a difference the first index that differs, both values and the distance in units in the last place (ULP).

scripts/gpu_check.sh runs it plain (the first answer of a GPU run, in seconds) and under compute-sanitizer
(memcheck on every op; racecheck on the ops whose kernels use shared memory: --only rope,alibi).

    python3 scripts/gpu_smoke.py [--only SUBSTRING[,SUBSTRING...]]

Exit status 1 when an op fails or differs.
"""
import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

from helpers import first_difference  # noqa: E402
from op_registry import SAMPLES, outputs_and_grads, tensor_ops, uses_dtype  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
def check(name, dtype, device="cuda"):
    """The op's sample on both devices; returns a list of problems (empty: the same bits)."""
    sample = SAMPLES[name]  # requires_grad: inputs only where the op is differentiable
    expected = outputs_and_grads(sample(dtype=dtype, requires_grad=True))
    actual = outputs_and_grads(sample(dtype=dtype, device=device, requires_grad=True))
    if device == "cuda":
        torch.cuda.synchronize()
    problems = []
    for i, (a, e) in enumerate(zip(actual, expected)):
        difference = first_difference(a, e)
        if difference:
            problems.append(f"output {i}: {difference}")
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated substrings of op names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU")
        return 1
    only = [s for s in args.only.split(",") if s]
    failed = 0
    for name in tensor_ops():
        if only and not any(s in name for s in only):
            continue
        for dtype in DTYPES if uses_dtype(name) else DTYPES[:1]:
            try:
                problems = check(name, dtype)
            except Exception:  # noqa: BLE001  (report every op, then fail)
                problems = ["raised: " + traceback.format_exc(limit=3).strip().replace("\n", " | ")]
            failed += bool(problems)
            print(f"{'ok  ' if not problems else 'FAIL'} {name} {str(dtype).replace('torch.', '')}"
                  + "".join(f"\n     {p}" for p in problems), flush=True)
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
