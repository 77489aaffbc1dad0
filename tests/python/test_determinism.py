"""Determinism: every op's outputs, and the gradients autograd computes through it, are bitwise identical from
run to run and for 1, 2 and 3 threads (conftest's same_bits_for_any_thread_count). Each op runs its registry
sample (op_registry.SAMPLES) of size "large": 0.5-2 M elements, so that 2 and 3 threads really split the work
(at::parallel_for's grain is 32768 elements) and chunk boundaries fall in different places for each thread count;
in float32 and bfloat16 (one dtype for the ops with no floating data), with the gradients of a fixed output
gradient.

Values too, so that a kernel returning the same wrong bits every time still fails: the outputs and gradients
equal those of the same sample run in float64 on the same values (its `reference=True` version) within the
dtype's rounding; the ops with no floating data (positions, buckets, frequencies for a length), for which a
float64 run is the same run, are checked against their definitions (PROBES). Extras: rope's double backward and
multi-axis rope, paths of rope that its sample does not take at this size."""
import math

import pytest
import torch
from torch.testing import assert_close

import posenc
from helpers import randn
from op_registry import SAMPLES, outputs_and_grads, tensor_ops, uses_dtype
from posenc import functional as PF

F64 = torch.float64
DTYPES = (torch.float32, torch.bfloat16)
# Against the float64 reference: max |got - expected| <= TOLERANCE * max |expected|, a few roundings of the dtype
# (measured: 1.2e-7 for float32, 3.6e-3 for bfloat16).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}

CASES = {f"{name}-{str(dtype).split('.')[-1]}": (name, dtype) for name in sorted(SAMPLES) for dtype in DTYPES
         if uses_dtype(name) or dtype == torch.float32}


def test_every_op_is_covered():
    covered = {name for name, _ in CASES.values()}
    assert set(tensor_ops()) <= covered, set(tensor_ops()) - covered
    assert covered <= set(tensor_ops()), covered - set(tensor_ops())  # no sample of an op that is gone


@pytest.mark.parametrize("case", CASES)
def test_same_bits_for_1_2_and_3_threads(case, same_bits_for_any_thread_count):
    name, dtype = CASES[case]
    sample = SAMPLES[name](dtype=dtype, size="large", requires_grad=True)
    result = same_bits_for_any_thread_count(lambda: outputs_and_grads(sample))
    if not sample.uses_dtype:
        if name in PROBES:
            PROBES[name](sample, result)
        return
    reference = outputs_and_grads(SAMPLES[name](dtype=dtype, size="large", requires_grad=True, reference=True))
    assert len(result) == len(reference)
    for index, (got, expected) in enumerate(zip(result, reference)):
        if not expected.is_floating_point():
            assert torch.equal(got, expected), f"result {index}"
            continue
        assert got.shape == expected.shape, f"result {index}"
        tolerance = TOLERANCE.get(got.dtype, 1e-12)  # a float32 result of a bfloat16 sample: float32's
        # Every 101st value of a large result (a prime step: every channel of every row has its turn), every value
        # of a small one: whole passes over millions of float64 values cost seconds.
        step = 101 if got.numel() > 100000 else 1
        got, expected = got.flatten()[::step], expected.flatten()[::step]
        error, scale = (got.double() - expected).abs().max().item(), expected.abs().max().item()
        assert error <= tolerance * scale, f"result {index} differs from the float64 reference by {error} (of {scale})"


# ---------------------------------------------------------------- the ops with no floating data

def _make_positions(sample, out):
    tokens, padding_idx = sample.args
    real = tokens != padding_idx
    assert torch.equal(out[0], real.cumsum(-1) * real + padding_idx)


def _positions_from_mask(sample, out):
    mask, pad_position = sample.args
    real = mask != 0
    assert torch.equal(out[0], torch.where(real, real.cumsum(-1) - 1, pad_position))


def _relative_position_bucket(sample, out):
    """T5's buckets (its float32 log step) of every relative position."""
    relative, bidirectional, num_buckets, max_distance = sample.args
    if bidirectional:
        num_buckets //= 2
        bucket, distance = (relative > 0).long() * num_buckets, relative.abs()
    else:
        bucket, distance = torch.zeros_like(relative), -relative.clamp(max=0)
    exact = num_buckets // 2
    log_part = (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    large = (exact + log_part).clamp(max=num_buckets - 1)
    assert torch.equal(out[0], bucket + torch.where(distance < exact, distance, large))


def _mrope_positions(sample, out):
    """Row 0: the text before the first image counts on all three axes; the image's tokens take (start, start + row,
    start + column) of its merged grid; the text after it continues at start + max(h, w) / merge."""
    token_types, image_grid_thw = sample.args[:2]
    merge = sample.args[4] if len(sample.args) > 4 else 2
    positions = out[0][:, 0]
    start = int((token_types[0] == 1).nonzero()[0])
    h, w = int(image_grid_thw[0, 1]) // merge, int(image_grid_thw[0, 2]) // merge
    assert torch.equal(positions[:, :start], torch.arange(start).expand(3, start))
    image = positions[:, start:start + h * w]
    rows, columns = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
    assert torch.equal(image, torch.stack([torch.zeros(h * w, dtype=torch.long), rows, columns]) + start)
    assert torch.equal(positions[:, start + h * w], torch.full((3,), start + max(h, w)))


def _rope_inv_freq_for_length(sample, out):
    """The frequencies of rope_inv_freq given the same length as an int."""
    length, rotary_dim, base, rope_type = sample.args
    inv_freq, _ = torch.ops.posenc.rope_inv_freq(rotary_dim, base, rope_type, seq_len=int(length), **sample.kwargs)
    assert_close(out[0], inv_freq, rtol=1e-6, atol=0)


def _zigzag_positions_varlen(sample, out):
    """The first 64 sequences: zigzag_positions of each, as positions and as indices into the packed tokens."""
    cu_seqlens, cp_size, cp_rank = sample.args
    positions, indices, local = out
    assert torch.equal(local, cu_seqlens // cp_size)
    for i in range(64):
        own = PF.zigzag_positions(int(cu_seqlens[i + 1] - cu_seqlens[i]), cp_size, cp_rank)
        assert torch.equal(positions[local[i]:local[i + 1]], own)
        assert torch.equal(indices[local[i]:local[i + 1]], own + cu_seqlens[i])


PROBES = {"make_positions": _make_positions, "positions_from_mask": _positions_from_mask,
          "relative_position_bucket": _relative_position_bucket, "mrope_positions": _mrope_positions,
          "rope_inv_freq_for_length": _rope_inv_freq_for_length, "zigzag_positions_varlen": _zigzag_positions_varlen}


# ---------------------------------------------------------------- extras: rope's double backward, multi-axis rope

def randint(high, *shape, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _double_backward(dtype):
    """d<R^T g, v>/dg = R v: the gradient of rope's gradient along its output gradient is the rotation of v."""
    inv_freq = posenc.frequencies.rope(128, 500000.0, {"rope_type": "llama3", "factor": 8.0})[0]
    q = randn(2, 512, 8, 128, dtype=dtype, requires_grad=True)
    positions = randint(100000, 2, 512, seed=3)
    v = randn(*q.shape, dtype=q.dtype, seed=8)

    def run():
        out = PF.rope(q, positions, inv_freq)
        grad_out = randn(*out.shape, dtype=out.dtype, seed=7, requires_grad=True)
        (grad_q,) = torch.autograd.grad(out, q, grad_out, create_graph=True)
        return (grad_q, *torch.autograd.grad(grad_q, grad_out, v))

    def probe(out):  # channel 0 of token 0, head 0 (neox: v0 cos - v64 sin)
        angle = positions[0, 0].item() * inv_freq[0].item()
        return out[1][0, 0, 0, 0], v[0, 0, 0, 0].item() * math.cos(angle) - v[0, 0, 0, 64].item() * math.sin(angle)

    return run, probe


def _multiaxis(dtype):
    """M-RoPE: positions [3, B, S], pair_axis over the three axes."""
    inv_freq, pair_axis = posenc.frequencies.mrope(128, [16, 24, 24], 1e6)
    q = randn(2, 512, 8, 128, dtype=dtype, requires_grad=True)
    positions = randint(100000, 3, 2, 512, seed=3)

    def run():
        out = PF.rope(q, positions, inv_freq, pair_axis=pair_axis)
        return out, *torch.autograd.grad(out, q, randn(*out.shape, dtype=out.dtype, seed=1))

    def probe(out):  # channel 0 (a time pair) of token 0, head 0: rotated by the time position
        angle = positions[0, 0, 0].item() * inv_freq[0].item()
        return out[0][0, 0, 0, 0], q[0, 0, 0, 0].item() * math.cos(angle) - q[0, 0, 0, 64].item() * math.sin(angle)

    return run, probe


EXTRAS = {f"{name}-{str(dtype).split('.')[-1]}": (build, dtype)
          for name, build in (("rope double backward", _double_backward), ("rope multiaxis", _multiaxis))
          for dtype in DTYPES}


@pytest.mark.parametrize("case", EXTRAS)
def test_extras_same_bits_for_1_2_and_3_threads(case, same_bits_for_any_thread_count):
    build, dtype = EXTRAS[case]
    run, probe = build(dtype)
    got, expected = probe(same_bits_for_any_thread_count(run))
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[got.dtype]
    assert_close(got.double(), torch.tensor(float(expected), dtype=F64), atol=tolerance, rtol=tolerance)
