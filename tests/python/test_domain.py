"""The supported domain of positions and angles, and what happens outside it.

- Rotary and sinusoidal families: a position, after `offset` is added (absent positions are offset + arange),
  lies in [-2^53, 2^53], where every integer is a float64. Outside, the op raises an error naming itself and the
  position; an int64 `offset` whose sum overflows int64 is the same error, never a wrap-around.
- Inside the domain, for any finite inv_freq, float32 outputs equal sin/cos (rope: the rotation) of the float64
  angle fl(p * w) to 1e-6, and fp16/bf16 outputs are that value's rounding; the references here are float64 torch.
- NaN and Inf floating positions (sinusoidal family) give NaN encodings, without an error.
- Learned family: rows outside [0, L_max), overflow included, are an error.
- In-place ops refuse tensors whose elements overlap in memory, whatever their strides, and leave memory as it
  was; non-overlapping strided views are rotated (or biased) where they lie.
"""
import math
import re

import pytest
import torch
from torch.testing import assert_close

import posenc
from posenc import functional as PF

LIMIT = 2 ** 53
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
INT32_MAX = 2 ** 31 - 1

SINUSOIDAL_OPS = ["sinusoidal", "add_sinusoidal", "embed_sinusoidal"]
ROPE_OPS = ["rope", "rope_backward", "rope_qk", "rope_qk_backward", "rope_", "qk_norm_rope", "qk_norm_rope_",
            "rope_qk_cache_"]
POSITION_OPS = SINUSOIDAL_OPS + ROPE_OPS
LEARNED_OPS = ["learned", "add_learned", "embed_learned"]


def encoding(op, positions, inv_freq, offset=0, dtype=torch.float64, seq_len=None):
    """Runs `op` on inputs chosen so that its output is an encoding [S, 2F] of the positions:
    [sin || cos] for the sinusoidal family ("half" layout, x = 0, token row 0 = 0), [cos || sin] for the forward
    rotations of the unit vector x = (1, 0) of every neox pair, [cos || -sin] for the backward ones."""
    pairs = inv_freq.numel()
    seq = positions.shape[-1] if positions is not None else seq_len
    if op == "sinusoidal":
        return PF.sinusoidal(positions, inv_freq, "half", dtype, offset)
    if op == "add_sinusoidal":
        return PF.add_sinusoidal(torch.zeros(seq, 2 * pairs, dtype=dtype), positions, inv_freq, 1.0, "half", offset)
    if op == "embed_sinusoidal":
        tokens = torch.zeros(seq, dtype=torch.long)
        weight = torch.zeros(3, 2 * pairs, dtype=dtype)
        return PF.embed_sinusoidal(tokens, weight, positions, inv_freq, 1.0, None, "half", offset)
    x = torch.cat([torch.ones(1, seq, 1, pairs, dtype=dtype), torch.zeros(1, seq, 1, pairs, dtype=dtype)], -1)
    if op == "rope":
        out = PF.rope(x, positions, inv_freq, 1.0, "neox", "bshd", offset)
    elif op == "rope_backward":
        out = PF.rope_backward(x, positions, inv_freq, 1.0, "neox", "bshd", offset)
    elif op == "rope_qk":
        q, k = PF.rope_qk(x, x.expand(1, seq, 2, 2 * pairs), positions, inv_freq, 1.0, "neox", "bshd", offset)
        assert torch.equal(k[:, :, 0], q[:, :, 0]) and torch.equal(k[:, :, 1], q[:, :, 0])
        out = q
    elif op == "rope_qk_backward":
        gq, gk = PF.rope_qk_backward(x, x.clone(), positions, inv_freq, 1.0, "neox", "bshd", offset)
        assert torch.equal(gk, gq)
        out = gq
    elif op == "rope_":
        out = x.clone()
        PF.rope_(out, positions, inv_freq, 1.0, "neox", "bshd", offset)
    elif op in ("qk_norm_rope", "qk_norm_rope_"):
        # x's norm (mean square 1/2: a unit vector in each pair) undone by the weight sqrt(1/2), without rounding in
        # between ("fused"): the rotation of x, within an ulp of the maths type.
        weight = torch.full((2 * pairs,), math.sqrt(0.5), dtype=torch.float64)
        args = (weight, weight, positions, inv_freq, 0.0, "fused", 1.0, "neox", "bshd", offset)
        if op == "qk_norm_rope":
            out, _ = PF.qk_norm_rope(x, x.clone(), *args)
        else:
            out = x.clone()
            PF.qk_norm_rope_(out, x.clone(), *args)
    elif op == "rope_qk_cache_":
        # Slots from cache_positions (the positions are far beyond any cache); k rotated into its cache as q is.
        out = x.clone()
        k_cache, v_cache = (torch.zeros(1, seq, 2, 2 * pairs, dtype=dtype) for _ in range(2))
        PF.rope_qk_cache_(out, x.expand(1, seq, 2, 2 * pairs), x.expand(1, seq, 2, 2 * pairs), k_cache, v_cache,
                          positions, inv_freq, torch.arange(seq), "bshd", 1.0, "neox", "bshd", offset)
        assert torch.equal(k_cache[:, :, 0], out[:, :, 0]) and torch.equal(k_cache[:, :, 1], out[:, :, 0])
    else:
        raise ValueError(op)
    return out[0, :, 0]


def expected_encoding(op, absolute_positions, inv_freq):
    """float64 reference of `encoding` from the exact positions (float64 values, |p| <= 2^53)."""
    angle = absolute_positions.double()[:, None] * inv_freq.double()[None, :]  # fl(p * w): one IEEE product
    sin, cos = angle.sin(), angle.cos()
    if op in SINUSOIDAL_OPS:
        return torch.cat([sin, cos], -1)
    return torch.cat([cos, -sin if op.endswith("backward") else sin], -1)


def assert_rounds_within(out, reference, tolerance):
    """out must be a rounding, in out's dtype, of a value within `tolerance` of the float64 reference: since
    rounding is monotone, round(ref - tol) <= out <= round(ref + tol). NaN where the reference is NaN."""
    low = (reference - tolerance).to(out.dtype).double()
    high = (reference + tolerance).to(out.dtype).double()
    got = out.double()
    nan = reference.isnan()
    assert torch.equal(got.isnan(), nan), "NaN where the reference has none, or the reverse"
    bad = ~nan & ((got < low) | (got > high))
    if bad.any():
        index = bad.nonzero()[0].tolist()
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} values off; first at {index}: got "
                             f"{got[tuple(index)].item()!r}, reference {reference[tuple(index)].item()!r}")


def assert_names_op_and_position(error, op):
    message = str(error.value)
    assert re.search(rf"posenc\.{op}\b", message), message
    assert "position" in message, message


# ---------------------------------------------------------------- the edge is inside

# (positions, offset, seq_len for absent positions): every absolute position lies in [-2^53, 2^53].
EDGE_CASES = {
    "int64 at both edges": (torch.tensor([-LIMIT, 0, LIMIT]), 0, None),
    "offset reaches the upper edge": (torch.tensor([LIMIT - 10, 3]), 10, None),
    "offset reaches the lower edge": (torch.tensor([-LIMIT + 7, 0]), -7, None),
    "absent positions end at the edge": (None, LIMIT - 3, 4),
    "absent positions start at the lower edge": (None, -LIMIT, 4),
    "int32 positions plus a large offset": (torch.tensor([INT32_MAX, 0], dtype=torch.int32), LIMIT - INT32_MAX, None),
    "far int64 positions brought back by the offset": (torch.tensor([2 ** 60 + 3, 2 ** 60]), -(2 ** 60), None),
    "float64 positions at both edges": (torch.tensor([LIMIT, -LIMIT, 0.5], dtype=torch.float64), 0, None),
    "float32 position at the edge": (torch.tensor([float(LIMIT), 1.5], dtype=torch.float32), 0, None),
}


def absolute(positions, offset, seq_len):
    """The exact positions after the offset, as float64 (Python integers first, so nothing rounds)."""
    if positions is None:
        values = [offset + s for s in range(seq_len)]
    elif positions.is_floating_point():
        values = [v + offset for v in positions.double().tolist()]
    else:
        values = [v + offset for v in positions.tolist()]
    assert all(abs(v) <= LIMIT for v in values)
    return torch.tensor(values, dtype=torch.float64)


def applicable(cases):
    """(op, case) pairs where the case fits the op: sinusoidal always takes positions; rotary positions are
    token indices, so integers."""
    return [(op, name) for op in POSITION_OPS for name, (positions, _, _) in cases.items()
            if not (positions is None and op == "sinusoidal")
            and not (positions is not None and positions.is_floating_point() and op not in SINUSOIDAL_OPS)]


@pytest.mark.parametrize("op, case", applicable(EDGE_CASES))
def test_positions_up_to_2_pow_53_are_accepted(op, case):
    positions, offset, seq_len = EDGE_CASES[case]
    inv_freq = torch.tensor([1.0, 0.1, 2.0 ** -20], dtype=torch.float64)
    out = encoding(op, positions, inv_freq, offset, torch.float64, seq_len)
    reference = expected_encoding(op, absolute(positions, offset, seq_len), inv_freq)
    assert_close(out, reference, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- outside is an error

# (positions, offset, seq_len): at least one absolute position lies outside [-2^53, 2^53], or the int64 sum
# overflows. Some overflowing sums would wrap into the domain (-2, 5): they must still be refused.
OUTSIDE_CASES = {
    "2^53 + 1": (torch.tensor([0, LIMIT + 1]), 0, None),
    "-2^53 - 1": (torch.tensor([-LIMIT - 1, 0]), 0, None),
    "int64 max": (torch.tensor([INT64_MAX]), 0, None),
    "int64 min": (torch.tensor([INT64_MIN]), 0, None),
    "offset passes the edge": (torch.tensor([LIMIT - 1, 0]), 2, None),
    "negative offset passes the edge": (torch.tensor([-LIMIT + 1]), -2, None),
    "absent positions pass the edge": (None, LIMIT - 2, 4),
    "absent positions below the edge": (None, -LIMIT - 1, 4),
    "absent positions overflow int64": (None, INT64_MAX - 1, 4),
    "int64 sum wraps to -2": (torch.tensor([INT64_MAX]), INT64_MAX, None),
    "int64 sum wraps to 5": (torch.tensor([INT64_MIN + 5]), INT64_MIN, None),
    "offset overflows on a small position": (torch.tensor([0, 5]), INT64_MAX, None),
    "int32 position plus offset passes the edge": (torch.tensor([INT32_MAX], dtype=torch.int32),
                                                    LIMIT - INT32_MAX + 1, None),
    "float64 2^53 + 2": (torch.tensor([0.0, LIMIT + 2.0], dtype=torch.float64), 0, None),
    "float64 -(2^53 + 2)": (torch.tensor([-(LIMIT + 2.0)], dtype=torch.float64), 0, None),
    "float64 1e300": (torch.tensor([1e300], dtype=torch.float64), 0, None),
    "float32 2^54": (torch.tensor([2.0 ** 54], dtype=torch.float32), 0, None),
    "float64 edge plus offset 2": (torch.tensor([float(LIMIT)], dtype=torch.float64), 2, None),
}


@pytest.mark.parametrize("op, case", applicable(OUTSIDE_CASES))
def test_positions_outside_the_domain_are_an_error(op, case):
    positions, offset, seq_len = OUTSIDE_CASES[case]
    inv_freq = torch.tensor([1.0, 0.01], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        with pytest.raises(RuntimeError) as error:
            encoding(op, positions, inv_freq, offset, dtype, seq_len)
        assert_names_op_and_position(error, op)


def test_packed_positions_restarting_at_the_offset_are_checked_too():
    x = torch.randn(7, 2, 4)
    cu_seqlens = torch.tensor([0, 3, 7])
    inv_freq = torch.tensor([1.0, 0.5], dtype=torch.float64)
    # The second sequence reaches offset + 3 = 2^53 + 1; the first stays inside.
    with pytest.raises(RuntimeError) as error:
        PF.rope(x, None, inv_freq, 1.0, "neox", "thd", LIMIT - 2, cu_seqlens)
    assert_names_op_and_position(error, "rope")
    inside = PF.rope(x.double(), None, inv_freq, 1.0, "neox", "thd", LIMIT - 3, cu_seqlens)
    assert inside.isfinite().all()


@pytest.mark.parametrize("module", ["rotary", "sinusoidal", "sinusoidal_embedding"])
def test_modules_refuse_positions_outside_the_domain(module):
    if module == "rotary":
        rotary = torch.jit.script(posenc.nn.RotaryEmbedding(8))
        q = torch.randn(1, 2, 1, 8)
        call, op = (lambda: rotary(q, q, torch.tensor([0, LIMIT]), 1)), "rope_qk"
    elif module == "sinusoidal":
        encode = torch.jit.script(posenc.nn.SinusoidalPositionalEncoding(8))
        call, op = (lambda: encode(torch.zeros(1, 3, 8), None, INT64_MAX - 1)), "add_sinusoidal"
    else:
        embed = torch.jit.script(posenc.nn.SinusoidalEmbedding(5, 8))
        call, op = (lambda: embed(torch.tensor([[1, 2]]), torch.tensor([[0, INT64_MAX]]), 1)), "embed_sinusoidal"
    with pytest.raises(RuntimeError) as error:
        call()
    assert_names_op_and_position(error, op)


# ---------------------------------------------------------------- accuracy inside the domain, any angle

# p * w covers angles 2^20 ... 2^60 exactly (p = 1), positions next to 2^53 with small and large w, negative
# positions and frequencies, and frequencies that are not powers of two.
ACCURACY_POSITIONS = torch.tensor([1, 3, 1000003, 2 ** 31 + 11, 2 ** 52 + 1, LIMIT - 1, LIMIT, -LIMIT, -(LIMIT - 3)])
ACCURACY_INV_FREQ = torch.tensor([2.0 ** 20, 2.0 ** 30, 2.0 ** 40, 2.0 ** 50, 2.0 ** 56, 2.0 ** 60, 1.0, 0.1,
                                  1.0 / 3.0, 1e-4, -7.5, 2.0 ** 7 * 1.1], dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("op", POSITION_OPS)
def test_outputs_are_sin_and_cos_of_the_float64_angle_for_any_angle(op, dtype):
    out = encoding(op, ACCURACY_POSITIONS, ACCURACY_INV_FREQ, 0, dtype)
    reference = expected_encoding(op, ACCURACY_POSITIONS.double(), ACCURACY_INV_FREQ)
    assert_rounds_within(out, reference, 1e-12 if dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("angle_log2", [20, 30, 40, 50, 56, 60])
@pytest.mark.parametrize("op", ["rope", "add_sinusoidal"])
def test_float32_rotation_of_random_vectors_at_large_angles(op, angle_log2):
    """Random x (not just unit vectors), float32: the rotated pairs are within 1e-6 of the float64 rotation
    (|x| <= 1), and positions given, absent with an offset, and shared by a batch all agree."""
    generator = torch.Generator().manual_seed(angle_log2)
    pairs = 4
    inv_freq = torch.tensor([2.0 ** angle_log2 / 3 ** i for i in range(pairs)], dtype=torch.float64)
    positions = torch.tensor([1, 2, 3, 5])
    x = torch.rand(2, 4, 3, 2 * pairs, generator=generator, dtype=torch.float64).mul(2).sub(1).float()
    angle = positions.double()[:, None] * inv_freq[None, :]
    if op == "rope":
        cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
        x1, x2 = x.double()[..., :pairs], x.double()[..., pairs:]
        reference = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
        given = PF.rope(x, positions, inv_freq)
        absent = PF.rope(x, None, inv_freq, offset=1)[:, [0, 1, 2]]
        absent_reference = reference[:, [0, 1, 2]]
    else:
        x = x.flatten(1, 2)[:, :4]  # [2, 4, 8]: S = 4
        reference = x.double() + torch.cat([angle.sin(), angle.cos()], -1)
        given = PF.add_sinusoidal(x, positions, inv_freq, 1.0, "half")
        absent = PF.add_sinusoidal(x, None, inv_freq, 1.0, "half", 1)[:, [0, 1, 2]]
        absent_reference = reference[:, [0, 1, 2]]
    assert_rounds_within(given, reference, 1e-6)
    assert_rounds_within(absent, absent_reference, 1e-6)


# ---------------------------------------------------------------- NaN and Inf positions

@pytest.mark.parametrize("offset", [0, 7])
@pytest.mark.parametrize("position_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", SINUSOIDAL_OPS)
def test_nan_and_inf_positions_give_nan_encodings(op, position_dtype, offset):
    positions = torch.tensor([float("nan"), float("inf"), -float("inf"), 2.0], dtype=position_dtype)
    inv_freq = torch.tensor([1.0, 0.25], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        out = encoding(op, positions, inv_freq, offset, dtype)
        assert out[:3].isnan().all(), out
        reference = expected_encoding(op, torch.tensor([2.0 + offset]), inv_freq)
        assert_rounds_within(out[3:], reference, 1e-6)


# ---------------------------------------------------------------- learned family: rows outside [0, L_max)

def learned_call(op, positions, offset, seq_len=3):
    weight = torch.randn(8, 4)
    if op == "learned":
        return PF.learned(weight, positions, offset)
    if op == "add_learned":
        seq = positions.shape[-1] if positions is not None else seq_len
        return PF.add_learned(torch.randn(2, seq, 4), weight, positions, offset)
    seq = positions.shape[-1] if positions is not None else seq_len
    return PF.embed_learned(torch.zeros(2, seq, dtype=torch.long), torch.randn(5, 4), weight, positions, 1.0, None,
                            offset)


LEARNED_OUTSIDE = {
    "row L_max": (torch.tensor([0, 8]), 0),
    "row -1": (torch.tensor([-1, 0]), 0),
    "offset past the table": (torch.tensor([6, 0]), 2),
    "int64 sum wraps to 5": (torch.tensor([INT64_MIN + 5]), INT64_MIN),
    "int64 sum wraps to -2": (torch.tensor([INT64_MAX]), INT64_MAX),
    "absent positions overflow": (None, INT64_MAX),
}


@pytest.mark.parametrize("op, case", [(op, name) for op in LEARNED_OPS for name, (positions, _) in
                                      LEARNED_OUTSIDE.items() if not (positions is None and op == "learned")])
def test_learned_rows_outside_the_table_are_an_error(op, case):
    positions, offset = LEARNED_OUTSIDE[case]
    with pytest.raises(RuntimeError) as error:
        learned_call(op, positions, offset)
    assert_names_op_and_position(error, op)


# ---------------------------------------------------------------- in place: overlapping memory is refused

def overlapping_rope_views(buffer):
    """Views of a 64-element buffer in bshd [B, S, H, D] whose elements share memory, though no stride is
    a broadcast of a size-1 dimension: a token stride smaller than a token, heads on top of each other, channel
    stride 0, rows of a batch that overlap the next batch row."""
    return {
        "token stride 2 < head_dim 4": buffer.as_strided((1, 4, 1, 4), (64, 2, 4, 1)),
        "two heads at one place": buffer.as_strided((1, 3, 2, 4), (64, 8, 0, 1)),
        "channel stride 0": buffer.as_strided((1, 2, 1, 4), (64, 4, 4, 0)),
        "batch rows overlap": buffer.as_strided((2, 3, 1, 4), (5, 4, 4, 1)),
        "channels overlap across heads": buffer.as_strided((1, 2, 2, 4), (64, 16, 3, 1)),
    }


def test_rope_inplace_refuses_overlapping_views_and_writes_nothing():
    buffer = torch.randn(64)
    inv_freq = torch.tensor([1.0, 0.5], dtype=torch.float64)
    for name, view in overlapping_rope_views(buffer).items():
        before = buffer.clone()
        with pytest.raises(RuntimeError) as error:
            PF.rope_(view, None, inv_freq)
        message = str(error.value)
        assert re.search(r"posenc\.rope_\b", message) and re.search(r"\bx\b", message), (name, message)
        assert torch.equal(buffer, before), name


def test_add_alibi_inplace_refuses_overlapping_views_and_writes_nothing():
    buffer = torch.randn(64)
    views = {
        "key stride 0": buffer.as_strided((1, 2, 3, 4), (64, 12, 4, 0)),
        "query rows overlap": buffer.as_strided((1, 2, 3, 4), (64, 16, 2, 1)),
        "heads overlap": buffer.as_strided((1, 2, 3, 4), (64, 5, 4, 1)),
        "batch rows overlap": buffer.as_strided((2, 1, 3, 4), (3, 12, 4, 1)),
    }
    for name, view in views.items():
        before = buffer.clone()
        with pytest.raises(RuntimeError) as error:
            PF.add_alibi_(view, PF.alibi_slopes(2))
        message = str(error.value)
        assert re.search(r"posenc\.add_alibi_\b", message) and re.search(r"\bscores\b", message), (name, message)
        assert torch.equal(buffer, before), name


def non_overlapping_views(buffer, shape):
    """Views of `buffer` with `shape` [B, S, H, D] (or [B, H, Q, K]) whose elements never share memory, in
    orders no contiguity rule recognises: the smallest stride on the first dimension, interleaved dims,
    gaps, and a size-1 dimension with stride 0."""
    b, s, h, d = shape
    return {
        "batch innermost": buffer.as_strided(shape, (1, b * h * d, b * d, b)),
        "interleaved heads and tokens": buffer.as_strided(shape, (s * h * d, d, s * d, 1)),
        "gaps between rows": buffer.as_strided(shape, (s * h * (d + 3) + 5, h * (d + 3), d + 3, 1)),
        "reversed order": buffer.as_strided(shape, (1, b, b * s, b * s * h)),
        "size-1 dimension with stride 0": buffer.as_strided((1, s, h, d), (0, h * d, d, 1)),
    }


def untouched(buffer, view):
    """A mask of the buffer's elements that `view` does not cover."""
    offsets = torch.tensor(view.storage_offset())
    for size, stride in zip(view.shape, view.stride()):
        offsets = (offsets[..., None] + torch.arange(size) * stride)
    mask = torch.ones(buffer.numel(), dtype=torch.bool)
    mask[offsets.flatten()] = False
    return mask


def test_rope_inplace_on_non_overlapping_strided_views_equals_rope():
    inv_freq = torch.tensor([1.0, 0.3, 0.01], dtype=torch.float64)
    positions = torch.tensor([3, 1, 4])
    for name in non_overlapping_views(torch.empty(400), (2, 3, 2, 6)):
        buffer = torch.randn(400)
        view = non_overlapping_views(buffer, (2, 3, 2, 6))[name]
        expected = PF.rope(view, positions, inv_freq)
        before, outside = buffer.clone(), untouched(buffer, view)
        PF.rope_(view, positions, inv_freq)
        assert_close(view, expected, atol=1e-6, rtol=1e-6, msg=name)
        assert torch.equal(buffer[outside], before[outside]), name


def test_add_alibi_inplace_on_non_overlapping_strided_views_equals_add_alibi():
    slopes = PF.alibi_slopes(2)
    for name in non_overlapping_views(torch.empty(400), (2, 2, 3, 5)):
        buffer = torch.randn(400)
        view = non_overlapping_views(buffer, (2, 2, 3, 5))[name]
        expected = PF.add_alibi(view, slopes, "symmetric")
        before, outside = buffer.clone(), untouched(buffer, view)
        PF.add_alibi_(view, slopes, "symmetric")
        assert_close(view, expected, atol=1e-6, rtol=1e-6, msg=name)
        assert torch.equal(buffer[outside], before[outside]), name
