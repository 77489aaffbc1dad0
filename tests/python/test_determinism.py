"""Determinism: every op's outputs, and the gradients autograd computes through it, are bitwise identical from
run to run and for 1, 2 and 3 threads (conftest's same_bits_for_any_thread_count). Shapes hold 0.5-2 M
elements, so 2 and 3 threads really split the work (at::parallel_for's grain is 32768 elements) and chunk
boundaries fall in different places for each thread count. Each case also checks one value against a float64
formula, so that a kernel returning the same wrong bits every time still fails."""
import math

import pytest
import torch
from torch.testing import assert_close

import posenc
from helpers import randn
from op_registry import tensor_ops
from posenc import functional as PF

F64 = torch.float64


def randint(high, *shape, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def with_grads(out, inputs, seed=1):
    """(out, d out / d inputs) for a fixed random output gradient."""
    outs = out if isinstance(out, tuple) else (out,)
    grads_out = [randn(*o.shape, dtype=o.dtype, seed=seed + i) for i, o in enumerate(outs)]
    return (*outs, *torch.autograd.grad(outs, inputs, grads_out))


def sinusoidal_cases(dtype):
    inv_freq = posenc.frequencies.sinusoidal(256)
    positions = randint(100000, 8, 1024)
    x = randn(8, 1024, 256, dtype=dtype, requires_grad=True)
    tokens = randint(3000, 8, 1024, seed=2)
    table = randn(3000, 256, dtype=dtype, seed=3, requires_grad=True)
    grad = randn(8, 1024, 256, dtype=dtype, seed=4)

    def first_value(out):  # PE of position positions[0, 0], channel 0 (interleaved: sin)
        return math.sin(positions[0, 0].item() * inv_freq[0].item())

    return {
        "sinusoidal": (lambda: PF.sinusoidal(positions[:4], inv_freq, "interleaved", dtype, 5),
                       lambda out: (out[0][0, 0, 0], math.sin((positions[0, 0].item() + 5) * inv_freq[0].item()))),
        "add_sinusoidal": (lambda: with_grads(PF.add_sinusoidal(x, positions, inv_freq, 0.5), x),
                           lambda out: (out[0][0, 0, 0], 0.5 * x[0, 0, 0].item() + first_value(out))),
        "embed_sinusoidal": (lambda: with_grads(PF.embed_sinusoidal(tokens, table, None, inv_freq, 2.0, 7), table),
                             lambda out: (out[0][0, 0, 1], 2 * table[tokens[0, 0], 1].item() + 1.0)),
        "embedding_backward": (lambda: PF.embedding_backward(grad, tokens, 3000, 0.5, 7),
                               lambda out: (out[0][tokens[0, 0], 0], 0.0 if tokens[0, 0] == 7 else
                                            0.5 * grad.double()[tokens == tokens[0, 0]][:, 0].sum().item())),
    }


def learned_cases(dtype):
    x = randn(8, 1024, 256, dtype=dtype, requires_grad=True)
    table = randn(2048, 256, dtype=dtype, seed=2, requires_grad=True)
    tokens = randint(3000, 8, 1024, seed=3)
    token_table = randn(3000, 256, dtype=dtype, seed=4, requires_grad=True)
    positions = randint(2000, 8, 1024, seed=5)
    mask = randint(2, 256, 4096, seed=6)
    return {
        "learned": (lambda: with_grads(PF.learned(table, positions, 3, 0), table),
                    lambda out: (out[0][0, 0, 0], table[positions[0, 0] + 3, 0].item())),
        "add_learned": (lambda: with_grads(PF.add_learned(x, table, None, 1000), (x, table)),
                        lambda out: (out[0][0, 0, 0], x[0, 0, 0].item() + table[1000, 0].item())),
        "embed_learned": (lambda: with_grads(PF.embed_learned(tokens, token_table, table, positions, 0.5, 1, 2, 0),
                                             (token_table, table)),
                          lambda out: (out[0][0, 0, 0], 0.5 * token_table[tokens[0, 0], 0].item() +
                                       table[positions[0, 0] + 2, 0].item())),
        "make_positions": (lambda: PF.make_positions(tokens % 5, 1),
                           lambda out: (out[0][0, 0], 1 if tokens[0, 0] % 5 == 1 else 2)),
        "positions_from_mask": (lambda: PF.positions_from_mask(mask, -1),
                                lambda out: (out[0][0, -1], mask[0].sum().item() - 1 if mask[0, -1] else -1)),
    }


def rope_cases(dtype):
    inv_freq = posenc.frequencies.rope(128, 500000.0, {"rope_type": "llama3", "factor": 8.0})[0]
    q = randn(2, 512, 16, 128, dtype=dtype, requires_grad=True)
    k = randn(2, 512, 4, 128, dtype=dtype, seed=2, requires_grad=True)
    positions = randint(100000, 2, 512, seed=3)
    cos, sin = randn(512, 128, seed=4), randn(512, 128, seed=5)
    grad = randn(2, 512, 16, 128, dtype=dtype, seed=6)

    def rotated(out, sign=1.0):  # channel 0 of token 0, head 0 (neox: x0 cos - x64 sin)
        angle = positions[0, 0].item() * inv_freq[0].item()
        x0, x64 = (q if sign > 0 else grad)[0, 0, 0, 0].item(), (q if sign > 0 else grad)[0, 0, 0, 64].item()
        return out[0][0, 0, 0, 0], x0 * math.cos(angle) - sign * x64 * math.sin(angle)

    def double_backward_value(out):  # d<R^T g, v>/dg = R v: the rotation of v = randn(seed=8)
        v = randn(*q.shape, dtype=q.dtype, seed=8)
        angle = positions[0, 0].item() * inv_freq[0].item()
        return out[1][0, 0, 0, 0], v[0, 0, 0, 0].item() * math.cos(angle) - v[0, 0, 0, 64].item() * math.sin(angle)

    def rope_inplace():
        x = q * 1.0  # a non-leaf: rope_ rebases it onto the rotation
        PF.rope_(x, positions, inv_freq)
        return with_grads(x, q)

    return {
        "rope": (lambda: with_grads(PF.rope(q, positions, inv_freq), q), rotated),
        "rope double backward": (lambda: _double_backward(q, positions, inv_freq), double_backward_value),
        "rope_backward": (lambda: PF.rope_backward(grad, positions, inv_freq), lambda out: rotated(out, -1.0)),
        "rope_qk": (lambda: with_grads(PF.rope_qk(q, k, positions, inv_freq), (q, k)), rotated),
        "rope_qk_backward": (lambda: PF.rope_qk_backward(grad, k.detach(), positions, inv_freq),
                             lambda out: rotated(out, -1.0)),
        "rope_": (rope_inplace, rotated),
        "rope_cos_sin": (lambda: with_grads(PF.rope_cos_sin(q, cos, sin), q),
                         lambda out: (out[0][0, 0, 0, 0], q[0, 0, 0, 0].item() * cos[0, 0].item() -
                                      q[0, 0, 0, 64].item() * sin[0, 0].item())),
        "rope_cos_sin_backward": (lambda: PF.rope_cos_sin_backward(grad, cos, sin),
                                  lambda out: (out[0][0, 0, 0, 0], grad[0, 0, 0, 0].item() * cos[0, 0].item() +
                                               grad[0, 0, 0, 64].item() * sin[0, 64].item())),
    }


def multiaxis_cases(dtype):
    """Multi-axis rotary (M-RoPE: positions [3, B, S], pair_axis over the three axes) and the position and frequency
    builders that take tensors."""
    inv_freq, pair_axis = posenc.frequencies.mrope(128, [16, 24, 24], 1e6)
    q = randn(2, 512, 16, 128, dtype=dtype, requires_grad=True)
    positions = randint(100000, 3, 2, 512, seed=3)
    # 256 rows of text, an image (grid 1 x 16 x 16, merge 2: 64 tokens) and text, the last 40 tokens padding.
    row = [0] * 100 + [1] * 64 + [0] * (4096 - 164)
    token_types = torch.tensor([row] * 256)
    mask = torch.ones_like(token_types)
    mask[:, -40:] = 0
    grids = torch.tensor([[1, 16, 16]] * 256)
    lengths = (randint(50, 4096, seed=4) * 8).tolist()  # 4096 sequences, about 800 k tokens
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])
    length = torch.tensor(3000)
    context = {"rope_type": "longrope", "original_max_position_embeddings": 2048.0, "max_position_embeddings": 8192.0,
               "short_factor": [1.0 + i / 64 for i in range(64)], "long_factor": [4.0 + i for i in range(64)]}
    rope_type, keywords = posenc.frequencies.rope_arguments(context)

    def rotated(out):  # channel 0 (a time pair) of token 0, head 0: rotated by the time position
        angle = positions[0, 0, 0].item() * inv_freq[0].item()
        x0, x64 = q[0, 0, 0, 0].item(), q[0, 0, 0, 64].item()
        return out[0][0, 0, 0, 0], x0 * math.cos(angle) - x64 * math.sin(angle)

    return {
        "rope multiaxis": (lambda: with_grads(PF.rope(q, positions, inv_freq, pair_axis=pair_axis), q), rotated),
        # The image's last patch: (100, 107, 107) with 8 x 8 merged patches; text after it at 100 + 8.
        "mrope_positions": (lambda: PF.mrope_positions(token_types, grids, None, mask),
                            lambda out: (out[0][2, 255, 163] + out[0][0, 255, 164] * 1000, 107 + 108 * 1000)),
        "rope_inv_freq_for_length": (lambda: torch.ops.posenc.rope_inv_freq_for_length(length, 128, 1e4, rope_type,
                                                                                         **keywords),
                                     lambda out: (out[0][1], 1e4 ** (-2 / 128) / 5.0)),
        "zigzag_positions_varlen": (lambda: PF.zigzag_positions_varlen(cu_seqlens, 4, 1),
                                    lambda out: (out[1][lengths[0] // 8], lengths[0] // 8 * 6)),
    }


def _double_backward(q, positions, inv_freq):
    out = PF.rope(q, positions, inv_freq)
    grad_out = randn(*out.shape, dtype=out.dtype, seed=7, requires_grad=True)
    (grad_q,) = torch.autograd.grad(out, q, grad_out, create_graph=True)
    return (grad_q, *torch.autograd.grad(grad_q, grad_out, randn(*q.shape, dtype=q.dtype, seed=8)))


def bias_cases(dtype):
    slopes = PF.alibi_slopes(16).requires_grad_(True)
    scores = randn(4, 16, 128, 256, dtype=dtype, requires_grad=True)
    grad = randn(4, 16, 128, 256, dtype=dtype, seed=2)
    table = randn(32, 16, dtype=dtype, seed=3, requires_grad=True)
    relative = randint(4000, 1024, 1024, seed=4) - 2000
    m0 = slopes[0].item()

    def scores_with_bias():
        out = scores.detach().clone()
        PF.add_alibi_(out, slopes.detach(), "symmetric")
        return out

    return {
        "alibi_bias": (lambda: with_grads(PF.alibi_bias(slopes, 256, 512, "causal", 0, None, dtype), slopes),
                       lambda out: (out[0][0, 0, 0, 0], -m0 * (512 - 256))),
        "add_alibi": (lambda: with_grads(PF.add_alibi(scores, slopes, "symmetric"), (scores, slopes)),
                      lambda out: (out[0][0, 0, 0, 0], scores[0, 0, 0, 0].item() - m0 * 128)),
        "add_alibi_": (scores_with_bias, lambda out: (out[0][0, 0, 0, 0], scores[0, 0, 0, 0].item() - m0 * 128)),
        "alibi_backward": (lambda: PF.alibi_backward(grad, slopes.detach(), "causal"),
                           lambda out: (out[0][0], -(grad[:, 0].double() * (
                               torch.arange(128, dtype=F64)[:, None] + 128 - torch.arange(256, dtype=F64))).sum()
                               .item())),
        "relative_position_bucket": (lambda: PF.relative_position_bucket(relative, True, 32, 128),
                                     lambda out: (out[0][0, 0], _bucket(relative[0, 0].item()))),
        "t5_bias": (lambda: with_grads(PF.t5_bias(table, 256, 512, True, 32, 128, 3), table),
                    lambda out: (out[0][0, 0, 0, 0], table[_bucket(-3), 0].item())),
        "t5_bias_backward": (lambda: PF.t5_bias_backward(grad[:1], False, 32, 128, 5),
                             lambda out: (out[0][0, 0], grad[0, 0].double()[
                                 (torch.arange(256)[None, :] - torch.arange(128)[:, None] - 5) >= 0].sum().item())),
    }


def _bucket(relative, num_buckets=32, max_distance=128):
    """T5's bidirectional bucket of one relative position (float32 log step, as T5)."""
    n_dir, exact = num_buckets // 2, num_buckets // 4
    offset = n_dir if relative > 0 else 0
    distance = abs(relative)
    if distance < exact:
        return offset + distance
    log_part = torch.log(torch.tensor(float(distance)) / exact) / math.log(max_distance / exact) * (n_dir - exact)
    return offset + min(exact + int(log_part.long()), n_dir - 1)


FAMILIES = {
    sinusoidal_cases: ["sinusoidal", "add_sinusoidal", "embed_sinusoidal", "embedding_backward"],
    learned_cases: ["learned", "add_learned", "embed_learned", "make_positions", "positions_from_mask"],
    rope_cases: ["rope", "rope double backward", "rope_backward", "rope_qk", "rope_qk_backward", "rope_",
                 "rope_cos_sin", "rope_cos_sin_backward"],
    bias_cases: ["alibi_bias", "add_alibi", "add_alibi_", "alibi_backward", "relative_position_bucket", "t5_bias",
                 "t5_bias_backward"],
    multiaxis_cases: ["rope multiaxis", "mrope_positions", "rope_inv_freq_for_length", "zigzag_positions_varlen"],
}
# The builders of positions and frequencies take no floating data: one dtype is enough.
DTYPE_FREE = {"mrope_positions", "rope_inv_freq_for_length", "zigzag_positions_varlen"}
CASES = {f"{name}-{str(dtype).split('.')[-1]}": (family, name, dtype)
         for family, names in FAMILIES.items() for name in names for dtype in (torch.float32, torch.bfloat16)
         if name not in DTYPE_FREE or dtype == torch.float32}


def test_every_op_is_covered():
    covered = {name.split("-")[0].split(" ")[0] for name in CASES}
    assert set(tensor_ops()) <= covered, set(tensor_ops()) - covered


@pytest.mark.parametrize("case", CASES)
def test_same_bits_for_1_2_and_3_threads(case, same_bits_for_any_thread_count):
    family, name, dtype = CASES[case]
    run, probe = family(dtype)[name]
    result = same_bits_for_any_thread_count(run)
    got, expected = probe(result if isinstance(result, tuple) else (result,))
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}.get(got.dtype, 0)
    assert_close(got.double(), torch.tensor(float(expected), dtype=F64), atol=tolerance,
                 rtol=tolerance)
