"""Under torch.autocast("cpu", dtype=torch.bfloat16) every posenc op behaves as the PyTorch expression nearest to
it does under autocast: the same result dtypes, close values (and equal to the op outside autocast where autocast
leaves it alone). The expressions are written here from their formulas."""
import pytest
import torch
import torch.nn.functional as F

import op_registry
import posenc
from posenc import functional as PF

BF16 = torch.bfloat16


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def cos_sin(positions, inv_freq, dtype):
    """Hugging Face's tables, in the dtype of the rotated tensor (as its rotary module returns them)."""
    angles = positions.double()[:, None] * inv_freq
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def assert_matches(ours, nearest, atol):
    ours = ours if isinstance(ours, tuple) else (ours,)
    nearest = nearest if isinstance(nearest, tuple) else (nearest,)
    assert [t.dtype for t in ours] == [t.dtype for t in nearest]
    for a, b in zip(ours, nearest):
        # bf16: one rounding apart at most (bf16 keeps 8 bits, a relative step of 2^-8 = 3.9e-3).
        torch.testing.assert_close(a.double(), b.double(), atol=atol[a.dtype], rtol=RTOL[a.dtype])


TOL = {BF16: 5e-2, torch.float32: 1e-5}
RTOL = {BF16: 2 ** -7, torch.float32: 0.0}
S, D = 6, 16
POSITIONS = torch.arange(S)
INV_FREQ = posenc.frequencies.rope(D)[0]
SIN_FREQ = posenc.frequencies.sinusoidal(D)


def rope_nearest(x, sign=1):
    cos, sin = cos_sin(POSITIONS, INV_FREQ, x.dtype)
    return x * cos[:, None] + sign * rotate_half(x) * sin[:, None]  # x [B, S, H, D]; sign -1: the backward


def sinusoidal_table(dtype=torch.float32):
    angles = POSITIONS.double()[:, None] * SIN_FREQ
    return torch.stack([angles.sin(), angles.cos()], -1).flatten(-2).to(dtype)  # interleaved


def cases():
    """(name, our call, the nearest PyTorch expression): both run under autocast."""
    x16, x32 = torch.randn(2, S, 3, D, dtype=BF16), torch.randn(2, S, 3, D)
    yield "rope bf16", lambda: PF.rope(x16, None, INV_FREQ), lambda: rope_nearest(x16)
    yield "rope fp32 stays fp32", lambda: PF.rope(x32, None, INV_FREQ), lambda: rope_nearest(x32)
    yield "rope_backward", lambda: PF.rope_backward(x16, None, INV_FREQ), lambda: rope_nearest(x16, -1)
    # q and k of different dtypes: each rotation in its own dtype, as two elementwise expressions give.
    yield "rope_qk mixed", lambda: PF.rope_qk(x16, x32[:, :, :1], None, INV_FREQ), lambda: (
        rope_nearest(x16), rope_nearest(x32[:, :, :1]))
    yield "rope_qk bf16", lambda: PF.rope_qk(x16, x16[:, :, :1], None, INV_FREQ), lambda: (
        rope_nearest(x16), rope_nearest(x16[:, :, :1]))
    cos32, sin32 = cos_sin(POSITIONS, INV_FREQ, torch.float32)
    yield "rope_cos_sin bf16 x, fp32 tables", lambda: PF.rope_cos_sin(x16, cos32, sin32), lambda: rope_nearest(x16)
    width = torch.randn(2, S, D, dtype=BF16)
    yield "add_sinusoidal", lambda: PF.add_sinusoidal(width, None, SIN_FREQ, 2.0), lambda: (
        width * 2.0 + sinusoidal_table(BF16))
    tokens, table32 = torch.randint(0, 11, (2, S)), torch.randn(11, D)
    yield "embed_sinusoidal", lambda: PF.embed_sinusoidal(tokens, table32, None, SIN_FREQ, 3.0), lambda: (
        F.embedding(tokens, table32) * 3.0 + sinusoidal_table())
    yield "sinusoidal", lambda: PF.sinusoidal(POSITIONS, SIN_FREQ), lambda: sinusoidal_table()
    wpe32, wpe16 = torch.randn(S + 2, D), torch.randn(S + 2, D, dtype=BF16)
    # x + embedding(weight): torch.add promotes bf16 + fp32 to fp32.
    yield "add_learned bf16 x, fp32 table", lambda: PF.add_learned(width, wpe32), lambda: (
        width + F.embedding(POSITIONS, wpe32))
    yield "add_learned bf16", lambda: PF.add_learned(width, wpe16, None, 2), lambda: (
        width + F.embedding(POSITIONS + 2, wpe16))
    yield "embed_learned fp32 tokens, bf16 positions", lambda: PF.embed_learned(tokens, table32, wpe16), lambda: (
        F.embedding(tokens, table32) + F.embedding(POSITIONS, wpe16))
    yield "learned", lambda: PF.learned(wpe32, POSITIONS), lambda: F.embedding(POSITIONS, wpe32)
    q, k = torch.randn(4, S, 8), torch.randn(4, S, 8)  # [B * H, S, d], BLOOM's shapes
    slopes = PF.alibi_slopes(4)
    bias = PF.alibi_bias(slopes, S, S, "causal")[0]  # [H, Q, K] float32
    # BLOOM adds its bias inside baddbmm, which autocast runs in bf16; ours adds it to the bf16 scores.
    yield "add_alibi on autocast scores", lambda: PF.add_alibi(torch.bmm(q, k.transpose(1, 2))[None], slopes), lambda: (
        torch.baddbmm(bias, q, k.transpose(1, 2))[None])
    yield "alibi_bias", lambda: PF.alibi_bias(slopes, S, S), lambda: (
        -slopes[:, None, None] * (torch.arange(S)[:, None] - torch.arange(S)[None, :]).float())[None]
    t5_table = torch.randn(16, 4)
    buckets = PF.relative_position_bucket(torch.arange(S)[None, :] - torch.arange(S)[:, None], True, 16, 20)
    yield "t5_bias", lambda: PF.t5_bias(t5_table, S, S, True, 16, 20), lambda: (
        F.embedding(buckets, t5_table).permute(2, 0, 1)[None])


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: c[0])
def test_dtypes_and_values_match_the_nearest_pytorch_expression(case):
    _, ours, nearest = case
    with autocast():
        result, expected = ours(), nearest()
    assert_matches(result, expected, TOL)


@pytest.mark.parametrize("case", [c for c in cases() if c[0] not in (
    "add_learned bf16 x, fp32 table", "embed_learned fp32 tokens, bf16 positions", "rope_qk mixed",
    "add_alibi on autocast scores")], ids=lambda c: c[0])
def test_ops_that_autocast_leaves_alone_give_the_same_bits(case):
    _, ours, _ = case
    with autocast():
        inside = ours()
    outside = ours()
    for a, b in zip(inside if isinstance(inside, tuple) else (inside,), outside if isinstance(outside, tuple) else (outside,)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_promoted_ops_equal_the_op_on_promoted_inputs():
    x, weight = torch.randn(2, S, D, dtype=BF16), torch.randn(S, D)
    with autocast():
        inside = PF.add_learned(x, weight)
    assert torch.equal(inside, PF.add_learned(x.float(), weight))
    with pytest.raises(RuntimeError, match="posenc.add_learned"):
        PF.add_learned(x, weight)  # outside autocast the op asks for one dtype, as before


def test_gradients_under_autocast_match_the_nearest_expression():
    x = torch.randn(2, S, D, dtype=BF16, requires_grad=True)
    weight = torch.randn(S + 1, D, requires_grad=True)
    upstream = torch.randn(2, S, D)
    with autocast():
        ours = PF.add_learned(x, weight, None, 1)
        nearest = x + F.embedding(POSITIONS + 1, weight)
    ours_grads = torch.autograd.grad(ours, (x, weight), upstream)
    nearest_grads = torch.autograd.grad(nearest, (x, weight), upstream)
    for a, b in zip(ours_grads, nearest_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    q = torch.randn(1, S, 2, D, dtype=BF16, requires_grad=True)
    k = torch.randn(1, S, 1, D, requires_grad=True)
    with autocast():
        out_q, out_k = PF.rope_qk(q, k, None, INV_FREQ)
    grad_q, grad_k = torch.autograd.grad((out_q, out_k), (q, k), (torch.ones_like(out_q), torch.ones_like(out_k)))
    assert (grad_q.dtype, grad_k.dtype) == (BF16, torch.float32)
    assert torch.equal(grad_k, PF.rope_backward(torch.ones_like(out_k), None, INV_FREQ))


def test_a_linear_then_rope_under_autocast():
    """The common path: projections run in bf16 under autocast, the rotation keeps their dtype."""
    projection = torch.nn.Linear(D, 2 * D)
    hidden = torch.randn(2, S, D)
    rotary = posenc.nn.RotaryEmbedding(D)
    with autocast():
        q, k = projection(hidden).view(2, S, 2, D).unbind(2)
        out_q, out_k = rotary(q[:, :, None], k[:, :, None])
    assert out_q.dtype == out_k.dtype == BF16
    assert torch.equal(out_q, PF.rope(q[:, :, None], None, rotary.inv_freq))


def test_every_op_has_an_autocast_policy():
    """Each registered op has a kernel for AutocastCPU and AutocastCUDA, so a new op needs a decision."""
    for op in op_registry.ops():
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"posenc::{op}", key), (op, key)
