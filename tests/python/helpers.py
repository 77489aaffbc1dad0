"""Small helpers shared by the Python tests (conftest.py holds the fixtures; op_registry.py lists the ops)."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_AS_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a, b, any_nan=False):
    """Bitwise equality (NaN payloads included), which torch.equal is not: it calls NaN unequal to itself.
    any_nan=True lets a NaN equal any NaN (in the same places): which operand's payload and sign an operation on
    two NaNs passes on depends on the order the compiler picked, and IEEE 754 leaves it open."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    as_int = _AS_INT[a.element_size()]
    a_bits, b_bits = a.contiguous().view(as_int), b.contiguous().view(as_int)
    if not any_nan:
        return torch.equal(a_bits, b_bits)
    a_nan, b_nan = a.isnan(), b.isnan()
    return torch.equal(a_nan, b_nan) and torch.equal(a_bits[~a_nan], b_bits[~b_nan])


def ordered(t):
    """Floating values as integers whose order and distances are those of the values (ULPs apart)."""
    bits = t.contiguous().view(_AS_INT[t.element_size()]).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    return torch.where(bits < 0, -(bits + sign_bit), bits)


def first_difference(actual, expected):
    """None when equal (NaN equal to NaN, as assert_close's equal_nan); else a line with the count of differing
    elements, the first one's index, both values and (floating) their distance in ULPs: what a CUDA-against-CPU
    comparison prints."""
    actual = actual.cpu()
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"shape/dtype {tuple(actual.shape)} {actual.dtype} against {tuple(expected.shape)} {expected.dtype}"
    if expected.is_floating_point():
        differ = ~((actual == expected) | (actual.isnan() & expected.isnan()))
    else:
        differ = actual != expected
    if not differ.any():
        return None
    flat = int(differ.flatten().nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), expected.shape))
    a, e = actual.flatten()[flat].item(), expected.flatten()[flat].item()
    line = f"{int(differ.sum())} of {expected.numel()} differ; first at {index}: {a!r}, expected {e!r}"
    if expected.is_floating_point():
        ulps = (ordered(actual.flatten()[flat:flat + 1]) - ordered(expected.flatten()[flat:flat + 1])).abs()
        line += f", {int(ulps)} ULP"
    return line


def randn(*shape, dtype=torch.float32, seed=0, generator=None, requires_grad=False):
    """Normal values from `generator`, else from a new generator seeded with `seed`: the same values in every
    run and process. Drawn in float32 and rounded to `dtype`, so that every dtype sees the same values."""
    generator = generator if generator is not None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).requires_grad_(requires_grad)


def nan_payload_q_and_weight(norm, weight_dtype, heads=4, head_dim=32):
    """qk_norm_rope inputs whose NaNs could be lost to bf16's integer rounding: a bf16 q [1, 3, heads, head_dim] holding
    NaNs of several payloads (low half included) and infinities, and a weight of weight_dtype ([heads * head_dim] for
    "olmo2", else [head_dim]) holding NaNs with full payloads."""
    q = randn(1, 3, heads, head_dim, seed=31).to(torch.bfloat16)
    for i, bits in enumerate([0x7FFF, -1, 0x7F81, -127, 0x7F80, -128]):  # NaNs, then +inf and -inf
        q.view(torch.int16).view(-1)[37 * i] = bits
    width = heads * head_dim if norm == "olmo2" else head_dim
    weight = (torch.rand(width, generator=torch.Generator().manual_seed(3)) + 0.5).to(weight_dtype)
    nans = {torch.bfloat16: [0x7FFF, -1], torch.float16: [0x7FFF, -1, 0x7E01],
            torch.float32: [0x7FFFFFFF, -1, 0x7F800001, 0x7FBFFFFF]}[weight_dtype]
    as_int = torch.int32 if weight_dtype == torch.float32 else torch.int16
    for i, bits in enumerate(nans):
        weight.view(as_int)[5 + 7 * i] = bits
    return q, weight


def tolerance(dtype):
    """assert_close's atol and rtol for a family's outputs against a float64 reference, by dtype: the loosest of
    the families' needs (rope's bf16 outputs, of larger magnitude, need atol 3e-2; alibi's float32 rtol 2e-6)."""
    return {torch.float64: dict(atol=1e-12, rtol=1e-12), torch.float32: dict(atol=2e-6, rtol=2e-6),
            torch.bfloat16: dict(atol=3e-2, rtol=1e-2), torch.float16: dict(atol=4e-3, rtol=1e-3)}[dtype]


def rotate_pairs(x, angle, layout="neox", scale=1.0):
    """float64 rotation of x [..., S, H, D] from the definition: pair i of the layout, (x1, x2), becomes
    (x1 cos - x2 sin, x2 cos + x1 sin) * scale with angle [..., S, pairs]; channels past the pairs pass through."""
    x = x.double()
    pairs = angle.shape[-1]
    cos, sin = (angle.cos() * scale)[..., None, :], (angle.sin() * scale)[..., None, :]
    if layout == "neox":
        first, second = torch.arange(pairs), torch.arange(pairs) + pairs
    else:
        first, second = torch.arange(0, 2 * pairs, 2), torch.arange(1, 2 * pairs, 2)
    out = x.clone()
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x2 * cos + x1 * sin
    return out


def opcheck_test(samples):
    """A test that runs torch.library.opcheck on each (op, args, kwargs) of `samples`, with the op's name as its id:
    a family file assigns it to its `test_opcheck`."""
    @pytest.mark.parametrize("sample", list(samples), ids=lambda s: s[0].__name__)
    def test_opcheck(sample):
        op, args, kwargs = sample
        torch.library.opcheck(op, args, kwargs)

    return test_opcheck


def assert_exports(model, inputs, op):
    """torch.export.export(model, inputs) gives a module that returns what the model does, and its graph calls
    posenc's `op`."""
    exported = torch.export.export(model, inputs)
    torch.testing.assert_close(exported.module()(*inputs), model(*inputs))
    assert f"posenc.{op}" in str(exported.graph)


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach the dispatcher (aten and posenc, forward and backward)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))
