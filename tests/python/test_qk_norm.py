"""QK-norm + RoPE family (qk_norm_rope, qk_norm_rope_backward, qk_norm_rope_): the ops against float64 formulas
written here (per head and over all heads, each rounding convention with its intermediate roundings in bf16/fp16),
against transformers' own modules (Qwen3RMSNorm, Gemma3RMSNorm, Olmo2RMSNorm, apply_rotary_pos_emb), gradients
(gradcheck, float64 autograd, thread-count-free weight gradients), formats, strides, GQA, partial rotary, empty
inputs, the in-place form under autograd, opcheck, torch.compile, torch.export, TorchScript and the bad inputs.

The float64 reference of the forward is an interval one: each intermediate value of a convention is carried as
(midpoint, radius) in float64, the radius bounding the float32 maths' own error (sum of squares, rsqrt, products,
sin/cos), and each rounding the convention does to the input dtype is applied to both ends of the interval
(rounding is monotone). The result is exact where the input dtype's rounding decides (bf16/fp16: the difference
between the conventions), and within the float32 maths' error elsewhere."""
import io
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch.testing import assert_close

from helpers import assert_exports, nan_payload_q_and_weight, randn, same_bits
from mutations import (F64, grow, not_floating, on_meta, overlapping, set_value, small, to_dtype, unknown_string,
                       wrong_rank)
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import functional as PF
from posenc import frequencies as FQ
from strategies import (FLOAT_DTYPES, OPS, arrange, assert_rounds_within, buffer_of, call, covered_offsets,
                        frequencies, generator, math_eps, normal, trig_error)
from test_rope import (BSHD_ORDER, FORMATS, Q_SCALE_REFUSALS, ROPE_FORMATS, from_format, model_q_scale, pair_indices,
                       q_scale_formula, rope_input, rope_mutations, rope_positions, rotate, to_format)

NORMS = ["llama", "gemma", "olmo2", "fused"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
WEIGHTS = ["per_head", "all_heads"]


# ---------------------------------------------------------------- float64 references (formulas written here)

def maths_dtype(dtype):
    """The kernels' maths type: float64 for float64 data, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def effective_weight(weight, norm, dtype):
    """The factor the normalized values are multiplied by, as float64: the weight in the maths type, plus one for
    "gemma", added in the maths type (Gemma 3's `1.0 + self.weight.float()`)."""
    w = weight.detach().to(maths_dtype(dtype))
    return (w + 1 if norm == "gemma" else w).double()


def rounded(t, dtype):
    """t rounded to dtype (to nearest, monotone), back in float64."""
    return t.to(dtype).double()


def to_interval(lo, hi):
    return (lo + hi) / 2, (hi - lo) / 2


def normalized(x_bshd, weight, eps, norm, dtype):
    """The normalized rows z = w * x / rms(x) of bshd x before the rotation, as (midpoint, radius) [B, S, H, D]: per
    head (weight [D]) or over all heads of a token (weight [H * D]), rounded as the convention rounds them:
    - llama (Qwen3RMSNorm): x * rsqrt(mean(x^2) + eps) rounded to the input dtype, times the weight, rounded again;
    - gemma (Gemma3RMSNorm): (1 + w) * x * rsqrt(...) in the maths type, rounded once;
    - olmo2 (Olmo2RMSNorm): w * x * rsqrt(...) in the maths type, rounded once;
    - fused: w * x * rsqrt(...), not rounded (the rotation's output is the one rounding).
    The radius bounds the maths type's error: the sum of squares over `group` values (16 lanes, then a tree), the
    mean, eps, sqrt, the division and the products, a few roundings each."""
    B, S, H, D = x_bshd.shape
    group = weight.shape[0]
    if x_bshd.numel() == 0 or group == 0:
        zero = torch.zeros(B, S, H, D, dtype=F64)
        return zero, zero
    rows = x_bshd.double().reshape(B, S, H * D // group, group)
    xhat = rows * (rows.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    u = math_eps(dtype)
    error = (group // 16 + 16) * u
    lo, hi = xhat - error * xhat.abs(), xhat + error * xhat.abs()
    if norm == "llama":
        lo, hi = rounded(lo, dtype), rounded(hi, dtype)
    w = effective_weight(weight, norm, dtype)
    lo, hi = torch.minimum(lo * w, hi * w), torch.maximum(lo * w, hi * w)
    lo, hi = lo - u * lo.abs(), hi + u * hi.abs()  # the product in the maths type
    if norm != "fused":
        lo, hi = rounded(lo, dtype), rounded(hi, dtype)
    mid, radius = to_interval(lo, hi)
    return mid.reshape(B, S, H, D), radius.reshape(B, S, H, D)


def angles(absolute, inv_freq):
    """angle [B or 1, S, 1, F] from the absolute position of each pair [B or 1, S, F]."""
    return absolute.double()[:, :, None, :] * inv_freq.double()


def reference(x_bshd, weight, absolute, inv_freq, eps, norm, scale, layout, dtype):
    """(reference, tolerance) of qk_norm_rope's output for bshd x, for assert_rounds_within: the normalized rows
    rotated as rope rotates them (pairs of the layout by absolute * inv_freq, times scale; the channels past the
    rotary ones pass through unscaled); tolerance: the interval's radius carried through the rotation, plus the
    rotation's own error (sin/cos to trig_error, a few roundings of the maths type)."""
    mid, radius = normalized(x_bshd, weight, eps, norm, dtype)
    angle = angles(absolute, inv_freq)
    out = rotate(mid, angle, layout, scale)
    first, second = pair_indices(angle.shape[-1], layout)
    c, s = angle.cos().abs() * abs(scale), angle.sin().abs() * abs(scale)
    magnitude = mid.abs() + radius
    tolerance = radius.clone()
    pair = (trig_error(dtype) + 4 * math_eps(dtype)) * abs(scale) * (magnitude[..., first] + magnitude[..., second])
    tolerance[..., first] = radius[..., first] * c + radius[..., second] * s + pair
    tolerance[..., second] = radius[..., second] * c + radius[..., first] * s + pair
    return out, tolerance


def composed(x_bshd, w, absolute, inv_freq, eps, scale, layout):
    """The float64 composition autograd differentiates: RMS norm (groups of w.numel() channels) times w, then the
    rotation. w is the effective weight (1 + w for gemma): its gradient is the weight's."""
    B, S, H, D = x_bshd.shape
    group = w.shape[0]
    rows = x_bshd.reshape(B, S, H * D // group, group)
    z = (rows * (rows.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w).reshape(B, S, H, D)
    return rotate(z, angles(absolute, inv_freq), layout, scale)


def backward_reference(x_bshd, g_bshd, weight, absolute, inv_freq, eps, norm, scale, layout, dtype):
    """(grad_x, tol_x, grad_w, tol_w): the gradients of the float64 composition for output gradient g (autograd
    passes gradients through the conventions' intermediate roundings, as the casts of the models' modules do), and
    bounds of the maths type's error: the gradient rotated back (sin/cos), the norm's backward
    r * (gz * w - xhat * mean(gz * w * xhat)) over `group` channels, and the weight's sum over every row."""
    B, S, H, D = x_bshd.shape
    group = weight.shape[0]
    if x_bshd.numel() == 0 or group == 0:
        return (torch.zeros(B, S, H, D, dtype=F64),) * 2 + (torch.zeros(group, dtype=F64),) * 2
    x = x_bshd.detach().double().requires_grad_()
    w = effective_weight(weight, norm, dtype).requires_grad_()
    out = composed(x, w, absolute, inv_freq, eps, scale, layout)
    grad_x, grad_w = torch.autograd.grad(out, (x, w), g_bshd.double())
    u, pairs = math_eps(dtype), absolute.shape[-1]
    # A bound of |gz|, the gradient rotated back: |scale| (|g1| + |g2|) on rotated channels, |g| past them.
    g = g_bshd.double().abs()
    bound = g.clone()
    first, second = pair_indices(pairs, layout)
    bound[..., first] = bound[..., second] = abs(scale) * (g[..., first] + g[..., second])
    rows = x.detach().reshape(B, S, H * D // group, group)
    r = (rows.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    xhat = (rows * r).abs()
    bound = bound.reshape(rows.shape)
    delta = trig_error(dtype) + (group // 16 + 16) * u
    row_max = bound.amax(-1, keepdim=True) * w.detach().abs().max()
    tol_x = (4 * delta * r * row_max * (1 + xhat)).reshape(B, S, H, D)
    terms = B * S * (H * D // group)
    tol_w = 4 * (delta + (terms + 16) * u) * (bound * xhat).sum((0, 1, 2))
    return grad_x, tol_x, grad_w, tol_w


def bshd_of(x, fmt):
    return x[None] if fmt == "thd" else x.permute(BSHD_ORDER[fmt])


def weight_of(x_bshd, mode, dtype=torch.float32, seed=0):
    """A norm weight of x: [D] (per head) or [H * D] (all heads of a token), around 1 with both signs among them."""
    size = x_bshd.shape[-1] * (x_bshd.shape[-2] if mode == "all_heads" else 1)
    return (randn(size, seed=seed) * 0.6 + 0.8).to(dtype)


def check_forward(out, x, weight, absolute, inv_freq, eps, norm, scale, layout, fmt):
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    expected, tolerance = reference(bshd_of(x, fmt), weight, absolute, inv_freq, eps, norm, scale, layout, x.dtype)
    assert_rounds_within(bshd_of(out, fmt), expected, tolerance)


def absolute_of(positions, offset, batch, seq, pairs, cu_seqlens=None):
    """The absolute position of each pair [B or 1, S, pairs] for positions None, [S] or [B, S] (no pair_axis)."""
    if positions is None:
        p = torch.arange(seq, dtype=F64) + offset
        if cu_seqlens is not None:
            bounds = cu_seqlens.tolist()
            p = torch.tensor([offset + t - max(b for b in bounds[:-1] if b <= t) for t in range(seq)], dtype=F64)
        p = p[None]
    else:
        p = (positions.double() + offset).reshape(-1, seq)
    return p[..., None].expand(p.shape[0], seq, pairs)


# ---------------------------------------------------------------- values against the float64 reference

POSITION_KINDS = {"bshd": "per_row", "bhsd": "shared", "sbhd": "none", "thd": "cu_seqlens"}


def positions_for(fmt, batch, seq, seed):
    kind = POSITION_KINDS[fmt]
    g = torch.Generator().manual_seed(seed)
    if kind == "per_row":
        return torch.randint(0, 5000, (batch, seq), generator=g), None
    if kind == "shared":
        return torch.randint(0, 5000, (seq,), generator=g), None
    if kind == "cu_seqlens":
        return None, torch.tensor([0, 2, 2, seq])
    return None, None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_values_against_the_float64_formula(dtype, norm, weights):
    """Every format (positions per row, shared, absent with an offset, packed sequences), GQA (4 and 2 heads),
    partial rotary (4 pairs of 10 channels), gptj and neox, a head of tiny values where eps matters."""
    inv_freq = FQ.rope(8, 500.0)[0]
    for i, fmt in enumerate(FORMATS):
        batch, seq = (1 if fmt == "thd" else 2), 5
        q = to_format(randn(batch, seq, 4, 10, seed=i) * 2, fmt).to(dtype)
        k = to_format(randn(batch, seq, 2, 10, seed=10 + i), fmt).to(dtype)
        # Head 1 of q: values of 1e-3 (mean square ~1e-6, as large as eps).
        bshd_of(q, fmt)[:, :, 1] = bshd_of(q, fmt)[:, :, 1] * 1e-3
        q_weight = weight_of(bshd_of(q, fmt), weights, dtype, seed=20)
        k_weight = weight_of(bshd_of(k, fmt), weights, dtype, seed=21)
        positions, cu_seqlens = positions_for(fmt, batch, seq, seed=i)
        layout = "gptj" if i % 2 else "neox"
        out_q, out_k = PF.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, 1e-6, norm, 0.75, layout, fmt,
                                       3, cu_seqlens)
        absolute = absolute_of(positions, 3, batch, seq, 4, cu_seqlens)
        check_forward(out_q, q, q_weight, absolute, inv_freq, 1e-6, norm, 0.75, layout, fmt)
        check_forward(out_k, k, k_weight, absolute, inv_freq, 1e-6, norm, 0.75, layout, fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_conventions_round_differently(dtype):
    """In bf16/fp16 each convention gives its own bits, each the reference's: llama rounds x / rms(x) before the
    weight, gemma multiplies by 1 + w, olmo2 rounds the product once, fused rounds nothing before the rotation."""
    q = (randn(2, 6, 3, 32, seed=1) * 3).to(dtype)
    weight = weight_of(q, "per_head", dtype, seed=2)
    inv_freq = FQ.rope(32)[0]
    positions = torch.randint(1, 4000, (2, 6), generator=torch.Generator().manual_seed(3))
    outs = {norm: PF.qk_norm_rope(q, q, weight, weight, positions, inv_freq, 1e-6, norm)[0] for norm in NORMS}
    for norm in NORMS:
        check_forward(outs[norm], q, weight, absolute_of(positions, 0, 2, 6, 16), inv_freq, 1e-6, norm, 1.0,
                      "neox", "bshd")
    for a in NORMS:
        for b in NORMS:
            if a < b:
                assert not torch.equal(outs[a], outs[b]), (a, b)


def test_float64_conventions_differ_only_by_gemma_weight():
    """Without roundings (float64) llama, olmo2 and fused are one formula; gemma is it with weight 1 + w."""
    q = randn(2, 4, 3, 16, dtype=F64, seed=4)
    k = randn(2, 4, 1, 16, dtype=F64, seed=5)
    w = randn(16, dtype=F64, seed=6)
    inv_freq = FQ.rope(16)[0]
    llama = PF.qk_norm_rope(q, k, w, w, None, inv_freq, 1e-6, "llama")
    for norm in ["olmo2", "fused"]:
        for a, b in zip(PF.qk_norm_rope(q, k, w, w, None, inv_freq, 1e-6, norm), llama):
            assert_close(a, b, atol=1e-14, rtol=0)
    for a, b in zip(PF.qk_norm_rope(q, k, w - 1, w - 1, None, inv_freq, 1e-6, "gemma"), llama):
        assert_close(a, b, atol=1e-14, rtol=0)


def test_eps_is_added_to_the_mean_square():
    """A head of values 1e-3: mean square 1e-6, which eps = 1e-6 doubles before the rsqrt; eps = 0.5 dominates."""
    x = torch.full((1, 1, 1, 8), 1e-3, dtype=F64)
    w = torch.ones(8, dtype=F64)
    inv_freq = FQ.rope(8)[0]
    for eps in [0.0, 1e-6, 0.5]:
        out, _ = PF.qk_norm_rope(x, x, w, w, torch.zeros(1, dtype=torch.long), inv_freq, eps)
        assert_close(out, x / math.sqrt(1e-6 + eps), atol=1e-15, rtol=1e-12)


def test_partial_rotary_normalizes_every_channel_and_rotates_the_first_ones():
    """inv_freq of 3 pairs in 10 channels: channels 6..9 are normalized with the others (their rms is the head's)
    and passed through unrotated and unscaled."""
    x = randn(2, 5, 3, 10, dtype=F64, seed=7) * 3
    w = randn(10, dtype=F64, seed=8)
    inv_freq = FQ.rope(6)[0]
    positions = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(9))
    out, _ = PF.qk_norm_rope(x, x, w, w, positions, inv_freq, 1e-6, "fused", 0.5, "gptj")
    z = x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * w
    assert_close(out[..., 6:], z[..., 6:], atol=1e-14, rtol=0)
    angle = positions.double()[..., None] * inv_freq
    assert_close(out, rotate(z, angle[:, :, None], "gptj", 0.5), atol=1e-14, rtol=0)
    assert not torch.allclose(out[..., :6], 0.5 * z[..., :6])  # the first channels are rotated


def test_all_heads_weight_normalizes_each_token_over_its_heads():
    """OLMo 2: a weight [H * D] takes one rms over every channel of the token, not one per head."""
    x = randn(1, 3, 4, 8, dtype=F64, seed=10)
    x[:, :, 0] *= 10  # heads of different magnitudes: per-head and per-token norms differ
    w_all = randn(32, dtype=F64, seed=11)
    inv_freq = FQ.rope(8)[0]
    zero = torch.zeros(3, dtype=torch.long)
    out, _ = PF.qk_norm_rope(x, x, w_all, w_all, zero, inv_freq)
    flat = x.reshape(1, 3, 32)
    expected = (flat * (flat.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * w_all).reshape(1, 3, 4, 8)
    assert_close(out, expected, atol=1e-14, rtol=0)
    per_head, _ = PF.qk_norm_rope(x, x, w_all[:8], w_all[:8], zero, inv_freq)
    assert not torch.allclose(per_head, expected[..., :8].expand_as(per_head))


def test_gqa_q_and_k_are_normalized_and_rotated_independently():
    """Hq = 8, Hk = 2 (and k with its own head_dim): each output equals the op's output for that tensor with any
    other partner, and the reference."""
    q = randn(2, 5, 8, 16, seed=12)
    k = randn(2, 5, 2, 12, seed=13)
    other_k = randn(2, 5, 1, 16, seed=14)
    qw, kw, other_kw = weight_of(q, "per_head"), weight_of(k, "all_heads", seed=1), weight_of(other_k, "per_head")
    inv_freq = FQ.rope(12)[0]
    positions = torch.arange(5) * 100
    out_q, out_k = PF.qk_norm_rope(q, k, qw, kw, positions, inv_freq, 1e-6, "olmo2")
    alone_q, _ = PF.qk_norm_rope(q, other_k, qw, other_kw, positions, inv_freq, 1e-6, "olmo2")
    _, alone_k = PF.qk_norm_rope(q[:, :, :1], k, qw, kw, positions, inv_freq, 1e-6, "olmo2")
    assert torch.equal(out_q, alone_q) and torch.equal(out_k, alone_k)
    absolute = absolute_of(positions, 0, 2, 5, 6)
    check_forward(out_q, q, qw, absolute, inv_freq, 1e-6, "olmo2", 1.0, "neox", "bshd")
    check_forward(out_k, k, kw, absolute, inv_freq, 1e-6, "olmo2", 1.0, "neox", "bshd")


# ---------------------------------------------------------------- formats, strides, empty inputs

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_bhsd_and_sbhd_views_give_the_bits_of_bshd(dtype, weights):
    q = randn(2, 6, 4, 16, dtype=dtype, seed=15)
    k = randn(2, 6, 2, 16, dtype=dtype, seed=16)
    qw, kw = weight_of(q, weights, dtype, 17), weight_of(k, weights, dtype, 18)
    inv_freq = FQ.rope(16)[0]
    positions = torch.randint(0, 900, (2, 6), generator=torch.Generator().manual_seed(19))
    expected = PF.qk_norm_rope(q, k, qw, kw, positions, inv_freq, 1e-6, "llama", 1.0, "gptj")
    for fmt in ["bhsd", "sbhd"]:
        for view in (lambda t: to_format(t, fmt), lambda t: to_format(t, fmt).contiguous()):  # strided, dense
            out = PF.qk_norm_rope(view(q), view(k), qw, kw, positions, inv_freq, 1e-6, "llama", 1.0, "gptj", fmt)
            for o, e in zip(out, expected):
                assert o.is_contiguous() and same_bits(from_format(o, fmt), e)


@pytest.mark.parametrize("make", [
    lambda t: t[..., ::2],                                               # channel stride 2
    lambda t: t[:, ::2, 1:, 4:12],                                       # sliced
    lambda t: t[:1, :1].expand(2, 3, 4, 16),                             # stride 0 (broadcast)
    lambda t: t.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0),    # channels outermost in memory
], ids=["channel_stride", "sliced", "expanded", "channels_outermost"])
def test_non_contiguous_inputs_and_weights(make):
    base = randn(2, 6, 4, 16, dtype=F64, seed=20)
    q, k = make(base), make(base * -0.5 + 1)
    assert not q.is_contiguous()
    head_dim = q.shape[-1]
    qw = randn(2 * head_dim, dtype=F64, seed=21)[::2]  # a strided weight too
    kw = randn(k.shape[-2] * head_dim, dtype=F64, seed=22)
    inv_freq = FQ.rope(head_dim - 2)[0]
    out = PF.qk_norm_rope(q, k, qw, kw, None, inv_freq, 1e-6, "gemma", 1.0, "neox", "bshd", 7)
    expected = PF.qk_norm_rope(q.contiguous(), k.contiguous(), qw.contiguous(), kw, None, inv_freq, 1e-6, "gemma",
                               1.0, "neox", "bshd", 7)
    for o, e in zip(out, expected):
        assert o.is_contiguous() and same_bits(o, e)
    absolute = absolute_of(None, 7, q.shape[0], q.shape[1], inv_freq.numel())
    check_forward(out[0], q, qw, absolute, inv_freq, 1e-6, "gemma", 1.0, "neox", "bshd")


def test_q_and_k_as_views_of_a_fused_qkv_projection():
    batch, seq, heads, head_dim = 2, 5, 4, 16
    qkv = randn(batch, seq, 3 * heads * head_dim, seed=23)
    q, k, v = qkv.view(batch, seq, 3, heads, head_dim).unbind(2)
    w = weight_of(q, "per_head")
    inv_freq = FQ.rope(head_dim)[0]
    out_q, out_k = PF.qk_norm_rope(q, k, w, w, None, inv_freq)
    expected_q, expected_k = PF.qk_norm_rope(q.contiguous(), k.contiguous(), w, w, None, inv_freq)
    assert same_bits(out_q, expected_q) and same_bits(out_k, expected_k)
    before = qkv.clone()
    PF.qk_norm_rope_(q, k, w, w, None, inv_freq)  # in place: only q's and k's slots change
    fused = qkv.view(batch, seq, 3, heads, head_dim)
    assert same_bits(fused[:, :, 0], expected_q) and same_bits(fused[:, :, 1], expected_k)
    assert torch.equal(fused[:, :, 2], before.view(batch, seq, 3, heads, head_dim)[:, :, 2])


def test_empty_inputs_give_empty_results():
    inv_freq = FQ.rope(8)[0]
    w = torch.ones(8)
    k = randn(1, 4, 2, 8, seed=24)
    for q in [torch.randn(2, 0, 3, 8), torch.randn(0, 4, 3, 8)]:
        kk = torch.randn(q.shape[0], q.shape[1], 1, 8)
        out_q, out_k = PF.qk_norm_rope(q, kk, w, w, None, inv_freq)
        assert out_q.shape == q.shape and out_k.shape == kk.shape
    # A q of no heads beside a k with some: k's result is that of any other q.
    out_q, out_k = PF.qk_norm_rope(torch.randn(1, 4, 0, 8), k, w, torch.ones(16), None, inv_freq)
    assert out_q.shape == (1, 4, 0, 8)
    assert torch.equal(out_k, PF.qk_norm_rope(randn(1, 4, 1, 8), k, w, torch.ones(16), None, inv_freq)[1])
    packed = torch.randn(0, 2, 8)
    out_q, _ = PF.qk_norm_rope(packed, packed, w, w, None, inv_freq, format="thd", cu_seqlens=torch.tensor([0]))
    assert out_q.shape == (0, 2, 8)
    # The backward of nothing: empty input gradients, zero weight gradients of the weights' shapes and dtypes.
    q, qw, kw = torch.randn(2, 0, 3, 8), torch.ones(24, dtype=torch.bfloat16), torch.ones(8, dtype=F64)
    grads = PF.qk_norm_rope_backward(q, q, q, q, qw, kw, None, inv_freq)
    assert [g.shape for g in grads] == [q.shape, q.shape, qw.shape, kw.shape]
    assert grads[2].dtype == torch.bfloat16 and grads[3].dtype == F64
    assert not grads[2].any() and not grads[3].any()


def test_nan_stays_in_its_group():
    """A NaN poisons the rms of its group (its head, or its token with a weight over all heads), nothing else."""
    x = randn(1, 3, 2, 8, seed=25)
    x[0, 1, 0, 3] = float("nan")
    inv_freq = FQ.rope(8)[0]
    out, _ = PF.qk_norm_rope(x, x, torch.ones(8), torch.ones(8), None, inv_freq)
    assert out[0, 1, 0].isnan().all() and not out[0, 1, 1].isnan().any() and not out[0, [0, 2]].isnan().any()
    out, _ = PF.qk_norm_rope(x, x, torch.ones(16), torch.ones(16), None, inv_freq)
    assert out[0, 1].isnan().all() and not out[0, [0, 2]].isnan().any()


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("norm", NORMS)
def test_every_nan_payload_gives_nan_in_bf16(norm, weight_dtype):
    """bf16 rounds in 32-bit lanes with integer arithmetic, where a NaN whose payload lies in the low half could carry
    into the sign and come out as zero. NaNs of every payload and infinities in q, and NaNs with full payloads in
    the weight (float32's low half included): the output is NaN exactly where the float64 formula's is, each NaN
    stored as 0x7FC0."""
    q, weight = nan_payload_q_and_weight(norm, weight_dtype)
    width = weight.shape[0]
    inv_freq = FQ.rope(32)[0]
    out, _ = PF.qk_norm_rope(q, q, weight, weight, None, inv_freq, 1e-6, norm)
    x = q.double()
    groups = x.reshape(1, 3, 1, width) if norm == "olmo2" else x
    r = 1 / (groups.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    z = (groups * r * effective_weight(weight, norm, torch.bfloat16)).reshape(x.shape)
    expected = rotate(z, angles(torch.arange(3)[None, :, None].expand(1, 3, 16), inv_freq), "neox", 1.0)
    assert torch.equal(out.isnan(), expected.isnan())
    assert expected.isnan().any() and (~expected.isnan()).any()
    assert (out.view(torch.int16)[out.isnan()] == 0x7FC0).all()
    # The weight gradients, summed over tokens that hold NaNs, back in bf16: every NaN stored as the outputs store it.
    grad_weight = PF.qk_norm_rope_backward(torch.ones_like(q), torch.ones_like(q), q, q, weight, weight, None,
                                           inv_freq, 1e-6, norm)[2]
    if weight_dtype == torch.bfloat16:
        assert grad_weight.isnan().any() and (grad_weight.view(torch.int16)[grad_weight.isnan()] == 0x7FC0).all()


# ---------------------------------------------------------------- against transformers' modules

def hf_modules():
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    return {"llama": qwen3.Qwen3RMSNorm, "gemma": gemma3.Gemma3RMSNorm, "olmo2": olmo2.Olmo2RMSNorm}, \
        qwen3.apply_rotary_pos_emb


def hf_norm(norm, size, weight):
    module = hf_modules()[0][norm](size, eps=1e-6).to(weight.dtype)  # a model in that dtype
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def hf_cos_sin(position_ids, inv_freq, dtype, scaling=1.0):
    """Qwen3RotaryEmbedding.forward: float32 angles of float32 frequencies, cos/sin of cat(angles, angles) times
    the attention scaling, cast to the activations' dtype."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def hf_prologue(norm, q, k, q_weight, k_weight, position_ids, inv_freq):
    """The attention prologue as the models write it, q and k [B, S, H, D]: Qwen3 and Gemma 3 normalize each head
    (Gemma 3 after the transpose to [B, H, S, D]), OLMo 2 the whole projection [B, S, H * D] before splitting it into
    heads; then apply_rotary_pos_emb on [B, H, S, D]. Returns q and k [B, H, S, D] and the normalized q and k."""
    _, apply_rotary_pos_emb = hf_modules()
    B, S = q.shape[:2]
    normed = []
    for x, w in ((q, q_weight), (k, k_weight)):
        if norm == "olmo2":
            z = hf_norm(norm, w.numel(), w)(x.reshape(B, S, -1)).view(x.shape).transpose(1, 2)
        else:
            z = hf_norm(norm, w.numel(), w)(x.transpose(1, 2))
        normed.append(z)
    cos, sin = hf_cos_sin(position_ids, inv_freq, q.dtype)
    with torch.no_grad():
        return apply_rotary_pos_emb(*normed, cos, sin), normed


def hf_case(norm, dtype, seed):
    """Qwen3-like shapes (GQA 4 and 2 heads, head_dim 64); OLMo 2 normalizes over all heads, and has as many key as
    query heads. Weights as checkpoints hold them: around 1 (Qwen3, OLMo 2), around 0 (Gemma 3's w of 1 + w)."""
    kv_heads = 4 if norm == "olmo2" else 2
    q = (randn(2, 7, 4, 64, seed=seed) * 2).to(dtype)
    k = randn(2, 7, kv_heads, 64, seed=seed + 1).to(dtype)
    sizes = (4 * 64, kv_heads * 64) if norm == "olmo2" else (64, 64)
    centre = 0.0 if norm == "gemma" else 1.0
    q_weight = (randn(sizes[0], seed=seed + 2) * 0.3 + centre).to(dtype)
    k_weight = (randn(sizes[1], seed=seed + 3) * 0.3 + centre).to(dtype)
    return q, k, q_weight, k_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", ["llama", "gemma", "olmo2"])
def test_the_norm_equals_transformers_module(norm, dtype):
    """At position 0 (no rotation) the op returns the normalized rows: those of Qwen3RMSNorm, Gemma3RMSNorm,
    Olmo2RMSNorm. Both compute the same float32 value up to the order of the sum of squares and rsqrt against
    1 / sqrt (a few float32 ulps); in bf16/fp16 the roundings then agree except where that float32 value lies within
    those ulps of a rounding boundary (a fraction ~2^-13 of the values): at most 1 ulp of the dtype apart, and 99%
    of the values exactly equal, where the wrong convention changes ~25% of them (or all, gemma's 1 + w)."""
    q, k, q_weight, k_weight = hf_case(norm, dtype, seed=30)
    inv_freq = FQ.rope(64, 1e6)[0]
    with torch.no_grad():
        _, (hf_q, hf_k) = hf_prologue(norm, q, k, q_weight, k_weight, torch.zeros(2, 7, dtype=torch.long), inv_freq)
    out_q, out_k = PF.qk_norm_rope(q, k, q_weight, k_weight, torch.zeros(7, dtype=torch.long), inv_freq, 1e-6, norm)
    for ours, theirs in ((out_q, hf_q.transpose(1, 2)), (out_k, hf_k.transpose(1, 2))):
        assert ours.dtype == theirs.dtype == dtype
        if dtype == torch.float32:
            assert_close(ours, theirs, atol=1e-6, rtol=2e-6)
            continue
        ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(theirs.float().abs().clamp_min(1e-30)))
        assert ((ours.float() - theirs.float()).abs() <= ulp).all()
        assert (ours == theirs).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["llama", "gemma", "olmo2"])
def test_the_prologue_matches_transformers(norm, dtype):
    """Norm, then apply_rotary_pos_emb with cos/sin built as Qwen3RotaryEmbedding builds them (positions < 32).
    Tolerances from transformers' own error, the larger: float32 angles p * inv_freq off by up to p * 2^-23 rad (the
    rounding of inv_freq and of the product), a few float32 ulps of sin/cos and products: (32 * 2^-23 + 2^-20) per
    unit of |z1| + |z2|; bf16: cos and sin rounded to bf16, then q * cos, rotate_half(q) * sin and their sum each
    rounded (4 roundings of 2^-9, relative to |z1| + |z2|), and our one rounding: 2^-7 (|z1| + |z2|)."""
    q, k, q_weight, k_weight = hf_case(norm, dtype, seed=40)
    inv_freq = FQ.rope(64, 1e6)[0]
    position_ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(41))
    (hf_q, hf_k), normed = hf_prologue(norm, q, k, q_weight, k_weight, position_ids, inv_freq)
    out_q, out_k = PF.qk_norm_rope(q.transpose(1, 2), k.transpose(1, 2), q_weight, k_weight, position_ids, inv_freq,
                                   1e-6, norm, 1.0, "neox", "bhsd")
    per_unit = 32 * 2.0 ** -23 + 2.0 ** -20 if dtype == torch.float32 else 2.0 ** -7
    for ours, theirs, z in ((out_q, hf_q, normed[0]), (out_k, hf_k, normed[1])):
        z = z.double().abs()
        pair_sum = z[..., :32] + z[..., 32:]
        tolerance = per_unit * torch.cat([pair_sum, pair_sum], -1)
        difference = (ours.double() - theirs.double()).abs()
        assert (difference <= tolerance).all(), f"max excess {(difference - tolerance).max().item()}"


# ---------------------------------------------------------------- gradients

GRADCHECK_SETTINGS = {
    # positions [B, S], offset, gptj, a scale; bshd
    "positions": dict(fmt="bshd", positions=torch.tensor([[3, 40, 7], [0, 11, 900]]), offset=2, scale=0.8,
                      layout="gptj"),
    # packed sequences, positions absent (they restart at each boundary), neox
    "cu_seqlens": dict(fmt="thd", cu_seqlens=torch.tensor([0, 1, 1, 3]), offset=5, scale=1.0, layout="neox"),
    # multi-axis: pair i driven by axis pair_axis[i] of positions [2, B, S] (bhsd)
    "pair_axis": dict(fmt="bhsd", positions=torch.tensor([[[1, 5, 9], [2, 0, 4]], [[30, 2, 8], [7, 7, 1]]]),
                      pair_axis=torch.tensor([1, 0]), offset=0, scale=1.3, layout="neox"),
}


def f64(*shape, seed):
    return randn(*shape, dtype=F64, seed=seed, requires_grad=True)


@pytest.mark.parametrize("setting", list(GRADCHECK_SETTINGS))
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("norm", NORMS)
def test_gradcheck(norm, weights, setting):
    """float64 gradients of q, k (GQA: 2 and 1 heads) and both weights; partial rotary (2 pairs of 6 channels)."""
    s = GRADCHECK_SETTINGS[setting]
    fmt = s["fmt"]
    batch = 1 if fmt == "thd" else 2
    q = to_format(f64(batch, 3, 2, 6, seed=50).detach(), fmt).requires_grad_()
    k = to_format(f64(batch, 3, 1, 6, seed=51).detach(), fmt).requires_grad_()
    q_weight = f64(6 * (2 if weights == "all_heads" else 1), seed=52)
    k_weight = f64(6, seed=53)
    inv_freq = FQ.rope(4)[0]

    def fn(q, k, q_weight, k_weight):
        return PF.qk_norm_rope(q, k, q_weight, k_weight, s.get("positions"), inv_freq, 1e-6, norm, s["scale"],
                               s["layout"], fmt, s["offset"], s.get("cu_seqlens"), s.get("pair_axis"))

    assert torch.autograd.gradcheck(fn, (q, k, q_weight, k_weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", NORMS)
def test_backward_equals_autograd_of_the_float64_composition(dtype, norm):
    """The gradients of q, k and both weights (per head for q, over all heads for k) against autograd on the float64
    formula, within the maths type's error (backward_reference's bounds), each rounded once to its dtype."""
    q = (randn(2, 9, 4, 24, seed=60) * 2).to(dtype).requires_grad_()
    k = randn(2, 9, 2, 24, seed=61).to(dtype).requires_grad_()
    qw = weight_of(q, "per_head", dtype, 62).requires_grad_()
    kw = weight_of(k, "all_heads", torch.float32, 63).requires_grad_()  # a float32 weight beside bf16 data
    inv_freq = FQ.rope(20, 1000.0)[0]
    positions = torch.randint(0, 10 ** 4, (2, 9), generator=torch.Generator().manual_seed(64))
    out_q, out_k = PF.qk_norm_rope(q, k, qw, kw, positions, inv_freq, 1e-5, norm, 0.9, "gptj")
    grad_q, grad_k = randn(*q.shape, dtype=dtype, seed=65), randn(*k.shape, dtype=dtype, seed=66)
    got = torch.autograd.grad((out_q, out_k), (q, k, qw, kw), (grad_q, grad_k))
    assert [g.dtype for g in got] == [dtype, dtype, dtype, torch.float32]
    absolute = absolute_of(positions, 0, 2, 9, 10)
    for x, g, w, gx, gw in ((q, grad_q, qw, got[0], got[2]), (k, grad_k, kw, got[1], got[3])):
        ref_x, tol_x, ref_w, tol_w = backward_reference(x, g, w, absolute, inv_freq, 1e-5, norm, 0.9, "gptj", dtype)
        assert_rounds_within(gx, ref_x, tol_x)
        assert_rounds_within(gw, ref_w, tol_w)
    # The backward op gives autograd's bits.
    direct = PF.qk_norm_rope_backward(grad_q, grad_k, q.detach(), k.detach(), qw.detach(), kw.detach(), positions,
                                      inv_freq, 1e-5, norm, 0.9, "gptj")
    assert all(same_bits(a, b) for a, b in zip(direct, got))


def test_only_one_output_used_gives_zero_gradient_to_the_other_input():
    q = randn(1, 4, 2, 8, dtype=F64, seed=67, requires_grad=True)
    k = randn(1, 4, 1, 8, dtype=F64, seed=68, requires_grad=True)
    w = randn(8, dtype=F64, seed=69, requires_grad=True)
    out_q, _ = PF.qk_norm_rope(q, k, w, w, None, FQ.rope(8)[0])
    grad_q, grad_k, grad_w = torch.autograd.grad(out_q.sum(), (q, k, w))
    assert grad_q.abs().sum() > 0 and not grad_k.any()
    assert torch.equal(grad_w, torch.autograd.grad(PF.qk_norm_rope(q, k, w, w.detach(), None, FQ.rope(8)[0])[0].sum(),
                                                   w)[0])


def test_weight_gradients_have_the_same_bits_for_1_2_and_3_threads(same_bits_for_any_thread_count):
    """The weights' gradients sum over 1024 tokens (64 chunks of 16), which 2 and 3 threads split: the chunks'
    partial sums are added in a fixed order whatever the split."""
    q = randn(4, 256, 4, 64, seed=70, requires_grad=True)
    k = randn(4, 256, 2, 64, seed=71, requires_grad=True)
    qw, kw = weight_of(q, "per_head", seed=72).requires_grad_(), weight_of(k, "all_heads", seed=73).requires_grad_()
    inv_freq = FQ.rope(64)[0]
    grads = randn(*q.shape, seed=74), randn(*k.shape, seed=75)

    def run():
        out = PF.qk_norm_rope(q, k, qw, kw, None, inv_freq, 1e-6, "llama")
        return torch.autograd.grad(out, (qw, kw), grads)

    gw_q, gw_k = same_bits_for_any_thread_count(run)
    ref_w = backward_reference(k, grads[1], kw, absolute_of(None, 0, 4, 256, 32), inv_freq, 1e-6, "llama", 1.0,
                               "neox", torch.float32)
    assert_rounds_within(gw_k, ref_w[2], ref_w[3])
    assert gw_q.abs().max() > 0


def test_double_backward_is_refused_with_a_clear_error():
    q = randn(1, 3, 2, 8, dtype=F64, seed=76, requires_grad=True)
    w = randn(8, dtype=F64, seed=77, requires_grad=True)
    out_q, _ = PF.qk_norm_rope(q, q, w, w, None, FQ.rope(8)[0])
    with pytest.raises(RuntimeError, match="posenc.qk_norm_rope_backward: a second derivative of qk_norm_rope is "
                                           "not supported"):
        torch.autograd.grad(out_q.sum(), (q, w), create_graph=True)
    # Without create_graph the same backward runs.
    out_q, _ = PF.qk_norm_rope(q, q, w, w, None, FQ.rope(8)[0])
    assert all(g.abs().sum() > 0 for g in torch.autograd.grad(out_q.sum(), (q, w)))


def test_inv_freq_is_not_differentiable():
    x = randn(1, 3, 2, 8)
    with pytest.raises(RuntimeError, match="posenc.qk_norm_rope: inv_freq is not differentiable"):
        PF.qk_norm_rope(x, x, torch.ones(8), torch.ones(8), None, FQ.rope(8)[0].requires_grad_())


def test_inplace_inv_freq_requiring_grad_names_the_inplace_op():
    x = randn(1, 3, 2, 8)
    with pytest.raises(RuntimeError, match=r"posenc\.qk_norm_rope_: inv_freq is not differentiable"):
        PF.qk_norm_rope_(x, x.clone(), torch.ones(8), torch.ones(8), None, FQ.rope(8)[0].requires_grad_())


# ---------------------------------------------------------------- in place

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_inplace_equals_the_functional_op(dtype, fmt):
    batch = 1 if fmt == "thd" else 2
    q = to_format(randn(batch, 6, 3, 10, dtype=dtype, seed=80), fmt)
    k = to_format(randn(batch, 6, 1, 10, dtype=dtype, seed=81), fmt)
    qw, kw = weight_of(bshd_of(q, fmt), "all_heads", dtype, 82), weight_of(bshd_of(k, fmt), "per_head", dtype, 83)
    inv_freq = FQ.rope(8)[0]
    positions, cu_seqlens = positions_for(fmt, batch, 6, seed=84)
    args = (positions, inv_freq, 1e-6, "olmo2", 2.0, "neox", fmt, 1, cu_seqlens)
    expected = PF.qk_norm_rope(q, k, qw, kw, *args)
    a, b = q.clone(), k.clone()
    versions = a._version, b._version
    result = PF.qk_norm_rope_(a, b, qw, kw, *args)
    assert result[0] is a and result[1] is b
    assert same_bits(a, expected[0]) and same_bits(b, expected[1])
    assert a._version > versions[0] and b._version > versions[1]
    assert OPS.qk_norm_rope_(q.clone(), k.clone(), qw, kw, *args) is None


def test_inplace_trains_through_non_leaf_inputs_with_the_functional_gradients():
    q_leaf = randn(2, 4, 2, 8, dtype=F64, seed=85, requires_grad=True)
    k_leaf = randn(2, 4, 1, 8, dtype=F64, seed=86, requires_grad=True)
    qw = randn(8, dtype=F64, seed=87, requires_grad=True)
    kw = randn(8, dtype=F64, seed=88, requires_grad=True)
    inv_freq = FQ.rope(8)[0]
    grads = randn(2, 4, 2, 8, dtype=F64, seed=89), randn(2, 4, 1, 8, dtype=F64, seed=90)
    args = (None, inv_freq, 1e-6, "gemma", 0.7, "gptj", "bshd", 3)
    expected_out = PF.qk_norm_rope(q_leaf * 3, k_leaf + 1, qw, kw, *args)
    expected = torch.autograd.grad(expected_out, (q_leaf, k_leaf, qw, kw), grads)
    q, k = q_leaf * 3, k_leaf + 1
    PF.qk_norm_rope_(q, k, qw, kw, *args)
    assert q.grad_fn is not None and k.grad_fn is not None
    assert torch.equal(q, expected_out[0]) and torch.equal(k, expected_out[1])
    got = torch.autograd.grad((q, k), (q_leaf, k_leaf, qw, kw), grads)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # Only the weights requiring grad: q and k (plain tensors) get a history through the op.
    q, k = (q_leaf * 3).detach(), (k_leaf + 1).detach()
    PF.qk_norm_rope_(q, k, qw, kw, *args)
    got = torch.autograd.grad((q, k), (qw, kw), grads)
    assert torch.equal(got[0], expected[2]) and torch.equal(got[1], expected[3])


def test_inplace_refuses_a_leaf_that_requires_grad_and_stale_saved_tensors():
    inv_freq = FQ.rope(8)[0]
    leaf = randn(1, 3, 2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        PF.qk_norm_rope_(leaf, randn(1, 3, 2, 8), torch.ones(8), torch.ones(8), None, inv_freq)
    weight = randn(1, 3, 2, 8, requires_grad=True)
    x = randn(1, 3, 2, 8)
    y = x * weight  # saves x for weight's gradient
    PF.qk_norm_rope_(x, randn(1, 3, 2, 8), torch.ones(8), torch.ones(8), None, inv_freq)  # records no node
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inplace_refuses_the_same_tensor_twice_and_overlapping_elements():
    inv_freq, w = FQ.rope(8)[0], torch.ones(8)
    x = randn(1, 3, 2, 8)
    before = x.clone()
    with pytest.raises(RuntimeError, match="posenc.qk_norm_rope_: q and k may share elements"):
        PF.qk_norm_rope_(x, x, w, w, None, inv_freq)
    with pytest.raises(RuntimeError, match="posenc.qk_norm_rope_: q has elements that share memory"):
        PF.qk_norm_rope_(x[:, :1].expand(1, 3, 2, 8), x.clone(), w, w, None, inv_freq)
    assert torch.equal(x, before)


def test_inplace_refuses_partly_overlapping_q_and_k():
    buffer = randn(1, 3, 3, 8)
    q, k = buffer[:, :, 0:2], buffer[:, :, 1:3]  # head 1 of q is head 0 of k
    before = buffer.clone()
    with pytest.raises(RuntimeError, match="posenc.qk_norm_rope_: .*q and k"):
        PF.qk_norm_rope_(q, k, torch.ones(8), torch.ones(8), None, FQ.rope(8)[0])
    assert torch.equal(buffer, before)


# ---------------------------------------------------------------- query scale (Llama 4, Ministral 3)

@pytest.mark.parametrize("model", ["llama4", "ministral3"])
def test_q_scale_matches_the_models_formulas(model):
    """q normalized, rotated, then times the model's own scale (Llama 4's expression, Ministral 3's
    get_llama_4_attn_scale: test_rope's helpers); k normalized and rotated only, bit for bit."""
    q, k = randn(2, 4, 40, 16, seed=90), randn(2, 2, 40, 16, seed=91)
    qw, kw = weight_of(q, "per_head", seed=92), weight_of(k, "per_head", seed=93)
    positions = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(94))
    inv_freq = FQ.rope(16)[0]
    beta, length, shift, scale = model_q_scale(model, positions)
    args = (positions, inv_freq, 1e-6, "llama", 1.0, "neox", "bhsd", 0, None, None)
    out_q, out_k = PF.qk_norm_rope(q, k, qw, kw, *args, beta, length, shift)
    plain_q, plain_k = PF.qk_norm_rope(q, k, qw, kw, *args)
    assert_close(out_q, plain_q * scale, atol=1e-6, rtol=1e-6)
    assert same_bits(out_k, plain_k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_q_scale_against_the_float64_formula(fmt):
    """float64: the normalized rows rotated (composed) times s(positions + offset) for q, every format and position
    form (positions [B, S] with negative ones, [S], none with an offset, packed sequences), a weight over all heads
    for q; k unscaled."""
    batch = 1 if fmt == "thd" else 2
    q = randn(batch, 10, 2, 8, dtype=F64, seed=95)
    k = randn(batch, 10, 1, 8, dtype=F64, seed=96)
    qw, kw = weight_of(q, "all_heads", F64, 97), weight_of(k, "per_head", F64, 98)
    inv_freq = FQ.rope(8)[0]
    beta, length, shift, offset, cu_seqlens = 0.3, 3, 2, 0, None
    if fmt == "bshd":
        positions = torch.randint(-10, 5000, (batch, 10), generator=torch.Generator().manual_seed(99))
        positions[:, 0] = torch.tensor([-9, -3])
        absolute = positions
    elif fmt == "bhsd":
        positions = torch.arange(-6, 14, 2)
        absolute = positions[None]
    elif fmt == "sbhd":
        positions, offset = None, 7
        absolute = torch.arange(10)[None] + offset
    else:
        positions, offset, cu_seqlens = None, 1, torch.tensor([0, 4, 4, 10])
        absolute = torch.cat([torch.arange(4), torch.arange(6)])[None] + offset
    out_q, out_k = PF.qk_norm_rope(to_format(q, fmt), to_format(k, fmt), qw, kw, positions, inv_freq, 1e-6,
                                   "gemma", 0.7, "gptj", fmt, offset, cu_seqlens, None, beta, length, shift)
    pairs = absolute[..., None].expand(*absolute.shape, 4)
    scale = q_scale_formula(absolute, beta, length, shift)
    expected_q = composed(q, qw + 1, pairs, inv_freq, 1e-6, 0.7, "gptj") * scale[..., None, None]
    assert_close(from_format(out_q, fmt), expected_q, atol=1e-12, rtol=1e-12)
    expected_k = composed(k, kw + 1, pairs, inv_freq, 1e-6, 0.7, "gptj")
    assert_close(from_format(out_k, fmt), expected_k, atol=1e-12, rtol=1e-12)


def test_q_scale_is_one_at_and_below_minus_shift():
    q, k = randn(1, 6, 2, 8, seed=100), randn(1, 6, 1, 8, seed=101)
    w = weight_of(q, "per_head", seed=102)
    positions = torch.tensor([-1000, -50, -6, -5, -3, 0])  # shift 5, length 4: floor((p + 5) / 4) <= 0 but at 0
    out_q, _ = PF.qk_norm_rope(q, k, w, w, positions, FQ.rope(8)[0], 1e-6, "llama", 1.0, "neox", "bshd", 0, None,
                               None, 2.0, 4, 5)
    plain_q, _ = PF.qk_norm_rope(q, k, w, w, positions, FQ.rope(8)[0])
    assert same_bits(out_q[:, :5], plain_q[:, :5])
    assert_close(out_q[:, 5], plain_q[:, 5] * (1 + 2.0 * math.log(2)))


@pytest.mark.parametrize("norm", ["llama", "olmo2"])
def test_q_scale_gradcheck_and_the_backward_op(norm):
    """float64 gradcheck of q, k and both weights with beta != 0 (positions [B, S] and an offset, bshd; packed
    sequences, thd); qk_norm_rope_backward with the same arguments gives autograd's bits, and q's gradient (not
    k's) differs from the unscaled one."""
    settings = [
        ("bshd", (torch.tensor([[3, 40, 7], [-4, 11, 900]]), FQ.rope(6)[0], 1e-6, norm, 0.8, "gptj", "bshd", 2, None,
                  None, 0.4, 4, 1)),
        ("thd", (None, FQ.rope(6)[0], 1e-6, norm, 1.0, "neox", "thd", 3, torch.tensor([0, 1, 3]), None, 1.5, 2, 0)),
    ]
    for fmt, args in settings:
        batch = 1 if fmt == "thd" else 2
        q = to_format(f64(batch, 3, 2, 6, seed=103).detach(), fmt).requires_grad_()
        k = to_format(f64(batch, 3, 1, 6, seed=104).detach(), fmt).requires_grad_()
        qw, kw = f64(12, seed=105), f64(6, seed=106)

        def fn(q, k, qw, kw):
            return PF.qk_norm_rope(q, k, qw, kw, *args)

        assert torch.autograd.gradcheck(fn, (q, k, qw, kw))
        out = fn(q, k, qw, kw)
        grads = [randn(*o.shape, dtype=F64, seed=107 + i) for i, o in enumerate(out)]
        got = torch.autograd.grad(out, (q, k, qw, kw), grads)
        direct = PF.qk_norm_rope_backward(*grads, q.detach(), k.detach(), qw.detach(), kw.detach(), *args)
        assert all(same_bits(a, b) for a, b in zip(direct, got))
        unscaled = PF.qk_norm_rope_backward(*grads, q.detach(), k.detach(), qw.detach(), kw.detach(), *args[:10])
        assert not torch.allclose(direct[0], unscaled[0]) and same_bits(direct[1], unscaled[1])


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_q_scale_inplace_equals_the_functional_op(fmt):
    batch = 1 if fmt == "thd" else 2
    q = to_format(randn(batch, 6, 3, 8, dtype=torch.bfloat16, seed=110), fmt)
    k = to_format(randn(batch, 6, 1, 8, dtype=torch.bfloat16, seed=111), fmt)
    qw, kw = weight_of(bshd_of(q, fmt), "all_heads", seed=112), weight_of(bshd_of(k, fmt), "per_head", seed=113)
    positions, cu_seqlens = positions_for(fmt, batch, 6, seed=114)
    args = (positions, FQ.rope(8)[0], 1e-6, "llama", 1.0, "neox", fmt, 3, cu_seqlens, None, 0.5, 2, 1)
    expected = PF.qk_norm_rope(q, k, qw, kw, *args)
    assert not same_bits(expected[0], PF.qk_norm_rope(q, k, qw, kw, *args[:10])[0])
    a, b = q.clone(), k.clone()
    PF.qk_norm_rope_(a, b, qw, kw, *args)
    assert same_bits(a, expected[0]) and same_bits(b, expected[1])


QS, KS, WS = randn(2, 4, 3, 8, seed=115), randn(2, 4, 1, 8, seed=116), torch.ones(8)


@pytest.mark.parametrize("op_name", ["qk_norm_rope", "qk_norm_rope_backward", "qk_norm_rope_"])
@pytest.mark.parametrize("kwargs, message", Q_SCALE_REFUSALS)
def test_q_scale_bad_arguments(op_name, kwargs, message):
    kwargs = dict(kwargs)
    positions, inv_freq = kwargs.pop("positions", None), kwargs.pop("inv_freq", FQ.rope(8)[0])
    tensors = (QS, KS, QS.clone(), KS.clone(), WS, WS) if op_name == "qk_norm_rope_backward" else \
        (QS.clone(), KS.clone(), WS, WS)
    with pytest.raises(RuntimeError, match=rf"posenc\.{op_name}: {re.escape(message)}"):
        getattr(PF, op_name)(*tensors, positions, inv_freq, **kwargs)
    if "q_scale_length" not in kwargs and math.isfinite(kwargs["q_scale_beta"]):  # beta 0: the plain op
        getattr(PF, op_name)(*tensors, positions, inv_freq, **dict(kwargs, q_scale_beta=0.0))


# ---------------------------------------------------------------- opcheck, compile, export, TorchScript

def opcheck_samples():
    inv_freq = FQ.rope(6)[0]
    q = randn(2, 5, 3, 8, seed=91, requires_grad=True)
    k = randn(2, 5, 1, 8, seed=92, requires_grad=True)
    qw, kw = randn(24, seed=93, requires_grad=True), randn(8, seed=94, requires_grad=True)
    packed = randn(9, 2, 8, seed=95, requires_grad=True)
    yield "qk_norm_rope", OPS.qk_norm_rope.default, (q, k, qw, kw, torch.randint(0, 99, (2, 5)), inv_freq, 1e-6,
                                                     "gemma", 0.5, "gptj", "bshd", 3)
    yield "qk_norm_rope_thd", OPS.qk_norm_rope.default, (packed, packed, kw, kw, None, inv_freq, 1e-6, "llama", 1.0,
                                                         "neox", "thd", 0, torch.tensor([0, 4, 9]))
    q_t, k_t = q.detach().transpose(1, 2), k.detach().transpose(1, 2)  # bhsd views
    yield "qk_norm_rope_backward", OPS.qk_norm_rope_backward.default, (
        q_t * 0.5, k_t.flip(-1), q_t, k_t, qw.detach(), kw.detach(), None, inv_freq, 1e-6, "olmo2", 1.0, "neox", "bhsd")
    yield "qk_norm_rope_", OPS.qk_norm_rope_.default, (q.detach().clone(), k.detach().clone(), qw.detach(),
                                                       kw.detach(), None, inv_freq, 1e-6, "fused", 2.0, "gptj")


@pytest.mark.parametrize("sample", list(opcheck_samples()), ids=lambda s: s[0])
def test_opcheck(sample):
    _, op, args = sample
    torch.library.opcheck(op, args)


class NormRopeAttention(torch.nn.Module):
    """A Qwen3-style prologue: fused qkv projection, per-head q/k norms and rotary (GQA), scaled dot-product
    attention."""

    def __init__(self, heads=4, kv_heads=2, head_dim=8, norm="llama"):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.norm = heads, kv_heads, head_dim, norm
        self.qkv = torch.nn.Linear(16, (heads + 2 * kv_heads) * head_dim)
        self.q_norm = torch.nn.Parameter(torch.rand(head_dim) + 0.5)
        self.k_norm = torch.nn.Parameter(torch.rand(head_dim) + 0.5)
        self.register_buffer("inv_freq", FQ.rope(head_dim)[0], persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, self.head_dim).split([self.heads, self.kv_heads, self.kv_heads], 2)
        q, k = PF.qk_norm_rope(q, k, self.q_norm, self.k_norm, None, self.inv_freq, 1e-6, self.norm)
        k, v = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2).reshape(b, s, -1)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    model = NormRopeAttention(norm="gemma")
    compiled_matches_eager(model, [randn(2, 6, 16, seed=96)], [model.qkv.weight, model.q_norm, model.k_norm])


def test_compile_fullgraph_inplace():
    torch._dynamo.reset()
    inv_freq = FQ.rope(8)[0]
    w = torch.rand(8) + 0.5

    def f(x):
        q, k = x * 2, x[:, :, :1] - 1
        PF.qk_norm_rope_(q, k, w, w, None, inv_freq, 1e-6, "olmo2", 1.0, "gptj")
        return q + 1, k

    x = randn(2, 5, 3, 8, seed=97)
    for a, b in zip(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x)):
        assert torch.equal(a, b)


def test_export():
    model = NormRopeAttention()
    x = randn(2, 6, 16, seed=98)
    assert_exports(model, (x,), "qk_norm_rope")


@pytest.mark.filterwarnings("ignore:`torch.jit.save` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_torchscript_scripts_a_function_calling_the_op():
    def prologue(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 inv_freq: torch.Tensor):
        return torch.ops.posenc.qk_norm_rope(q, k, q_weight, k_weight, None, inv_freq, 1e-6, "olmo2", 1.0, "neox",
                                             "bshd", 4)

    scripted = torch.jit.script(prologue)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    q = randn(2, 5, 3, 8, seed=99, requires_grad=True)
    k = randn(2, 5, 1, 8, seed=100)
    qw, kw, inv_freq = torch.rand(24) + 0.5, torch.rand(8) + 0.5, FQ.rope(8)[0]
    expected = prologue(q, k, qw, kw, inv_freq)
    grad = randn(*q.shape, seed=101)
    expected_grad = torch.autograd.grad(expected[0], q, grad)[0]
    assert expected_grad.abs().sum() > 0
    for fn in (scripted, loaded):
        out = fn(q, k, qw, kw, inv_freq)
        assert all(torch.equal(a, b) for a, b in zip(out, expected))
        assert torch.equal(torch.autograd.grad(out[0], q, grad)[0], expected_grad)


# ---------------------------------------------------------------- bad input

Q, K = randn(2, 4, 3, 8), randn(2, 4, 1, 8)
W = torch.ones(8)
INV = FQ.rope(8)[0]


@pytest.mark.parametrize("call, message", [
    (lambda: PF.qk_norm_rope(Q, K, torch.ones(7), W, None, INV),
     r"posenc.qk_norm_rope: q_weight has shape \[7\] but needs \[8\] \(each head\) or \[24\] \(all heads of a "
     r"token\) for an input of shape \[2, 4, 3, 8\]"),
    (lambda: PF.qk_norm_rope(Q, K, W, torch.ones(24), None, INV), r"k_weight has shape \[24\] but needs \[8\]"),
    (lambda: PF.qk_norm_rope(Q, K, torch.ones(1, 8), W, None, INV), r"q_weight has shape \[1, 8\]"),
    (lambda: PF.qk_norm_rope(Q, K, W.long(), W, None, INV), "posenc.qk_norm_rope: q_weight must be a floating"),
    (lambda: PF.qk_norm_rope(Q, K, W, W, None, INV, norm="rms"),
     'posenc.qk_norm_rope: norm must be "llama", "gemma", "olmo2" or "fused", got "rms"'),
    (lambda: PF.qk_norm_rope(Q, K, W, W, None, INV, eps=-1e-6), "posenc.qk_norm_rope: eps must be finite and >= 0"),
    (lambda: PF.qk_norm_rope(Q, K, W, W, None, INV, eps=float("nan")), "eps must be finite and >= 0, got nan"),
    (lambda: PF.qk_norm_rope(Q, K.double(), W, W, None, INV), "posenc.qk_norm_rope: k is Double but q is Float"),
    (lambda: PF.qk_norm_rope(Q, K, W, W, None, FQ.rope(10)[0]), "rotary_dim 10 exceeds the head_dim 8"),
    (lambda: PF.qk_norm_rope_backward(Q[:, :, :2], K, Q, K, W, W, None, INV),
     r"posenc.qk_norm_rope_backward: grad_q has shape \[2, 4, 2, 8\] but q has shape \[2, 4, 3, 8\]"),
    (lambda: PF.qk_norm_rope_backward(Q, K, Q.double(), K, W, W, None, INV),
     "posenc.qk_norm_rope_backward: q is Double but grad_q is Float"),
    (lambda: PF.qk_norm_rope_backward(Q, K, Q, K, W, W, None, INV, norm="Gemma"), 'got "Gemma"'),
    (lambda: PF.qk_norm_rope_(Q.clone(), K.clone(), W, W.to("meta"), None, INV), "posenc.qk_norm_rope_: k_weight"),
])
def test_bad_input_messages(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_bad_input_meta_matches_cpu():
    q = torch.empty(2, 4, 3, 8, device="meta")
    with pytest.raises(RuntimeError, match=r"posenc.qk_norm_rope: q_weight has shape \[5\]"):
        PF.qk_norm_rope(q, q, torch.ones(5, device="meta"), torch.ones(8, device="meta"), None, INV.to("meta"))


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (which imports this file to find
# them): each op's sample call (op_registry.SAMPLES: determinism, concurrency, no_grad, CUDA and CPU-capability
# tests), its hypothesis property (test_properties.py) and its bad-input cases (bad_input_fuzzer.py).

# ---- sample calls
# Large: [2, 512, 8 | 2, 128] (GQA) with Llama 3 frequencies and positions [B, S] up to 1e5; small: partial rotary
# (65 pairs in 134 channels; the in-place op: M-RoPE), the four formats and every convention between the ops,
# per-head and over-heads weights, views, packed sequences.

def _frequencies(m):
    if m.large:
        return FQ.rope(128, 500000.0, {"rope_type": "llama3", "factor": 8.0})[0]
    return FQ.rope(130, 500.0)[0]


def _large(m, seed, q_weight_size, k_weight_size):
    q, k = m.floats(2, 512, 8, 128, seed=seed), m.floats(2, 512, 2, 128, seed=seed + 1)
    q_weight, k_weight = m.floats(q_weight_size, seed=seed + 2), m.floats(k_weight_size, seed=seed + 3)
    return q, k, q_weight, k_weight, m.ints(100000, 2, 512, seed=seed + 4), _frequencies(m)


@sample("qk_norm_rope")
def _build_qk_norm_rope(m):
    """Large: "llama", per-head weights. Small: OLMo 2 ("olmo2", weights over all heads), q and k as bhsd views
    (transposed bshd data), positions absent, offset 5, gptj, attention scale 0.9."""
    if m.large:
        q, k, qw, kw, positions, inv_freq = _large(m, 110, 128, 128)
        return call_args(m.grad(q), m.grad(k), m.grad(qw), m.grad(kw), positions, inv_freq)
    q = m.grad(m.floats(2, 8, 4, 134, seed=110).transpose(1, 2))
    k = m.grad(m.floats(2, 8, 2, 134, seed=111).transpose(1, 2))
    qw, kw = m.grad(m.floats(4 * 134, seed=112)), m.grad(m.floats(2 * 134, seed=113))
    return call_args(q, k, qw, kw, None, _frequencies(m), 1e-6, "olmo2", 0.9, "gptj", "bhsd", 5)


@sample("qk_norm_rope_backward")
def _build_qk_norm_rope_backward(m):
    """Not differentiable (no inputs). Large: "fused", q's weight over all heads. Small: "gemma", thd packed
    sequences (an empty one among them), positions absent, offset 1, grad_q a channel-strided view, q's weight per
    head and k's over all heads, eps 1e-5."""
    if m.large:
        q, k, qw, kw, positions, inv_freq = _large(m, 120, 8 * 128, 128)
        grad_q, grad_k = m.floats(2, 512, 8, 128, seed=125), m.floats(2, 512, 2, 128, seed=126)
        return call_args(grad_q, grad_k, q, k, qw, kw, positions, inv_freq, 1e-6, "fused")
    grad_q = m.floats(16, 4, 268, seed=120)[..., ::2]
    grad_k = m.floats(16, 2, 134, seed=121)
    q, k = m.floats(16, 4, 134, seed=122), m.floats(16, 2, 134, seed=123)
    qw, kw = m.floats(134, seed=124), m.floats(2 * 134, seed=125)
    return call_args(grad_q, grad_k, q, k, qw, kw, None, _frequencies(m), 1e-5, "gemma", 1.0, "neox", "thd", 1,
                     torch.tensor([0, 5, 5, 16]))


@sample("qk_norm_rope_")
def _build_qk_norm_rope_(m):
    """Large: "gemma", k's weight over all heads. Small: "llama", sbhd, multi-axis (M-RoPE sections [8, 12, 12] of
    64-channel heads, positions [3, B, S]), offset 3, per-head weights."""
    if m.large:
        q, k, qw, kw, positions, inv_freq = _large(m, 130, 128, 2 * 128)
        return call_args(m.grad(q), m.grad(k), m.grad(qw), m.grad(kw), positions, inv_freq, 1e-6, "gemma")
    q, k = m.grad(m.floats(16, 2, 4, 64, seed=130)), m.grad(m.floats(16, 2, 2, 64, seed=131))
    qw, kw = m.grad(m.floats(64, seed=132)), m.grad(m.floats(64, seed=133))
    inv_freq, pair_axis = FQ.mrope(64, [8, 12, 12])
    return call_args(q, k, qw, kw, m.ints(100000, 3, 2, 16, seed=134), inv_freq, 1e-6, "llama", 1.0, "neox", "sbhd",
                     3, None, pair_axis)


# ---- properties: random valid inputs against the float64 references (test_properties.py)

def norm_weight(draw, gen, x_bshd, dtype):
    """A weight of x, per head [D] or over all heads [H * D], in the data's dtype or another floating one (a
    float32 weight beside bf16 data: mixed precision), around 1 with both signs among its values, laid out at
    random."""
    size = x_bshd.shape[-1] * (x_bshd.shape[-2] if draw(st.booleans()) else 1)
    weight_dtype = draw(st.sampled_from([dtype, dtype, torch.float32, torch.float64]))
    values = normal(gen, [size], F64, draw(st.sampled_from([0.1, 1.0]))) + draw(st.sampled_from([0.0, 1.0]))
    return arrange(draw, values.to(weight_dtype), expand=False)


def scaled_input(draw, gen, fmt, batch, seq, pairs, dtype, expand):
    """q or k (rope_input): its own head count and head_dim (at least the rotary channels), values of a magnitude
    from 1e-3 (a mean square as large as eps) to 30."""
    heads, head_dim = draw(st.integers(0, 3)), 2 * pairs + draw(st.integers(0, 3))
    scale = draw(st.sampled_from([1.0, 1e-3, 30.0]))
    x, x_bshd = rope_input(draw, gen, fmt, batch, seq, heads, head_dim, dtype, expand)
    with torch.no_grad():
        buffer_of(x).mul_(scale)  # the whole storage (poison stays NaN): a view's values scale with it
    return x, x_bshd


def qk_norm_case(draw, expand=True, grads=False):
    gen = generator(draw)
    fmt = draw(st.sampled_from(ROPE_FORMATS))
    batch = 1 if fmt == "thd" else draw(st.integers(0, 3))
    seq, pairs = draw(st.integers(0, 5)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    case = dict(fmt=fmt, dtype=dtype, pairs=pairs, inv_freq=frequencies(draw, pairs))
    for name in ("q", "k"):
        case[name], case[name + "_bshd"] = scaled_input(draw, gen, fmt, batch, seq, pairs, dtype, expand)
        case[name + "_weight"] = norm_weight(draw, gen, case[name + "_bshd"], dtype)
        if grads:
            case["grad_" + name], case["grad_" + name + "_bshd"] = rope_input(
                draw, gen, fmt, batch, seq, *case[name + "_bshd"].shape[2:], dtype, expand)
    positions, offset, cu_seqlens, pair_axis, absolute = rope_positions(draw, gen, fmt, batch, seq, pairs)
    case.update(positions=positions, offset=offset, cu_seqlens=cu_seqlens, pair_axis=pair_axis, absolute=absolute,
                eps=draw(st.sampled_from([1e-6, 1e-5, 0.0, 0.25])), norm=draw(st.sampled_from(NORMS)),
                scale=draw(st.sampled_from([1.0, 0.5, 1.25])), layout=draw(st.sampled_from(["neox", "gptj"])))
    note(f"{fmt} {dtype} q {list(case['q'].shape)} stride {case['q'].stride()} weight {list(case['q_weight'].shape)} "
         f"{case['q_weight'].dtype}, k {list(case['k'].shape)} weight {list(case['k_weight'].shape)} "
         f"{case['k_weight'].dtype}, {case['norm']} eps {case['eps']}, positions "
         f"{None if positions is None else (positions.dtype, list(positions.shape))}, offset {offset}, cu_seqlens "
         f"{cu_seqlens}, pair_axis {None if pair_axis is None else pair_axis.tolist()}")
    return case


def case_arguments(case):
    return (case["q_weight"], case["k_weight"], case["positions"], case["inv_freq"], case["eps"], case["norm"],
            case["scale"], case["layout"], case["fmt"], case["offset"], case["cu_seqlens"], case["pair_axis"])


def check_case_output(out, case, name):
    x_bshd = case[name + "_bshd"]
    assert out.dtype == case["dtype"] and out.shape == case[name].shape and out.is_contiguous()
    expected, tolerance = reference(x_bshd, case[name + "_weight"], case["absolute"], case["inv_freq"], case["eps"],
                                    case["norm"], case["scale"], case["layout"], case["dtype"])
    assert_rounds_within(bshd_of(out, case["fmt"]), expected, tolerance)


@property_check("qk_norm_rope")
@given(st.data())
def check_qk_norm_rope(data):
    case = qk_norm_case(data.draw)
    q_out, k_out = call("qk_norm_rope", case["q"], case["k"], *case_arguments(case))
    check_case_output(q_out, case, "q")
    check_case_output(k_out, case, "k")


@property_check("qk_norm_rope_backward")
@given(st.data())
def check_qk_norm_rope_backward(data):
    case = qk_norm_case(data.draw, grads=True)
    out = call("qk_norm_rope_backward", case["grad_q"], case["grad_k"], case["q"], case["k"], *case_arguments(case))
    for name, grad_x, grad_w in (("q", out[0], out[2]), ("k", out[1], out[3])):
        assert grad_x.dtype == case["dtype"] and grad_x.shape == case[name].shape and grad_x.is_contiguous()
        assert grad_w.dtype == case[name + "_weight"].dtype and grad_w.shape == case[name + "_weight"].shape
        ref_x, tol_x, ref_w, tol_w = backward_reference(case[name + "_bshd"], case["grad_" + name + "_bshd"],
                                                        case[name + "_weight"], case["absolute"], case["inv_freq"],
                                                        case["eps"], case["norm"], case["scale"], case["layout"],
                                                        case["dtype"])
        assert_rounds_within(bshd_of(grad_x, case["fmt"]), ref_x, tol_x)
        assert_rounds_within(grad_w, ref_w, tol_w)


@property_check("qk_norm_rope_")
@given(st.data())
def check_qk_norm_rope_inplace(data):
    """In place: the functional op's bits in q and k, and nothing written outside them."""
    case = qk_norm_case(data.draw, expand=False)
    q, k = case["q"], case["k"]
    expected = OPS.qk_norm_rope(q, k, *case_arguments(case))
    buffers = [buffer_of(q), buffer_of(k)]
    before = [b.clone() for b in buffers]
    assert OPS.qk_norm_rope_(q, k, *case_arguments(case)) is None
    assert same_bits(q, expected[0], any_nan=True) and same_bits(k, expected[1], any_nan=True)
    for x, storage, old in zip((q, k), buffers, before):
        outside = torch.ones(storage.numel(), dtype=torch.bool)
        outside[covered_offsets(x)] = False
        assert same_bits(storage[outside], old[outside]), "wrote outside the view"


# ---- bad inputs: a small valid call of each op, and the mutations that each make one argument wrong

def qk_norm_common(draw, names):
    """q and k (or their gradients too) of their own head counts and head_dims, weights per head or over all
    heads."""
    pairs, batch, seq = small(draw), small(draw), small(draw)
    kw = {}
    for name in ("q", "k"):
        heads, head_dim = small(draw), 2 * pairs + small(draw, 0, 2)
        kw[name] = randn(batch, seq, heads, head_dim)
        kw[name + "_weight"] = torch.ones(head_dim * (heads if draw(st.booleans()) else 1))
        if "grad_" + name in names:
            kw["grad_" + name] = randn(batch, seq, heads, head_dim, seed=1)
    ordered = {name: kw[name] for name in names}
    ordered.update(q_weight=kw["q_weight"], k_weight=kw["k_weight"], positions=None,
                   inv_freq=torch.rand(pairs, dtype=F64), eps=1e-6, norm="llama", attention_scale=1.0, layout="neox",
                   format="bshd", offset=0, cu_seqlens=None)
    return ordered


def qk_norm_rope(draw):
    return qk_norm_common(draw, ["q", "k"])


def qk_norm_rope_backward(draw):
    return qk_norm_common(draw, ["grad_q", "grad_k", "q", "k"])


def qk_norm_rope_inplace(draw):
    return qk_norm_common(draw, ["q", "k"])


def weight_wrong_size(arg):
    """One entry more or fewer than [D] or [H * D] (neither: D + 1 = H * D would need D = 1)."""
    def mutate(draw, kw):
        by = draw(st.sampled_from([1, -1])) if kw[arg].numel() > 1 else 1
        grow(arg, 0, by)(draw, kw)
    return mutate


def same_tensor_twice(draw, kw):
    kw["k"], kw["k_weight"] = kw["q"], kw["q_weight"]


def norm_mutations(names, inplace=False):
    out = rope_mutations(names, inplace)
    out.update({
        "q_weight_wrong_size": weight_wrong_size("q_weight"),
        "k_weight_wrong_size": weight_wrong_size("k_weight"),
        "q_weight_wrong_rank": wrong_rank("q_weight", [0, 2]),
        "k_weight_not_floating": not_floating("k_weight"),
        "q_weight_on_meta": on_meta("q_weight"),
        "norm_unknown": unknown_string("norm", set(NORMS)),
        "eps_invalid": set_value("eps", st.sampled_from([-1e-6, -1.0, float("nan"), float("inf"), -float("inf")])),
    })
    if inplace:
        out["same_tensor_twice"] = same_tensor_twice
        out["k_overlapping"] = overlapping("k")
    return out


BACKWARD_MUTATIONS = norm_mutations(["grad_q", "grad_k"])
BACKWARD_MUTATIONS.update({
    "q_other_dtype": to_dtype("q", torch.float64, torch.bfloat16),
    "grad_q_other_heads": grow("grad_q", 2),
    "grad_k_other_head_dim": grow("grad_k", 3),
})

bad_inputs("qk_norm_rope", base=qk_norm_rope, mutations=norm_mutations(["q", "k"]))
bad_inputs("qk_norm_rope_backward", base=qk_norm_rope_backward, mutations=BACKWARD_MUTATIONS)
bad_inputs("qk_norm_rope_", base=qk_norm_rope_inplace, mutations=norm_mutations(["q", "k"], inplace=True))


# ---------------------------------------------------------------- a fused QKV projection

def packed_case(fmt, dtype=torch.float32):
    """qkv of 3 q heads, 1 kv head, head_dim 8, in a token-major format, with its positions."""
    shape = {"bshd": (2, 6), "sbhd": (6, 2), "thd": (7,)}[fmt]
    qkv = randn(*shape, (3 + 2) * 8, dtype=dtype, seed=120)
    positions, cu_seqlens = (None, torch.tensor([0, 3, 7])) if fmt == "thd" else (torch.randint(0, 99, (2, 6)), None)
    return qkv, positions, cu_seqlens


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("inplace", [False, True])
def test_packed_equals_the_op_on_the_slices_and_leaves_v(fmt, inplace):
    qkv, positions, cu_seqlens = packed_case(fmt, torch.bfloat16)
    if fmt == "sbhd":
        positions = positions.T.contiguous().T  # [B, S] whatever the format
    qw, kw = randn(8, seed=121) * 0.5 + 1, randn(8, seed=122) * 0.5 + 1
    inv_freq = FQ.rope(8)[0]
    before = qkv.clone()
    heads = before.unflatten(-1, (5, 8))
    want_q, want_k = PF.qk_norm_rope(heads[..., :3, :], heads[..., 3:4, :], qw, kw, positions, inv_freq, 1e-6,
                                     "gemma", 1.0, "gptj", fmt, 2, cu_seqlens)
    q, k, v = PF.qk_norm_rope_packed(qkv, 3, 1, qw, kw, positions, inv_freq, 1e-6, "gemma", 1.0, "gptj", fmt, 2,
                                     cu_seqlens, None, inplace=inplace)
    assert same_bits(q, want_q) and same_bits(k, want_k)
    assert v.data_ptr() == qkv.data_ptr() + 4 * 8 * qkv.element_size() and torch.equal(v, heads[..., 4:, :])
    if inplace:  # q and k are qkv's own memory, rewritten; v's columns untouched
        assert q.data_ptr() == qkv.data_ptr() and torch.equal(qkv.unflatten(-1, (5, 8))[..., :3, :], want_q)
        assert torch.equal(qkv[..., 32:], before[..., 32:])
    else:
        assert torch.equal(qkv, before)


def test_packed_gradients_reach_qkv():
    qkv, positions, _ = packed_case("bshd")
    qkv.requires_grad_()
    qw, kw = randn(8, seed=123, requires_grad=True), randn(8, seed=124, requires_grad=True)
    inv_freq = FQ.rope(8)[0]
    q, k, v = PF.qk_norm_rope_packed(qkv, 3, 1, qw, kw, positions, inv_freq)
    cotangent = [randn(*t.shape, seed=125 + i) for i, t in enumerate((q, k, v))]
    got = torch.autograd.grad([q, k, v], [qkv, qw, kw], cotangent)
    detached = qkv.detach().clone().requires_grad_()
    heads = detached.unflatten(-1, (5, 8))
    q2, k2 = PF.qk_norm_rope(heads[..., :3, :], heads[..., 3:4, :], qw, kw, positions, inv_freq)
    want = torch.autograd.grad([q2, k2, heads[..., 4:, :]], [detached, qw, kw], cotangent)
    assert all(same_bits(a, b) for a, b in zip(got, want))


def test_packed_refuses_a_width_or_format_it_cannot_split():
    qkv, _, _ = packed_case("bshd")
    w, inv_freq = torch.ones(8), FQ.rope(8)[0]
    with pytest.raises(ValueError, match=r"posenc.qk_norm_rope_packed: qkv's last size 40 must be .* "
                                         r"num_q_heads=2, num_kv_heads=2"):
        PF.qk_norm_rope_packed(qkv, 2, 2, w, w, None, inv_freq)
    with pytest.raises(ValueError, match='posenc.qk_norm_rope_packed: format must be .* got "bhsd"'):
        PF.qk_norm_rope_packed(qkv, 3, 1, w, w, None, inv_freq, format="bhsd")


def test_packed_exports_and_scripts():
    class Prologue(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_weight, self.k_weight = torch.nn.Parameter(torch.rand(8) + 0.5), torch.nn.Parameter(torch.rand(8))
            self.register_buffer("inv_freq", FQ.rope(8)[0])

        def forward(self, qkv):
            q, k, v = PF.qk_norm_rope_packed(qkv, 3, 1, self.q_weight, self.k_weight, None, self.inv_freq)
            return q.sum(-2) + k.sum(-2) + v.sum(-2)

    qkv, model = packed_case("bshd")[0], Prologue()
    want = model(qkv)
    assert want.shape == (2, 6, 8)
    exported = torch.export.export(model, (qkv,))
    assert same_bits(exported.module()(qkv), want)
    assert any("qk_norm_rope" in str(node.target) for node in exported.graph.nodes)
    assert same_bits(torch.jit.script(model)(qkv), want)


# ---------------------------------------------------------------- the example of docs/qk_norm.md

DOC = Path(__file__).resolve().parents[2] / "docs" / "qk_norm.md"


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", DOC.read_text()))))
def test_docs_examples_run(index):
    """Every Python block of the page runs as pasted (its asserts compare with Hugging Face's modules)."""
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[index]
    exec(compile(block, f"{DOC.name}[{index}]", "exec"), {})
