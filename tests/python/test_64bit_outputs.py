"""64-bit indexing at full size: real outputs of more than 2^31 bf16 elements (4 GiB) from every op that writes a
floating tensor, with the values at the far end checked against the op run on that slice alone and against
float64 formulas. Integer outputs (int64: 16 GiB at 2^31 elements) are left out.

Collected only with POSENC_BIG_TESTS=1 (conftest.py): up to 9 GiB of memory at peak (add_sinusoidal and
add_learned of an expanded x: its contiguous copy plus the output) and a few minutes.
"""
import functools
import math
import os

import pytest
import torch

import helpers
from helpers import same_bits
from posenc import functional as PF

if os.environ.get("POSENC_BIG_TESTS") != "1":  # named on the command line without the variable
    pytest.skip("set POSENC_BIG_TESTS=1 to run the 4 GiB tests", allow_module_level=True)

BF16 = torch.bfloat16
F64 = torch.float64
randn = functools.partial(helpers.randn, dtype=BF16)


ROWS = 2 ** 31 // (1024 * 128) + 1  # rows of a [ROWS, 1024, 128] output: 2^31 + 2^17 elements
ROPE_BATCH = 2 ** 31 // (1024 * 16 * 128) + 1  # a [ROPE_BATCH, 1024, 16, 128] output: 2^31 + 2^21 elements


def assert_far_end(out, reference_of_slice, slices):
    """The last rows of a big output equal the op run on those rows alone, bit for bit."""
    assert out.numel() > 2 ** 31
    assert same_bits(out[slices], reference_of_slice)


def test_big_sinusoidal():
    positions = torch.arange(2 ** 22 + 1) * 3 - 5
    inv_freq = torch.logspace(0, -4, 256, dtype=F64)
    out = PF.sinusoidal(positions, inv_freq, "interleaved", BF16)
    assert_far_end(out, PF.sinusoidal(positions[-3:], inv_freq, "interleaved", BF16), slice(-3, None))
    angle = positions[-1].double() * inv_freq
    expected = torch.stack([angle.sin(), angle.cos()], -1).flatten()
    torch.testing.assert_close(out[-1].double(), expected, atol=4e-3, rtol=0)


@pytest.mark.parametrize("op", ["rope", "rope_backward", "rope_cos_sin", "rope_cos_sin_backward"])
def test_big_rope(op):
    """x expanded over heads from [ROPE_BATCH, 1024, 1, 128] (256 MiB); the output is 4 GiB of bf16."""
    base = randn(ROPE_BATCH, 1024, 1, 128)
    x = base.expand(ROPE_BATCH, 1024, 16, 128)
    positions = (torch.arange(ROPE_BATCH)[:, None] * 7 + torch.arange(1024)) % 100003
    inv_freq = torch.logspace(0, -4, 64, dtype=F64)
    cos, sin = randn(1024, 128, dtype=torch.float32, seed=1), randn(1024, 128, dtype=torch.float32, seed=2)
    calls = {
        "rope": lambda t, p: PF.rope(t, p, inv_freq),
        "rope_backward": lambda t, p: PF.rope_backward(t, p, inv_freq),
        "rope_cos_sin": lambda t, p: PF.rope_cos_sin(t, cos, sin),
        "rope_cos_sin_backward": lambda t, p: PF.rope_cos_sin_backward(t, cos, sin),
    }
    out = calls[op](x, positions)
    tail = calls[op](x[-2:].contiguous(), positions[-2:])
    assert_far_end(out, tail, slice(-2, None))
    if op == "rope":
        angle = positions[-1, -1].double() * inv_freq
        x1, x2 = base[-1, -1, 0, :64].double(), base[-1, -1, 0, 64:].double()
        expected = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()])
        torch.testing.assert_close(out[-1, -1, -1].double(), expected, atol=3e-2, rtol=1e-2)


def test_big_rope_qk_and_backward():
    q, k_base = randn(ROPE_BATCH, 1024, 1, 128), randn(ROPE_BATCH, 1024, 1, 128, seed=1)
    k = k_base.expand(ROPE_BATCH, 1024, 16, 128)  # k's output is the big one
    inv_freq = torch.logspace(0, -4, 64, dtype=F64)
    for op in (PF.rope_qk, PF.rope_qk_backward):
        q_out, k_out = op(q, k, None, inv_freq, 1.0, "neox", "bshd", 11)
        del q_out
        q_tail, k_tail = op(q[-2:], k[-2:].contiguous(), None, inv_freq, 1.0, "neox", "bshd", 11)
        assert_far_end(k_out, k_tail, slice(-2, None))
        del k_out


def test_big_rope_inplace():
    x = torch.empty(ROPE_BATCH, 1024, 16, 128, dtype=BF16)
    x.copy_(randn(ROPE_BATCH, 1024, 1, 128).expand_as(x))
    positions = torch.arange(1024) * 13
    inv_freq = torch.logspace(0, -4, 64, dtype=F64)
    tail = x[-2:].clone()
    PF.rope_(tail, positions, inv_freq)
    PF.rope_(x, positions, inv_freq)
    assert_far_end(x, tail, slice(-2, None))


@pytest.mark.parametrize("op", ["add_sinusoidal", "add_learned"])
def test_big_adds(op):
    """x [ROWS, 1024, 128] (2^31 + 2^17 bf16 elements) expanded from one batch row; positions differ per row."""
    x = randn(1, 1024, 128).expand(ROWS, 1024, 128)
    positions = (torch.arange(ROWS)[:, None] + torch.arange(1024)) % 4000
    if op == "add_sinusoidal":
        inv_freq = torch.logspace(0, -4, 64, dtype=F64)
        out = PF.add_sinusoidal(x, positions, inv_freq, 0.5)
        tail = PF.add_sinusoidal(x[-2:], positions[-2:], inv_freq, 0.5)
    else:
        table = randn(4000, 128, seed=3)
        out = PF.add_learned(x, table, positions, 0)
        tail = PF.add_learned(x[-2:], table, positions[-2:], 0)
        expected = x[-1, -1].double() + table[positions[-1, -1]].double()
        torch.testing.assert_close(out[-1, -1].double(), expected, atol=2e-2, rtol=1e-2)
    assert_far_end(out, tail, slice(-2, None))


@pytest.mark.parametrize("op", ["embed_sinusoidal", "embed_learned", "learned"])
def test_big_gathers(op):
    tokens = (torch.arange(ROWS)[:, None] * 31 + torch.arange(1024)) % 30000
    table = randn(30000, 128, seed=4)
    if op == "embed_sinusoidal":
        inv_freq = torch.logspace(0, -4, 64, dtype=F64)
        out = PF.embed_sinusoidal(tokens, table, None, inv_freq, 2.0)
        tail = PF.embed_sinusoidal(tokens[-2:], table, None, inv_freq, 2.0)
    elif op == "embed_learned":
        pos_table = randn(2048, 128, seed=5)
        out = PF.embed_learned(tokens, table, pos_table, None, 1.0, None, 1000)
        tail = PF.embed_learned(tokens[-2:], table, pos_table, None, 1.0, None, 1000)
    else:
        out = PF.learned(table, tokens)
        tail = PF.learned(table, tokens[-2:])
        assert same_bits(out[-1, -1], table[tokens[-1, -1]])
    assert_far_end(out, tail, slice(-2, None))


def test_big_embedding_backward():
    """grad [ROWS, 1024, 128] expanded from one batch row; the last batch row's tokens are used nowhere else,
    so their table rows are single gradient rows; token 0 appears once per batch row (a sum of ROWS terms)."""
    grad = (torch.arange(1, 1025, dtype=torch.float32)[:, None] / 1024 + torch.zeros(128)).to(BF16)
    grad = grad[None].expand(ROWS, 1024, 128)
    tokens = torch.zeros(ROWS, 1024, dtype=torch.long)
    tokens[:, 1:] = torch.arange(1, 1024) % 500 + 1
    tokens[-1, 1:] = torch.arange(1, 1024) + 1000  # rows 1001 ... 2023: the last batch row's alone
    out = PF.embedding_backward(grad, tokens, 2100)
    assert same_bits(out[1001:2024], grad[-1, 1:])
    sum_of_token_0 = (grad[0, 0].double() * ROWS).to(BF16)  # 1/1024 * ROWS, exact in float32
    assert same_bits(out[0], sum_of_token_0)


@pytest.mark.parametrize("op", ["add_alibi", "alibi_bias", "alibi_backward"])
def test_big_alibi(op):
    batch = 2 ** 31 // (16 * 256 * 512) + 1
    slopes = PF.alibi_slopes(16)[None] * torch.linspace(1, 2, batch)[:, None]
    if op == "alibi_bias":
        out = PF.alibi_bias(slopes, 256, 512, "symmetric", 0, None, BF16)
        tail = PF.alibi_bias(slopes[-2:], 256, 512, "symmetric", 0, None, BF16)
        expected = -slopes[-1, -1].double() * (255 + 256 - 0)  # query 255, key 0
        assert out[-1, -1, -1, 0].item() == pytest.approx(expected.item(), rel=1e-2)
    else:
        scores = randn(1, 16, 256, 512).expand(batch, 16, 256, 512)
        if op == "add_alibi":
            out = PF.add_alibi(scores, slopes, "symmetric")
            tail = PF.add_alibi(scores[-2:], slopes[-2:], "symmetric")
        else:
            out = PF.alibi_backward(scores, slopes, "symmetric")  # [batch, 16]: every batch row alike
            tail = PF.alibi_backward(scores[-2:], slopes[-2:], "symmetric")
            assert same_bits(out[-2:], tail) and same_bits(out[0], out[-1])
            return
    assert_far_end(out, tail, slice(-2, None))


def test_big_add_alibi_inplace():
    batch = 2 ** 31 // (16 * 256 * 512) + 1
    scores = torch.empty(batch, 16, 256, 512, dtype=BF16)
    scores.copy_(randn(1, 16, 256, 512).expand_as(scores))
    slopes = PF.alibi_slopes(16)[None] * torch.linspace(1, 2, batch)[:, None]
    tail = scores[-2:].clone()
    PF.add_alibi_(tail, slopes[-2:], "causal")
    PF.add_alibi_(scores, slopes, "causal")
    assert_far_end(scores, tail, slice(-2, None))


T5_Q, T5_K = 8192, 16385  # 16 heads x 8192 x 16385 = 2^31 + 2^17 elements


def t5_bucket_of(relative, num_buckets=32, max_distance=128):
    """T5's bidirectional buckets of relative positions (tensor), with its float32 log step."""
    n_dir, exact = num_buckets // 2, num_buckets // 4
    offset = (relative > 0).long() * n_dir
    distance = relative.abs()
    log_part = torch.log(distance.float() / exact) / math.log(max_distance / exact) * (n_dir - exact)
    far = (exact + log_part.long()).clamp(max=n_dir - 1)
    return offset + torch.where(distance < exact, distance, far)


def test_big_t5_bias():
    weight = randn(32, 16, seed=6)
    out = PF.t5_bias(weight, T5_Q, T5_K, True, 32, 128, 3)
    last_row = PF.t5_bias(weight, 1, T5_K, True, 32, 128, 3 + T5_Q - 1)
    assert_far_end(out, last_row[0], (0, slice(None), slice(-1, None)))
    buckets = t5_bucket_of(torch.arange(T5_K) - (T5_Q - 1 + 3))
    assert same_bits(out[0, -1, -1], weight[buckets, -1])


def test_big_t5_bias_backward():
    """grad [1, 16, Q, K] expanded from [1, 16, 1, K]: the gradient of bucket b is sum_j g[j] * (the number of
    queries i whose j - i - q_offset falls in b), computed here from prefix counts in float64."""
    g = (torch.arange(T5_K, dtype=torch.float32) % 17 / 16).to(BF16)
    grad = (g[None, None, None, :] * torch.linspace(1, 2, 16, dtype=BF16)[None, :, None, None]).expand(
        1, 16, T5_Q, T5_K)
    q_offset = 5
    out = PF.t5_bias_backward(grad, True, 32, 128, q_offset)
    # d = j - i - q_offset ranges over [-(Q - 1) - q_offset, K - 1 - q_offset]; prefix[b, n] counts the d's
    # below the n-th value that fall in bucket b.
    lowest = -(T5_Q - 1) - q_offset
    d = torch.arange(lowest, T5_K - q_offset)
    one_hot = torch.nn.functional.one_hot(t5_bucket_of(d), 32).double()
    prefix = torch.cat([torch.zeros(1, 32, dtype=F64), one_hot.cumsum(0)])  # prefix[n] = counts of d < lowest + n
    j = torch.arange(T5_K)
    high = j - q_offset - lowest + 1  # i = 0: d = j - q_offset
    low = high - T5_Q                 # i = Q - 1
    counts = prefix[high] - prefix[low]  # [K, 32]
    reference = counts.T @ grad[0, :, 0, :].double().T  # [32, 16]
    assert_rounds(out, reference)


def assert_rounds(out, reference):
    """out is reference rounded to out's dtype, give or take one rounding of the float64 sums."""
    low = (reference * (1 - 1e-9)).to(out.dtype).double()
    high = (reference * (1 + 1e-9)).to(out.dtype).double()
    got = out.double()
    assert bool(((got >= torch.minimum(low, high)) & (got <= torch.maximum(low, high))).all())
