"""What the bad-input cases of several families share (each op's small valid call and its mutations live in its
family's test file, test_sinusoidal.py, test_learned.py, ..., registered with op_registry.bad_inputs;
bad_input_fuzzer.py runs them): `small`, for the sizes of a base call, and mutations, each a function
mutate(draw, kw) that makes one argument of the call's keyword arguments kw wrong (its dtype, rank, size, device,
string, a value out of range, overlapping memory, ...), or a factory of them."""
import torch
from hypothesis import strategies as st

from strategies import INT64_MAX, INT64_MIN, LIMIT

F64 = torch.float64


def small(draw, low=1, high=3):
    return draw(st.integers(low, high))


# ---------------------------------------------------------------- mutations: each makes one argument wrong

def to_dtype(arg, *dtypes):
    def mutate(draw, kw):
        kw[arg] = kw[arg].to(draw(st.sampled_from(dtypes)))
    return mutate


def not_floating(arg):
    return to_dtype(arg, torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64)


def not_index(arg):
    return to_dtype(arg, torch.float32, torch.float64, torch.bool, torch.int16, torch.uint8)


def wrong_rank(arg, ranks):
    """arg reshaped (or padded) to a rank in `ranks`."""
    def mutate(draw, kw):
        rank = draw(st.sampled_from(ranks))
        t = kw[arg].flatten()
        kw[arg] = t[:1].reshape([]) if rank == 0 else t.reshape([t.numel()] + [1] * (rank - 1))
    return mutate


def grow(arg, dim, by=1):
    """`by` more entries along `dim` (a size mismatch with the other arguments); a negative `by`, fewer."""
    def mutate(draw, kw):
        t = kw[arg]
        kw[arg] = torch.cat([t] + [t.narrow(dim, 0, 1)] * by, dim) if by >= 0 else t.narrow(dim, 0, t.shape[dim] + by)
    return mutate


def on_meta(arg):
    def mutate(draw, kw):
        kw[arg] = kw[arg].to("meta")
    return mutate


def unknown_string(arg, valid):
    def mutate(draw, kw):
        kw[arg] = draw(st.one_of(st.sampled_from(["", "NEOX", "Half", "bshd ", "causal\0", "thd2", "sym"]),
                                 st.text(max_size=6)).filter(lambda s: s not in valid))
    return mutate


def set_value(arg, strategy):
    def mutate(draw, kw):
        kw[arg] = draw(strategy)
    return mutate


def put(arg, values):
    """One element of the (index or position) tensor set to a value drawn from `values`."""
    def mutate(draw, kw):
        t = kw[arg].clone()
        flat = t.view(-1)
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from(values))
        kw[arg] = t
    return mutate


def positions_beyond_domain(floating):
    """Given positions with one beyond [-2^53, 2^53] (or absent positions pushed past it by the offset)."""
    def mutate(draw, kw):
        seq = positions_length(kw)
        may_be_absent = kw.get("positions", 0) is None  # every op but sinusoidal
        how = draw(st.sampled_from(["given", "overflow"] + (["absent"] if may_be_absent else []) +
                                   (["float"] if floating else [])))
        if how == "given":
            values = torch.arange(seq)
            values[draw(st.integers(0, seq - 1))] = draw(st.sampled_from([LIMIT + 1, -LIMIT - 1, INT64_MAX, INT64_MIN]))
            kw["positions"] = values
        elif how == "absent":
            kw["offset"] = draw(st.sampled_from([LIMIT - seq + 2, -LIMIT - 1, min(INT64_MAX, INT64_MAX - seq + 2),
                                                 INT64_MIN]))
        elif how == "overflow":  # the int64 sum wraps, to -2, 5 or int64 min + 4
            position, offset = draw(st.sampled_from([(INT64_MAX, INT64_MAX), (INT64_MIN + 5, INT64_MIN),
                                                     (5, INT64_MAX)]))
            values = torch.zeros(seq, dtype=torch.long)
            values[draw(st.integers(0, seq - 1))] = position
            kw["positions"], kw["offset"] = values, offset
        else:  # finite floating positions past the edge, representable in their dtype (not inf: that is NaN)
            dtype = draw(st.sampled_from([F64, torch.float32]))
            beyond = [LIMIT + 2.0, -LIMIT - 2.0, 1e300] if dtype == F64 else [2.0 ** 54, -2.0 ** 54, 1e30]
            values = torch.arange(seq, dtype=dtype)
            values[draw(st.integers(0, seq - 1))] = draw(st.sampled_from(beyond))
            kw["positions"] = values
    return mutate


def positions_length(kw):
    if kw.get("positions") is not None:
        return kw["positions"].shape[-1]
    for name in ("x", "grad", "q", "grad_q"):
        if name in kw:
            return kw[name].shape[1] if kw[name].dim() == 4 else kw[name].shape[-2]
    return kw["tokens"].shape[-1]


def overlapping(arg):
    """arg replaced by a view whose elements share memory: expanded, or an as_strided with short strides."""
    def mutate(draw, kw):
        t = kw[arg]
        if draw(st.booleans()):
            kw[arg] = t[:1].expand(t.shape[0] + 1, *t.shape[1:]) if t.dim() else t
        else:
            buffer = torch.randn(2 * t.numel() + 8)
            strides = list(t.contiguous().stride())
            dim = draw(st.integers(0, t.dim() - 1))
            strides[dim] = 0 if strides[dim] <= 1 else draw(st.integers(0, strides[dim] - 1))
            shape = list(t.shape)
            shape[dim] = max(shape[dim], 2)
            kw[arg] = buffer.as_strided(shape, strides)
    return mutate
