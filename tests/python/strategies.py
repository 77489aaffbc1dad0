"""What the hypothesis properties of several families share (each op's property lives in its family's test file,
test_sinusoidal.py, test_learned.py, ..., registered with op_registry.property_check; test_properties.py runs them):
strategies that draw inputs (shapes with sizes 0 and 1 among the others, random memory layouts: permuted, sliced
out of a NaN-filled buffer, expanded along broadcast dimensions; frequencies; positions and offsets anywhere in the
supported domain, next to its edges included) and the checks of outputs (rounding against a float64 reference;
`call`, which checks that the Meta kernel predicts the output's shape, dtype and strides)."""
import math

import torch
from hypothesis import strategies as st

import posenc  # noqa: F401  (loads libposenc.so: torch.ops.posenc.*)

OPS = torch.ops.posenc
LIMIT = 2 ** 53
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- drawing inputs

def generator(draw):
    return torch.Generator().manual_seed(draw(st.integers(0, 2 ** 32 - 1)))


def drawing(data, dtypes=None):
    """What a property starts from: (draw, a torch.Generator seeded by a drawn integer), then a dtype drawn from
    `dtypes` where given."""
    draw = data.draw
    gen = generator(draw)
    return (draw, gen) if dtypes is None else (draw, gen, draw(st.sampled_from(dtypes)))


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
            value = torch.tensor(max(min(value, LIMIT - offset), -LIMIT - offset), dtype=dtype)
            while abs(float(value) + offset) > LIMIT:  # rounded to float32 past the limit: one step back in
                value = torch.nextafter(value, torch.zeros_like(value))
            values.append(float(value))
    base = torch.tensor(values, dtype=dtype).reshape(pos_shape)
    positions = drawn_tensor(draw, pos_shape, lambda s: base[tuple(slice(0, n) for n in s)].clone())
    exact = [v + offset for v in (positions.double() if positions.is_floating_point() else positions).flatten()
             .tolist()]
    assert all(abs(v) <= LIMIT for v in exact)
    return positions, offset, torch.tensor(exact, dtype=torch.float64).reshape(pos_shape)


def sizes(draw, count, low=0, high=4):
    return [draw(st.integers(low, high)) for _ in range(count)]


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


def covered_offsets(view):
    """Storage offsets of every element of a view."""
    offsets = torch.tensor(view.storage_offset())
    for size, stride in zip(view.shape, view.stride()):
        offsets = offsets[..., None] + torch.arange(size) * stride
    return offsets.flatten()


def buffer_of(view):
    """The whole storage under a view, as a flat tensor of its dtype."""
    return torch.empty(0, dtype=view.dtype).set_(view.untyped_storage())
