"""Sinusoidal family: values against float64 formulas written here, the primer's worked example, gradients,
opcheck, torch.compile, torch.export, TorchScript and the bad inputs."""
import concurrent.futures
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st
from torch.testing import assert_close

import posenc
from helpers import assert_exports, opcheck_test, randn, same_bits, tolerance
from mutations import (F64, grow, not_floating, not_index, on_meta, positions_beyond_domain, positions_length, put,
                       set_value, small, unknown_string, wrong_rank)
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import functional as PF
from strategies import (FLOAT_DTYPES, INT64_MAX, INT64_MIN, arrange, assert_rounds_within, call, drawing, drawn_tensor,
                        frequencies, integers, math_eps, normal, positions_and_offset, sizes, trig_error)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["interleaved", "half", "half_cos_first"]


def reference_pe(positions, inv_freq, layout):
    """float64 encoding written from the formulas: angle = p * w, sin/cos paired per layout."""
    angle = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    s, c = angle.sin(), angle.cos()
    if layout == "interleaved":
        return torch.stack([s, c], dim=-1).flatten(-2)
    return torch.cat([s, c] if layout == "half" else [c, s], dim=-1)


def pad_zero_column(pe, width):
    return F.pad(pe, (0, width - pe.shape[-1]))


# ---------------------------------------------------------------- frequencies

@pytest.mark.parametrize("dim", [2, 4, 64, 512])
def test_frequencies_paper(dim):
    w = posenc.frequencies.sinusoidal(dim)
    expected = torch.tensor([10000.0 ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)
    assert w.dtype == torch.float64
    assert_close(w, expected, rtol=1e-14, atol=0)


def test_frequencies_odd_dim_use_whole_pairs():
    """Odd dim: F = dim // 2 pairs over the exponent i / F, as fairseq and diffusers do (plus a zero column)."""
    w = posenc.frequencies.sinusoidal(7, base=100.0)
    expected = torch.tensor([100.0 ** (-i / 3) for i in range(3)], dtype=torch.float64)
    assert w.dtype == torch.float64
    assert_close(w, expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("dim", [4, 6, 80, 384])
def test_frequencies_shift_one_is_fairseq(dim):
    half = dim // 2
    expected = torch.tensor([math.exp(-i * math.log(10000.0) / (half - 1)) for i in range(half)], dtype=torch.float64)
    assert_close(posenc.frequencies.sinusoidal(dim, shift=1), expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("args", [(1,), (2, 10000.0, 1), (8, -1.0), (8, 10000.0, 2)])
def test_frequencies_bad_arguments(args):
    with pytest.raises(ValueError, match="posenc.frequencies.sinusoidal"):
        posenc.frequencies.sinusoidal(*args)


# ---------------------------------------------------------------- the primer's worked example

def test_primer_table_d_model_4():
    """The primer's hand-traced table: d_model = 4, base 10000, omega = (1, 0.01), positions 0-3."""
    inv_freq = posenc.frequencies.sinusoidal(4)
    assert inv_freq.tolist() == pytest.approx([1.0, 0.01], rel=1e-15)
    pe = PF.sinusoidal(torch.arange(4), inv_freq, dtype=torch.float64)
    table = torch.tensor([[0.000, 1.000, 0.000, 1.000],
                          [0.841, 0.540, 0.010, 1.000],
                          [0.909, -0.416, 0.020, 1.000],
                          [0.141, -0.990, 0.030, 1.000]], dtype=torch.float64)
    assert_close(pe, table, atol=5e-4, rtol=0)
    # The primer's check: PE(2) is PE(1) rotated by k = 1, with cos(1) = 0.540 and sin(1) = 0.841.
    sin1, cos1 = pe[1, 0], pe[1, 1]
    assert_close(sin1 * 0.540 + cos1 * 0.841, pe[2, 0], atol=1e-3, rtol=0)
    assert_close(cos1 * 0.540 - sin1 * 0.841, pe[2, 1], atol=1e-3, rtol=0)


def test_rotation_identity_every_pair():
    """PE(p + k) = R(k) PE(p) for every frequency pair, R(k) built from the op's own PE(k)."""
    inv_freq = posenc.frequencies.sinusoidal(64)
    p = torch.tensor([0, 1, 17, 500, 4093])
    for k in [1, 2, 7, 100, 3000]:
        pe_p = PF.sinusoidal(p, inv_freq, dtype=torch.float64).view(-1, 32, 2)
        pe_pk = PF.sinusoidal(p + k, inv_freq, dtype=torch.float64).view(-1, 32, 2)
        sin_k, cos_k = PF.sinusoidal(torch.tensor([k]), inv_freq, dtype=torch.float64).view(32, 2).unbind(-1)
        rotated_sin = pe_p[..., 0] * cos_k + pe_p[..., 1] * sin_k
        rotated_cos = pe_p[..., 1] * cos_k - pe_p[..., 0] * sin_k
        assert_close(torch.stack([rotated_sin, rotated_cos], -1), pe_pk, atol=1e-12, rtol=0)


def test_distinct_encodings_below_10000():
    pe = PF.sinusoidal(torch.arange(10000), posenc.frequencies.sinusoidal(64), dtype=torch.float64)
    closest = math.inf
    for start in range(0, 10000, 2500):
        d = torch.cdist(pe[start:start + 2500], pe)
        d[torch.arange(d.shape[0]), torch.arange(start, start + d.shape[0])] = math.inf
        closest = min(closest, d.min().item())
    assert closest > 0.1


def test_accuracy_float32_up_to_2_pow_20():
    """The accuracy target: max abs error <= 1e-6 against float64 for |p| <= 2^20 (eager float32 is off by
    ~1e-1 there)."""
    inv_freq = posenc.frequencies.sinusoidal(256)
    positions = torch.cat([torch.arange(0, 2 ** 20 + 1, 997), torch.tensor([2 ** 20, -(2 ** 20), 2 ** 20 - 1])])
    pe = PF.sinusoidal(positions, inv_freq, dtype=torch.float32)
    error = (pe.double() - reference_pe(positions, inv_freq, "interleaved")).abs().max().item()
    assert error <= 1e-6
    naive = (positions.float()[:, None] * inv_freq.float()).sin()
    naive_error = (naive.double() - reference_pe(positions, inv_freq, "half")[:, :128]).abs().max().item()
    assert naive_error > 100 * error  # the test distinguishes our engine from a float32 product


# ---------------------------------------------------------------- the conventions users compare with

def test_fairseq_whisper_convention():
    """Whisper's sinusoids(length, channels) and fairseq's table: shift 1, [sin || cos]."""
    length, channels = 50, 24
    increment = math.log(10000) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2, dtype=torch.float64))
    scaled = torch.arange(length, dtype=torch.float64)[:, None] * inv_timescales[None, :]
    expected = torch.cat([scaled.sin(), scaled.cos()], dim=1)
    inv_freq = posenc.frequencies.sinusoidal(channels, shift=1)
    assert_close(PF.sinusoidal(torch.arange(length), inv_freq, "half", torch.float64), expected, atol=1e-12, rtol=0)


def test_fairseq_odd_dim_zero_column():
    module = posenc.nn.SinusoidalPositionalEncoding(7, shift=1, layout="half").double()
    out = module(torch.zeros(2, 9, 7, dtype=torch.float64))
    half = 3
    w = torch.exp(-torch.arange(half, dtype=torch.float64) * math.log(10000) / (half - 1))
    angle = torch.arange(9, dtype=torch.float64)[:, None] * w
    expected = torch.cat([angle.sin(), angle.cos(), torch.zeros(9, 1, dtype=torch.float64)], dim=1)
    assert_close(out, expected.expand(2, 9, 7), atol=1e-12, rtol=0)


@pytest.mark.parametrize("flip_sin_to_cos", [False, True])
def test_diffusion_timestep_convention(flip_sin_to_cos):
    """diffusers' get_timestep_embedding: float timesteps, downscale_freq_shift 1, optional cos first."""
    timesteps = torch.tensor([0.0, 1.5, 37.25, 999.0, 500.5])
    dim, max_period, shift = 32, 10000, 1
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float64) / (half - shift)
    angle = timesteps.double()[:, None] * torch.exp(exponent)[None, :]
    parts = [angle.cos(), angle.sin()] if flip_sin_to_cos else [angle.sin(), angle.cos()]
    expected = torch.cat(parts, dim=-1)
    layout = "half_cos_first" if flip_sin_to_cos else "half"
    out = PF.sinusoidal(timesteps, posenc.frequencies.sinusoidal(dim, float(max_period), shift), layout)
    assert out.dtype == torch.float32
    assert_close(out.double(), expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- sinusoidal op over dtypes, layouts, shapes

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position_dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
def test_sinusoidal_values(layout, dtype, position_dtype):
    positions = torch.randint(-50, 3000, (3, 11)).to(position_dtype)
    inv_freq = posenc.frequencies.sinusoidal(18)
    out = PF.sinusoidal(positions, inv_freq, layout, dtype, offset=5)
    assert out.shape == (3, 11, 18) and out.dtype == dtype
    assert_close(out.double(), reference_pe(positions.double() + 5, inv_freq, layout), **tolerance(dtype))


def test_sinusoidal_default_dtype():
    inv_freq = posenc.frequencies.sinusoidal(4)
    assert PF.sinusoidal(torch.arange(3), inv_freq).dtype == torch.float32
    assert PF.sinusoidal(torch.arange(3, dtype=torch.float64), inv_freq).dtype == torch.float64


# ---------------------------------------------------------------- add_sinusoidal

def positions_case(kind, batch, seq):
    if kind == "none":
        return None, torch.arange(seq)
    if kind == "shared":
        p = torch.randint(0, 5000, (seq,))
        return p, p
    p = torch.randint(0, 5000, (batch, seq))
    return p, p


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["none", "shared", "per_row"])
@pytest.mark.parametrize("width", [16, 17])
def test_add_sinusoidal_values(dtype, layout, kind, width):
    batch, seq = 3, 10
    x = torch.randn(batch, seq, width, dtype=dtype)
    positions, reference_positions = positions_case(kind, batch, seq)
    inv_freq = posenc.frequencies.sinusoidal(width, shift=1)
    out = PF.add_sinusoidal(x, positions, inv_freq, 1.5, layout, offset=3)
    pe = pad_zero_column(reference_pe(reference_positions + 3, inv_freq, layout), width)
    expected = x.double() * 1.5 + pe
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out.double(), expected, **tolerance(dtype))


def across_threads(fn):
    """fn() with 1 thread, then 2: both results."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(2)
        two = fn()
    finally:
        torch.set_num_threads(previous)
    return one, two


# Shapes that cut into several blocks of positions and tiles (D = 1024: 32 positions per block), a decoding
# step (one position, many leading indices) and a 4-d input; the kernel splits them over threads.
@pytest.mark.parametrize("shape", [(3, 100, 1025), (64, 1, 1024), (2, 3, 40, 1024)])
@pytest.mark.parametrize("kind", ["none", "shared", "per_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_sinusoidal_blocks_and_threads(shape, kind, dtype):
    x = torch.randn(shape, dtype=dtype)
    seq = shape[-2]
    positions = {"none": None, "shared": torch.randint(0, 5000, (seq,)),
                 "per_row": torch.randint(0, 5000, shape[:-1])}[kind]
    inv_freq = posenc.frequencies.sinusoidal(shape[-1])
    one, two = across_threads(lambda: PF.add_sinusoidal(x, positions, inv_freq, 1.5, "interleaved", 2))
    assert torch.equal(one, two)
    reference_positions = torch.arange(seq) if positions is None else positions
    pe = pad_zero_column(reference_pe(reference_positions + 2, inv_freq, "interleaved"), shape[-1])
    assert_close(one.double(), x.double() * 1.5 + pe, **tolerance(dtype))


@pytest.mark.parametrize("shape", [(3, 100), (64, 1)])
def test_embed_sinusoidal_blocks_and_threads(shape):
    tokens = torch.randint(0, 300, shape)
    weight = torch.randn(300, 1024)
    inv_freq = posenc.frequencies.sinusoidal(1024)
    one, two = across_threads(lambda: PF.embed_sinusoidal(tokens, weight, None, inv_freq, 2.0))
    assert torch.equal(one, two)
    pe = reference_pe(torch.arange(shape[-1]), inv_freq, "interleaved")
    assert_close(one.double(), F.embedding(tokens, weight).double() * 2.0 + pe, **tolerance(torch.float32))


# A call whose positions are whole numbers >= 0 reads an encoding table the CPU keeps between calls, computed by the
# same kernel. The reference: the encodings computed in calls too small to read a kept table (fewer than 8192
# pairs each), added in the maths type as the kernel adds them (x * scale, then + pe, each rounded once to float32;
# float64 for float64 data).
def computed_encodings(positions, inv_freq, layout, dtype):
    per_call = max(1, 8191 // inv_freq.numel())
    flat = positions.reshape(-1)
    pe = torch.cat([PF.sinusoidal(chunk, inv_freq, layout, dtype=dtype) for chunk in flat.split(per_call)])
    return pe.reshape(*positions.shape, -1)


def kept_reference(x, inv_freq, layout, offset, prefix=0, scale=1.0, positions=None):
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    if positions is None:
        positions = torch.arange(x.shape[-2] - prefix)
    pe = computed_encodings(positions + offset, inv_freq, layout, opmath)
    sums = x.to(opmath) * scale
    sums[..., prefix:, :pe.shape[-1]] += pe
    return sums.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("layout", ["interleaved", "half", "half_cos_first"])
@pytest.mark.parametrize("seq, offset, prefix, width", [(300, 0, 0, 1024), (100, 4000, 0, 1025), (200, 7, 2, 512),
                                                        (10, 0, 0, 64)])  # the last: too few pairs to keep
def test_kept_tables_give_the_bits_of_computed_ones(dtype, layout, seq, offset, prefix, width):
    x = torch.randn(2, seq, width, dtype=dtype)
    inv_freq = posenc.frequencies.sinusoidal(width)
    for _ in range(2):  # the call that computes the table, then one that finds it
        out = PF.add_sinusoidal(x, None, inv_freq, 1.5, layout, offset, num_prefix_tokens=prefix)
        assert same_bits(out, kept_reference(x, inv_freq, layout, offset, prefix, 1.5))


@pytest.mark.parametrize("kind", ["arange", "per_row", "scattered", "whole_floats", "fractions", "negative"])
def test_kept_tables_for_given_positions(kind):
    """Given positions read kept rows where every one is a whole number >= 0 (shared, one per row as fairseq's
    padding-aware ones, in any order, floating timesteps), and are computed otherwise: the same bits either way."""
    batch, seq, width = 3, 200, 256
    x = torch.randn(batch, seq, width, dtype=torch.bfloat16)
    inv_freq = posenc.frequencies.sinusoidal(width)
    real = torch.rand(batch, seq) > 0.2
    positions = {"arange": torch.arange(seq), "per_row": torch.cumsum(real, 1) * real + 1,
                 "scattered": torch.randint(0, 6000, (seq,)), "whole_floats": torch.arange(seq) * 5.0,
                 "fractions": torch.arange(seq) + 0.5, "negative": torch.arange(seq) - 7}[kind]
    for _ in range(2):
        out = PF.add_sinusoidal(x, positions, inv_freq, 1.5, "half", 3)
        assert same_bits(out, kept_reference(x, inv_freq, "half", 3, scale=1.5, positions=positions))
        table = PF.sinusoidal(positions, inv_freq, "half", offset=3)
        assert same_bits(table, computed_encodings(positions + 3, inv_freq, "half", torch.float32))


def test_kept_tables_follow_frequencies_layout_dtype_and_length():
    """No call reads a table kept for other frequencies (one of them changed), another layout or maths type, or
    fewer positions (the table grows)."""
    inv_freq = posenc.frequencies.sinusoidal(1024)
    changed = inv_freq.clone()
    changed[-1] *= 1.5
    calls = [(inv_freq, "half", 0, torch.float32), (changed, "half", 0, torch.float32),
             (inv_freq, "interleaved", 0, torch.float32), (inv_freq, "half", 0, torch.float64),
             (inv_freq, "half", 500, torch.bfloat16), (inv_freq, "half", 100, torch.float32),
             (changed, "half", 700, torch.float32), (inv_freq, "half", 0, torch.float32)]
    for w, layout, offset, dtype in calls:
        x = torch.randn(2, 256, 1024, dtype=dtype)
        assert same_bits(PF.add_sinusoidal(x, None, w, 1.0, layout, offset), kept_reference(x, w, layout, offset))
    x = torch.randn(1, 256, 1024)
    assert not torch.equal(PF.add_sinusoidal(x, None, inv_freq), PF.add_sinusoidal(x, None, changed))


def test_kept_tables_under_concurrent_calls():
    """Threads that compute, grow and read kept tables at once each get their own encodings."""
    freqs = [posenc.frequencies.sinusoidal(512, base) for base in (100.0, 1000.0, 10000.0, 50000.0)]
    x = torch.randn(1, 256, 512)
    cases = [(i % 4, (i // 4) * 100) for i in range(32)]  # tables of up to 4 rows per position: grown, not replaced
    expected = [kept_reference(x, freqs[f], "half", offset) for f, offset in cases]

    def call(i):
        f, offset = cases[i]
        return same_bits(PF.add_sinusoidal(x, None, freqs[f], 1.0, "half", offset), expected[i])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(call, list(range(32)) * 2))


def test_embed_sinusoidal_reads_kept_tables_too():
    tokens = torch.randint(0, 300, (2, 400))
    weight = torch.randn(300, 256, dtype=torch.bfloat16)
    inv_freq = posenc.frequencies.sinusoidal(256)
    for _ in range(2):
        out = PF.embed_sinusoidal(tokens, weight, None, inv_freq, 2.0, offset=5)
        assert same_bits(out, kept_reference(F.embedding(tokens, weight), inv_freq, "interleaved", 5, scale=2.0))


def test_no_kept_tables_compute_the_same_bits(tmp_path):
    """POSENC_ENCODING_CACHE_MB=0 keeps no table, nor a grid's axis values: every call computes its encodings, with
    the bits of kept ones."""
    torch.manual_seed(0)
    x = torch.randn(2, 600, 1024, dtype=torch.bfloat16)
    w = posenc.frequencies.sinusoidal(1024)
    grid = torch.ops.posenc.grid_positions([20, 30], None, None, 1.0)
    grid_freq, pair_axis, layout = torch.ops.posenc.grid_sinusoidal_inv_freq(1024, "mae", 10000.0)
    kept = [PF.add_sinusoidal(x, None, w, 1.0, "half", offset) for offset in (0, 50)]
    kept += [torch.ops.posenc.add_sinusoidal(x, grid, grid_freq, 1.0, layout, 0, pair_axis) for _ in range(2)]
    torch.save([x, w, grid, grid_freq, pair_axis, layout], tmp_path / "inputs")
    code = ("import sys, torch, posenc, posenc.functional as PF\n"
            "x, w, grid, grid_freq, pair_axis, layout = torch.load(sys.argv[1] + '/inputs')\n"
            "out = [PF.add_sinusoidal(x, None, w, 1.0, 'half', o) for o in (0, 50)]\n"
            "ops = torch.ops.posenc\n"
            "out += [ops.add_sinusoidal(x, grid, grid_freq, 1.0, layout, 0, pair_axis) for _ in range(2)]\n"
            "torch.save(out, sys.argv[1] + '/out')\n")
    env = dict(os.environ, POSENC_LIBRARY=posenc.library_path, POSENC_ENCODING_CACHE_MB="0")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=True, timeout=300)
    out = torch.load(tmp_path / "out")
    assert len(out) == len(kept) and all(same_bits(a, b) for a, b in zip(kept, out))


def test_add_sinusoidal_strided_input():
    base = torch.randn(10, 4, 32, dtype=torch.float64)
    x = base.transpose(0, 1)[:, :, ::2]  # [4, 10, 16], not contiguous
    inv_freq = posenc.frequencies.sinusoidal(16)
    out = PF.add_sinusoidal(x, None, inv_freq)
    assert_close(out, x + reference_pe(torch.arange(10), inv_freq, "interleaved"), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_scale", [0.25, 1.0, -3.0, 0.3, 1 / 3 + 1e-12])
def test_add_sinusoidal_backward_is_scale(x_scale, dtype):
    # 2 x 37 tokens of 67 channels: whole vectors and tails; zeros of both signs, values near the type's largest and
    # smallest, infinities and NaN
    x = torch.randn(2, 37, 67, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 37, 67, dtype=dtype) * torch.logspace(-6, 6, 67, dtype=torch.float64).to(dtype)
    info = torch.finfo(dtype)
    grad[0, 0, :8] = torch.tensor([0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_normal / 3, math.inf,
                                   math.nan], dtype=dtype)
    PF.add_sinusoidal(x, None, posenc.frequencies.sinusoidal(66), x_scale).backward(grad)
    expected = grad * x_scale  # ATen's product, x_scale rounded to the compute type
    assert torch.equal(x.grad.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(x.grad).view(-1), torch.nan_to_num(expected).view(-1))
    assert torch.equal(x.grad.signbit() | x.grad.isnan(), expected.signbit() | expected.isnan())  # zeros' signs
    # a strided gradient (the expanded one of a sum) and a batch of one token
    x.grad = None
    PF.add_sinusoidal(x, None, posenc.frequencies.sinusoidal(66), x_scale).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 1.0) * x_scale)
    one = torch.randn(1, 67, dtype=dtype, requires_grad=True)
    PF.add_sinusoidal(one, None, posenc.frequencies.sinusoidal(66), x_scale).backward(grad[0, :1])
    assert torch.equal(torch.nan_to_num(one.grad), torch.nan_to_num(grad[0, :1] * x_scale))


def test_add_sinusoidal_gradcheck():
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    inv_freq = posenc.frequencies.sinusoidal(6)
    positions = torch.randint(0, 100, (2, 4))
    assert torch.autograd.gradcheck(lambda t: PF.add_sinusoidal(t, positions, inv_freq, 0.7, "half", 2), (x,))
    assert torch.autograd.gradgradcheck(lambda t: PF.add_sinusoidal(t, None, inv_freq, 0.7), (x,))


# ---------------------------------------------------------------- embed_sinusoidal and embedding_backward

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "shared", "per_row"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embed_sinusoidal_matches_embedding_reference(dtype, kind, padding_idx):
    vocab, width, batch, seq = 13, 9, 3, 7
    weight = torch.randn(vocab, width, dtype=dtype)
    tokens = torch.randint(0, vocab, (batch, seq))
    tokens[0, :2] = 0
    positions, reference_positions = positions_case(kind, batch, seq)
    inv_freq = posenc.frequencies.sinusoidal(width)

    ours_weight = weight.clone().requires_grad_()
    out = PF.embed_sinusoidal(tokens, ours_weight, positions, inv_freq, 3.0, padding_idx, "half", 1)
    reference_weight = weight.double().requires_grad_()
    pe = pad_zero_column(reference_pe(reference_positions + 1, inv_freq, "half"), width)
    expected = F.embedding(tokens, reference_weight, padding_idx=padding_idx) * 3.0 + pe
    assert_close(out.double(), expected.detach(), **tolerance(dtype))

    grad = torch.randn(batch, seq, width, dtype=dtype)
    out.backward(grad)
    expected.backward(grad.double())
    assert_close(ours_weight.grad.double(), reference_weight.grad, **tolerance(dtype))
    if padding_idx is not None:
        assert (ours_weight.grad[padding_idx] == 0).all()


def test_embed_sinusoidal_gradcheck():
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([[1, 5, 5, 0], [2, 2, 3, 1]])
    inv_freq = posenc.frequencies.sinusoidal(4)
    assert torch.autograd.gradcheck(
        lambda w: PF.embed_sinusoidal(tokens, w, None, inv_freq, 2.0, None, "interleaved", 3), (weight,))


def test_double_backward_through_embedding_is_a_clear_error():
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    out = PF.embed_sinusoidal(torch.tensor([1, 2]), weight, None, posenc.frequencies.sinusoidal(4))
    upstream = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="posenc.embedding_backward: double backward"):
        torch.autograd.grad(out, weight, upstream, create_graph=True)


def test_embedding_backward_deterministic_across_threads(same_bits_for_any_thread_count):
    grad = torch.randn(4, 2048, 64)
    indices = torch.randint(0, 50, (4, 2048))
    two = same_bits_for_any_thread_count(lambda: PF.embedding_backward(grad, indices, 50, 1.0, 3))
    expected = torch.zeros(50, 64, dtype=torch.float64).index_add_(0, indices.flatten(), grad.double().view(-1, 64))
    expected[3] = 0
    assert_close(two.double(), expected, atol=1e-4, rtol=1e-5)


def test_embedding_backward_suffix_indices():
    grad = torch.randn(3, 5, 4, dtype=torch.float64)
    indices = torch.tensor([4, 0, 4, 1, 2])
    out = PF.embedding_backward(grad, indices, 6, 0.5)
    expected = torch.zeros(6, 4, dtype=torch.float64).index_add_(0, indices, grad.sum(0)) * 0.5
    assert_close(out, expected)


# ---------------------------------------------------------------- modules

def test_module_matches_functional_and_scripts():
    module = posenc.nn.SinusoidalPositionalEncoding(16, base=500.0, layout="half", x_scale=4.0)
    x = torch.randn(2, 6, 16)
    positions = torch.tensor([3, 1, 4, 1, 5, 9])
    expected = x.double() * 4.0 + reference_pe(positions + 2, posenc.frequencies.sinusoidal(16, 500.0), "half")
    assert_close(module(x, positions, 2).double(), expected, atol=2e-6, rtol=0)
    scripted = torch.jit.script(module)
    assert_close(scripted(x, positions, 2), module(x, positions, 2), atol=0, rtol=0)


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double().float()])
def test_module_frequencies_stay_float64(convert):
    module = posenc.nn.SinusoidalPositionalEncoding(64)
    exact = posenc.frequencies.sinusoidal(64)
    convert(module)
    assert module.inv_freq.dtype == torch.float64
    assert torch.equal(module.inv_freq, exact)
    assert "inv_freq" not in module.state_dict()


def test_embedding_module():
    module = posenc.nn.SinusoidalEmbedding(20, 8, padding_idx=-1)
    assert module.padding_idx == 19 and (module.weight[19] == 0).all()
    tokens = torch.tensor([[3, 19, 7]])
    expected = F.embedding(tokens, module.weight.double()) * math.sqrt(8) + reference_pe(
        torch.arange(3), posenc.frequencies.sinusoidal(8), "interleaved")
    assert_close(module(tokens).double(), expected.detach(), atol=2e-6, rtol=0)
    module(tokens).sum().backward()
    assert (module.weight.grad[19] == 0).all() and (module.weight.grad[3] != 0).all()
    assert_close(torch.jit.script(module)(tokens), module(tokens), atol=0, rtol=0)


# ---------------------------------------------------------------- opcheck, compile, export

def opcheck_samples():
    inv_freq = posenc.frequencies.sinusoidal(8)
    yield torch.ops.posenc.sinusoidal.default, (torch.arange(5), inv_freq), {}
    yield torch.ops.posenc.sinusoidal.default, (torch.rand(2, 3) * 100, inv_freq, "half", torch.float64, 2), {}
    for positions in [None, torch.arange(4) * 3, torch.randint(0, 9, (2, 4))]:
        x = torch.randn(2, 4, 9, requires_grad=True)
        yield torch.ops.posenc.add_sinusoidal.default, (x, positions, inv_freq, 2.0, "half", 1), {}
    weight = torch.randn(10, 8, requires_grad=True)
    tokens = torch.randint(0, 10, (2, 4))
    yield torch.ops.posenc.embed_sinusoidal.default, (tokens, weight, None, inv_freq, 2.0, 0, "interleaved", 0), {}
    yield torch.ops.posenc.embedding_backward.default, (torch.randn(2, 4, 8), tokens, 10, 2.0, 1), {}


test_opcheck = opcheck_test(opcheck_samples())


class TinyEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = posenc.nn.SinusoidalEmbedding(32, 16, padding_idx=0)
        self.proj = torch.nn.Linear(16, 16)
        self.encode = posenc.nn.SinusoidalPositionalEncoding(16, shift=1, layout="half")

    def forward(self, tokens):
        return self.encode(self.proj(self.embed(tokens)), None, 4)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    model = TinyEncoder()
    compiled_matches_eager(model, [torch.randint(0, 32, (2, 12))], [model.embed.weight])


def test_compile_inductor_dynamic():
    torch._dynamo.reset()
    module = posenc.nn.SinusoidalPositionalEncoding(8)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for seq in [5, 9]:
        x = torch.randn(2, seq, 8)
        assert_close(compiled(x), module(x))


def test_export():
    model = TinyEncoder()
    tokens = torch.randint(0, 32, (2, 12))
    assert_exports(model, (tokens,), "embed_sinusoidal")


# ---------------------------------------------------------------- bad input

def test_bad_width_for_pairs():
    with pytest.raises(RuntimeError, match=r"posenc.add_sinusoidal: x has 7 channels but inv_freq has 2 frequencies"):
        PF.add_sinusoidal(torch.randn(2, 7), None, posenc.frequencies.sinusoidal(4))


@pytest.mark.parametrize("call, message", [
    (lambda: PF.add_sinusoidal(torch.ones(2, 4, dtype=torch.int64), None, posenc.frequencies.sinusoidal(4)),
     "posenc.add_sinusoidal: x must be a floating tensor, got Long"),
    (lambda: PF.add_sinusoidal(torch.ones(2, 4), None, torch.arange(2)),
     r"posenc.add_sinusoidal: inv_freq must be float64 \(or float32\), got Long"),
    (lambda: PF.add_sinusoidal(torch.ones(2, 4), torch.ones(2, dtype=torch.bool), posenc.frequencies.sinusoidal(4)),
     "posenc.add_sinusoidal: positions must be an integer or floating tensor, got Bool"),
    (lambda: PF.add_sinusoidal(torch.ones(3, 2, 4), torch.arange(3), posenc.frequencies.sinusoidal(4)),
     r"posenc.add_sinusoidal: positions has shape \[3\] but x needs \[2\] or \[3, 2\]"),
    (lambda: PF.add_sinusoidal(torch.ones(4), None, posenc.frequencies.sinusoidal(4)),
     r"posenc.add_sinusoidal: x must be \[..., S, D\], got shape \[4\]"),
    (lambda: PF.add_sinusoidal(torch.ones(2, 4), None, posenc.frequencies.sinusoidal(4), layout="neox"),
     "posenc.add_sinusoidal: layout must be .* got \"neox\""),
    (lambda: PF.sinusoidal(torch.arange(3), torch.empty(0, dtype=torch.float64)),
     "posenc.sinusoidal: inv_freq is empty"),
    (lambda: PF.sinusoidal(torch.arange(3), torch.ones(2, 2, dtype=torch.float64)),
     r"posenc.sinusoidal: inv_freq must be 1-D, got shape \[2, 2\]"),
    (lambda: PF.sinusoidal(torch.arange(3), posenc.frequencies.sinusoidal(4), dtype=torch.int32),
     "posenc.sinusoidal: dtype must be floating, got Int"),
    (lambda: PF.embed_sinusoidal(torch.tensor([1, 10]), torch.randn(10, 4), None, posenc.frequencies.sinusoidal(4)),
     r"posenc.embed_sinusoidal: tokens holds 10 at flat index 1, outside \[0, 10\)"),
    (lambda: PF.embed_sinusoidal(torch.tensor([-1]), torch.randn(10, 4), None, posenc.frequencies.sinusoidal(4)),
     r"posenc.embed_sinusoidal: tokens holds -1"),
    (lambda: PF.embed_sinusoidal(torch.tensor([1.0]), torch.randn(10, 4), None, posenc.frequencies.sinusoidal(4)),
     "posenc.embed_sinusoidal: tokens must be an int64 or int32 tensor, got Float"),
    (lambda: PF.embed_sinusoidal(torch.tensor([1]), torch.randn(10, 4), None, posenc.frequencies.sinusoidal(4), 1.0, 10),
     r"posenc.embed_sinusoidal: padding_idx 10 is outside \[0, 10\)"),
    (lambda: PF.embedding_backward(torch.randn(3, 4), torch.tensor([0, 1, 5]), 5),
     r"posenc.embedding_backward: indices holds 5 at flat index 2, outside \[0, 5\)"),
    (lambda: PF.embedding_backward(torch.randn(3, 4), torch.tensor([0, 1]), 5),
     r"posenc.embedding_backward: indices has shape \[2\] which does not end grad's leading shape \[3\]"),
])
def test_bad_input_messages(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_bad_input_meta_matches_cpu():
    x = torch.empty(2, 7, device="meta")
    with pytest.raises(RuntimeError, match="posenc.add_sinusoidal: x has 7 channels"):
        PF.add_sinusoidal(x, None, posenc.frequencies.sinusoidal(4).to("meta"))


def test_positions_requiring_grad_are_rejected():
    positions = torch.arange(3.0, requires_grad=True)
    with pytest.raises(RuntimeError, match="posenc.sinusoidal: positions and inv_freq are not differentiable"):
        PF.sinusoidal(positions, posenc.frequencies.sinusoidal(4))


def test_empty_inputs_give_empty_results():
    inv_freq = posenc.frequencies.sinusoidal(4)
    assert PF.add_sinusoidal(torch.randn(2, 0, 4), None, inv_freq).shape == (2, 0, 4)
    assert PF.add_sinusoidal(torch.randn(0, 3, 4), torch.randint(0, 5, (0, 3)), inv_freq).shape == (0, 3, 4)
    assert PF.sinusoidal(torch.empty(0, dtype=torch.int64), inv_freq).shape == (0, 4)
    assert PF.embed_sinusoidal(torch.empty(2, 0, dtype=torch.int64), torch.randn(5, 4), None, inv_freq).shape == (2, 0, 4)
    assert torch.equal(PF.embedding_backward(torch.randn(0, 4), torch.empty(0, dtype=torch.int64), 3), torch.zeros(3, 4))


def test_nan_and_inf_positions_propagate():
    positions = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    out = PF.sinusoidal(positions, posenc.frequencies.sinusoidal(4))
    assert torch.isfinite(out[0]).all()
    assert torch.isnan(out[1:]).all()
    x = torch.tensor([[1.0, float("nan"), 0.0, 0.0]])
    out = PF.add_sinusoidal(x, None, posenc.frequencies.sinusoidal(4))
    assert torch.isnan(out[0, 1]) and torch.isfinite(out[0, [0, 2, 3]]).all()



def test_signed_zero_angles_as_documented():
    # architecture.md, "Angles": a -0.0 angle's float32 sine is +0.0 on the fast reduction, -0.0 on the exact path
    # (a row with an angle past 2^26 rad) and in float64, as torch.sin gives it
    inv_freq = torch.tensor([1.0, -0.0, -0.5], dtype=torch.float64)
    positions = torch.tensor([0.0, 3.0, 2.0**30], dtype=torch.float64)
    angles = positions[:, None] * inv_freq
    expected = torch.cat([angles.sin(), angles.cos()], dim=1)
    out64 = PF.sinusoidal(positions, inv_freq, layout="half", dtype=torch.float64)
    out32 = PF.sinusoidal(positions, inv_freq, layout="half", dtype=torch.float32)
    assert torch.equal(out64.signbit(), expected.signbit())
    assert_close(out32.double(), expected, atol=1e-6, rtol=0)
    negative_zeros = (angles == 0) & angles.signbit()
    assert negative_zeros.sum() == 4
    assert not out32[:2, :3][negative_zeros[:2]].signbit().any()  # fast rows
    assert out32[2:, :3][negative_zeros[2:]].signbit().all()  # the exact path's row


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (which imports this file to find
# them): each op's sample call (op_registry.SAMPLES: determinism, concurrency, no_grad, CUDA and CPU-capability
# tests), its hypothesis property (test_properties.py) and its bad-input cases (bad_input_fuzzer.py).

# ---- sample calls
# Small: widths 130/131 (odd pairs, an unencoded last channel); large: [4, 1024, 256].

def _sinusoidal_frequencies(m):
    return posenc.frequencies.sinusoidal(m.size(130, 256))  # small: 65 pairs (odd)


@sample("sinusoidal")
def _build_sinusoidal(m):
    """Output in the sample's dtype, an offset. Small: a video grid's integer positions [3, 4, 16] (time, row,
    column), the 65 pairs in runs of 12, 1, 26 and 26 on axes 0, 1, 2, 1 (int64 pair_axis), half_per_axis; large:
    integer positions [4, 1024] up to 1e5, interleaved."""
    if m.large:
        return call_args(m.ints(100000, 4, 1024, seed=10), _sinusoidal_frequencies(m), "interleaved", m.dtype, 5)
    positions = m.ints(5000, 3, 4, 16, seed=10)
    pair_axis = torch.tensor([0] * 12 + [1] + [2] * 26 + [1] * 26)
    return call_args(positions, _sinusoidal_frequencies(m), "half_per_axis", m.dtype, 3, pair_axis)


@sample("add_sinusoidal")
def _build_add_sinusoidal(m):
    """Small: a cls token, then 7 image tokens a row with per-row positions [2, 3, 7] on 2 axes, the 65 pairs in
    MAE's blocks (32 on axis 1, 33 on axis 0; int32 pair_axis), half_per_axis, an offset; large: per-row positions
    [B, S], interleaved."""
    x = m.grad(m.floats(*m.size((3, 8, 131), (4, 1024, 256)), seed=11))
    if m.large:
        return call_args(x, m.ints(100000, 4, 1024, seed=12), _sinusoidal_frequencies(m), 0.5, "interleaved", 0)
    positions = m.ints(5000, 2, 3, 7, seed=12)
    pair_axis = torch.tensor([1] * 32 + [0] * 33, dtype=torch.int32)
    return call_args(x, positions, _sinusoidal_frequencies(m), 2.0, "half_per_axis", 3, pair_axis, 1)


@sample("embed_sinusoidal")
def _build_embed_sinusoidal(m):
    """Small: positions [S] given, padding_idx 0; large: positions absent, padding_idx 7."""
    vocab = m.size(50, 3000)
    tokens = m.ints(vocab, *m.size((3, 8), (4, 1024)), seed=13)
    table = m.grad(m.floats(vocab, m.size(130, 256), seed=14))
    positions = None if m.large else m.ints(5000, 8, seed=15)
    return call_args(tokens, table, positions, _sinusoidal_frequencies(m), m.size(2.5, 2.0), m.size(0, 7),
                     m.size("half", "interleaved"), m.size(4, 0))


# ---- properties: random valid inputs against float64 references (test_properties.py)

SINUSOIDAL_LAYOUTS = ["interleaved", "half", "half_cos_first"]
GRID_LAYOUTS = SINUSOIDAL_LAYOUTS + ["half_per_axis"]  # sinusoidal and add_sinusoidal


def encoding(absolute, inv_freq, layout, width=None, pair_axis=None):
    """PE of absolute positions [...] -> [..., width]: sin/cos of fl(p * w) in the layout, zero past 2F. With
    pair_axis, absolute is [n_axes, ...] and pair i takes absolute[pair_axis[i]]; "half_per_axis": each run of
    consecutive pairs on one axis, its sines then its cosines (without pair_axis: one run, "half")."""
    if pair_axis is None:
        angle = absolute.double()[..., None] * inv_freq.double()
    else:
        angle = absolute.double()[pair_axis.long()].movedim(0, -1) * inv_freq.double()
    sin, cos = angle.sin(), angle.cos()
    if layout == "interleaved":
        pe = torch.stack([sin, cos], -1).flatten(-2)
    elif layout == "half":
        pe = torch.cat([sin, cos], -1)
    elif layout == "half_cos_first":
        pe = torch.cat([cos, sin], -1)
    else:
        axes = pair_axis.tolist() if pair_axis is not None else [0] * inv_freq.numel()
        parts, start = [], 0
        for i in range(1, len(axes) + 1):
            if i == len(axes) or axes[i] != axes[start]:
                parts += [sin[..., start:i], cos[..., start:i]]
                start = i
        pe = torch.cat(parts, -1)
    if width is not None and width > pe.shape[-1]:
        pe = torch.cat([pe, torch.zeros(*pe.shape[:-1], width - pe.shape[-1], dtype=torch.float64)], -1)
    return pe


def pair_axes(draw, pairs):
    """(None, None), or (n_axes, pair_axis): 1 to 3 axes, the pairs in blocks (MAE, CogVideoX: runs of about
    pairs / n_axes), cycling over the axes (runs of one pair) or in any order; int64 or int32, laid out at random
    in memory."""
    if draw(st.booleans()):
        return None, None
    n_axes = draw(st.sampled_from([2, 3, 1]))
    kind = draw(st.sampled_from(["blocks", "cycle", "any"]))
    if kind == "blocks":
        axes = [i * n_axes // pairs for i in range(pairs)]
        if draw(st.booleans()):  # the last axis first (MAE: the column's pairs, then the row's)
            axes = [n_axes - 1 - a for a in axes]
    elif kind == "cycle":
        axes = [i % n_axes for i in range(pairs)]
    else:
        axes = [draw(st.integers(0, n_axes - 1)) for _ in range(pairs)]
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    return n_axes, arrange(draw, torch.tensor(axes, dtype=dtype), expand=False)


def grid_layout(draw, pair_axis):
    """A layout of sinusoidal / add_sinusoidal: "half_per_axis" drawn first where pairs follow axes."""
    return draw(st.sampled_from(GRID_LAYOUTS[::-1] if pair_axis is not None else GRID_LAYOUTS))


def axis_positions(draw, n_axes, rows, shared_ok=True):
    """Multi-axis positions for rows of leading shape `rows` (..., S): [n_axes, S] (shared by the rows) or
    [n_axes, *rows], any dtype, with an offset; and the absolute float64 positions, [n_axes, *rows]."""
    shared = shared_ok and len(rows) > 1 and draw(st.booleans())
    shape = [n_axes, rows[-1]] if shared else [n_axes] + list(rows)
    positions, offset, absolute = positions_and_offset(draw, shape, floating_ok=True, required=True)
    if shared:
        absolute = absolute.reshape([n_axes] + [1] * (len(rows) - 1) + [rows[-1]])
    return positions, offset, absolute.expand([n_axes] + list(rows))


@property_check("sinusoidal")
@given(st.data())
def check_sinusoidal(data):
    draw = data.draw
    pairs = draw(st.integers(1, 6))
    inv_freq = frequencies(draw, pairs)
    shape = sizes(draw, draw(st.integers(1, 3)))
    n_axes, pair_axis = pair_axes(draw, pairs)
    layout = grid_layout(draw, pair_axis)
    if pair_axis is None:
        positions, offset, absolute = positions_and_offset(draw, shape, floating_ok=True, shared_ok=False)
        if positions is None:  # sinusoidal always takes positions: arange(S), and the offset drawn for them
            positions = torch.arange(shape[-1]).expand(shape)
        absolute = absolute.expand(shape)
    else:
        positions, offset, absolute = axis_positions(draw, n_axes, shape, shared_ok=False)
    dtype = draw(st.sampled_from([None] + FLOAT_DTYPES))
    note(f"positions {positions.dtype} {list(positions.shape)} stride {positions.stride()}, offset {offset}, "
         f"pair_axis {None if pair_axis is None else pair_axis.tolist()}")
    out = call("sinusoidal", positions, inv_freq, layout, dtype, offset, pair_axis)
    expected_dtype = dtype or (positions.dtype if positions.is_floating_point() else torch.float32)
    assert out.dtype == expected_dtype and out.is_contiguous()
    assert_rounds_within(out, encoding(absolute, inv_freq, layout, pair_axis=pair_axis), trig_error(out.dtype))


def frequencies_and_width(draw):
    """inv_freq of 1 to 5 pairs, and a width of twice the pairs, or one more (the last channel left zero)."""
    pairs = draw(st.integers(1, 5))
    return frequencies(draw, pairs), 2 * pairs + draw(st.integers(0, 1))


@property_check("add_sinusoidal")
@given(st.data())
def check_add_sinusoidal(data):
    draw, gen = drawing(data)
    inv_freq, width = frequencies_and_width(draw)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    rows = sizes(draw, draw(st.integers(1, 3)))
    x = drawn_tensor(draw, rows + [width], lambda s: normal(gen, s, dtype))
    # The first num_prefix_tokens tokens (cls, registers) get no encoding; the others the positions of S - prefix.
    prefix = draw(st.one_of(st.just(0), st.integers(0, rows[-1])))
    encoded = rows[:-1] + [rows[-1] - prefix]
    n_axes, pair_axis = pair_axes(draw, inv_freq.numel())
    if pair_axis is None:
        positions, offset, absolute = positions_and_offset(draw, encoded, floating_ok=True)
        absolute = absolute.expand(encoded)
    else:
        positions, offset, absolute = axis_positions(draw, n_axes, encoded)
    x_scale = draw(st.sampled_from([1.0, 0.0, -1.5, math.sqrt(width)]))
    layout = grid_layout(draw, pair_axis)
    note(f"prefix {prefix}, positions {None if positions is None else list(positions.shape)}, pair_axis "
         f"{None if pair_axis is None else pair_axis.tolist()}")
    out = call("add_sinusoidal", x, positions, inv_freq, x_scale, layout, offset, pair_axis, prefix)
    assert out.dtype == dtype and out.is_contiguous()
    scaled = x.double() * x_scale
    reference = scaled.clone()
    reference[..., prefix:, :] += encoding(absolute, inv_freq, layout, width, pair_axis)
    eps = math_eps(dtype)
    assert_rounds_within(out, reference, trig_error(dtype) + 4 * eps * (scaled.abs() + 1))
    if dtype == torch.float64 or float(torch.tensor(x_scale, dtype=torch.float32)) == x_scale:
        # Prefix tokens: exactly x * x_scale, -0.0 included.
        assert same_bits(out[..., :prefix, :], x[..., :prefix, :] * x_scale), "prefix tokens"


@property_check("embed_sinusoidal")
@given(st.data())
def check_embed_sinusoidal(data):
    draw, gen = drawing(data)
    inv_freq, width = frequencies_and_width(draw)
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


# ---- bad inputs: a small valid call of each op, and the mutations that each make one argument wrong

def sinusoidal(draw):
    pairs, seq = small(draw), small(draw)
    return dict(positions=torch.arange(seq), inv_freq=torch.rand(pairs, dtype=F64), layout="half", dtype=None,
                offset=0, pair_axis=None)


def add_sinusoidal(draw):
    pairs, batch, seq = small(draw), small(draw), small(draw)
    return dict(x=randn(batch, seq, 2 * pairs), positions=None, inv_freq=torch.rand(pairs, dtype=F64), x_scale=1.0,
                layout="interleaved", offset=0, pair_axis=None, num_prefix_tokens=0)


def embed_sinusoidal(draw):
    pairs, batch, seq, vocab = small(draw), small(draw), small(draw), small(draw, 2, 5)
    return dict(tokens=torch.randint(0, vocab, (batch, seq)), token_weight=randn(vocab, 2 * pairs), positions=None,
                inv_freq=torch.rand(pairs, dtype=F64), token_scale=1.0, padding_idx=None, layout="half", offset=0)


def sinusoidal_domain_and_frequencies():
    return {
        "inv_freq_not_floating": not_floating("inv_freq"),
        "inv_freq_wrong_rank": wrong_rank("inv_freq", [0, 2]),
        "inv_freq_empty": lambda draw, kw: kw.update(inv_freq=torch.empty(0, dtype=F64)),
        "inv_freq_on_meta": on_meta("inv_freq"),
        "layout_unknown": unknown_string("layout", {"interleaved", "half", "half_cos_first", "half_per_axis"}),
        "positions_bool_or_complex": lambda draw, kw: kw.update(positions=torch.zeros(
            positions_length(kw), dtype=draw(st.sampled_from([torch.bool, torch.complex64])))),
        "positions_beyond_domain": positions_beyond_domain(floating=True),
    }


def with_pair_axis(mutate=None):
    """A mutation: positions [2, S] of two axes and a valid pair_axis (one per pair of inv_freq), then `mutate`
    (which makes one of them wrong)."""
    def mutation(draw, kw):
        kw["positions"] = torch.zeros(2, positions_length(kw), dtype=torch.long)
        kw["pair_axis"] = torch.tensor([draw(st.integers(0, 1)) for _ in range(kw["inv_freq"].shape[0])])
        if mutate is not None:
            mutate(draw, kw)
    return mutation


def pair_axis_mutations(no_axis_dimension):
    """pair_axis of the wrong length, rank, dtype or device, holding an axis outside [0, n_axes); positions without
    the leading axis dimension (`no_axis_dimension(kw)`)."""
    return {
        "pair_axis_wrong_length": with_pair_axis(lambda draw, kw: kw.update(pair_axis=torch.zeros(
            kw["inv_freq"].shape[0] + draw(st.sampled_from([-1, 1, 5])), dtype=torch.long))),
        "pair_axis_out_of_range": with_pair_axis(put("pair_axis", [2, 3, -1, 2 ** 31, INT64_MAX, INT64_MIN])),
        "pair_axis_not_index": with_pair_axis(not_index("pair_axis")),
        "pair_axis_wrong_rank": with_pair_axis(wrong_rank("pair_axis", [0, 2])),
        "pair_axis_on_meta": with_pair_axis(on_meta("pair_axis")),
        "positions_without_axis_dimension": with_pair_axis(lambda draw, kw: kw.update(
            positions=no_axis_dimension(kw))),
    }


def add_sinusoidal_prefix_mutations():
    def prefix_out_of_range(draw, kw):
        kw["num_prefix_tokens"] = draw(st.sampled_from([-1, kw["x"].shape[-2] + 1, INT64_MAX, INT64_MIN]))

    def positions_not_seq_minus_prefix(draw, kw):  # positions for all S tokens, some of which are prefix tokens
        seq = kw["x"].shape[-2]
        kw["num_prefix_tokens"] = draw(st.integers(1, seq))
        if draw(st.booleans()):
            with_pair_axis()(draw, kw)
        else:
            kw["positions"] = torch.arange(seq)

    return {
        "num_prefix_tokens_out_of_range": prefix_out_of_range,
        "positions_not_seq_minus_prefix": positions_not_seq_minus_prefix,
        "pair_axis_without_positions": with_pair_axis(lambda draw, kw: kw.update(positions=None)),
        "positions_axes_wrong_shape": with_pair_axis(lambda draw, kw: kw.update(
            positions=torch.zeros(2, kw["x"].shape[-2] + 1, dtype=torch.long))),
    }


bad_inputs("sinusoidal", base=sinusoidal, mutations=dict(
    sinusoidal_domain_and_frequencies(), dtype_not_floating=set_value(
        "dtype", st.sampled_from([torch.int64, torch.bool, torch.complex64])),
    **pair_axis_mutations(lambda kw: torch.tensor(0))))
bad_inputs("add_sinusoidal", base=add_sinusoidal, mutations=dict(
    sinusoidal_domain_and_frequencies(), x_not_floating=not_floating("x"),
    x_wrong_rank=wrong_rank("x", [0, 1]), x_width_mismatch=grow("x", -1, by=2),
    positions_wrong_shape=lambda draw, kw: kw.update(
        positions=torch.arange(kw["x"].shape[-2] + 1)),
    positions_on_meta=lambda draw, kw: kw.update(
        positions=torch.arange(kw["x"].shape[-2], device="meta")),
    **pair_axis_mutations(lambda kw: torch.arange(kw["x"].shape[-2])), **add_sinusoidal_prefix_mutations()))
bad_inputs("embed_sinusoidal", base=embed_sinusoidal, mutations=dict(
    sinusoidal_domain_and_frequencies(), tokens_not_index=not_index("tokens"),
    tokens_out_of_vocab=lambda draw, kw: put("tokens", [kw["token_weight"].shape[0], -1,
                                                         INT64_MAX, INT64_MIN])(draw, kw),
    token_weight_wrong_rank=wrong_rank("token_weight", [1, 3]),
    token_weight_width_mismatch=grow("token_weight", 1, by=2),
    token_weight_not_floating=not_floating("token_weight"),
    padding_idx_out_of_range=lambda draw, kw: kw.update(padding_idx=draw(st.sampled_from(
        [-1, kw["token_weight"].shape[0], INT64_MAX, INT64_MIN])))))
