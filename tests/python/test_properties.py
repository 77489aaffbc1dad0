"""Property-based tests (hypothesis) of every op in torch.ops.posenc.

Each test draws random valid inputs: shapes with sizes 0 and 1 among the others, every floating dtype, random
memory layouts (permuted, sliced out of a NaN-filled buffer, expanded along broadcast dimensions), the op's
layouts and formats, and positions and offsets anywhere in the supported domain, next to its edges included.
It compares the output with a float64 reference written here from the formulas (no posenc call), and checks
that the Meta kernel predicts the output's shape, dtype and strides.

Both the properties (test_property) and random bad inputs (test_bad_inputs_raise_an_error_naming_the_op,
bad_input_fuzzer.py) run in subprocesses, so that a crash fails the test of the case that crashed instead of
ending the session; POSENC_PROPERTIES_IN_PROCESS=1 runs the properties in the pytest process instead.

Profiles (conftest.py): "ci" (default; derandomized, 25 examples per property, 12 per bad-input case) and
"long" (random, 1000 and 500): POSENC_HYPOTHESIS_PROFILE=long python -m pytest tests/python/test_properties.py
"""
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st


def _subprocess_arguments():
    """The subprocess side (main() below) reads its example count from the command line. @given reads the
    settings profile when it decorates, so the profile must be loaded before the decorators below run."""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=25)
    parser.add_argument("--derandomize", action="store_true")
    parser.add_argument("--after", default=None)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401  (registers the profiles)
    settings.register_profile("subprocess", settings.get_profile("ci"), max_examples=args.examples,
                              derandomize=args.derandomize)
    settings.load_profile("subprocess")
    return args


SUBPROCESS_ARGUMENTS = _subprocess_arguments() if __name__ == "__main__" else None

import bad_input_fuzzer  # noqa: E402

OPS = torch.ops.posenc
LIMIT = 2 ** 53
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SINUSOIDAL_LAYOUTS = ["interleaved", "half", "half_cos_first"]
ROPE_FORMATS = ["bshd", "bhsd", "sbhd", "thd"]
# Where the bshd dimensions of a 4-D x sit in each format.
BSHD_ORDER = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}


# ---------------------------------------------------------------- drawing inputs

def generator(draw):
    return torch.Generator().manual_seed(draw(st.integers(0, 2 ** 32 - 1)))


def normal(gen, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def integers(gen, shape, low, high, dtype=torch.long):
    return torch.randint(low, high, shape, generator=gen, dtype=torch.long).to(dtype) if high > low else \
        torch.full(shape, low, dtype=dtype)


def arrange(draw, base, shape=None, expand=True):
    """`base` laid out at random in memory: contiguous, permuted, or sliced with gaps out of a larger buffer
    filled with NaN (or int64 max), so a kernel reading past a stride reads poison; then expanded to `shape`
    along the dimensions where base has size 1 (when `expand`)."""
    shape = list(base.shape) if shape is None else list(shape)
    how = draw(st.sampled_from(["contiguous", "permuted", "gaps"]))
    if how == "permuted" and base.dim() > 1:
        order = draw(st.permutations(range(base.dim())))
        base = base.permute(order).contiguous().permute([order.index(d) for d in range(base.dim())])
    elif how == "gaps" and base.dim() > 0:
        steps = [draw(st.integers(1, 3)) for _ in range(base.dim())]
        lead = draw(st.integers(0, 2))
        poison = float("nan") if base.is_floating_point() else (True if base.dtype == torch.bool else
                                                                 torch.iinfo(base.dtype).max)
        buffer = torch.full([n * s + lead for n, s in zip(base.shape, steps)], poison, dtype=base.dtype)
        view = buffer[tuple(slice(lead, lead + n * s, s) for n, s in zip(base.shape, steps))]
        view.copy_(base)
        base = view
    return base.expand(shape) if expand and list(base.shape) != shape else base


def drawn_tensor(draw, shape, make, expand=True):
    """A tensor of `shape` made by make(shape') and `arrange`d, where shape' has size 1 along a random set of
    dimensions that are then expanded (broadcast views: the same values repeated)."""
    broadcast = [d for d, n in enumerate(shape) if expand and n > 1 and draw(st.integers(0, 3)) == 0]
    base_shape = [1 if d in broadcast else n for d, n in enumerate(shape)]
    return arrange(draw, make(base_shape), shape, expand)


def frequencies(draw, pairs):
    """float64 inv_freq of `pairs` values: a base^(-i/pairs) ladder, or any finite values from 2^-30 to 2^60 of
    either sign (the domain promises accuracy for any finite frequency)."""
    if draw(st.booleans()):
        base = draw(st.sampled_from([10000.0, 500000.0, 2.0, 1e6]))
        values = [base ** (-i / pairs) for i in range(pairs)]
    else:
        values = [draw(st.sampled_from([1.0, -1.0])) * 2.0 ** draw(st.floats(-30, 60)) for _ in range(pairs)]
    return arrange(draw, torch.tensor(values, dtype=torch.float64), expand=False)


def absolute_positions(draw, count):
    """`count` absolute positions (Python ints) in [-2^53, 2^53]: small, large, or next to an edge."""
    regime = draw(st.sampled_from(["small", "large", "edge"]))
    if regime == "small":
        return [draw(st.integers(-20, 3000)) for _ in range(count)]
    if regime == "large":
        return [draw(st.integers(-2 ** 45, 2 ** 45)) for _ in range(count)]
    edge = draw(st.sampled_from([LIMIT, -LIMIT]))
    return [edge - (1 if edge > 0 else -1) * draw(st.integers(0, 40)) for _ in range(count)]


def positions_and_offset(draw, shape, floating_ok, shared_ok=True, required=False):
    """Positions for an input whose rows have leading shape `shape` (..., S): absent, [S] (shared) or `shape`
    (only `shape` when `required`), in a random integer (or, if floating_ok, floating) dtype, with an offset; every
    absolute position lies in [-2^53, 2^53]. Returns (positions or None, offset, absolute float64 positions
    broadcastable to `shape`)."""
    seq = shape[-1] if shape else 1
    kinds = ["per_row"] if required else ["absent", "shared", "per_row"] if shared_ok else ["absent", "per_row"]
    kind = draw(st.sampled_from(kinds))
    if kind == "absent":
        offset = draw(st.one_of(st.integers(-5, 100), st.sampled_from([LIMIT - seq + 1, -LIMIT]),
                                st.integers(-LIMIT, LIMIT - seq + 1)))
        return None, offset, torch.tensor([offset + s for s in range(seq)], dtype=torch.float64)
    pos_shape = [seq] if kind == "shared" else list(shape)
    count = math.prod(pos_shape)
    dtypes = [torch.int64, torch.int32] + ([torch.float64, torch.float32] if floating_ok else [])
    dtype = draw(st.sampled_from(dtypes))
    absolute = absolute_positions(draw, count)
    if dtype == torch.int64:
        offset = draw(st.one_of(st.just(0), st.integers(-5, 5), st.integers(-2 ** 62, 2 ** 62)))
        values = [a - offset for a in absolute]
    elif dtype == torch.int32:
        low, high = (max(absolute) - 2 ** 31 + 1, min(absolute) + 2 ** 31 - 1) if absolute else (0, 0)
        offset = draw(st.integers(low, high)) if low <= high else None
        if offset is None:  # the spread is wider than int32: keep the positions small instead
            absolute = [draw(st.integers(-1000, 1000)) for _ in range(count)]
            offset = draw(st.integers(-5, 5))
        values = [a - offset for a in absolute]
    else:
        # Floating positions (diffusion timesteps): fractions among small values; the offset stays small so
        # that p + offset is exact in float64.
        offset = draw(st.integers(-3, 3))
        values = []
        for a in absolute:
            value = a - offset + (draw(st.sampled_from([0.0, 0.25, 0.5])) if abs(a) < 2 ** 40 else 0.0)
            value = float(torch.tensor(value, dtype=dtype))  # representable in the positions' dtype
            value = max(min(value, LIMIT - offset), -LIMIT - offset)
            values.append(float(torch.tensor(value, dtype=dtype)))
    base = torch.tensor(values, dtype=dtype).reshape(pos_shape)
    positions = drawn_tensor(draw, pos_shape, lambda s: base[tuple(slice(0, n) for n in s)].clone())
    exact = [v + offset for v in (positions.double() if positions.is_floating_point() else positions).flatten()
             .tolist()]
    assert all(abs(v) <= LIMIT for v in exact)
    return positions, offset, torch.tensor(exact, dtype=torch.float64).reshape(pos_shape)


# ---------------------------------------------------------------- checking outputs

def math_eps(dtype):
    """Unit roundoff of the maths type: float64 for float64 data, float32 otherwise."""
    return 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24


def trig_error(dtype):
    """The promised sin/cos error against float64: 1e-6 for float32 maths."""
    return 1e-13 if dtype == torch.float64 else 1e-6


def assert_rounds_within(out, reference, tolerance):
    """out is the rounding, in its dtype, of some value within `tolerance` (a number or a tensor) of the
    float64 reference: round(ref - tol) <= out <= round(ref + tol), rounding being monotone. NaN where the
    reference is NaN, and only there."""
    reference = reference.double()
    tolerance = torch.as_tensor(tolerance, dtype=torch.float64)
    assert out.shape == reference.shape, (out.shape, reference.shape)
    low = (reference - tolerance).to(out.dtype).double()
    high = (reference + tolerance).to(out.dtype).double()
    got = out.double()
    assert torch.equal(got.isnan(), reference.isnan()), "NaN where the reference has none, or the reverse"
    bad = ~reference.isnan() & ((got < low) | (got > high))
    if bad.any():
        index = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} values off; first at {index}: got "
                             f"{got[index].item()!r}, reference {reference[index].item()!r}, tolerance "
                             f"{tolerance.expand_as(reference)[index].item()!r}")


def significant_strides(t):
    """Strides that address memory: those of dimensions longer than 1, in a non-empty tensor (what torch's
    own fake-tensor checks compare)."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1] if t.numel() else []


def to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    return value


def call(op, *args, **kwargs):
    """Runs torch.ops.posenc.<op> on the arguments, and on Meta copies of them: the Meta kernel must predict
    the output's shape, dtype and strides."""
    out = getattr(OPS, op)(*args, **kwargs)
    meta = getattr(OPS, op)(*[to_meta(a) for a in args], **{k: to_meta(v) for k, v in kwargs.items()})
    outs, metas = (out, meta) if isinstance(out, tuple) else ((out,), (meta,))
    for o, m in zip(outs, metas):
        assert (o.shape, o.dtype, significant_strides(o)) == (m.shape, m.dtype, significant_strides(m)), \
            f"{op}: Meta {m.shape} {m.dtype} strides {m.stride()} vs CPU {o.shape} {o.dtype} strides {o.stride()}"
    return out


# ---------------------------------------------------------------- float64 references

def encoding(absolute, inv_freq, layout, width=None):
    """PE of absolute positions [...] -> [..., width]: sin/cos of fl(p * w) in the layout, zero past 2F."""
    angle = absolute.double()[..., None] * inv_freq.double()
    sin, cos = angle.sin(), angle.cos()
    if layout == "interleaved":
        pe = torch.stack([sin, cos], -1).flatten(-2)
    elif layout == "half":
        pe = torch.cat([sin, cos], -1)
    else:
        pe = torch.cat([cos, sin], -1)
    if width is not None and width > pe.shape[-1]:
        pe = torch.cat([pe, torch.zeros(*pe.shape[:-1], width - pe.shape[-1], dtype=torch.float64)], -1)
    return pe


def pair_indices(pairs, layout):
    if layout == "neox":
        return torch.arange(pairs), torch.arange(pairs) + pairs
    return torch.arange(0, 2 * pairs, 2), torch.arange(1, 2 * pairs, 2)


def rotate(x, angle, layout, scale, inverse=False):
    """float64 rotation of the pairs of x [..., D] by angle [..., F] (broadcast over heads by the caller),
    times scale; channels past 2F copied unscaled. inverse: by -angle."""
    x = x.double()
    first, second = pair_indices(angle.shape[-1], layout)
    cos, sin = angle.cos() * scale, angle.sin() * scale
    sin = -sin if inverse else sin
    out = x.clone()
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x2 * cos + x1 * sin
    return out


def rotate_half(x, rotary_dim, layout):
    """The per-channel partner of x's first rotary_dim channels, signed: (-x2, x1) per pair."""
    first, second = pair_indices(rotary_dim // 2, layout)
    out = torch.zeros_like(x[..., :rotary_dim])
    out[..., first] = -x[..., second]
    out[..., second] = x[..., first]
    return out


def t5_bucket(relative, bidirectional, num_buckets, max_distance):
    """Mesh TensorFlow's bucketing with T5's float32 steps, from Python integers (no int64 wrap at
    INT64_MIN: its distance 2^63 falls in the last bucket)."""
    n_dir = num_buckets // 2 if bidirectional else num_buckets
    exact = n_dir // 2
    flat = relative.flatten().tolist()
    offsets = [n_dir if (bidirectional and r > 0) else 0 for r in flat]
    distances = [abs(r) if bidirectional else max(-r, 0) for r in flat]
    far = torch.tensor([min(d, 2 ** 63 - 1) for d in distances], dtype=torch.long).float()  # T5: .float()
    log_part = torch.log(far / exact) / math.log(max_distance / exact) * (n_dir - exact)
    large = (exact + log_part.long()).clamp(max=n_dir - 1).tolist()
    buckets = [o + (d if d < exact else lg) for o, d, lg in zip(offsets, distances, large)]
    return torch.tensor(buckets, dtype=torch.long).reshape(relative.shape)


# ---------------------------------------------------------------- sinusoidal family

def sizes(draw, count, low=0, high=4):
    return [draw(st.integers(low, high)) for _ in range(count)]


@given(st.data())
def check_sinusoidal(data):
    draw = data.draw
    pairs = draw(st.integers(1, 6))
    inv_freq = frequencies(draw, pairs)
    shape = sizes(draw, draw(st.integers(1, 3)))
    layout = draw(st.sampled_from(SINUSOIDAL_LAYOUTS))
    positions, offset, absolute = positions_and_offset(draw, shape, floating_ok=True, shared_ok=False)
    if positions is None:  # sinusoidal always takes positions: arange(S), and the offset drawn for them
        positions = torch.arange(shape[-1]).expand(shape)
    dtype = draw(st.sampled_from([None] + FLOAT_DTYPES))
    note(f"positions {positions.dtype} {list(positions.shape)} stride {positions.stride()}, offset {offset}")
    out = call("sinusoidal", positions, inv_freq, layout, dtype, offset)
    expected_dtype = dtype or (positions.dtype if positions.is_floating_point() else torch.float32)
    assert out.dtype == expected_dtype and out.is_contiguous()
    assert_rounds_within(out, encoding(absolute.expand(shape), inv_freq, layout), trig_error(out.dtype))


@given(st.data())
def check_add_sinusoidal(data):
    draw = data.draw
    gen = generator(draw)
    pairs = draw(st.integers(1, 5))
    inv_freq = frequencies(draw, pairs)
    width = 2 * pairs + draw(st.integers(0, 1))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    rows = sizes(draw, draw(st.integers(1, 3)))
    x = drawn_tensor(draw, rows + [width], lambda s: normal(gen, s, dtype))
    positions, offset, absolute = positions_and_offset(draw, rows, floating_ok=True)
    x_scale = draw(st.sampled_from([1.0, 0.0, -1.5, math.sqrt(width)]))
    layout = draw(st.sampled_from(SINUSOIDAL_LAYOUTS))
    out = call("add_sinusoidal", x, positions, inv_freq, x_scale, layout, offset)
    assert out.dtype == dtype and out.is_contiguous()
    scaled = x.double() * x_scale
    reference = scaled + encoding(absolute.expand(rows), inv_freq, layout, width)
    eps = math_eps(dtype)
    assert_rounds_within(out, reference, trig_error(dtype) + 4 * eps * (scaled.abs() + 1))


@given(st.data())
def check_embed_sinusoidal(data):
    draw = data.draw
    gen = generator(draw)
    pairs = draw(st.integers(1, 5))
    inv_freq = frequencies(draw, pairs)
    width = 2 * pairs + draw(st.integers(0, 1))
    vocab = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    weight = drawn_tensor(draw, [vocab, width], lambda s: normal(gen, s, dtype))
    rows = sizes(draw, draw(st.integers(1, 3)))
    tokens = drawn_tensor(draw, rows, lambda s: integers(gen, s, 0, vocab, draw(st.sampled_from([torch.long,
                                                                                                 torch.int]))))
    positions, offset, absolute = positions_and_offset(draw, rows, floating_ok=True)
    token_scale = draw(st.sampled_from([1.0, 2.5, -0.5]))
    padding_idx = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    layout = draw(st.sampled_from(SINUSOIDAL_LAYOUTS))
    out = call("embed_sinusoidal", tokens, weight, positions, inv_freq, token_scale, padding_idx, layout, offset)
    assert out.dtype == dtype and out.shape == (*rows, width)
    scaled = weight.double()[tokens.long()] * token_scale
    reference = scaled + encoding(absolute.expand(rows), inv_freq, layout, width)
    assert_rounds_within(out, reference, trig_error(dtype) + 4 * math_eps(dtype) * (scaled.abs() + 1))


@given(st.data())
def check_embedding_backward(data):
    draw = data.draw
    gen = generator(draw)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    leading = sizes(draw, draw(st.integers(0, 3)))
    width = draw(st.integers(1, 5))
    grad = drawn_tensor(draw, leading + [width], lambda s: normal(gen, s, dtype))
    suffix = leading[len(leading) - draw(st.integers(0, len(leading))):]
    num_rows = draw(st.integers(1, 6))
    indices = drawn_tensor(draw, suffix, lambda s: integers(gen, s, 0, num_rows,
                                                             draw(st.sampled_from([torch.long, torch.int]))))
    scale = draw(st.sampled_from([1.0, 0.5, -3.0]))
    padding_idx = draw(st.one_of(st.none(), st.integers(0, num_rows - 1)))
    out = call("embedding_backward", grad, indices, num_rows, scale, padding_idx)
    assert out.dtype == dtype and out.shape == (num_rows, width)
    rows = grad.double().reshape(-1, width)
    ids = indices.long().expand(leading).reshape(-1)
    reference = torch.zeros(num_rows, width, dtype=torch.float64).index_add_(0, ids, rows) * scale
    magnitude = torch.zeros(num_rows, width, dtype=torch.float64).index_add_(0, ids, rows.abs()) * abs(scale)
    count = torch.zeros(num_rows, dtype=torch.float64).index_add_(0, ids, torch.ones(ids.numel(),
                                                                                      dtype=torch.float64))
    if padding_idx is not None:
        reference[padding_idx] = 0
        magnitude[padding_idx] = 0
    assert_rounds_within(out, reference, (count[:, None] + 2) * math_eps(dtype) * magnitude)


# ---------------------------------------------------------------- learned family

def learned_rows(draw, gen, shape, table_rows, shared_ok=True):
    """Positions whose rows (position + offset) lie in [0, table_rows): absent (needs S <= table_rows),
    [S] or `shape`, int64 or int32, with an offset that may be large. Returns (positions, offset, rows)."""
    seq = shape[-1]
    kinds = (["absent"] if seq <= table_rows else []) + (["shared"] if shared_ok else []) + ["per_row"]
    kind = draw(st.sampled_from(kinds))
    if kind == "absent":
        offset = draw(st.integers(0, table_rows - seq))
        return None, offset, torch.arange(offset, offset + seq)
    pos_shape = [seq] if kind == "shared" else list(shape)
    dtype = draw(st.sampled_from([torch.long, torch.int]))
    limit = 2 ** 31 - table_rows if dtype == torch.int else 2 ** 62
    offset = draw(st.one_of(st.integers(-3, 3), st.integers(-limit, limit)))
    rows = integers(gen, pos_shape, 0, table_rows)
    positions = drawn_tensor(draw, pos_shape, lambda s: (rows[tuple(slice(0, n) for n in s)] - offset).to(dtype))
    return positions, offset, positions.long() + offset


@given(st.data())
def check_learned(data):
    draw = data.draw
    gen = generator(draw)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    table_rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    weight = drawn_tensor(draw, [table_rows, width], lambda s: normal(gen, s, dtype))
    shape = sizes(draw, draw(st.integers(1, 3)))
    positions, offset, rows = learned_rows(draw, gen, shape, table_rows, shared_ok=False)
    if positions is None:
        positions, rows = torch.arange(shape[-1]).expand(shape) - offset, (torch.arange(shape[-1])).expand(shape)
    padding_idx = draw(st.one_of(st.none(), st.integers(0, table_rows - 1)))
    out = call("learned", weight, positions, offset, padding_idx)
    assert out.dtype == dtype
    assert_rounds_within(out, weight.double()[rows.expand(shape)], 0.0)


@given(st.data())
def check_add_learned(data):
    draw = data.draw
    gen = generator(draw)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    rows_shape = sizes(draw, draw(st.integers(1, 3)))
    table_rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    weight = drawn_tensor(draw, [table_rows, width], lambda s: normal(gen, s, dtype))
    x = drawn_tensor(draw, rows_shape + [width], lambda s: normal(gen, s, dtype))
    positions, offset, rows = learned_rows(draw, gen, rows_shape, table_rows)
    padding_idx = draw(st.one_of(st.none(), st.integers(0, table_rows - 1)))
    out = call("add_learned", x, weight, positions, offset, padding_idx)
    assert out.dtype == dtype and out.is_contiguous()
    table = weight.double()[rows.expand(rows_shape)]
    assert_rounds_within(out, x.double() + table, 2 * math_eps(dtype) * (x.double().abs() + table.abs()))


@given(st.data())
def check_embed_learned(data):
    draw = data.draw
    gen = generator(draw)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    shape = sizes(draw, draw(st.integers(1, 3)))
    vocab, table_rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    token_weight = drawn_tensor(draw, [vocab, width], lambda s: normal(gen, s, dtype))
    pos_weight = drawn_tensor(draw, [table_rows, width], lambda s: normal(gen, s, dtype))
    tokens = drawn_tensor(draw, shape, lambda s: integers(gen, s, 0, vocab))
    positions, offset, rows = learned_rows(draw, gen, shape, table_rows)
    token_scale = draw(st.sampled_from([1.0, 0.5, 27.7]))
    padding_idx = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    pos_padding_idx = draw(st.one_of(st.none(), st.integers(0, table_rows - 1)))
    out = call("embed_learned", tokens, token_weight, pos_weight, positions, token_scale, padding_idx, offset,
               pos_padding_idx)
    assert out.dtype == dtype
    scaled = token_weight.double()[tokens] * token_scale
    table = pos_weight.double()[rows.expand(shape)]
    assert_rounds_within(out, scaled + table, 4 * math_eps(dtype) * (scaled.abs() + table.abs()))


@given(st.data())
def check_make_positions(data):
    draw = data.draw
    gen = generator(draw)
    padding_idx = draw(st.one_of(st.integers(-3, 5), st.integers(INT64_MIN, INT64_MAX - 64)))
    shape = sizes(draw, draw(st.integers(1, 3)))
    dtype = draw(st.sampled_from([torch.long, torch.int]))
    values = [padding_idx, 0, 1, 2] if dtype == torch.long or abs(padding_idx) < 2 ** 31 else [0, 1, 2]
    tokens = drawn_tensor(draw, shape, lambda s: torch.tensor(values)[integers(gen, s, 0, len(values))].to(dtype))
    out = call("make_positions", tokens, padding_idx)
    assert out.dtype == torch.long
    real = tokens.long() != padding_idx
    rows = (math.prod(shape[:-1]), shape[-1])
    reference = [[padding_idx + count if keep else padding_idx for keep, count in zip(row, counts)]
                 for row, counts in zip(real.reshape(rows).tolist(), real.long().cumsum(-1).reshape(rows).tolist())]
    assert out.shape == tokens.shape and out.reshape(rows).tolist() == reference


@given(st.data())
def check_positions_from_mask(data):
    draw = data.draw
    gen = generator(draw)
    shape = sizes(draw, draw(st.integers(1, 3)))
    dtype = draw(st.sampled_from([torch.bool, torch.long, torch.int, torch.uint8, torch.float32, torch.float64,
                                  torch.bfloat16]))
    values = {torch.bool: [False, True]}.get(dtype, [0, 1, 2, -1] if dtype != torch.uint8 else [0, 1, 255])
    if dtype.is_floating_point:
        values = [0.0, 1.0, 0.5, float("nan"), -0.0]
    mask = drawn_tensor(draw, shape, lambda s: torch.tensor(values, dtype=dtype)[integers(gen, s, 0, len(values))])
    pad_position = draw(st.one_of(st.integers(-2, 2), st.sampled_from([INT64_MIN, INT64_MAX])))
    out = call("positions_from_mask", mask, pad_position)
    real = (mask != 0).long()
    reference = torch.where(real.bool(), real.cumsum(-1) - 1, torch.full_like(real, pad_position))
    assert out.dtype == torch.long and torch.equal(out, reference)


# ---------------------------------------------------------------- rotary family

def rope_input(draw, gen, fmt, batch, seq, heads, head_dim, dtype, expand=True):
    """x of bshd sizes [batch, seq, heads, head_dim] in `fmt` (thd: [seq, heads, head_dim], batch 1), laid out
    at random. Returns (x, x as bshd)."""
    if fmt == "thd":
        x = drawn_tensor(draw, [seq, heads, head_dim], lambda s: normal(gen, s, dtype), expand)
        return x, x[None]
    order = BSHD_ORDER[fmt]
    bshd = [batch, seq, heads, head_dim]
    x = drawn_tensor(draw, [bshd[d] for d in order], lambda s: normal(gen, s, dtype), expand)
    return x, x.permute(order)


def rope_positions(draw, gen, fmt, batch, seq, pairs):
    """positions, offset, cu_seqlens, pair_axis, and the absolute position of each pair as float64
    [batch or 1, seq, pairs]. A third of the draws are multi-axis: pair_axis [pairs] (int64 or int32) names an
    axis of positions [n_axes, S], [n_axes, B, S] or, for thd, [n_axes, T] (cu_seqlens do not change given
    positions)."""
    cu_seqlens = None
    if fmt == "thd" and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, seq), max_size=3)))
        cu_seqlens = torch.tensor([0] + cuts + [seq], dtype=draw(st.sampled_from([torch.long, torch.int])))
    rows = [1, seq] if fmt == "thd" else [batch, seq]
    if draw(st.integers(0, 2)) == 0:
        n_axes = draw(st.integers(1, 3))
        axes = [draw(st.integers(0, n_axes - 1)) for _ in range(pairs)]
        pair_axis = arrange(draw, torch.tensor(axes, dtype=draw(st.sampled_from([torch.long, torch.int]))),
                            expand=False)
        shared = fmt == "thd" or draw(st.booleans())
        shape = [n_axes, seq] if shared else [n_axes, batch, seq]
        positions, offset, absolute = positions_and_offset(draw, shape, floating_ok=False, required=True)
        per_pair = absolute[torch.tensor(axes, dtype=torch.long)].movedim(0, -1)  # [(B,) S, pairs]
        return positions, offset, cu_seqlens, pair_axis, per_pair.expand(rows + [pairs])
    positions, offset, absolute = positions_and_offset(draw, [seq] if fmt == "thd" else rows, floating_ok=False)
    if positions is None and cu_seqlens is not None:
        # Packed sequences restart at offset: token t of the sequence starting at b sits at offset + t - b.
        bounds = cu_seqlens.tolist()
        starts = [max(b for b in bounds[:-1] if b <= t) for t in range(seq)]
        absolute = torch.tensor([offset + t - b for t, b in zip(range(seq), starts)], dtype=torch.float64)
    return positions, offset, cu_seqlens, None, absolute.expand(rows)[..., None].expand(rows + [pairs])


def rope_reference(x_bshd, absolute, inv_freq, layout, scale, inverse=False):
    """float64 rotation of bshd x: pair i by absolute[b, s, i] * inv_freq[i] (absolute [batch or 1, seq, pairs],
    each pair's position on its axis)."""
    angle = absolute[:, :, None, :] * inv_freq.double()  # [B, S, 1, F]
    return rotate(x_bshd, angle, layout, scale, inverse)


def rope_tolerance(x_bshd, pairs, scale, dtype):
    """On rotated channels (trig + 4 eps) * |scale| * (the sum of the head's rotary magnitudes, a bound on
    |x1| + |x2| of any pair); past them, nothing (a copy)."""
    x = x_bshd.double().abs()
    tol = torch.zeros_like(x)
    rotary = x[..., :2 * pairs].sum(-1, keepdim=True)
    tol[..., :2 * pairs] = (trig_error(dtype) + 4 * math_eps(dtype)) * abs(scale) * rotary
    return tol


def rope_case(draw, gen, with_k=False, expand=True):
    fmt = draw(st.sampled_from(ROPE_FORMATS))
    batch = 1 if fmt == "thd" else draw(st.integers(0, 3))
    seq = draw(st.integers(0, 5))
    pairs = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    inv_freq = frequencies(draw, pairs)
    heads = draw(st.integers(0, 3))
    x, x_bshd = rope_input(draw, gen, fmt, batch, seq, heads, 2 * pairs + draw(st.integers(0, 3)), dtype, expand)
    k = k_bshd = None
    if with_k:
        k, k_bshd = rope_input(draw, gen, fmt, batch, seq, draw(st.integers(0, 3)),
                               2 * pairs + draw(st.integers(0, 3)), dtype, expand)
    positions, offset, cu_seqlens, pair_axis, absolute = rope_positions(draw, gen, fmt, batch, seq, pairs)
    scale = draw(st.sampled_from([1.0, 0.5, 1.25]))
    layout = draw(st.sampled_from(["neox", "gptj"]))
    note(f"{fmt} x {list(x.shape)} stride {x.stride()} {dtype}, positions "
         f"{None if positions is None else (positions.dtype, list(positions.shape))}, offset {offset}, "
         f"cu_seqlens {cu_seqlens}, pair_axis {None if pair_axis is None else pair_axis.tolist()}")
    return dict(fmt=fmt, x=x, x_bshd=x_bshd, k=k, k_bshd=k_bshd, positions=positions, offset=offset,
                cu_seqlens=cu_seqlens, pair_axis=pair_axis, absolute=absolute, inv_freq=inv_freq, scale=scale,
                layout=layout, dtype=dtype, pairs=pairs)


def check_rope_output(out, case, x, x_bshd, inverse=False):
    fmt = case["fmt"]
    assert out.dtype == case["dtype"] and out.shape == x.shape and out.is_contiguous()
    out_bshd = out[None] if fmt == "thd" else out.permute(BSHD_ORDER[fmt])
    reference = rope_reference(x_bshd, case["absolute"], case["inv_freq"], case["layout"], case["scale"], inverse)
    assert_rounds_within(out_bshd, reference, rope_tolerance(x_bshd, case["pairs"], case["scale"], case["dtype"]))


@given(data=st.data())
def check_rope_and_its_backward(op, data):
    case = rope_case(data.draw, generator(data.draw))
    out = call(op, case["x"], case["positions"], case["inv_freq"], case["scale"], case["layout"], case["fmt"],
               case["offset"], case["cu_seqlens"], case["pair_axis"])
    check_rope_output(out, case, case["x"], case["x_bshd"], inverse=op == "rope_backward")


@given(data=st.data())
def check_rope_qk_and_its_backward(op, data):
    case = rope_case(data.draw, generator(data.draw), with_k=True)
    q_out, k_out = call(op, case["x"], case["k"], case["positions"], case["inv_freq"], case["scale"],
                        case["layout"], case["fmt"], case["offset"], case["cu_seqlens"], case["pair_axis"])
    check_rope_output(q_out, case, case["x"], case["x_bshd"], inverse=op.endswith("backward"))
    check_rope_output(k_out, case, case["k"], case["k_bshd"], inverse=op.endswith("backward"))


def covered_offsets(view):
    """Storage offsets of every element of a view."""
    offsets = torch.tensor(view.storage_offset())
    for size, stride in zip(view.shape, view.stride()):
        offsets = offsets[..., None] + torch.arange(size) * stride
    return offsets.flatten()


def buffer_of(view):
    """The whole storage under a view, as a flat tensor of its dtype."""
    return torch.empty(0, dtype=view.dtype).set_(view.untyped_storage())


@given(st.data())
def check_rope_inplace(data):
    case = rope_case(data.draw, generator(data.draw), expand=False)
    x = case["x"]
    storage, before = buffer_of(x), buffer_of(x).clone()
    original_bshd = case["x_bshd"].clone()
    assert OPS.rope_(x, case["positions"], case["inv_freq"], case["scale"], case["layout"], case["fmt"],
                     case["offset"], case["cu_seqlens"], case["pair_axis"]) is None
    bshd = x[None] if case["fmt"] == "thd" else x.permute(BSHD_ORDER[case["fmt"]])
    reference = rope_reference(original_bshd, case["absolute"], case["inv_freq"], case["layout"], case["scale"])
    assert_rounds_within(bshd, reference, rope_tolerance(original_bshd, case["pairs"], case["scale"],
                                                         case["dtype"]))
    outside = torch.ones(storage.numel(), dtype=torch.bool)
    outside[covered_offsets(x)] = False
    assert torch.equal(storage[outside].isnan(), before[outside].isnan())
    assert torch.equal(storage[outside].nan_to_num(), before[outside].nan_to_num()), "wrote outside the view"


def random_view(draw, gen, dims, last_min=1, max_size=3):
    """An as_strided view of a small buffer with random sizes and strides (0 and overlapping ones included),
    and whether two of its elements share memory (by enumeration)."""
    shape = sizes(draw, dims - 1, 1, max_size) + [draw(st.integers(last_min, max_size + 1))]
    strides = [draw(st.integers(0, 12)) for _ in range(dims)]
    offset = draw(st.integers(0, 3))
    extent = offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    buffer = normal(gen, [extent], torch.float32)
    view = buffer.as_strided(shape, strides, offset)
    offsets = covered_offsets(view)
    return buffer, view, offsets.unique().numel() != offsets.numel()


@given(st.data())
def check_inplace_ops_refuse_exactly_the_views_whose_elements_overlap(data):
    draw = data.draw
    gen = generator(draw)
    op = draw(st.sampled_from(["rope_", "add_alibi_"]))
    buffer, view, overlaps = random_view(draw, gen, 4, last_min=2 if op == "rope_" else 1)
    before = buffer.clone()
    note(f"{op} on shape {list(view.shape)} strides {view.stride()}, overlapping: {overlaps}")
    if op == "rope_":
        inv_freq = torch.tensor([1.0, 0.25], dtype=torch.float64)[:view.shape[-1] // 2]
        expected = OPS.rope(view, None, inv_freq, 1.0, "neox", "bshd", 3, None)
        run, arg = (lambda: OPS.rope_(view, None, inv_freq, 1.0, "neox", "bshd", 3, None)), "x"
    else:
        slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float32)
        expected = OPS.add_alibi(view, slopes, "symmetric", 0)
        run, arg = (lambda: OPS.add_alibi_(view, slopes, "symmetric", 0)), "scores"
    if overlaps:
        with pytest.raises(RuntimeError) as error:
            run()
        message = str(error.value)
        assert f"posenc.{op}:" in message and re.search(rf"\b{arg}\b", message), message
        assert torch.equal(buffer, before), "memory changed though the op refused"
    else:
        run()
        torch.testing.assert_close(view, expected, atol=1e-6, rtol=1e-6)


@given(data=st.data())
def check_rope_cos_sin_and_its_backward(op, data):
    draw = data.draw
    gen = generator(draw)
    fmt = draw(st.sampled_from(ROPE_FORMATS))
    batch = 1 if fmt == "thd" else draw(st.integers(0, 3))
    seq, heads = draw(st.integers(0, 4)), draw(st.integers(0, 3))
    rotary_dim = 2 * draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    x, x_bshd = rope_input(draw, gen, fmt, batch, seq, heads, rotary_dim + draw(st.integers(0, 3)), dtype)
    table_batch = draw(st.sampled_from([None, 1] if fmt == "thd" else [None, 1, batch]))
    if fmt == "thd":
        table_batch = None
    table_shape = ([] if table_batch is None else [table_batch]) + [seq, rotary_dim]
    table_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    cos = drawn_tensor(draw, table_shape, lambda s: normal(gen, s, table_dtype))
    sin = drawn_tensor(draw, table_shape, lambda s: normal(gen, s, table_dtype))
    layout = draw(st.sampled_from(["neox", "gptj"]))
    out = call(op, x, cos, sin, layout, fmt)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    # Tables as [B or 1, S, 1, r] against bshd x; any table values (not only real cos/sin).
    table_rows = cos.shape[0] if cos.dim() == 3 else 1
    c = cos.double().reshape(table_rows, seq, 1, rotary_dim)
    s = sin.double().reshape(table_rows, seq, 1, rotary_dim)
    xd = x_bshd.double()
    if op == "rope_cos_sin":
        reference = xd.clone()
        reference[..., :rotary_dim] = xd[..., :rotary_dim] * c + rotate_half(xd, rotary_dim, layout) * s
    else:  # the transpose of the map above: grad * cos - rotate(grad * sin)
        x_var = torch.zeros_like(xd, requires_grad=True)
        y = x_var.clone()
        y = torch.cat([x_var[..., :rotary_dim] * c + rotate_half(x_var, rotary_dim, layout) * s,
                       x_var[..., rotary_dim:]], -1)
        (reference,) = torch.autograd.grad(y, x_var, xd)
    magnitude = xd.abs().sum(-1, keepdim=True) * (c.abs().amax(-1, keepdim=True) + s.abs().amax(-1, keepdim=True))
    tolerance = 4 * math_eps(dtype) * magnitude.expand_as(xd)
    if table_dtype != torch.float64 or dtype != torch.float64:  # tables are read in x's maths type
        tolerance = tolerance + 2 * math_eps(torch.float32) * magnitude
    out_bshd = out[None] if fmt == "thd" else out.permute(BSHD_ORDER[fmt])
    assert_rounds_within(out_bshd, reference, tolerance)


# ---------------------------------------------------------------- ALiBi

def alibi_reference(slopes, q_len, k_len, mode, head_offset, num_heads):
    """float64 -m * d (causal) or -m * |d| (symmetric), d = i + (k_len - q_len) - j: [B or 1, H, Q, K]."""
    m = slopes.double()
    m = m[None] if m.dim() == 1 else m
    m = m[:, head_offset:head_offset + num_heads, None, None]
    i = torch.arange(q_len, dtype=torch.float64)[:, None]
    j = torch.arange(k_len, dtype=torch.float64)[None, :]
    d = i + (k_len - q_len) - j
    return -m * (d.abs() if mode == "symmetric" else d)


def alibi_slopes_case(draw, gen, batch):
    """slopes [H_total] or [batch, H_total] in any floating dtype, laid out at random."""
    total = draw(st.integers(0, 5))
    shape = [total] if draw(st.booleans()) else [batch, total]
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    slopes = drawn_tensor(draw, shape, lambda s: (torch.rand(s, generator=gen, dtype=torch.float64) - 0.2).to(dtype))
    return slopes, total


@given(st.data())
def check_alibi_bias(data):
    draw = data.draw
    gen = generator(draw)
    slopes, total = alibi_slopes_case(draw, gen, draw(st.integers(0, 3)))
    q_len, k_len = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    mode = draw(st.sampled_from(["causal", "symmetric"]))
    head_offset = draw(st.integers(0, total))
    num_heads = draw(st.one_of(st.none(), st.integers(0, total - head_offset)))
    dtype = draw(st.sampled_from([None] + FLOAT_DTYPES))
    out = call("alibi_bias", slopes, q_len, k_len, mode, head_offset, num_heads, dtype)
    heads = total - head_offset if num_heads is None else num_heads
    reference = alibi_reference(slopes, q_len, k_len, mode, head_offset, heads)
    assert out.dtype == (dtype or slopes.dtype)
    assert_rounds_within(out, reference, 2 * math_eps(out.dtype) * reference.abs())


def add_alibi_case(draw, gen, expand=True):
    batch, heads = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    q_len, k_len = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    scores = drawn_tensor(draw, [batch, heads, q_len, k_len], lambda s: normal(gen, s, dtype, 3.0), expand)
    slopes, total = alibi_slopes_case(draw, gen, batch)
    if total < heads:
        slopes = torch.cat([slopes, torch.full([*slopes.shape[:-1], heads - total], 0.5, dtype=slopes.dtype)], -1)
        total = heads
    head_offset = draw(st.integers(0, total - heads))
    mode = draw(st.sampled_from(["causal", "symmetric"]))
    return scores, slopes, mode, head_offset, alibi_reference(slopes, q_len, k_len, mode, head_offset, heads)


@given(st.data())
def check_add_alibi(data):
    scores, slopes, mode, head_offset, bias = add_alibi_case(data.draw, generator(data.draw))
    out = call("add_alibi", scores, slopes, mode, head_offset)
    assert out.dtype == scores.dtype and out.is_contiguous()
    reference = scores.double() + bias
    assert_rounds_within(out, reference, 4 * math_eps(scores.dtype) * (scores.double().abs() + bias.abs()))


@given(st.data())
def check_add_alibi_inplace(data):
    scores, slopes, mode, head_offset, bias = add_alibi_case(data.draw, generator(data.draw), expand=False)
    original = scores.double().clone()  # .double() of float64 scores is scores itself
    storage, before = buffer_of(scores), buffer_of(scores).clone()
    assert OPS.add_alibi_(scores, slopes, mode, head_offset) is None
    assert_rounds_within(scores, original + bias, 4 * math_eps(scores.dtype) * (original.abs() + bias.abs()))
    outside = torch.ones(storage.numel(), dtype=torch.bool)
    outside[covered_offsets(scores)] = False
    assert torch.equal(storage[outside].nan_to_num(), before[outside].nan_to_num()), "wrote outside the view"


@given(st.data())
def check_alibi_backward(data):
    draw = data.draw
    gen = generator(draw)
    scores, slopes, mode, head_offset, _ = add_alibi_case(draw, gen)
    grad = scores  # any tensor shaped like scores
    out = call("alibi_backward", grad, slopes, mode, head_offset)
    assert out.dtype == slopes.dtype and out.shape == slopes.shape
    batch, heads, q_len, k_len = grad.shape
    m = slopes.double().detach().requires_grad_(True)
    bias = alibi_reference(m, q_len, k_len, mode, head_offset, heads)
    (reference,) = torch.autograd.grad((grad.double() * bias).sum(), m)
    unit = alibi_reference(torch.ones_like(m), q_len, k_len, mode, head_offset, heads).abs()
    magnitude = (grad.double().abs() * unit)
    magnitude = magnitude.sum((0, 2, 3)) if slopes.dim() == 1 else magnitude.sum((2, 3))
    tol = torch.zeros_like(reference)
    tol[..., head_offset:head_offset + heads] = 8 * math_eps(torch.float32) * magnitude
    assert_rounds_within(out, reference, tol)


# ---------------------------------------------------------------- T5

def t5_config(draw):
    bidirectional = draw(st.booleans())
    num_buckets = draw(st.integers(4 if bidirectional else 2, 40))
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    max_distance = draw(st.one_of(st.integers(exact + 1, exact + 20), st.integers(exact + 1, 2 ** 40)))
    return bidirectional, num_buckets, max_distance


@given(st.data())
def check_relative_position_bucket(data):
    draw = data.draw
    gen = generator(draw)
    bidirectional, num_buckets, max_distance = t5_config(draw)
    dtype = draw(st.sampled_from([torch.long, torch.int]))
    info = torch.iinfo(dtype)
    shape = sizes(draw, draw(st.integers(0, 3)))
    extremes = torch.tensor([min(max(v, info.min), info.max) for v in
                             (info.min, info.max, info.min + 1, 0, -1, 1, max_distance, -max_distance)], dtype=dtype)
    relative = drawn_tensor(draw, shape, lambda s: torch.where(
        integers(gen, s, 0, 2).bool(), integers(gen, s, -3 * max_distance, 3 * max_distance).clamp(info.min, info.max)
        .to(dtype), extremes[integers(gen, s, 0, len(extremes))]))
    out = call("relative_position_bucket", relative, bidirectional, num_buckets, max_distance)
    assert out.dtype == torch.long
    assert torch.equal(out, t5_bucket(relative.long(), bidirectional, num_buckets, max_distance))


@given(st.data())
def check_t5_bias(data):
    draw = data.draw
    gen = generator(draw)
    bidirectional, num_buckets, max_distance = t5_config(draw)
    heads = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    weight = drawn_tensor(draw, [num_buckets, heads], lambda s: normal(gen, s, dtype))
    q_len, k_len = draw(st.integers(0, 6)), draw(st.integers(0, 30))
    q_offset = draw(st.one_of(st.integers(-40, 40), st.integers(-2 ** 62, 2 ** 62 - q_len)))
    out = call("t5_bias", weight, q_len, k_len, bidirectional, num_buckets, max_distance, q_offset)
    relative = torch.arange(k_len)[None, :] - (torch.arange(q_len)[:, None] + q_offset)
    buckets = t5_bucket(relative, bidirectional, num_buckets, max_distance)
    reference = weight.double()[buckets].permute(2, 0, 1)[None]
    assert out.dtype == dtype and out.shape == (1, heads, q_len, k_len)
    assert_rounds_within(out, reference, 0.0)


@given(st.data())
def check_t5_bias_backward(data):
    draw = data.draw
    gen = generator(draw)
    bidirectional, num_buckets, max_distance = t5_config(draw)
    heads, q_len, k_len = draw(st.integers(0, 3)), draw(st.integers(0, 6)), draw(st.integers(0, 30))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    grad = drawn_tensor(draw, [1, heads, q_len, k_len], lambda s: normal(gen, s, dtype))
    q_offset = draw(st.one_of(st.integers(-40, 40), st.integers(-2 ** 62, 2 ** 62 - q_len)))
    out = call("t5_bias_backward", grad, bidirectional, num_buckets, max_distance, q_offset)
    assert out.dtype == dtype and out.shape == (num_buckets, heads)
    relative = torch.arange(k_len)[None, :] - (torch.arange(q_len)[:, None] + q_offset)
    buckets = t5_bucket(relative, bidirectional, num_buckets, max_distance).flatten()
    rows = grad[0].double().permute(1, 2, 0).reshape(q_len * k_len, heads)
    reference = torch.zeros(num_buckets, heads, dtype=torch.float64).index_add_(0, buckets, rows)
    magnitude = torch.zeros(num_buckets, heads, dtype=torch.float64).index_add_(0, buckets, rows.abs())
    assert_rounds_within(out, reference, 1e-12 * magnitude)


# ---------------------------------------------------------------- position and frequency builders that take tensors

def vision_run(draw, merge):
    """A grid (t, h, w) with t * (h // merge) * (w // merge) tokens, 1 to 8 of them."""
    t, height, width = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    return [t, height * merge + draw(st.integers(0, merge - 1)), width * merge + draw(st.integers(0, merge - 1))]


def mrope_reference(rows, masks, image_grids, video_grids, merge, intervals):
    """Qwen2-VL's M-RoPE positions ([3, B, S] lists) and rope_deltas, per row from the description: text tokens
    count up on every axis; a run of vision tokens is the next grid's (time, row, column) patches (time = trunc(frame
    * interval)) after the running position p, and the text after it starts at p + max(h, w) // merge; a row's delta
    is its largest position + 1 - its real token count; tokens outside the mask stay 0."""
    positions = [[[0] * len(row) for row in rows] for _ in range(3)]
    deltas = []
    grids = {1: iter(image_grids), 2: iter(video_grids)}
    for b, (row, mask) in enumerate(zip(rows, masks)):
        real = [s for s in range(len(row)) if mask[s]]
        runs = [list(group) for _, group in itertools.groupby(real, key=lambda s: row[s])]
        p, largest = 0, -1
        for run in runs:
            if row[run[0]] == 0:
                triples = [(p + j,) * 3 for j in range(len(run))]
                p += len(run)
            else:
                (t, h, w), interval = next(grids[row[run[0]]])
                triples = [(p + math.trunc(f * interval), p + i, p + j)
                           for f in range(t) for i in range(h // merge) for j in range(w // merge)]
                p += max(h, w) // merge
            for s, triple in zip(run, triples):
                for axis in range(3):
                    positions[axis][b][s] = triple[axis]
            largest = max([largest] + [v for triple in triples for v in triple])
        deltas.append([largest + 1 - len(real)])
    return positions, deltas


@given(st.data())
def check_mrope_positions(data):
    draw = data.draw
    merge = draw(st.integers(1, 3))
    split = draw(st.booleans())
    tokens_per_second = draw(st.sampled_from([None, 1.0, 2.0, 0.5, 25.0]))
    batch = draw(st.integers(0, 3))
    rows, masks, image_grids, video_grids, seconds = [], [], [], [], []
    for _ in range(batch):
        row = [0] * draw(st.integers(0, 2))
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from([1, 2]))
            grid = vision_run(draw, merge)
            frames = grid[0] if kind == 2 and split else 1
            tokens_per_frame = grid[0] // frames * (grid[1] // merge) * (grid[2] // merge)
            for _ in range(frames):  # text after each run (Qwen3-VL: between the frames of a split video)
                row += [kind] * tokens_per_frame + [0] * draw(st.integers(1, 2))
            (image_grids if kind == 1 else video_grids).append(grid)
            if kind == 2:
                seconds.append(draw(st.sampled_from([0.5, 1.0, 2.0, 0.25, 1.5])))
        while row and row[-1] == 0 and draw(st.booleans()):  # rows may end with vision tokens
            row.pop()
        rows.append(row)
    seq = max((len(row) for row in rows), default=draw(st.integers(0, 3)))
    pad = draw(st.sampled_from(["left", "right"]))
    for b, row in enumerate(rows):  # padding (type 0) outside the mask
        padding = seq - len(row)
        masks.append([0] * padding + [1] * len(row) if pad == "left" else [1] * len(row) + [0] * padding)
        rows[b] = [0] * padding + row if pad == "left" else row + [0] * padding
    gen = generator(draw)
    index_dtype = draw(st.sampled_from([torch.long, torch.int]))
    token_types = arrange(draw, torch.tensor(rows, dtype=index_dtype).reshape(batch, seq), expand=False)
    mask_dtype = draw(st.sampled_from([torch.long, torch.bool, torch.float32]))
    with_mask = draw(st.booleans()) or any(0 in m for m in masks)
    # Padding of any type outside the mask: the op must not read it.
    padded = torch.tensor(masks, dtype=torch.bool).reshape(batch, seq).logical_not()
    token_types = torch.where(padded, integers(gen, [batch, seq], 0, 3, index_dtype), token_types) if with_mask \
        else token_types
    mask = arrange(draw, torch.tensor(masks).reshape(batch, seq).to(mask_dtype), expand=False) if with_mask else None

    def grid_tensor(grids):
        if not grids and draw(st.booleans()):
            return None
        return arrange(draw, torch.tensor(grids, dtype=index_dtype).reshape(len(grids), 3), expand=False)

    per_grid = draw(st.booleans())
    seconds_dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    second_per_grid_ts = torch.tensor(seconds, dtype=seconds_dtype) if per_grid else None
    scale = 1.0 if tokens_per_second is None else tokens_per_second
    intervals = [scale * sec for sec in seconds] if per_grid else [scale] * len(video_grids)
    note(f"rows {rows}, masks {masks}, images {image_grids}, videos {video_grids}, merge {merge}, split {split}, "
         f"tokens_per_second {tokens_per_second}, seconds {second_per_grid_ts}")
    positions, deltas = call("mrope_positions", token_types, grid_tensor(image_grids), grid_tensor(video_grids), mask,
                             merge, tokens_per_second, second_per_grid_ts, split)
    split_videos = [[1, h, w] for t, h, w in video_grids for _ in range(t)] if split else video_grids
    split_intervals = [i for (t, _, _), i in zip(video_grids, intervals) for _ in range(t)] if split else intervals
    expected, expected_deltas = mrope_reference(
        rows, masks if with_mask else [[1] * seq] * batch, [(g, 1.0) for g in image_grids],
        list(zip(split_videos, split_intervals)), merge, None)
    assert positions.dtype == deltas.dtype == torch.long
    assert positions.tolist() == expected and positions.shape == (3, batch, seq)
    assert deltas.tolist() == expected_deltas and deltas.shape == (batch, 1)


def rope_for_length_reference(rotary_dim, base, rope_type, keywords, length):
    """float64 inv_freq of the length-dependent types and the plain ones, from the formulas: theta^(-2i/r), over
    factor (linear); dynamic NTK's theta (factor L / max - (factor - 1))^(r / (r - 2)) with L = max(length, max);
    fixed NTK's theta alpha^(r / (r - 2)); LongRoPE's long factors beyond the original context, else short."""
    exponents = [2 * i / rotary_dim for i in range(rotary_dim // 2)]
    ntk = rotary_dim / (rotary_dim - 2) if rotary_dim > 2 else None
    if rope_type == "dynamic":
        context, factor = keywords["max_position_embeddings"], keywords["factor"]
        longest = max(length, context)
        base = base * (factor * longest / context - (factor - 1)) ** ntk
    elif rope_type == "ntk":
        base = base * keywords["alpha"] ** ntk
    values = [base ** -e for e in exponents]
    if rope_type == "linear":
        values = [v / keywords["factor"] for v in values]
    elif rope_type == "longrope":
        factors = keywords["long_factor" if length > keywords["original_max_position_embeddings"] else "short_factor"]
        values = [v / f for v, f in zip(values, factors)]
    return torch.tensor(values, dtype=torch.float64)


@given(st.data())
def check_rope_inv_freq_for_length(data):
    draw = data.draw
    rotary_dim = 2 * draw(st.integers(2, 8))
    base = draw(st.sampled_from([10000.0, 500000.0, 2.0, 1e6]))
    rope_type = draw(st.sampled_from(["default", "linear", "dynamic", "ntk", "longrope"]))
    context = draw(st.sampled_from([2, 64, 4096, 2 ** 20]))
    keywords = {"default": {}, "linear": {"factor": draw(st.sampled_from([2.0, 0.5, 8.0]))},
                "dynamic": {"factor": draw(st.sampled_from([2.0, 4.0, 1.0])), "max_position_embeddings": float(context)},
                "ntk": {"alpha": draw(st.sampled_from([1.0, 3.0, 1000.0]))},
                "longrope": {"original_max_position_embeddings": float(context), "factor": 4.0,
                             "short_factor": [draw(st.sampled_from([1.0, 1.5])) for _ in range(rotary_dim // 2)],
                             "long_factor": [draw(st.sampled_from([2.0, 40.0])) for _ in range(rotary_dim // 2)]},
                }[rope_type]
    dtype = draw(st.sampled_from([torch.long, torch.int, torch.int16, torch.uint8, torch.float64, torch.float32]))
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    length = draw(st.one_of(st.sampled_from([-1, 0, 1, context - 1, context, context + 1, 2 * context]),
                            st.integers(0, 2 ** 40)))
    length = min(max(length, info.min), min(info.max, 2 ** 24 if dtype == torch.float32 else 2 ** 40))
    seq_len = torch.tensor(length, dtype=dtype)
    out = call("rope_inv_freq_for_length", seq_len, rotary_dim, base, rope_type, **keywords)
    assert out.dtype == torch.float64 and out.shape == (rotary_dim // 2,)
    reference = rope_for_length_reference(rotary_dim, base, rope_type, keywords, seq_len.item())
    # exp(-e log theta) against theta ** -e: a few units of roundoff of the exponent, |log inv_freq|.
    assert_rounds_within(out, reference, 16 * 2.0 ** -53 * reference.abs() * (1 + reference.log().abs()))


@given(st.data())
def check_zigzag_positions_varlen(data):
    draw = data.draw
    cp_size = draw(st.integers(1, 4))
    cp_rank = draw(st.integers(0, cp_size - 1))
    lengths = [2 * cp_size * draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 4)))]
    bounds = [sum(lengths[:n]) for n in range(len(lengths) + 1)]
    dtype = draw(st.sampled_from([torch.long, torch.int]))
    cu_seqlens = arrange(draw, torch.tensor(bounds, dtype=dtype), expand=False)
    # The output's length follows cu_seqlens' values: no Meta kernel to compare with.
    positions, indices, local = OPS.zigzag_positions_varlen(cu_seqlens, cp_size, cp_rank)
    # Each sequence is cut into 2 cp_size chunks; this rank holds chunks cp_rank and 2 cp_size - 1 - cp_rank.
    expected_positions, expected_indices = [], []
    for start, length in zip(bounds, lengths):
        chunk = length // (2 * cp_size)
        mine = [c * chunk + i for c in (cp_rank, 2 * cp_size - 1 - cp_rank) for i in range(chunk)]
        expected_positions += mine
        expected_indices += [start + p for p in mine]
    assert positions.dtype == indices.dtype == torch.long and local.dtype == dtype
    assert positions.tolist() == expected_positions and indices.tolist() == expected_indices
    assert local.tolist() == [b // cp_size for b in bounds]


# ---------------------------------------------------------------- every op is covered; bad input fuzzing

# Every op's property: (function, the op it is given, if it serves several).
PROPERTIES = {
    "sinusoidal": (check_sinusoidal,), "add_sinusoidal": (check_add_sinusoidal,),
    "embed_sinusoidal": (check_embed_sinusoidal,), "embedding_backward": (check_embedding_backward,),
    "learned": (check_learned,), "add_learned": (check_add_learned,), "embed_learned": (check_embed_learned,),
    "make_positions": (check_make_positions,), "positions_from_mask": (check_positions_from_mask,),
    "rope": (check_rope_and_its_backward, "rope"), "rope_backward": (check_rope_and_its_backward, "rope_backward"),
    "rope_qk": (check_rope_qk_and_its_backward, "rope_qk"),
    "rope_qk_backward": (check_rope_qk_and_its_backward, "rope_qk_backward"), "rope_": (check_rope_inplace,),
    "rope_cos_sin": (check_rope_cos_sin_and_its_backward, "rope_cos_sin"),
    "rope_cos_sin_backward": (check_rope_cos_sin_and_its_backward, "rope_cos_sin_backward"),
    "alibi_bias": (check_alibi_bias,), "add_alibi": (check_add_alibi,), "add_alibi_": (check_add_alibi_inplace,),
    "alibi_backward": (check_alibi_backward,), "relative_position_bucket": (check_relative_position_bucket,),
    "t5_bias": (check_t5_bias,), "t5_bias_backward": (check_t5_bias_backward,),
    "mrope_positions": (check_mrope_positions,), "rope_inv_freq_for_length": (check_rope_inv_freq_for_length,),
    "zigzag_positions_varlen": (check_zigzag_positions_varlen,),
    "in-place overlap": (check_inplace_ops_refuse_exactly_the_views_whose_elements_overlap,),
}


def run_property(name):
    function, *op = PROPERTIES[name]
    function(*op)


def test_every_op_has_a_property_and_bad_input_cases():
    from op_registry import tensor_ops
    assert sorted(set(PROPERTIES) - {"in-place overlap"}) == tensor_ops()
    assert sorted({op for op, *_ in bad_input_fuzzer.CASES.values()}) == tensor_ops()


def run_in_subprocesses(command):
    """Runs a case runner (this file's __main__, or bad_input_fuzzer.py) that prints a JSON line when each case
    starts and ends. When the process dies (segfault, abort), the case it was running is recorded as a crash
    and a new process resumes after it. Returns {case: record}."""
    results, after = {}, []
    while True:
        run = subprocess.run(command + after, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
        running = None
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record["status"] == "start":
                    running = record["case"]
                else:
                    results[record["case"]] = record
                    running = None
        if run.returncode == 0 or running is None:
            if run.returncode != 0:
                results["(runner)"] = {"status": "fail", "detail": f"exit {run.returncode}: {run.stderr[-4000:]}"}
            return results
        results[running] = {"status": "fail", "detail": f"the process died (exit {run.returncode}) on this case; "
                                                        f"stderr (tail):\n{run.stderr[-4000:]}"}
        after = ["--after", running]


def profile_arguments(examples_divisor=1):
    profile = settings.default
    return ["--examples", str(max(5, profile.max_examples // examples_divisor))] + \
        (["--derandomize"] if profile.derandomize else [])


def check_record(results, case):
    assert "(runner)" not in results, results.get("(runner)", {}).get("detail")
    assert case in results, f"{case} did not run"
    assert results[case]["status"] == "ok", results[case]["detail"]


IN_PROCESS = os.environ.get("POSENC_PROPERTIES_IN_PROCESS") == "1"


@pytest.fixture(scope="module")
def property_results():
    if IN_PROCESS:
        return None
    return run_in_subprocesses([sys.executable, __file__] + profile_arguments())


@pytest.mark.parametrize("name", list(PROPERTIES))
def test_property(name, property_results):
    """The property of one op over random valid inputs. It runs in a subprocess (a crash fails this test, not
    the session); POSENC_PROPERTIES_IN_PROCESS=1 runs it here instead, for a debugger or a profiler."""
    if IN_PROCESS:
        run_property(name)
    else:
        check_record(property_results, name)


@pytest.fixture(scope="module")
def fuzzer_results():
    return run_in_subprocesses([sys.executable, str(Path(bad_input_fuzzer.__file__))] + profile_arguments(2))


@pytest.mark.parametrize("case", sorted(bad_input_fuzzer.CASES))
def test_bad_inputs_raise_an_error_naming_the_op(case, fuzzer_results):
    check_record(fuzzer_results, case)


def main():
    """The subprocess side of test_property: runs every property with the given number of examples and prints
    a JSON line when each starts and ends."""
    import faulthandler
    import traceback

    args = SUBPROCESS_ARGUMENTS
    faulthandler.enable()
    names = list(PROPERTIES)
    for name in names[names.index(args.after) + 1 if args.after else 0:]:
        if args.only not in name:
            continue
        print(json.dumps({"case": name, "status": "start"}), flush=True)
        try:
            run_property(name)
            record = {"case": name, "status": "ok", "detail": ""}
        except (Exception, pytest.fail.Exception) as error:  # noqa: BLE001  (pytest.raises fails with the latter)
            notes = "\n".join(getattr(error, "__notes__", []))
            record = {"case": name, "status": "fail",
                      "detail": "".join(traceback.format_exception_only(type(error), error)) + notes}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
