"""64-bit indexing, cheaply: inputs are views whose elements lie beyond element 2^31 of a lazily allocated 4 GiB
buffer (only the touched pages become memory), so the kernels' stride arithmetic reaches far offsets; in-place
ops write there. Each result must equal the same op on a small contiguous copy, bit for bit.
test_64bit_outputs.py (POSENC_BIG_TESTS=1) writes real outputs of more than 2^31 elements.
"""
import functools
import math

import torch

import helpers
from helpers import same_bits
from posenc import functional as PF

BF16 = torch.bfloat16
F64 = torch.float64
FAR = 2 ** 31 + 4096  # an element offset past int32's range
randn = functools.partial(helpers.randn, dtype=BF16)


def far_view(values, stride_dim=0):
    """A view with the values of `values` whose elements along `stride_dim` sit FAR elements apart in a lazily
    allocated buffer: element [1, ...] lies past 2^31. Only the pages holding elements are touched."""
    shape = list(values.shape)
    inner_shape = shape[:stride_dim] + shape[stride_dim + 1:]
    strides = list(torch.empty(inner_shape).stride())
    strides.insert(stride_dim, FAR)
    buffer = torch.empty(FAR * (shape[stride_dim] - 1) + math.prod(inner_shape), dtype=values.dtype)
    view = buffer.as_strided(shape, strides)
    view.copy_(values)
    return view


# ---------------------------------------------------------------- far offsets (always run)

ROPE_FREQ = torch.tensor([1.0, 0.1, 0.01, 1e-3], dtype=F64)


def test_rope_family_reads_and_writes_past_2_pow_31():
    x = randn(2, 3, 2, 8)
    far = far_view(x)  # batch row 1 starts past element 2^31
    positions = torch.tensor([[1, 2, 3], [70000, 5, 9]])
    assert same_bits(PF.rope(far, positions, ROPE_FREQ), PF.rope(x, positions, ROPE_FREQ))
    assert same_bits(PF.rope_backward(far, positions, ROPE_FREQ, 0.5), PF.rope_backward(x, positions, ROPE_FREQ, 0.5))
    k = randn(2, 3, 1, 8, seed=1)
    q_far, k_far = PF.rope_qk(far, far_view(k), positions, ROPE_FREQ)
    q_ref, k_ref = PF.rope_qk(x, k, positions, ROPE_FREQ)
    assert same_bits(q_far, q_ref) and same_bits(k_far, k_ref)
    gq, gk = PF.rope_qk_backward(far, far_view(k), positions, ROPE_FREQ)
    assert same_bits(gq, PF.rope_qk_backward(x, k, positions, ROPE_FREQ)[0])
    cos, sin = randn(3, 8, dtype=torch.float32, seed=2), randn(3, 8, dtype=torch.float32, seed=3)
    assert same_bits(PF.rope_cos_sin(far, cos, sin), PF.rope_cos_sin(x, cos, sin))
    assert same_bits(PF.rope_cos_sin_backward(far, cos, sin), PF.rope_cos_sin_backward(x, cos, sin))
    expected = x.clone()
    PF.rope_(expected, positions, ROPE_FREQ)
    PF.rope_(far, positions, ROPE_FREQ)
    assert same_bits(far, expected)


def test_qk_norm_rope_reads_and_writes_past_2_pow_31():
    q, k = randn(2, 3, 2, 8, seed=4), randn(2, 3, 1, 8, seed=5)
    q_far, k_far = far_view(q), far_view(k)
    weights = (randn(8, seed=6), randn(8, seed=7))
    positions = torch.tensor([[0, 5, 9], [3, 4, 7]])
    got = PF.qk_norm_rope(q_far, k_far, *weights, positions, ROPE_FREQ)
    assert all(same_bits(a, b) for a, b in zip(got, PF.qk_norm_rope(q, k, *weights, positions, ROPE_FREQ)))
    grads = (randn(2, 3, 2, 8, seed=8), randn(2, 3, 1, 8, seed=9))
    got = PF.qk_norm_rope_backward(far_view(grads[0]), far_view(grads[1]), q_far, k_far, *weights, positions,
                                   ROPE_FREQ)
    want = PF.qk_norm_rope_backward(*grads, q, k, *weights, positions, ROPE_FREQ)
    assert all(same_bits(a, b) for a, b in zip(got, want))
    PF.qk_norm_rope_(q_far, k_far, *weights, positions, ROPE_FREQ)
    want = PF.qk_norm_rope(q, k, *weights, positions, ROPE_FREQ)
    assert same_bits(q_far, want[0]) and same_bits(k_far, want[1])


def test_alibi_reads_and_writes_past_2_pow_31():
    scores = randn(2, 3, 4, 5)
    slopes = PF.alibi_slopes(3).expand(2, 3) * torch.tensor([[1.0], [0.5]])
    far = far_view(scores)
    assert same_bits(PF.add_alibi(far, slopes), PF.add_alibi(scores, slopes))
    assert same_bits(PF.alibi_backward(far, slopes, "symmetric"), PF.alibi_backward(scores, slopes, "symmetric"))
    expected = scores.clone()
    PF.add_alibi_(expected, slopes, "symmetric")
    PF.add_alibi_(far, slopes, "symmetric")
    assert same_bits(far, expected)


def test_sinusoidal_and_learned_read_past_2_pow_31():
    inv_freq = torch.tensor([1.0, 0.01], dtype=F64)
    x = randn(2, 3, 4)
    positions = torch.tensor([[0, 1, 2], [9, 8, 7]])
    assert same_bits(PF.add_sinusoidal(far_view(x), positions, inv_freq, 2.0),
                     PF.add_sinusoidal(x, positions, inv_freq, 2.0))
    table = randn(5, 4, seed=1)
    tokens = torch.tensor([[0, 4, 2], [4, 4, 1]])
    far_table = far_view(table)  # row 1 onwards past 2^31
    assert same_bits(PF.embed_sinusoidal(tokens, far_table, None, inv_freq, 1.5),
                     PF.embed_sinusoidal(tokens, table, None, inv_freq, 1.5))
    assert same_bits(PF.learned(far_table, tokens, 0), PF.learned(table, tokens, 0))
    assert same_bits(PF.add_learned(far_view(x), far_table, tokens), PF.add_learned(x, table, tokens))
    assert same_bits(PF.embed_learned(tokens, far_table, far_view(table), tokens, 0.5),
                     PF.embed_learned(tokens, table, table, tokens, 0.5))
    assert same_bits(PF.embedding_backward(far_view(x), tokens, 5, 0.5), PF.embedding_backward(x, tokens, 5, 0.5))


def test_t5_backward_reads_past_2_pow_31():
    grad = randn(1, 3, 4, 6)
    far = far_view(grad.transpose(0, 1).contiguous(), 0).transpose(0, 1)  # head 1 onwards past 2^31
    assert same_bits(PF.t5_bias_backward(far, True, 8, 20, 5), PF.t5_bias_backward(grad, True, 8, 20, 5))
