"""Every op once on the GPU against the CPU: each op's small registry sample (tests/python/op_registry.py), forward
and, where it has inputs that take gradients, backward, in every floating dtype, then the EXTRA calls below
(qk_norm_rope in each rounding convention); one line per op and dtype, and for a difference the first index that
differs, both values and the distance in units in the last place (ULP).

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
from op_registry import SAMPLES, Sample, exact_values, outputs_and_grads, tensor_ops, uses_dtype  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def qk_norm_sample(name, norm):
    """A call of qk_norm_rope (or qk_norm_rope_) with rounding `norm`, built as a registry sample is: q [2, 5, 4, 32]
    with a weight per head, k [2, 5, 2, 40] channel-strided with a weight over its heads, 24 channels of each head
    rotated (the rest normalized only), positions [B, S], gptj pairs. The forward's inputs take gradients: autograd
    runs qk_norm_rope_backward (both weights' gradients included) on the sample's device."""
    def build(dtype=torch.float32, device="cpu", requires_grad=False):
        def floats(*shape, seed):
            return exact_values(shape, seed, dtype).to(device, dtype)

        q, k = floats(2, 5, 4, 32, seed=11), floats(2, 5, 2, 80, seed=12)[..., ::2]
        q_weight, k_weight = floats(32, seed=13), floats(80, seed=14)
        inputs = (q, k, q_weight, k_weight) if requires_grad and name == "qk_norm_rope" else ()
        for t in inputs:
            t.requires_grad_()
        inv_freq = torch.ops.posenc.rope_inv_freq(24)[0].to(device)
        positions = torch.randint(0, 4096, (2, 5), generator=torch.Generator().manual_seed(15)).to(device)
        args = (q, k, q_weight, k_weight, positions, inv_freq, 1e-6, norm, 0.75, "gptj", "bshd", 3)
        return Sample(name, getattr(torch.ops.posenc, name), args, {}, inputs, (), dtype, True)

    return build


# Calls beyond the registry's one sample per op: qk_norm_rope and qk_norm_rope_ in each rounding convention (the
# registry's samples take one convention per op and size).
EXTRA = {f"{name}[{norm}]": qk_norm_sample(name, norm)
         for name in ("qk_norm_rope", "qk_norm_rope_") for norm in ("llama", "gemma", "olmo2", "fused")}


def check(name, dtype, device="cuda"):
    """The op's sample (or an EXTRA call) on both devices; returns a list of problems (empty: the same bits)."""
    sample = EXTRA[name] if name in EXTRA else SAMPLES[name]  # requires_grad: inputs only where differentiable
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
    for name in [*tensor_ops(), *EXTRA]:
        if only and not any(s in name for s in only):
            continue
        for dtype in DTYPES if name in EXTRA or uses_dtype(name) else DTYPES[:1]:
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
