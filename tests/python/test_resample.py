"""Learned tables resampled to a new grid (resample_learned, add_resampled_learned, resample_learned_backward):
values against F.interpolate and a float64 formula written here, gradients, determinism, bad input, opcheck,
compile, export, TorchScript, ONNX Runtime, and the op's coverage entries."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from helpers import randn, same_bits
from mutations import grow, not_floating, on_meta, set_value, small, to_dtype, unknown_string, wrong_rank
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import functional as PF
from strategies import FLOAT_DTYPES, assert_rounds_within, call, drawing, drawn_tensor, math_eps, normal

MODES = [(mode, align_corners, antialias) for mode in ("bicubic", "bilinear") for align_corners in (False, True)
         for antialias in (False, True)]
# (source grid, grid): up, down (by more than 2, so antialias widens its filter), mixed, one row, equal.
GRIDS = [((4, 5), (7, 9)), ((9, 11), (4, 3)), ((6, 3), (2, 8)), ((1, 4), (3, 1)), ((5, 5), (5, 5))]


# ---------------------------------------------------------------- the float64 formula


def keys(x, a):
    """Keys' cubic convolution kernel with parameter a."""
    x = abs(x)
    if x <= 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def axis_weights(size_in, size_out, mode, align_corners, antialias, scale_factor=None):
    """float64 [size_out, size_in]: row o holds the weights output o gives each input, as ATen's upsample kernels
    define them (F.interpolate)."""
    if align_corners:
        scale = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
    else:
        scale = 1.0 / scale_factor if scale_factor is not None else size_in / size_out
    m = torch.zeros(size_out, size_in, dtype=torch.float64)
    for o in range(size_out):
        if antialias:  # the separable filter, support widened by the downscale, weights normalized
            support = (2.0 if mode == "bicubic" else 1.0) * max(scale, 1.0)
            inv = 1.0 / scale if scale >= 1.0 else 1.0
            center = scale * (o + 0.5)
            lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), size_in)
            weights = [keys((k - center + 0.5) * inv, -0.5) if mode == "bicubic"
                       else max(0.0, 1 - abs((k - center + 0.5) * inv)) for k in range(lo, hi)]
            total = sum(weights)
            for k, w in zip(range(lo, hi), weights):
                m[o, k] += w / total if total != 0 else w
            continue
        source = scale * o if align_corners else scale * (o + 0.5) - 0.5
        if mode == "bilinear":
            source = max(source, 0.0)
        i = min(math.floor(source), size_in - 1)
        t = min(max(source - i, 0.0), 1.0)
        if mode == "bilinear":
            m[o, i] += 1 - t
            m[o, min(i + 1, size_in - 1)] += t
        else:  # Keys, A = -0.75, taps clamped into the grid
            for k, w in zip(range(i - 1, i + 3), (keys(t + 1, -0.75), keys(t, -0.75), keys(1 - t, -0.75),
                                                   keys(2 - t, -0.75))):
                m[o, min(max(k, 0), size_in - 1)] += w
    return m


def reference(weight, source_grid, grid, mode="bicubic", align_corners=False, antialias=False, scale_factor=None,
              num_prefix_tokens=0):
    """The resampled table in float64 (prefix rows, then Mh @ table @ Mw^T per channel)."""
    p, (hs, ws), (h, w) = num_prefix_tokens, source_grid, grid
    sf = scale_factor or (None, None)
    mh = axis_weights(hs, h, mode, align_corners, antialias, sf[0])
    mw = axis_weights(ws, w, mode, align_corners, antialias, sf[1])
    table = weight[p:].double().reshape(hs, ws, -1)
    rows = torch.einsum("hi,ijd,wj->hwd", mh, table, mw).reshape(h * w, -1)
    return torch.cat([weight[:p].double(), rows])


def interpolated(weight, source_grid, grid, mode="bicubic", align_corners=False, antialias=False,
                 scale_factor=None, num_prefix_tokens=0):
    """What vision transformers write: F.interpolate of the grid rows as an image, then the prefix rows in front."""
    p, (hs, ws) = num_prefix_tokens, source_grid
    image = weight[p:].reshape(1, hs, ws, -1).permute(0, 3, 1, 2)
    size = None if scale_factor is not None else tuple(grid)
    out = F.interpolate(image, size=size, scale_factor=scale_factor, mode=mode,
                        align_corners=align_corners if mode != "nearest" else None, antialias=antialias,
                        recompute_scale_factor=False if scale_factor is not None else None)
    assert tuple(out.shape[-2:]) == tuple(grid)
    return torch.cat([weight[:p], out.permute(0, 2, 3, 1).reshape(-1, weight.shape[1])])


def round_once(t, dtype):
    """float64 t rounded once to dtype (torch's own conversion to fp16 and bf16 goes through float32, rounding
    twice): through float32 rounded to odd, whose 24 bits leave the last rounding the same as a direct one."""
    if dtype in (torch.float32, torch.float64):
        return t.to(dtype)
    f = t.float()
    toward_zero = torch.where(f.double().abs() > t.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    bits = toward_zero.view(torch.int32)
    odd = torch.where(toward_zero.double() != t, bits | 1, bits).view(torch.float32)
    return torch.where(t.isfinite(), odd, f).to(dtype)


def assert_rounds_once_within(out, reference, tolerance):
    """out is the single rounding to its dtype of a value within `tolerance` of the float64 reference."""
    low, high = round_once(reference - tolerance, out.dtype), round_once(reference + tolerance, out.dtype)
    bad = (out.double() < low.double()) | (out.double() > high.double())
    assert not bad.any(), (int(bad.sum()), out[bad][:4], reference[bad][:4])


def assert_relative(actual, expected, bound):
    error = ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
    assert error <= bound, error
    return error


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("mode, align_corners, antialias", MODES)
@pytest.mark.parametrize("source_grid, grid", GRIDS)
@pytest.mark.parametrize("prefix", [0, 5])
def test_resample_matches_interpolate_and_the_float64_formula(mode, align_corners, antialias, source_grid, grid,
                                                              prefix):
    torch.manual_seed(0)
    weight = torch.randn(prefix + source_grid[0] * source_grid[1], 6)
    args = (source_grid, grid, mode, align_corners, antialias, None, prefix)
    out = PF.resample_learned(weight, *args)
    assert out.shape == (prefix + grid[0] * grid[1], 6) and out.dtype == torch.float32
    assert torch.equal(out[:prefix], weight[:prefix])
    assert_relative(out, interpolated(weight, *args), 2e-6)
    assert_relative(out, reference(weight, *args), 2e-7)  # the float64 sum rounded once
    w64 = weight.double()
    assert_relative(PF.resample_learned(w64, *args), reference(w64, *args), 1e-12)
    assert_relative(PF.resample_learned(w64, *args), interpolated(w64, *args), 1e-12)


@pytest.mark.parametrize("mode, align_corners, antialias", MODES)
def test_model_sized_grids_are_closer_to_float64_than_float32_interpolate(mode, align_corners, antialias):
    """DINOv2-L's 37 x 37 -> 46 x 46: F.interpolate forms its coordinates and weights in float32 and drifts from its
    own float64 result by up to ~5e-6 (relative to the largest value); ours stays within float32 rounding of it."""
    torch.manual_seed(9)
    weight = torch.randn(1 + 37 * 37, 64)
    args = ((37, 37), (46, 46), mode, align_corners, antialias, None, 1)
    exact = interpolated(weight.double(), *args)
    out = PF.resample_learned(weight, *args)
    assert_relative(out, exact, 1e-7)
    assert_relative(out, reference(weight, *args), 1e-7)
    assert_relative(interpolated(weight, *args), exact, 1e-5)


@pytest.mark.parametrize("mode, align_corners, antialias", MODES)
@pytest.mark.parametrize("source_grid, grid, scale_factor", [
    ((16, 16), (18, 18), (18.1 / 16, 18.1 / 16)),  # DINOv2's original (grid + 0.1) / source_grid
    ((37, 37), (46, 46), ((46 + 0.1) / 37, (46 + 0.1) / 37)),
    ((7, 5), (3, 12), (0.5, 2.5)),
])
def test_scale_factor_gives_the_coordinates_of_interpolate_scale_factor(mode, align_corners, antialias, source_grid,
                                                                        grid, scale_factor):
    torch.manual_seed(1)
    weight = torch.randn(1 + source_grid[0] * source_grid[1], 4, dtype=torch.float64)
    args = (source_grid, grid, mode, align_corners, antialias, list(scale_factor), 1)
    out = PF.resample_learned(weight, *args)
    assert_relative(out, interpolated(weight, *args), 1e-12)
    assert_relative(out, reference(weight, *args), 1e-12)
    if not align_corners:  # the coordinates differ from those of size=grid
        assert not torch.allclose(out, PF.resample_learned(weight, *args[:5], None, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode, align_corners, antialias", MODES)
def test_add_matches_hugging_face_x_plus_pos(dtype, mode, align_corners, antialias):
    """x + pos.to(x.dtype) after an interpolation in float32 (ViT's interpolate_pos_encoding)."""
    torch.manual_seed(2)
    source_grid, grid, prefix = (5, 6), (8, 4), 1
    weight = torch.randn(prefix + 30, 16).to(dtype)
    x = torch.randn(3, 2, prefix + 32, 16).to(dtype)
    args = (source_grid, grid, mode, align_corners, antialias, None, prefix)
    out = PF.add_resampled_learned(x, weight, *args)
    assert out.dtype == dtype and out.shape == x.shape
    exact = reference(weight, *args)
    tiny = 1e-12 * magnitude(weight, args)  # the float64 sums' own error, in another order
    assert_rounds_once_within(PF.resample_learned(weight, *args), exact, tiny)  # the float64 table rounded once
    if dtype != torch.float64:  # then added to x in float32 and rounded once
        table = PF.resample_learned(weight, *args)
        assert torch.equal(out, (x.float() + table.float()).to(dtype))
    else:
        assert_rounds_within(out, x.double() + exact, 2 * math_eps(dtype) * (x.double().abs() + exact.abs()) + tiny)
    hf = x + interpolated(weight if dtype == torch.float64 else weight.float(), *args).to(dtype)
    # HF rounds a float32 interpolation to dtype; ATen forms its coordinates and weights in float32 too (a
    # relative error of up to ~2e-6 in float32, measured), so: a few float32 steps, or a step or two of dtype apart
    step = {torch.float32: 4e-6, torch.float64: 1e-13, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
    ratio = (out.double() - hf.double()).abs() / (x.double().abs() + magnitude(weight, args))
    assert ratio.max().item() <= step[dtype], ratio.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_add_over_many_blocks_is_x_plus_the_table(dtype, same_bits_for_any_thread_count):
    """The CPU add forms the table's rows block by block as x streams past them (blocks of 128 KiB: 32 to 131 rows of
    1000 channels, which cut the 13-token grid rows anywhere, the 3 prefix rows in the first), for 1 to 5 leading
    rows and any thread count: the same bits as x + resample_learned's table, summed in maths precision."""
    torch.manual_seed(8)
    args = ((11, 7), (19, 13), "bicubic", False, False, None, 3)
    weight = (torch.randn(3 + 77, 1000) * 4).to(dtype)
    weight[5, 7], weight[40, 999] = float("nan"), float("inf")
    table = PF.resample_learned(weight, *args)
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    for leads in (1, 3, 5):
        x = torch.randn(leads, 3 + 19 * 13, 1000).to(dtype)
        out = same_bits_for_any_thread_count(lambda: PF.add_resampled_learned(x, weight, *args))
        # any NaN: torch's own rounding to bf16 keeps a NaN's sign and payload, posenc's gives 0x7FC0
        assert same_bits(out, (x.to(opmath) + table.to(opmath)).to(dtype), any_nan=True)
        assert out.isnan().any() and out.isinf().any()


def test_reduced_precision_tables_round_once_from_float64():
    """fp16 and bf16 tables are the float64 sums rounded once (not through float32 first)."""
    torch.manual_seed(3)
    weight = torch.randn(1 + 9 * 9, 64, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16):
        w = weight.to(dtype)
        args = ((9, 9), (13, 11), "bicubic", False, False, None, 1)
        assert_rounds_once_within(PF.resample_learned(w, *args), reference(w, *args), 1e-12 * magnitude(w, args))


@pytest.mark.parametrize("dtype, last_place, hair", [(torch.bfloat16, 2.0 ** -7, 2.0 ** -40),
                                                      (torch.float16, 2.0 ** -10, 2.0 ** -24)])
def test_reduced_precision_sums_a_hair_off_a_midpoint_round_to_its_side(dtype, last_place, hair):
    """Sums a hair off a midpoint of the type (at most half a float32 ulp: their nearest float32 is the midpoint
    itself) round to the side they lie on, the midpoints themselves to even: what rounding the float64 sum once
    gives, not rounding it to float32 first. The gradient's three leading rows sum to them in float64 (each row is a
    value of the type), and an adjoint onto a grid of the same size passes them through."""
    args = ((3, 4), (3, 4), "bicubic", False, False, None, 0)
    half = last_place / 2
    cases = {(1.0, half, hair): 1 + last_place, (1.0, half, -hair): 1.0, (1.0, half, 0.0): 1.0,
             (1.0 + last_place, half, hair): 1 + 2 * last_place, (1.0 + last_place, half, -hair): 1 + last_place,
             (1.0 + last_place, half, 0.0): 1 + 2 * last_place, (-1.0, -half, -hair): -1 - last_place}
    for rows, expected in cases.items():
        grad = torch.tensor(rows, dtype=torch.float64)[:, None, None].expand(3, 12, 40).to(dtype)
        assert torch.equal(grad.double().sum(0), torch.full((12, 40), sum(rows), dtype=torch.float64))
        out = PF.resample_learned_backward(grad, *args)
        assert torch.equal(out.double(), torch.full((12, 40), expected, dtype=torch.float64)), rows


def test_strided_weight_and_x():
    torch.manual_seed(4)
    weight = torch.randn(8, 1 + 12).t()  # [13, 8], transposed
    x = torch.randn(2, 8, 1 + 20).transpose(-1, -2)
    args = ((3, 4), (4, 5), "bilinear", False, True, None, 1)
    torch.testing.assert_close(PF.add_resampled_learned(x, weight, *args),
                               x + PF.resample_learned(weight.contiguous(), *args), rtol=0, atol=0)


def test_empty_and_nonfinite():
    args = ((2, 2), (3, 3), "bicubic", False, False, None, 1)
    assert PF.resample_learned(torch.empty(5, 0), *args).shape == (10, 0)
    assert PF.add_resampled_learned(torch.empty(0, 10, 3), torch.randn(5, 3), *args).shape == (0, 10, 3)
    assert torch.equal(PF.resample_learned_backward(torch.empty(0, 10, 3), *args), torch.zeros(5, 3))
    weight = torch.randn(5, 3)
    weight[2, 1] = float("nan")
    out = PF.resample_learned(weight, *args)
    assert out[:, 1].isnan().any() and out[:, 0].isfinite().all()


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("mode, align_corners, antialias", MODES)
def test_backward_is_the_adjoint_of_interpolate(mode, align_corners, antialias):
    torch.manual_seed(5)
    source_grid, grid, prefix = (6, 5), (3, 8), 2
    weight = torch.randn(prefix + 30, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, prefix + 24, 4, dtype=torch.float64, requires_grad=True)
    args = (source_grid, grid, mode, align_corners, antialias, None, prefix)
    grad_out = torch.randn_like(x)
    ours = torch.autograd.grad(PF.add_resampled_learned(x, weight, *args), (x, weight), grad_out)
    expected = torch.autograd.grad(x + interpolated(weight, *args), (x, weight), grad_out)
    torch.testing.assert_close(ours[0], expected[0], rtol=0, atol=0)
    assert_relative(ours[1], expected[1], 1e-12)
    summed = grad_out.sum((0, 1))
    adjoint = torch.cat([summed[:prefix], (reference(torch.eye(prefix + 30, dtype=torch.float64), *args)[prefix:].t()
                                           @ summed[prefix:])[prefix:]])
    assert_relative(PF.resample_learned_backward(grad_out, *args), adjoint, 1e-12)


def test_gradcheck_and_gradgradcheck_float64():
    torch.manual_seed(6)
    for mode, align_corners, antialias in MODES:
        args = ((4, 3), (2, 5), mode, align_corners, antialias, None, 1)
        weight = torch.randn(13, 2, dtype=torch.float64, requires_grad=True)
        x = torch.randn(2, 11, 2, dtype=torch.float64, requires_grad=True)
        grad = torch.randn(2, 11, 2, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda w: PF.resample_learned(w, *args), (weight,))
        assert torch.autograd.gradcheck(lambda a, w: PF.add_resampled_learned(a, w, *args), (x, weight))
        assert torch.autograd.gradgradcheck(lambda a, w: PF.add_resampled_learned(a, w, *args), (x, weight))
        assert torch.autograd.gradcheck(lambda g: PF.resample_learned_backward(g, *args), (grad,))
        assert torch.autograd.gradgradcheck(lambda w: PF.resample_learned(w, *args), (weight,))


def test_backward_is_bitwise_identical_for_any_thread_count(same_bits_for_any_thread_count):
    torch.manual_seed(7)
    args = ((14, 14), (24, 24), "bicubic", False, True, None, 1)
    weight = torch.randn(1 + 196, 256, requires_grad=True)
    x = torch.randn(8, 1 + 576, 256)
    grad_out = torch.randn_like(x)

    def forward_and_grad():
        out = PF.add_resampled_learned(x, weight, *args)
        return out, torch.autograd.grad(out, weight, grad_out)[0]

    out, grad = same_bits_for_any_thread_count(forward_and_grad)
    assert_relative(grad, torch.autograd.grad(interpolated(weight, *args), weight, grad_out.sum(0))[0], 2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leads", [1, 40])
def test_backward_cut_by_grid_rows_or_channels_gives_the_same_bits(same_bits_for_any_thread_count, leads, dtype):
    """The CPU adjoint gives each thread a run of input grid rows, each forming the gradient's sums for the output grid
    rows they read (those beside a cut formed on both sides), or, where those twice-formed rows would read more than
    a sum formed first writes (40 leading rows at 2 and 3 threads here), forms the whole sum first and gives each
    thread a run of channels: the same bits for any thread count, both ways, and the float64 adjoint rounded once."""
    torch.manual_seed(11)
    args = ((12, 9), (17, 13), "bicubic", False, False, None, 2)
    grad = torch.randn(leads, 2 + 17 * 13, 64, dtype=torch.float64).to(dtype)
    got = same_bits_for_any_thread_count(lambda: PF.resample_learned_backward(grad, *args))
    weight = torch.zeros(2 + 12 * 9, 64, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(interpolated(weight, *args), weight, grad.double().sum(0))[0]
    assert got.dtype == dtype
    assert_relative(got.double(), expected.to(dtype).double(), 2e-6 if dtype == torch.float32 else 2.0 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_sums_the_leading_rows_in_order(dtype):
    """grad's leading rows are summed in float64 in their order, one after another, whatever their count (the CPU
    adds up to eight in one sweep): rows 2^53, 1, ..., 1, -2^53 sum to 0, each 1 vanishing into 2^53 (half its last
    place, rounded to even), and the same rows with the ones first to about their count."""
    args = ((3, 4), (5, 6), "bicubic", False, False, None, 1)
    tokens = 1 + 5 * 6

    def in_order(values):  # Python's floats are float64: each sum rounded, left to right
        total = values[0]
        for value in values[1:]:
            total = total + value
        return total

    for leads in (2, 3, 4, 7, 8, 9, 12, 13, 19):
        for values in ([2.0 ** 53] + [1.0] * (leads - 2) + [-(2.0 ** 53)],
                       [1.0] * (leads - 2) + [2.0 ** 53, -(2.0 ** 53)]):
            grad = torch.tensor(values, dtype=torch.float64)[:, None, None].expand(leads, tokens, 70).to(dtype)
            expected = PF.resample_learned_backward(torch.full((1, tokens, 70), in_order(values), dtype=dtype), *args)
            assert same_bits(PF.resample_learned_backward(grad, *args), expected), (leads, values[0])
        assert leads <= 3 or in_order(values) != 0  # the two orders differ (one 1 alone vanishes either way)


@pytest.mark.parametrize("leads", [1, 3, 8])
def test_backward_of_a_large_grid_sums_the_leading_rows_in_order(leads):
    """DINOv2-L's grid (37 x 37 to 46 x 46, 1024 channels), whose runs of sums pass a core's L2 cache on some CPUs:
    there the CPU forms the whole sum first, not grid row by grid row as it goes. Either way the float32 gradient is
    the float64 sum of the leading rows, in order, through the float64 adjoint, rounded once; and that adjoint is
    F.interpolate's."""
    torch.manual_seed(9)
    args = ((37, 37), (46, 46), "bicubic", False, False, None, 1)
    grad = torch.randn(leads, 1 + 46 * 46, 1024)
    summed = grad[0].double()
    for row in grad[1:]:
        summed = summed + row.double()
    expected = PF.resample_learned_backward(summed[None], *args)
    assert same_bits(PF.resample_learned_backward(grad, *args), expected.float())
    weight = torch.zeros(1 + 37 * 37, 1024, dtype=torch.float64, requires_grad=True)
    assert_relative(expected, torch.autograd.grad(interpolated(weight, *args), weight, summed)[0], 1e-12)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("call, message", [
    (lambda: PF.resample_learned(torch.randn(5, 3), [2, 2, 1], [3, 3]),
     r"posenc\.resample_learned: source_grid must be two positive sizes \(rows, columns\), got \[2, 2, 1\]"),
    (lambda: PF.resample_learned(torch.randn(4, 3), [2, 2], [0, 3]),
     r"posenc\.resample_learned: grid must be two positive sizes \(rows, columns\), got \[0, 3\]"),
    (lambda: PF.resample_learned(torch.randn(5, 3), [2, 2], [3, 3]),
     r"posenc\.resample_learned: weight has 5 rows but num_prefix_tokens \+ prod\(source_grid\) = 0 \+ 2 \* 2 = 4"),
    (lambda: PF.resample_learned(torch.randn(4, 3), [2, 2], [2 ** 40, 2 ** 40]),
     r"posenc\.resample_learned: grid \[1099511627776, 1099511627776\] with num_prefix_tokens 0 has more tokens "
     r"than int64 can count"),
    (lambda: PF.resample_learned(torch.randn(4, 3), [2, 2], [3, 3], "nearest"),
     r'posenc\.resample_learned: mode must be "bicubic" or "bilinear", got "nearest"'),
    (lambda: PF.resample_learned(torch.randn(4, 3), [2, 2], [3, 3], num_prefix_tokens=-1),
     r"posenc\.resample_learned: num_prefix_tokens must be >= 0, got -1"),
    (lambda: PF.resample_learned(torch.randn(4, 3), [2, 2], [3, 3], scale_factor=[1.5, float("inf")]),
     r"posenc\.resample_learned: scale_factor must be two positive finite numbers \(rows, columns\), got \[1.5, inf\]"),
    (lambda: PF.resample_learned(torch.randn(4, 3), [2, 2], [3, 3], scale_factor=[1.5]),
     r"posenc\.resample_learned: scale_factor must be two positive finite numbers"),
    (lambda: PF.resample_learned(torch.ones(4, 3, dtype=torch.long), [2, 2], [3, 3]),
     r"posenc\.resample_learned: weight must be a floating"),
    (lambda: PF.add_resampled_learned(torch.randn(2, 10, 3), torch.randn(4, 3), [2, 2], [3, 3]),
     r"posenc\.add_resampled_learned: x has 10 rows but num_prefix_tokens \+ prod\(grid\) = 0 \+ 3 \* 3 = 9"),
    (lambda: PF.add_resampled_learned(torch.randn(2, 9, 4), torch.randn(4, 3), [2, 2], [3, 3]),
     r"posenc\.add_resampled_learned: x has 4 channels but weight has 3"),
    (lambda: PF.add_resampled_learned(torch.randn(2, 9, 3), torch.randn(4, 3, dtype=torch.float64), [2, 2], [3, 3]),
     r"posenc\.add_resampled_learned: weight is Double but x is Float"),
    (lambda: PF.resample_learned_backward(torch.randn(2, 8, 3), [2, 2], [3, 3]),
     r"posenc\.resample_learned_backward: grad has 8 rows but num_prefix_tokens \+ prod\(grid\) = 0 \+ 3 \* 3 = 9"),
])
def test_bad_input_names_the_op_the_argument_and_the_value(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_bad_input_meta_matches_cpu():
    meta = dict(device="meta")
    with pytest.raises(RuntimeError, match=r"posenc\.add_resampled_learned: x has 10 rows"):
        PF.add_resampled_learned(torch.empty(2, 10, 3, **meta), torch.empty(4, 3, **meta), [2, 2], [3, 3])
    out = PF.add_resampled_learned(torch.empty(2, 10, 3, **meta), torch.empty(5, 3, **meta), [2, 2], [3, 3],
                                   num_prefix_tokens=1)
    assert out.shape == (2, 10, 3)
    assert PF.resample_learned_backward(torch.empty(2, 10, 3, **meta), [2, 2], [3, 3],
                                        num_prefix_tokens=1).shape == (5, 3)


# ---------------------------------------------------------------- opcheck, compile, export, TorchScript


def opcheck_samples():
    weight = torch.randn(1 + 12, 4, requires_grad=True)
    x = torch.randn(2, 1 + 20, 4, requires_grad=True)
    yield torch.ops.posenc.resample_learned.default, (weight, [3, 4], [4, 5]), {"num_prefix_tokens": 1}
    yield (torch.ops.posenc.add_resampled_learned.default, (x, weight, [3, 4], [4, 5]),
           {"mode": "bilinear", "antialias": True, "num_prefix_tokens": 1})
    yield (torch.ops.posenc.add_resampled_learned.default, (x, weight, [3, 4], [4, 5], "bicubic", False, False,
                                                             [1.4, 1.3], 1), {})
    yield (torch.ops.posenc.resample_learned_backward.default, (torch.randn(2, 21, 4, requires_grad=True), [3, 4],
                                                                 [4, 5]), {"align_corners": True,
                                                                           "num_prefix_tokens": 1})


@pytest.mark.parametrize("op, args, kwargs", list(opcheck_samples()))
def test_opcheck(op, args, kwargs):
    torch.library.opcheck(op, args, kwargs)


class Resampled(torch.nn.Module):
    """A ViT's patch embedding plus its position table resized to the image's patch grid."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1 + 16, 8))

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return PF.add_resampled_learned(x, self.weight, [4, 4], [rows, cols], "bicubic", False, True, None, 1)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    weight = torch.randn(1 + 16, 8, requires_grad=True)
    x = torch.randn(2, 1 + 30, 8, requires_grad=True)

    def fn(x, weight):
        return PF.add_resampled_learned(x, weight, [4, 4], [5, 6], "bilinear", False, False, None, 1) * 2

    compiled_matches_eager(fn, (x, weight), (x, weight))


def test_export():
    model = Resampled()
    x = torch.randn(2, 1 + 30, 8)
    program = torch.export.export(model, (x, 5, 6))
    torch.testing.assert_close(program.module()(x, 5, 6), model(x, 5, 6))
    assert "posenc.add_resampled_learned" in str(program.graph)


class ResampledImage(torch.nn.Module):
    """A ViT's positional step: the patch grid read from the image's size, as Hugging Face's interpolate_pos_encoding
    reads it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1 + 16, 8))

    def forward(self, image: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        grid = [image.shape[-2] // 4, image.shape[-1] // 4]
        return PF.add_resampled_learned(x, self.weight, [4, 4], grid, "bicubic", False, False, None, 1)


def _image_and_tokens(height, width):
    return torch.zeros(1, 3, height, width), torch.randn(2, 1 + (height // 4) * (width // 4), 8)


def test_a_symbolic_grid_compiles_once():
    """grid is SymInt[]: under torch.compile(dynamic=True) images of three sizes share one graph, forward and
    backward, with the eager values."""
    model, graphs = ResampledImage(), []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    compiled = torch.compile(model, backend=backend, dynamic=True)
    for height, width in ((20, 12), (24, 28), (36, 16)):  # distinct sides: equal ones would share one symbol
        image, x = _image_and_tokens(height, width)
        out = compiled(image, x)
        assert torch.equal(out, model(image, x))
        (grad,) = torch.autograd.grad(out.sum(), model.weight)
        torch.testing.assert_close(grad, torch.autograd.grad(model(image, x).sum(), model.weight)[0])
    assert len(graphs) == 1


def test_export_with_a_symbolic_image_size():
    model = ResampledImage()
    rows, cols = torch.export.Dim("rows", min=2, max=64), torch.export.Dim("cols", min=2, max=64)
    program = torch.export.export(model, _image_and_tokens(16, 16),
                                  dynamic_shapes=({2: 4 * rows, 3: 4 * cols}, {1: torch.export.Dim.DYNAMIC}))
    for height, width in ((16, 16), (20, 12), (40, 8)):
        image, x = _image_and_tokens(height, width)
        assert torch.equal(program.module()(image, x), model(image, x))


def test_torchscript_round_trip(tmp_path):
    model = Resampled()
    scripted = torch.jit.script(model)
    x = torch.randn(2, 1 + 30, 8)
    assert torch.equal(scripted(x, 5, 6), model(x, 5, 6))
    path = tmp_path / "resampled.pt"
    scripted.save(str(path))
    loaded = torch.jit.load(str(path))
    assert torch.equal(loaded(x, 5, 6), model(x, 5, 6))
    loaded(x, 5, 6).sum().backward()
    expected = torch.autograd.grad(model(x, 5, 6).sum(), model.weight)[0]
    torch.testing.assert_close(loaded.weight.grad, expected)


# ---------------------------------------------------------------- ONNX Runtime


@pytest.mark.parametrize("mode, align_corners, antialias", MODES)
@pytest.mark.parametrize("source_grid, grid, scale_factor", [((4, 5), (7, 9), None), ((9, 11), (4, 3), None),
                                                             ((8, 8), (9, 9), [1.1875, 1.1875]),
                                                             ((8, 8), (9, 10), [1.1875, 1.1875])])
def test_onnx_runtime_matches(mode, align_corners, antialias, source_grid, grid, scale_factor):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import posenc.onnx

    class Model(torch.nn.Module):
        def forward(self, x, weight):  # the table an input, so that the exporter does not fold it into a constant
            return PF.add_resampled_learned(x, weight, list(source_grid), list(grid), mode, align_corners, antialias,
                                            scale_factor, 1)

    torch.manual_seed(8)
    model = Model()
    x = torch.randn(2, 1 + grid[0] * grid[1], 8)
    weight = torch.randn(1 + source_grid[0] * source_grid[1], 8)
    program = posenc.onnx.export(model, (x, weight))
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    got = torch.from_numpy(session.run(None, {names[0]: x.numpy(), names[1]: weight.numpy()})[0])
    expected = model(x, weight)
    error = assert_relative(got - x, expected - x, 5e-6)
    graph = str(program.model_proto.graph)
    shrinks = grid[0] < source_grid[0] or grid[1] < source_grid[1]
    resize = not (antialias and align_corners) and not (scale_factor and list(grid) == [9, 10] and not align_corners) \
        and not (mode == "bicubic" and not antialias and shrinks)
    assert ('op_type: "Resize"' in graph) == resize  # what Resize cannot say goes through MatMul
    print(f"onnxruntime {mode} align_corners={align_corners} antialias={antialias} {source_grid}->{grid} "
          f"scale_factor={scale_factor}: relative error {error:.2e}")


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs


@sample("resample_learned")
def _build_resample_learned(m):
    """Small: bilinear, antialias, a downscale, 5 prefix rows; large: DINOv2-L's 37 x 37 -> 46 x 46, D 768."""
    hs, ws, h, w = m.size((9, 7), (37, 37)) + m.size((4, 5), (46, 46))
    prefix = m.size(5, 1)
    weight = m.grad(m.floats(prefix + hs * ws, m.size(130, 768), seed=40))
    return call_args(weight, [hs, ws], [h, w], m.size("bilinear", "bicubic"), False, m.size(True, False), None,
                     prefix)


@sample("add_resampled_learned")
def _build_add_resampled_learned(m):
    """Small: align_corners, odd width; large: ViT-B/16 at 384 px (14 x 14 -> 24 x 24, cls), D 768, B 4."""
    hs, ws, h, w = m.size((5, 6), (14, 14)) + m.size((7, 3), (24, 24))
    x = m.grad(m.floats(*m.size((3, 1 + 21, 131), (4, 1 + 576, 768)), seed=41))
    weight = m.grad(m.floats(1 + hs * ws, m.size(131, 768), seed=42))
    return call_args(x, weight, [hs, ws], [h, w], "bicubic", m.size(True, False), False, None, 1)


@sample("resample_learned_backward")
def _build_resample_learned_backward(m):
    """Small: scale_factor, no prefix; large: [4, 1 + 24 * 24, 256] to 14 x 14, antialias."""
    hs, ws, h, w = m.size((6, 6), (14, 14)) + m.size((7, 7), (24, 24))
    prefix = m.size(0, 1)
    grad = m.floats(*m.size((2, 49, 130), (4, 1 + 576, 256)), seed=43)
    return call_args(grad, [hs, ws], [h, w], "bicubic", False, m.size(False, True), m.size([1.2, 1.2], None), prefix)


def drawn_resampling(draw):
    """A drawn grid pair and the options of a resampling."""
    source_grid = [draw(st.integers(1, 6)), draw(st.integers(1, 6))]
    grid = [draw(st.integers(1, 7)), draw(st.integers(1, 7))]
    mode, align_corners, antialias = draw(st.sampled_from(MODES))
    scale_factor = None
    if not align_corners and draw(st.booleans()):
        scale_factor = [draw(st.floats(0.25, 4.0)), draw(st.floats(0.25, 4.0))]
    return source_grid, grid, mode, align_corners, antialias, scale_factor, draw(st.integers(0, 2))


def magnitude(weight, args):
    """The float64 resampling of |weight| with |weights|: a bound of every term's size."""
    source_grid, grid, mode, align_corners, antialias, scale_factor, prefix = args
    sf = scale_factor or (None, None)
    mh = axis_weights(source_grid[0], grid[0], mode, align_corners, antialias, sf[0]).abs()
    mw = axis_weights(source_grid[1], grid[1], mode, align_corners, antialias, sf[1]).abs()
    table = weight[prefix:].double().abs().reshape(*source_grid, -1)
    rows = torch.einsum("hi,ijd,wj->hwd", mh, table, mw).reshape(grid[0] * grid[1], -1)
    return torch.cat([weight[:prefix].double().abs(), rows])


@property_check("resample_learned", "add_resampled_learned")
@given(data=st.data())
def check_resampled_tables(op, data):
    draw, gen, dtype = drawing(data, FLOAT_DTYPES)
    args = drawn_resampling(draw)
    (hs, ws), (h, w), prefix = args[0], args[1], args[-1]
    width = draw(st.integers(1, 5))
    weight = drawn_tensor(draw, [prefix + hs * ws, width], lambda s: normal(gen, s, dtype))
    table = reference(weight, *args)
    bound = 16 * math_eps(torch.float64) * magnitude(weight, args)
    if op == "resample_learned":
        out = call(op, weight, *args)
        assert out.dtype == dtype
        assert_rounds_once_within(out, table, bound)
        return
    leading = [draw(st.integers(0, 2)) for _ in range(draw(st.integers(0, 2)))]
    x = drawn_tensor(draw, leading + [prefix + h * w, width], lambda s: normal(gen, s, dtype))
    out = call(op, x, weight, *args)
    assert out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float64:
        assert_rounds_within(out, x.double() + table, 2 * math_eps(dtype) * (x.double().abs() + table.abs()) + bound)
    else:  # the table rounded once to dtype, added in float32, rounded once
        rounded = call("resample_learned", weight, *args)
        assert_rounds_once_within(rounded, table, bound)
        assert torch.equal(out, (x.float() + rounded.float()).to(dtype))


@property_check("resample_learned_backward")
@given(data=st.data())
def check_resample_learned_backward(data):
    draw, gen, dtype = drawing(data, FLOAT_DTYPES)
    args = drawn_resampling(draw)
    (hs, ws), (h, w), prefix = args[0], args[1], args[-1]
    width = draw(st.integers(1, 5))
    leading = [draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 2)))]
    grad = drawn_tensor(draw, leading + [prefix + h * w, width], lambda s: normal(gen, s, dtype))
    out = call("resample_learned_backward", grad, *args)
    assert out.dtype == dtype and out.shape == (prefix + hs * ws, width)
    rows = prefix + hs * ws
    basis = torch.eye(rows, dtype=torch.float64)
    matrix = reference(basis, *args)  # [P + H * W, P + Hs * Ws]: column r is row r's resampling
    summed = grad.double().reshape(-1, prefix + h * w, width).sum(0)
    expected = matrix.t() @ summed
    bound = (16 * math_eps(torch.float64) * (matrix.abs().t() @ grad.double().abs().reshape(-1, prefix + h * w, width)
                                             .sum(0)))
    assert_rounds_once_within(out, expected, bound)


def resample_learned(draw):
    hs, ws, h, w, width, prefix = small(draw), small(draw), small(draw), small(draw), small(draw), small(draw, 0, 2)
    return dict(weight=randn(prefix + hs * ws, width), source_grid=[hs, ws], grid=[h, w], mode="bicubic",
                align_corners=False, antialias=False, scale_factor=None, num_prefix_tokens=prefix)


def add_resampled_learned(draw):
    kw = resample_learned(draw)
    kw["x"] = randn(small(draw), kw["num_prefix_tokens"] + kw["grid"][0] * kw["grid"][1], kw["weight"].shape[1])
    return kw


def resample_learned_backward(draw):
    kw = resample_learned(draw)
    weight = kw.pop("weight")
    kw["grad"] = randn(small(draw), kw["num_prefix_tokens"] + kw["grid"][0] * kw["grid"][1], weight.shape[1])
    return kw


BAD_GRIDS = st.sampled_from([[0, 2], [2, -1], [3], [1, 2, 3], []])
COMMON = dict(
    source_grid_not_two_positive=set_value("source_grid", BAD_GRIDS), grid_not_two_positive=set_value("grid", BAD_GRIDS),
    grid_too_many_tokens=set_value("grid", st.sampled_from([[2 ** 40, 2 ** 40], [2 ** 62, 4]])),
    mode_unknown=unknown_string("mode", ["bicubic", "bilinear"]),
    num_prefix_tokens_negative=set_value("num_prefix_tokens", st.integers(-5, -1)),
    scale_factor_bad=set_value("scale_factor", st.sampled_from([[0.0, 1.0], [1.0, -2.0], [float("nan"), 1.0],
                                                                [1.0, float("inf")], [1.0], [1.0, 1.0, 1.0]])))
bad_inputs("resample_learned", base=resample_learned, mutations=dict(
    COMMON, weight_not_floating=not_floating("weight"), weight_wrong_rank=wrong_rank("weight", [1, 3]),
    weight_rows_mismatch=grow("weight", 0)))
bad_inputs("add_resampled_learned", base=add_resampled_learned, mutations=dict(
    COMMON, x_not_floating=not_floating("x"), x_wrong_rank=wrong_rank("x", [0, 1]),
    weight_other_dtype=to_dtype("weight", torch.float64, torch.bfloat16), weight_rows_mismatch=grow("weight", 0),
    x_tokens_mismatch=grow("x", -2), x_width_mismatch=grow("x", -1), weight_on_meta=on_meta("weight")))
bad_inputs("resample_learned_backward", base=resample_learned_backward, mutations=dict(
    COMMON, grad_not_floating=not_floating("grad"), grad_wrong_rank=wrong_rank("grad", [0, 1]),
    grad_tokens_mismatch=grow("grad", -2)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_onnx_runtime_in_float64_and_float16(dtype):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import posenc.onnx

    class Model(torch.nn.Module):
        def forward(self, x, weight):
            return PF.add_resampled_learned(x, weight, [4, 5], [7, 9], "bicubic", False, True, None, 1)

    torch.manual_seed(10)
    x, weight = torch.randn(2, 64, 8, dtype=dtype), torch.randn(21, 8, dtype=dtype)
    program = posenc.onnx.export(Model(), (x, weight))
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    got = torch.from_numpy(session.run(None, {names[0]: x.numpy(), names[1]: weight.numpy()})[0])
    assert_relative(got, Model()(x, weight), 1e-12 if dtype == torch.float64 else 1e-3)  # fp16: an ulp


def test_the_docs_example_runs_as_written():
    """docs/vision.md's example of the resampled tables, executed as pasted."""
    from pathlib import Path
    page = (Path(__file__).resolve().parents[2] / "docs" / "vision.md").read_text()
    section = page[page.index("## Learned tables resampled to a new grid"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    namespace = {}
    exec(compile(code, "docs/vision.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 1 + 24 * 24, 768)
