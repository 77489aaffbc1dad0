"""CUDA kernels against the CPU kernels: every op's registry samples (op_registry.SAMPLES), then every op, forward
and backward, over dtypes, layouts, formats, strides, alignments and position kinds, with the CPU's bits (far
angles and float64 data included: both devices run posenc's own sin/cos); no op waiting for the GPU; the CPU's
errors for bad index data, at the call (synchronous checks) or from posenc.cuda.check_errors() (the default);
streams and CUDA-graph capture, a patched Hugging Face Llama's training and decoding steps included. The comparisons
need a GPU and skip without one; opcheck, torch.compile and torch.export run on every device of the `device` fixture
(the CPU everywhere, CUDA where present), and posenc.cuda's switches on any machine."""
import contextlib
import inspect
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import _disable_current_modes

import posenc  # noqa: F401
from helpers import first_difference, nan_payload_q_and_weight
from op_registry import SAMPLES, SIZES, outputs_and_grads, sample_outputs, tensor_ops, uses_dtype
from posenc import frequencies as FQ
from posenc import functional as PF

ops = torch.ops.posenc
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def to_cuda(t):
    """t on the GPU with its sizes, strides and storage offset (so the GPU reads the same layout)."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    if t.numel() == 0:
        return t.cuda()
    base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    return base.cuda().as_strided(t.size(), t.stride(), t.storage_offset())


def same(actual, expected):
    """CUDA results equal the CPU's, bit for bit."""
    if isinstance(expected, (tuple, list)):
        for a, e in zip(actual, expected):
            same(a, e)
        return
    assert actual.is_cuda
    difference = first_difference(actual, expected)
    assert difference is None, difference


def run_both(op, *args, **kwargs):
    expected = op(*args, **kwargs)
    actual = op(*[to_cuda(a) for a in args], **{k: to_cuda(v) for k, v in kwargs.items()})
    same(actual, expected)
    return expected


# ---------------------------------------------------------------- registration

@cuda_only
def test_every_op_has_a_cuda_kernel():
    # Every op with a tensor argument has a kernel of its own at the CUDA key; the ops without one (frequencies,
    # slopes, zigzag_positions) dispatch to their CompositeExplicitAutograd kernel on every device.
    names = tensor_ops()
    assert {"rope", "mrope_positions", "rope_inv_freq_for_length", "zigzag_positions_varlen"} <= set(names)
    missing = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(f"posenc::{n}", "CUDA")]
    assert not missing, f"no CUDA kernel for {missing}: was posenc built with POSENC_CUDA?"


# ---------------------------------------------------------------- every op: its registry samples

def test_every_op_has_a_sample_to_compare():
    assert set(tensor_ops()) <= set(SAMPLES), set(tensor_ops()) - set(SAMPLES)
    assert READ_ON_THE_HOST <= set(tensor_ops())  # the ops left out of test_no_op_waits_for_the_gpu


@cuda_only
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_sample_on_cuda_equals_the_cpu(name):
    """Each op's registry sample (op_registry.SAMPLES) at both sizes, in every dtype (one for the ops with no
    floating data), with the gradients of its inputs, built on each device from the same values."""
    for size in SIZES:
        for dtype in FLOATS if uses_dtype(name) else FLOATS[:1]:
            expected = sample_outputs(name, dtype=dtype, size=size, requires_grad=True)
            actual = sample_outputs(name, dtype=dtype, size=size, device="cuda", requires_grad=True)
            assert len(actual) == len(expected), (size, dtype)
            same(actual, expected)


# The ops whose output size depends on their data: they read it on the host (csrc/cuda/host.cu runs them on host
# copies), by design, and so synchronize.
READ_ON_THE_HOST = {
    "mrope_positions",  # one position per token of the image and video grids its token types and grid sizes describe
    "zigzag_positions_varlen",  # as many positions as cu_seqlens' last value
}


@cuda_only
@pytest.mark.parametrize("name", sorted(set(SAMPLES) - READ_ON_THE_HOST))
def test_no_op_waits_for_the_gpu(name, asynchronous):
    """Each op's registry samples (as test_every_sample_on_cuda_equals_the_cpu builds them: both sizes, every dtype,
    with their positions, cu_seqlens and pair_axis), forward and backward, under torch.cuda.set_sync_debug_mode
    ("error"), which raises at any call that makes the host wait for the GPU (.item(), a copy to the host, a
    synchronize): the asynchronous checks read nothing back. Then, outside that mode (the comparison copies to the
    host), nothing recorded and the CPU's bits."""
    for size in SIZES:
        for dtype in FLOATS if uses_dtype(name) else FLOATS[:1]:
            cpu_sample = SAMPLES[name](dtype=dtype, size=size, requires_grad=True)
            expected = outputs_and_grads(cpu_sample)
            sample = SAMPLES[name](dtype=dtype, size=size, device="cuda", requires_grad=True)
            # outputs_and_grads makes each output gradient once, on the output's device: a copy from the host, which
            # waits. The CPU run's, copied now, are the ones it then finds made.
            sample.output_gradients.update({key: g.cuda() for key, g in cpu_sample.output_gradients.items()})
            torch.cuda.set_sync_debug_mode("error")
            try:
                actual = outputs_and_grads(sample)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            posenc.cuda.check_errors()
            assert len(actual) == len(expected), (size, dtype)
            same(actual, expected)


@cuda_only
def test_calls_return_while_the_gpu_is_busy(asynchronous):
    """set_sync_debug_mode sees the waits that PyTorch makes, not those of posenc's own CUDA runtime calls (a
    cudaStreamSynchronize, a cudaMemcpy to the host). Behind a GPU kernel that sleeps half a second, every op's small
    sample, then a call with a bad token id, returns while that kernel still runs: no call waited for the GPU, and
    the failure is raised only by check_errors(). A first run of the same calls loads their kernels, allocates the
    failure record and caches the memory they take, any of which could wait once."""
    names = sorted(set(SAMPLES) - READ_ON_THE_HOST)
    samples = [SAMPLES[name](device="cuda") for name in names]
    bad_op, bad_args = bad_index_calls()["token id past the vocabulary"]
    expected = cpu_error(bad_op, bad_args)
    bad_args = [to_cuda(a) for a in bad_args]
    for sample in samples:
        sample.run()
    bad_op(*bad_args)
    with pytest.raises(RuntimeError):
        posenc.cuda.check_errors()
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # clock cycles: about half a second
    asleep = torch.cuda.Event()
    asleep.record()
    for sample in samples:
        sample.run()
    bad_op(*bad_args)
    assert not asleep.query(), "a call waited for the GPU"
    with pytest.raises(RuntimeError) as raised:
        posenc.cuda.check_errors()
    assert message(raised.value) == message(expected)


# ---------------------------------------------------------------- rotary

def captured_graph(step):
    """step() warmed up on a side stream, then captured in a CUDA graph: (graph, the captured outputs), which each
    graph.replay() rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def replays_follow_new_values(graph, captured, step, x):
    """New values written into x (an input step() reads): graph.replay() rewrites the captured outputs with the
    bits step() now gives eagerly."""
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for a, e in zip(captured, step()):
        assert torch.equal(a, e)


def rope_input(fmt, dtype, batch=2, seq=5, heads=3, head_dim=16, layout_view="contiguous"):
    """x in `fmt` as contiguous data, a transposed view (channel stride 1, other strides permuted), a channel-strided
    view (V = 1 path) or a view one element off 16-byte alignment."""
    shape = {"bshd": (batch, seq, heads, head_dim), "bhsd": (batch, heads, seq, head_dim),
             "sbhd": (seq, batch, heads, head_dim), "thd": (seq, heads, head_dim)}[fmt]
    if layout_view == "channel_strided":
        return torch.randn(*shape[:-1], 2 * head_dim, dtype=dtype)[..., ::2]
    if layout_view == "unaligned":
        flat = torch.randn(math.prod(shape) + 1, dtype=dtype)
        return flat[1:].view(shape)
    if layout_view == "transposed" and fmt != "thd":
        return torch.randn(*shape, dtype=dtype).transpose(0, 1).contiguous().transpose(0, 1)
    return torch.randn(*shape, dtype=dtype)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("fmt", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("view", ["contiguous", "transposed", "channel_strided", "unaligned"])
def test_rope_forward_backward_and_in_place(dtype, layout, fmt, view):
    x = rope_input(fmt, dtype, head_dim=32, layout_view=view)
    batch, seq = (1, x.shape[0]) if fmt == "thd" else (x.shape[PERM_B[fmt]], x.shape[PERM_S[fmt]])
    # Every channel rotated; 16 of 32 (whole vectors of pairs and of copied channels); 12 of 32 (pairs that fill
    # no whole vector: element by element).
    for rotary_dim in (32, 16, 12):
        inv_freq, _ = FQ.rope(rotary_dim)
        for positions in [None, torch.randint(0, 4096, (seq,)), torch.randint(-50, 50, (seq,), dtype=torch.int32)]:
            for op in (ops.rope, ops.rope_backward):
                run_both(op, x, positions, inv_freq, 0.75, layout, fmt, 3)
        if fmt != "thd":
            per_row = torch.randint(0, 10**6, (batch, seq))
            run_both(ops.rope, x, per_row, inv_freq, 1.0, layout, fmt, 0)
        expected = x.clone()
        ops.rope_(expected, None, inv_freq, 1.0, layout, fmt, 7)
        actual = to_cuda(x)
        ops.rope_(actual, None, inv_freq.cuda(), 1.0, layout, fmt, 7)
        same(actual, expected)


PERM_B = {"bshd": 0, "bhsd": 0, "sbhd": 1}
PERM_S = {"bshd": 1, "bhsd": 2, "sbhd": 0}


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_qk_gqa_long_heads_and_decoding(dtype):
    # GQA head counts, head dims past one block of coefficients (600 pairs > 256), and a decoding step
    # (B = 8, S = 1: few tokens, split over several blocks).
    inv_freq, scale = FQ.rope(1200, 500000.0, {"rope_type": "llama3", "factor": 8.0})
    q, k = torch.randn(2, 3, 8, 1200, dtype=dtype), torch.randn(2, 3, 2, 1232, dtype=dtype)
    for op in (ops.rope_qk, ops.rope_qk_backward):
        run_both(op, q, k, torch.arange(3) + 100, inv_freq, scale, "neox", "bshd", 0)
    inv_freq, _ = FQ.rope(128)
    q, k = torch.randn(8, 1, 32, 128, dtype=dtype), torch.randn(8, 1, 8, 128, dtype=dtype)
    run_both(ops.rope_qk, q, k, torch.randint(0, 8192, (8, 1)), inv_freq, 1.0, "gptj", "bshd", 0)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_far_positions_take_float64_sin_and_cos(dtype):
    # |p * w| > 2^26: both devices take posenc's own float64 sin/cos, the same bits.
    x = torch.randn(1, 4, 2, 8, dtype=dtype)
    inv_freq, _ = FQ.rope(8, 1.0)
    positions = torch.tensor([2**40, -(2**45), 3, 2**52])
    run_both(ops.rope, x, positions, inv_freq)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_varlen_cu_seqlens(dtype):
    x = torch.randn(11, 4, 32, dtype=dtype)
    inv_freq, _ = FQ.rope(32)
    for cu in [torch.tensor([0, 3, 3, 11]), torch.tensor([0, 11], dtype=torch.int32)]:
        run_both(ops.rope, x, None, inv_freq, 1.0, "neox", "thd", 5, cu)
        run_both(ops.rope, x, torch.arange(11), inv_freq, 1.0, "gptj", "thd", 0, cu)


# Multi-axis rotary: pair i rotates by the position of axis pair_axis[i].

@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("fmt", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("view", ["contiguous", "channel_strided", "unaligned"])
def test_rope_pair_axis(dtype, layout, fmt, view):
    x = rope_input(fmt, dtype, head_dim=32, layout_view=view)
    batch, seq = (1, x.shape[0]) if fmt == "thd" else (x.shape[PERM_B[fmt]], x.shape[PERM_S[fmt]])
    # M-RoPE's three sections (16 pairs: vector paths), interleaved sections, and 6 pairs of 16 channels (no whole
    # vector of pairs: element by element, the rest copied); int32 and int64 axes.
    cases = [FQ.mrope(32, [4, 6, 6], 1e4), FQ.mrope(32, [6, 5, 5], 1e4, interleaved=True),
             (FQ.rope(12)[0], torch.tensor([1, 0, 1, 1, 0, 1]))]
    for inv_freq, pair_axis in cases:
        n_axes = int(pair_axis.max()) + 1
        for positions in [torch.randint(0, 4096, (n_axes, seq)),
                          torch.randint(-50, 50, (n_axes, seq), dtype=torch.int32)]:
            for op in (ops.rope, ops.rope_backward):
                run_both(op, x, positions, inv_freq, 0.75, layout, fmt, 3, None, pair_axis)
        if fmt != "thd":
            per_row = torch.randint(0, 10**6, (n_axes, batch, seq))
            run_both(ops.rope, x, per_row, inv_freq, 1.0, layout, fmt, 0, None, pair_axis.int())
        else:
            cu = torch.tensor([0, 2, seq])
            run_both(ops.rope, x, torch.randint(0, 99, (n_axes, seq)), inv_freq, 1.0, layout, fmt, 1, cu, pair_axis)
        positions = torch.randint(0, 4096, (n_axes, seq))
        expected = x.clone()
        ops.rope_(expected, positions, inv_freq, 1.0, layout, fmt, 7, None, pair_axis)
        actual = to_cuda(x)
        ops.rope_(actual, positions.cuda(), inv_freq.cuda(), 1.0, layout, fmt, 7, None, pair_axis.cuda())
        same(actual, expected)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_qk_pair_axis_long_heads_far_axes_and_one_axis(dtype):
    # 300 pairs (more than one block of coefficients), GQA, per-row positions.
    inv_freq, pair_axis = FQ.mrope(600, [100, 100, 100], 1e6)
    q, k = torch.randn(2, 3, 4, 600, dtype=dtype), torch.randn(2, 3, 2, 632, dtype=dtype)
    positions = torch.randint(0, 10**5, (3, 2, 3))
    for op in (ops.rope_qk, ops.rope_qk_backward):
        run_both(op, q, k, positions, inv_freq, 0.5, "neox", "bshd", 0, None, pair_axis)
    # One far axis sends the whole token to float64 sin/cos (the CPU's choice per token, whatever the axis).
    inv_freq, pair_axis = FQ.axial(16, 2, 1.0)
    x = torch.randn(1, 3, 2, 16, dtype=dtype)
    positions = torch.tensor([[0, 5, 2**40], [2**30, 7, 3]])
    run_both(ops.rope, x, positions, inv_freq, 1.0, "neox", "bshd", 0, None, pair_axis)
    # A single axis is the one-axis rotation, bit for bit.
    inv_freq, _ = FQ.rope(16)
    x = torch.randn(2, 5, 2, 16, dtype=dtype)
    positions = torch.randint(0, 1000, (5,))
    one_axis = ops.rope(x.cuda(), positions.cuda(), inv_freq.cuda())
    axes = ops.rope(x.cuda(), positions[None].cuda(), inv_freq.cuda(), 1.0, "neox", "bshd", 0, None,
                    torch.zeros(8, dtype=torch.long, device="cuda"))
    same(axes, one_axis.cpu())


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_rope_cos_sin_and_transpose(dtype, layout):
    x = torch.randn(2, 6, 3, 16, dtype=dtype)
    for table_shape in [(6, 12), (1, 6, 12), (2, 6, 12)]:
        cos, sin = torch.randn(table_shape), torch.randn(table_shape)
        run_both(ops.rope_cos_sin, x, cos, sin, layout, "bshd")
        run_both(ops.rope_cos_sin_backward, x, cos.double(), sin.half(), layout, "bshd")


# ---------------------------------------------------------------- QK-norm + RoPE
# The CUDA kernels sum as the CPU does (16 lanes folded by the same tree, the weight gradients in the CPU's chunks of
# tokens, folded in float64 in chunk order) and round every product, square root and division as it does, so every
# output is compared bit for bit: the forward, the in-place form, the input gradients and both weight gradients.

NORMS = ["llama", "gemma", "olmo2", "fused"]


def qk_norm_weights(q, k, fmt, k_over_heads, dtype):
    """q's weight per head ([head_dim]); k's per head or over its heads ([heads * head_dim], OLMo 2)."""
    heads = {"bshd": 2, "bhsd": 1, "sbhd": 2, "thd": 1}[fmt]
    q_weight = torch.randn(q.shape[-1], dtype=dtype)
    k_weight = torch.randn(k.shape[heads] * k.shape[-1] if k_over_heads else k.shape[-1], dtype=dtype)
    return q_weight, k_weight


def run_qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, scale, layout, fmt, offset,
                     cu_seqlens=None, pair_axis=None, **q_scale):
    """The forward, the backward (its four gradients, the weights' twice: their bits must not vary between runs)
    and the in-place form, each on both devices; q_scale: the query scale's keywords (q_scale_beta, ...)."""
    args = (positions, inv_freq, eps, norm, scale, layout, fmt, offset, cu_seqlens, pair_axis)
    run_both(ops.qk_norm_rope, q, k, q_weight, k_weight, *args, **q_scale)
    grad_q, grad_k = torch.randn(q.shape, dtype=q.dtype), torch.randn(k.shape, dtype=k.dtype)
    expected = run_both(ops.qk_norm_rope_backward, grad_q, grad_k, q, k, q_weight, k_weight, *args, **q_scale)
    again = ops.qk_norm_rope_backward(*[to_cuda(t) for t in (grad_q, grad_k, q, k, q_weight, k_weight)],
                                      *[to_cuda(a) for a in args], **q_scale)
    same(again, expected)
    q_cpu, k_cpu = q.clone(), k.clone()
    ops.qk_norm_rope_(q_cpu, k_cpu, q_weight, k_weight, *args, **q_scale)
    q_cuda, k_cuda = to_cuda(q), to_cuda(k)
    ops.qk_norm_rope_(q_cuda, k_cuda, to_cuda(q_weight), to_cuda(k_weight), *[to_cuda(a) for a in args], **q_scale)
    same((q_cuda, k_cuda), (q_cpu, k_cpu))


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("fmt", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("view", ["contiguous", "transposed", "channel_strided", "unaligned"])
def test_qk_norm_rope_forward_backward_and_in_place(dtype, norm, fmt, view):
    torch.manual_seed(0)
    q = rope_input(fmt, dtype, head_dim=32, layout_view=view)
    k = rope_input(fmt, dtype, heads=2, head_dim=32, layout_view=view)
    batch, seq = (1, q.shape[0]) if fmt == "thd" else (q.shape[PERM_B[fmt]], q.shape[PERM_S[fmt]])
    for layout in ("neox", "gptj"):
        for k_over_heads, weight_dtype in [(False, dtype), (True, torch.float32)]:
            q_weight, k_weight = qk_norm_weights(q, k, fmt, k_over_heads, weight_dtype)
            # Every channel rotated, and 12 of 32 (the rest normalized only).
            for rotary_dim in (32, 12):
                inv_freq, _ = FQ.rope(rotary_dim)
                for positions in [None, torch.randint(0, 4096, (seq,))]:
                    run_qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, 1e-6, norm, 0.75, layout, fmt, 3)
            inv_freq, _ = FQ.rope(32)
            if fmt == "thd":
                for cu in [torch.tensor([0, 2, 2, seq]), torch.tensor([0, seq], dtype=torch.int32)]:
                    run_qk_norm_rope(q, k, q_weight, k_weight, None, inv_freq, 1e-5, norm, 1.0, layout, fmt, 4, cu)
                    run_qk_norm_rope(q, k, q_weight, k_weight, torch.arange(seq), inv_freq, 1e-5, norm, 1.0, layout,
                                     fmt, 0, cu)
            else:
                per_row = torch.randint(0, 10**6, (batch, seq))
                run_qk_norm_rope(q, k, q_weight, k_weight, per_row, inv_freq, 0.0, norm, 1.0, layout, fmt, 0)


@cuda_only
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", NORMS)
def test_qk_norm_rope_nan_payloads_in_bf16(norm, weight_dtype):
    """bf16 rounds in 32-bit lanes with integer arithmetic, where a NaN with ones in its low half could carry into
    the sign: the CPU skips the select of llama's first rounding (its NaNs keep their payload in the high half), the
    GPU cannot (its arithmetic returns every NaN as 0x7FFFFFFF). NaNs of several payloads and infinities in q, NaNs
    in the weight: the CPU's bits, every NaN stored as 0x7FC0."""
    q, weight = nan_payload_q_and_weight(norm, weight_dtype)
    out = run_both(ops.qk_norm_rope, q, q, weight, weight, None, FQ.rope(32)[0], 1e-6, norm)
    assert out[0].isnan().any() and (out[0].view(torch.int16)[out[0].isnan()] == 0x7FC0).all()


# The query scale (q_scale_beta, q_scale_length, q_scale_shift): q's coefficients times s(p), rounded after the
# attention scale, the CPU's bits. Heads past half a chunk of coefficients (a scaled chunk holds 128 pairs), an empty
# q (k is then the first view, and unscaled), positions below -shift (scaled by 1).

Q_SCALES = [dict(q_scale_beta=0.1, q_scale_length=8192, q_scale_shift=0),
            dict(q_scale_beta=0.5, q_scale_length=3, q_scale_shift=-4)]


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("view", ["contiguous", "channel_strided"])
def test_rope_qk_query_scale(dtype, layout, view):
    torch.manual_seed(0)
    for q_scale in Q_SCALES:
        for head_dim in (32, 320):
            inv_freq, scale = FQ.rope(head_dim)
            for fmt in ("bshd", "bhsd"):
                q = rope_input(fmt, dtype, heads=4, head_dim=head_dim, layout_view=view)
                k = rope_input(fmt, dtype, heads=2, head_dim=head_dim, layout_view=view)
                batch, seq = q.shape[PERM_B[fmt]], q.shape[PERM_S[fmt]]
                for positions, offset in [(None, 7), (torch.randint(-10, 10**5, (seq,)), 0),
                                          (torch.randint(0, 10**6, (batch, seq)), 0)]:
                    for op in (ops.rope_qk, ops.rope_qk_backward):
                        out = run_both(op, q, k, positions, inv_freq, 0.75, layout, fmt, offset, **q_scale)
                    assert torch.equal(out[1], ops.rope_qk_backward(q, k, positions, inv_freq, 0.75, layout, fmt,
                                                                    offset)[1])  # k unscaled
            # thd: the positions restart at each sequence of cu_seqlens.
            q = rope_input("thd", dtype, seq=11, heads=4, head_dim=head_dim, layout_view=view)
            k = rope_input("thd", dtype, seq=11, heads=2, head_dim=head_dim, layout_view=view)
            for cu in [torch.tensor([0, 3, 3, 11]), torch.tensor([0, 11], dtype=torch.int32)]:
                for op in (ops.rope_qk, ops.rope_qk_backward):
                    run_both(op, q, k, None, inv_freq, scale, layout, "thd", 5, cu, **q_scale)
                    run_both(op, q, k, torch.arange(11) * 1000, inv_freq, scale, layout, "thd", 0, cu, **q_scale)
        # An empty q: k alone, unscaled.
        inv_freq, _ = FQ.rope(32)
        q, k = torch.randn(2, 5, 0, 32, dtype=dtype), torch.randn(2, 5, 2, 32, dtype=dtype)
        out = run_both(ops.rope_qk, q, k, None, inv_freq, 1.0, layout, "bshd", 3, **q_scale)
        same(ops.rope_qk(to_cuda(q), to_cuda(k), None, inv_freq.cuda(), 1.0, layout, "bshd", 3)[1], out[1])


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["llama", "fused"])
@pytest.mark.parametrize("fmt", ["bshd", "bhsd", "thd"])
def test_qk_norm_rope_query_scale(dtype, norm, fmt):
    torch.manual_seed(0)
    for q_scale in Q_SCALES:
        for head_dim in (32, 320):
            q = rope_input(fmt, dtype, heads=4, head_dim=head_dim)
            k = rope_input(fmt, dtype, heads=2, head_dim=head_dim)
            q_weight, k_weight = qk_norm_weights(q, k, fmt, False, dtype)
            inv_freq, scale = FQ.rope(head_dim)
            for layout in ("neox", "gptj"):
                if fmt == "thd":
                    seq = q.shape[0]
                    for cu in [torch.tensor([0, 2, 2, seq]), torch.tensor([0, seq], dtype=torch.int32)]:
                        run_qk_norm_rope(q, k, q_weight, k_weight, None, inv_freq, 1e-5, norm, scale, layout, fmt, 4,
                                         cu, **q_scale)
                        run_qk_norm_rope(q, k, q_weight, k_weight, torch.arange(seq) * 977, inv_freq, 1e-5, norm, 1.0,
                                         layout, fmt, 0, cu, **q_scale)
                    continue
                batch, seq = q.shape[PERM_B[fmt]], q.shape[PERM_S[fmt]]
                for positions, offset in [(None, 3), (torch.randint(-10, 10**5, (seq,)), 0),
                                          (torch.randint(0, 10**6, (batch, seq)), 0)]:
                    run_qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, 1e-6, norm, 0.75, layout, fmt,
                                     offset, **q_scale)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_qk_norm_rope_pair_axis(dtype, fmt):
    q = rope_input(fmt, dtype, head_dim=32)
    k = rope_input(fmt, dtype, heads=2, head_dim=32, layout_view="channel_strided")
    seq = q.shape[0] if fmt == "thd" else q.shape[1]
    inv_freq, pair_axis = FQ.mrope(32, [4, 6, 6], 1e4)
    for norm, layout, k_over_heads in [("llama", "neox", False), ("olmo2", "gptj", True), ("fused", "neox", True)]:
        q_weight, k_weight = qk_norm_weights(q, k, fmt, k_over_heads, dtype)
        run_qk_norm_rope(q, k, q_weight, k_weight, torch.randint(0, 4096, (3, seq)), inv_freq, 1e-6, norm, 1.0,
                         layout, fmt, 2, None, pair_axis)
        if fmt == "thd":
            run_qk_norm_rope(q, k, q_weight, k_weight, torch.randint(0, 99, (3, seq)), inv_freq, 1e-6, norm, 1.0,
                             layout, fmt, 1, torch.tensor([0, 2, seq]), pair_axis.int())
        else:
            run_qk_norm_rope(q, k, q_weight, k_weight, torch.randint(0, 10**5, (3, q.shape[0], seq)), inv_freq,
                             1e-6, norm, 1.0, layout, fmt, 0, None, pair_axis)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_norm_rope_shapes_past_one_block(dtype):
    # 80 heads (more than the 64 groups a block holds at once); head_dim 8, over all heads (a lane's channels step
    # over several heads, 16 > head_dim); 5000 pairs (cos/sin past 32 KiB: a global row per block); a decoding step
    # (B = 8, S = 1: a token's heads split over several blocks).
    cases = [((2, 3, 80, 64), (2, 3, 8, 64), 64, False),
             ((2, 5, 6, 8), (2, 5, 3, 8), 8, True),
             ((1, 2, 2, 10000), (1, 2, 1, 10008), 10000, False),
             ((8, 1, 32, 128), (8, 1, 8, 128), 128, True)]
    for q_shape, k_shape, rotary_dim, k_over_heads in cases:
        q, k = torch.randn(q_shape, dtype=dtype), torch.randn(k_shape, dtype=dtype)
        q_weight, k_weight = qk_norm_weights(q, k, "bshd", k_over_heads, dtype)
        inv_freq, scale = FQ.rope(rotary_dim, 5e5)
        positions = torch.randint(0, 8192, (q_shape[0], q_shape[1]))
        for norm in ("llama", "gemma"):
            run_qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, 1e-6, norm, scale, "neox", "bshd", 0)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_weight_gradients_over_many_chunks(dtype):
    # 20012 tokens: 1001 chunks of 20 (tokens_per_chunk past 16384 tokens), the last of 12, and float32 partial sums
    # that depend on where the chunks split: the CPU's bits only where the GPU chunks the tokens as the CPU does.
    q, k = torch.randn(4, 5003, 4, 32, dtype=dtype), torch.randn(4, 5003, 1, 32, dtype=dtype)
    q_weight, k_weight = qk_norm_weights(q, k, "bshd", True, dtype)
    inv_freq, _ = FQ.rope(32)
    grads = torch.randn(q.shape, dtype=dtype), torch.randn(k.shape, dtype=dtype)
    args = (q, k, q_weight, k_weight, None, inv_freq, 1e-6, "olmo2", 1.0, "neox", "bshd", 0)
    expected = run_both(ops.qk_norm_rope_backward, *grads, *args)
    for _ in range(2):
        actual = ops.qk_norm_rope_backward(*[to_cuda(t) for t in (*grads, *args)])
        same(actual[2:], expected[2:])


@cuda_only
@pytest.mark.parametrize("norm", NORMS)
def test_qk_norm_rope_autograd_matches_the_cpu(norm):
    inv_freq, _ = FQ.rope(16)
    q, k = torch.randn(2, 5, 4, 16, requires_grad=True), torch.randn(2, 5, 2, 16, requires_grad=True)
    q_weight, k_weight = torch.randn(16, requires_grad=True), torch.randn(32, requires_grad=True)
    positions = torch.randint(0, 100, (2, 5))

    def grads(q, k, q_weight, k_weight, positions, inv_freq):
        rq, rk = PF.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, 1e-6, norm)
        return torch.autograd.grad((rq * rq.detach()).sum() + (rk * 3).sum(), (q, k, q_weight, k_weight))

    expected = grads(q, k, q_weight, k_weight, positions, inv_freq)
    cuda_leaves = [t.detach().cuda().requires_grad_() for t in (q, k, q_weight, k_weight)]
    same(grads(*cuda_leaves, positions.cuda(), inv_freq.cuda()), expected)


@cuda_only
def test_qk_norm_rope_under_graph_capture():
    inv_freq, _ = FQ.rope(64)
    inv_freq = inv_freq.cuda()
    q, k = torch.randn(2, 16, 4, 64, device="cuda"), torch.randn(2, 16, 2, 64, device="cuda")
    q_weight, k_weight = torch.randn(64, device="cuda"), torch.randn(128, device="cuda")
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)

    def step():
        out = ops.qk_norm_rope(q, k, q_weight, k_weight, None, inv_freq, 1e-6, "llama", 1.0, "neox", "bshd", 5)
        return (*out, *ops.qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight, None, inv_freq, 1e-6,
                                                 "llama", 1.0, "neox", "bshd", 5))

    replays_follow_new_values(*captured_graph(step), step, q)


# ---------------------------------------------------------------- sinusoidal and learned

@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["interleaved", "half", "half_cos_first"])
def test_sinusoidal_family(dtype, layout):
    inv_freq = FQ.sinusoidal(64)
    run_both(ops.sinusoidal, torch.rand(3, 7) * 1000, inv_freq, layout, dtype, 2)
    run_both(ops.sinusoidal, torch.randint(-100, 5000, (9,), dtype=torch.int16), inv_freq, layout, dtype, 0)
    for width in (64, 65):  # even: 16-byte vectors; odd: the unencoded last channel, element by element
        x = torch.randn(2, 5, width, dtype=dtype)
        for positions in [None, torch.randint(0, 100, (5,)), torch.randint(0, 100, (2, 5), dtype=torch.int32)]:
            run_both(ops.add_sinusoidal, x, positions, inv_freq, 8.0, layout, 3)
        run_both(ops.add_sinusoidal, x[:, 1:], None, inv_freq, 1.0, layout, 0)  # a sliced view
        table = torch.randn(30, width, dtype=dtype)
        tokens = torch.randint(0, 30, (2, 5))
        run_both(ops.embed_sinusoidal, tokens, table, None, inv_freq, 2.0, 1, layout, 4)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
def test_add_sinusoidal_backward_is_scale(dtype):
    """The gradient of x, computed by add_sinusoidal itself with every token a prefix token: grad * x_scale as
    PyTorch's mul gives it on the GPU, and the CPU's bits."""
    x = torch.randn(2, 37, 67, dtype=dtype, device="cuda", requires_grad=True)
    grad = torch.randn(2, 37, 67, dtype=dtype, device="cuda")
    PF.add_sinusoidal(x, None, FQ.sinusoidal(66).cuda(), 1 / 3 + 1e-12).backward(grad)
    same(x.grad, grad * (1 / 3 + 1e-12))
    cpu = x.detach().cpu().requires_grad_()
    PF.add_sinusoidal(cpu, None, FQ.sinusoidal(66), 1 / 3 + 1e-12).backward(grad.cpu())
    same(x.grad, cpu.grad)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("convention", FQ.GRID_CONVENTIONS)
def test_sinusoidal_grids(dtype, convention):
    """Multi-axis positions (shared and per row), every grid convention, prefix tokens, an odd width."""
    inv_freq, pair_axis, layout = FQ.grid_sinusoidal(48, convention)
    grid = [2, 3, 5] if convention == "cogvideox" else [6, 5]
    positions = PF.grid_positions(grid, scale=[1.3] * len(grid), interpolation_scale=0.7)
    run_both(ops.sinusoidal, positions, inv_freq, layout, dtype, 1, pair_axis)
    for width in (48, 49):
        x = torch.randn(2, 2 + positions.shape[1], width, dtype=dtype)
        run_both(ops.add_sinusoidal, x, positions, inv_freq, 2.0, layout, 0, pair_axis, 2)
        per_row = torch.stack([positions, positions.flip(-1)], 1)  # [n_axes, B, N]
        run_both(ops.add_sinusoidal, x, per_row, inv_freq, 1.0, layout, 3, pair_axis.int(), 2)


@cuda_only
def test_real_positions_and_learned_frequencies():
    """Floating rotary positions, and the gradient with respect to inv_freq, as on the CPU."""
    inv_freq, pair_axis = FQ.axial(16)
    positions = PF.patch_center_positions(3, 4, 2, 0.1, 1.5, 2.0, torch.Generator().manual_seed(0))
    q = torch.randn(2, 14, 2, 16)
    run_both(ops.rope_qk, q, q * 0.5, positions, inv_freq, 1.0, "neox", "bshd", 0, None, pair_axis, 0.0, 1, 0)
    grads = []
    for device in ("cpu", "cuda"):
        w = inv_freq.to(device).requires_grad_()
        x = q.double().to(device)
        out_q, out_k = PF.rope_qk(x, x * 0.5, positions.to(device), w, pair_axis=pair_axis.to(device))
        weights = torch.linspace(-1, 1, out_q.numel(), dtype=torch.float64, device=device).view_as(out_q)
        ((out_q * weights).sum() + out_k.sum()).backward()
        grads.append(w.grad.cpu())
    assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
def test_learned_family(dtype):
    for width in (64, 63):
        weight = torch.randn(40, width, dtype=dtype)
        x = torch.randn(3, 6, width, dtype=dtype)
        run_both(ops.learned, weight, torch.randint(0, 38, (4, 5)), 2, None)
        for positions in [None, torch.randint(0, 30, (6,)), torch.randint(0, 30, (3, 6), dtype=torch.int32)]:
            run_both(ops.add_learned, x, weight, positions, 1, None)
            run_both(ops.embed_learned, torch.randint(0, 40, (3, 6)), weight, weight[:35], positions, 0.5, None, 2, None)
        run_both(ops.add_learned, x[:, :, : width - 1], weight[:, : width - 1], None, 0, None)  # unaligned rows
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]])
    run_both(ops.positions_from_mask, mask, -1)
    run_both(ops.positions_from_mask, mask.bool(), 0)
    run_both(ops.make_positions, torch.tensor([[1, 1, 5, 6], [7, 8, 9, 1]]), 1)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode, align_corners, antialias", [
    ("bicubic", False, False), ("bicubic", True, False), ("bicubic", False, True), ("bilinear", False, False),
    ("bilinear", True, True)])
def test_resampled_learned_same_bits(dtype, mode, align_corners, antialias):
    """Resampled tables, their add and the adjoint (a gather, float64 sums in the CPU's order): the CPU's bits."""
    for (hs, ws), (h, w), scale_factor in [((14, 14), (24, 24), None), ((9, 7), (4, 5), None),
                                            ((8, 8), (9, 9), [1.1875, 1.1875])]:
        for width, prefix in [(64, 1), (33, 0)]:
            weight = torch.randn(prefix + hs * ws, width, dtype=dtype)
            x = torch.randn(3, prefix + h * w, width, dtype=dtype)
            args = ([hs, ws], [h, w], mode, align_corners, antialias, scale_factor, prefix)
            run_both(ops.resample_learned, weight, *args)
            run_both(ops.add_resampled_learned, x, weight, *args)
            run_both(ops.add_resampled_learned, x[:, :, : width - 1], weight[:, : width - 1], *args)
            run_both(ops.resample_learned_backward, x, *args)
            run_both(ops.resample_learned_backward, x.transpose(0, 1).contiguous().transpose(0, 1), *args)


@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("width", [64, 33])
def test_embedding_backward_same_bits(dtype, width):
    grad = torch.randn(4, 50, width, dtype=dtype)
    ids = torch.randint(0, 20, (4, 50))
    ids[:, ::3] = 7  # a frequent row: a long ordered sum
    for indices in [ids, ids[0]]:  # per row, and shared by the batch
        for padding_idx in [None, 7]:
            run_both(ops.embedding_backward, grad, indices, 25, 1.5, padding_idx)
    run_both(ops.embedding_backward, grad.transpose(0, 1), ids.t().int(), 25, 1.0, None)


# ---------------------------------------------------------------- ALiBi and T5

@cuda_only
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["causal", "symmetric"])
def test_alibi_family(dtype, mode):
    slopes = PF.alibi_slopes(8)
    run_both(ops.alibi_bias, slopes, 5, 9, mode, 2, 4, dtype)
    run_both(ops.alibi_bias, torch.rand(3, 8).to(dtype), 4, 4, mode, 0, None, None)
    for k_len in (40, 37):  # whole vectors, and not
        scores = torch.randn(2, 4, 6, k_len, dtype=dtype)
        run_both(ops.add_alibi, scores, slopes, mode, 4)
        run_both(ops.add_alibi, scores.transpose(2, 3).contiguous().transpose(2, 3), slopes, mode, 0)  # key stride
        expected = scores.clone()
        ops.add_alibi_(expected[:, 1:], slopes, mode, 1)  # in place through a view
        actual = to_cuda(scores)
        ops.add_alibi_(actual[:, 1:], slopes.cuda(), mode, 1)
        same(actual, expected)
        grad = torch.randn(2, 4, 6, k_len, dtype=dtype)
        run_both(ops.alibi_backward, grad, slopes.to(dtype), mode, 4)
        run_both(ops.alibi_backward, grad, torch.rand(2, 4).to(dtype), mode, 0)
        run_both(ops.alibi_backward, grad.transpose(2, 3).contiguous().transpose(2, 3), slopes, mode, 0)


@cuda_only
@pytest.mark.parametrize("bidirectional, num_buckets, max_distance",
                         [(True, 32, 128), (False, 32, 128), (True, 64, 1000), (False, 5, 7), (True, 1200, 5000),
                          (True, 8, 2**40)])
def test_t5_buckets_and_bias(bidirectional, num_buckets, max_distance):
    # (True, 1200, ...): more log buckets than the kernel parameters hold (the device-memory table).
    relative = torch.cat([torch.arange(-3000, 3000), torch.tensor([2**62, -(2**62), -(2**63), 2**63 - 1, 2**41])])
    run_both(ops.relative_position_bucket, relative, bidirectional, num_buckets, max_distance)
    run_both(ops.relative_position_bucket, relative[:6000].int(), bidirectional, num_buckets, max_distance)
    for dtype in FLOATS:
        weight = torch.randn(num_buckets, 3, dtype=dtype)
        run_both(ops.t5_bias, weight, 7, 12, bidirectional, num_buckets, max_distance, 5)
        run_both(ops.t5_bias, weight.t().contiguous().t(), 16, 16, bidirectional, num_buckets, max_distance, 0)
        run_both(ops.t5_bias_backward, torch.randn(1, 3, 7, 12, dtype=dtype), bidirectional, num_buckets,
                 max_distance, -4)


@cuda_only
def test_t5_device_memory_table_waits_for_nothing_and_replays():
    """A table past the kernel parameters (1200 bidirectional buckets) is copied to the device once, without a wait,
    and kept: calls wait for nothing, and a captured graph replays with a live table."""
    weight = torch.randn(1200, 3)
    weight_cuda = weight.cuda()
    expected = ops.t5_bias(weight, 7, 12, True, 1200, 5000, 5)
    graph, captured = captured_graph(lambda: [ops.t5_bias(weight_cuda, 7, 12, True, 1200, 6000, 5)])
    graph.replay()
    torch.cuda.synchronize()
    same(captured[0], ops.t5_bias(weight, 7, 12, True, 1200, 6000, 5))
    torch.cuda.set_sync_debug_mode("error")
    try:
        actual = ops.t5_bias(weight_cuda, 7, 12, True, 1200, 5000, 5)
        actual = ops.t5_bias(weight_cuda, 7, 12, True, 1200, 5000, 5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    same(actual, expected)


# ---------------------------------------------------------------- gradients end to end

@cuda_only
def test_autograd_gradients_match_the_cpu():
    torch.manual_seed(1)
    inv_freq, _ = FQ.rope(16)
    q = torch.randn(2, 5, 4, 16, requires_grad=True)
    k = torch.randn(2, 5, 2, 16, requires_grad=True)
    wte = torch.randn(30, 16, requires_grad=True)
    wpe = torch.randn(10, 16, requires_grad=True)
    slopes = torch.rand(4, requires_grad=True)
    table = torch.randn(32, 4, requires_grad=True)
    tokens = torch.randint(0, 30, (2, 5))

    sin_freq = FQ.sinusoidal(16)

    def loss(q, k, wte, wpe, slopes, table, tokens, inv_freq, sin_freq):
        rq, rk = PF.rope_qk(q, k, None, inv_freq)
        h = PF.embed_learned(tokens, wte, wpe, None)
        scores = rq.transpose(1, 2) @ rk.repeat_interleave(2, 2).transpose(1, 2).transpose(-1, -2)  # [2, 4, 5, 5]
        scores = PF.add_alibi(scores, slopes) + PF.t5_bias(table, 5, 5, True, 32, 128)
        return scores.square().sum() + PF.add_sinusoidal(h, None, sin_freq, 2.0).square().sum()

    inputs = [q, k, wte, wpe, slopes, table]
    expected = torch.autograd.grad(loss(*inputs, tokens, inv_freq, sin_freq), inputs)
    cuda_inputs = [t.detach().cuda().requires_grad_() for t in inputs]
    actual = torch.autograd.grad(loss(*cuda_inputs, tokens.cuda(), inv_freq.cuda(), sin_freq.cuda()), cuda_inputs)
    for a, e in zip(actual, expected):
        assert_close(a.cpu(), e, rtol=1e-5, atol=1e-5)  # the matmul and sums differ between the devices


# ---------------------------------------------------------------- bad index data
# On the CPU a bad index (a position outside its domain, a token id outside the vocabulary, bad cu_seqlens, a pair_axis
# value out of range, a cache slot out of range or taken twice) raises at the call. On the GPU the index data lives in
# device memory, and reading it on the host would make every call wait for the GPU: by default (asynchronous checks)
# the op checks it on the device, stays in bounds, and records the first failure there, which posenc.cuda.check_errors()
# raises with the CPU's message word for word, as does the next posenc CUDA op called after the failing kernel has
# run. Synchronous checks (posenc.cuda.set_sync_checks(True), or POSENC_CUDA_SYNC_CHECKS=1 when posenc loads) raise at
# the call, as the CPU does.

def bad_index_calls():
    """name -> (op, CPU arguments): calls that the CPU refuses for their index data alone (freshly built: the in-place
    rope_qk_cache_ writes its q and caches)."""
    inv_freq, _ = FQ.rope(8)
    x = torch.randn(2, 3, 2, 8)
    table = torch.randn(10, 8)

    def cache_call(positions=None, cache_positions=None):
        q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
        return ops.rope_qk_cache_, (q, k, v, torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 8), positions, inv_freq,
                                    cache_positions)

    return {
        "position past 2^53": (ops.rope, (x, torch.tensor([0, 2**53 + 1, 3]), inv_freq)),
        "cu_seqlens decreasing": (ops.rope, (x[0], None, inv_freq, 1.0, "neox", "thd", 0, torch.tensor([0, 2, 1]))),
        "cu_seqlens short of the tokens": (ops.rope, (x[0], None, inv_freq, 1.0, "neox", "thd", 0,
                                                      torch.tensor([0, 2]))),
        "table row past the table": (ops.add_learned, (torch.randn(2, 3, 8), table, torch.tensor([0, 10, 1]))),
        "negative table row": (ops.learned, (table, torch.tensor([[1, -1]]), 0)),
        "token id past the vocabulary": (ops.embed_learned, (torch.tensor([[1, 10]]), table, table, None)),
        "negative token id": (ops.embed_sinusoidal, (torch.tensor([[-1, 2]]), table, None, FQ.sinusoidal(8))),
        "gradient row past num_rows": (ops.embedding_backward, (torch.randn(2, 8), torch.tensor([3, 10]), 10)),
        "real position past 2^53": (ops.add_sinusoidal, (torch.randn(2, 8), torch.tensor([2.0**60, 1.0]),
                                                         FQ.sinusoidal(8))),
        "NaN real position": (ops.rope, (x, torch.tensor([0.5, float("nan"), 3.0]), inv_freq)),
        "position plus offset overflows": (ops.sinusoidal, (torch.tensor([2**62, 1]), FQ.sinusoidal(8), "interleaved",
                                                            None, 2**62)),
        "pair_axis past the axes of positions": (ops.add_sinusoidal, (
            torch.randn(1, 4, 8), torch.zeros(2, 3), FQ.sinusoidal(8), 1.0, "half_per_axis", 0,
            torch.tensor([0, 1, 2, 1]), 1)),
        # Several bad arguments in one call: the first the CPU checks is the one raised (pair_axis's values, then
        # cu_seqlens before them, then the positions after them), so the device must report its checks in that order.
        "pair_axis value past the axes": (ops.rope, (x, torch.zeros(2, 3, dtype=torch.long), inv_freq, 1.0, "neox",
                                                     "bshd", 0, None, torch.tensor([0, 1, 2, 1]))),
        "cu_seqlens before pair_axis": (ops.rope, (x[0], torch.zeros(2, 3, dtype=torch.long), inv_freq, 1.0, "neox",
                                                   "thd", 0, torch.tensor([0, 2]), torch.tensor([0, 1, 2, 1]))),
        "pair_axis before positions": (ops.rope, (x, torch.tensor([[0, 1, 2], [3, 2**53, 5]]), inv_freq, 1.0, "neox",
                                                  "bshd", 1, None, torch.tensor([0, 1, -1, 1]))),
        "positions after a good pair_axis": (ops.rope, (x, torch.tensor([[0, 1, 2], [3, 2**53, 5]]), inv_freq, 1.0,
                                                        "neox", "bshd", 1, None, torch.tensor([0, 1, 1, 1]))),
        # Cache slots (rope_qk_cache_ into [B, H, S_max = 6, D] caches): out of range, or one slot for two tokens.
        "cache slot past S_max": cache_call(cache_positions=torch.tensor([0, 1, 6])),
        "cache slot taken twice": cache_call(cache_positions=torch.tensor([[0, 1, 2], [3, 4, 3]])),
        "slot from positions past S_max": cache_call(positions=torch.tensor([0, 6, 1])),
        "slot from positions taken twice": cache_call(positions=torch.tensor([2, 1, 2])),
    }


def host_checked_calls():
    """name -> (op, CPU arguments): bad calls whose error needs no device data, raised at the call in both modes: an
    offset that takes the absent positions (offset + arange) out of their domain, checked on the host from the
    arguments; and the two ops whose output size depends on their data, which run on host copies of it (csrc/cuda/
    host.cu)."""
    inv_freq, _ = FQ.rope(8)
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
    return {
        "offset past 2^53": (ops.rope, (torch.randn(2, 3, 2, 8), None, inv_freq, 1.0, "neox", "bshd", 2**63 - 2)),
        "offset past the table": (ops.add_learned, (torch.randn(2, 3, 8), torch.randn(10, 8), None, 8)),
        "offset past the cache slots": (ops.rope_qk_cache_, (q, k, v, torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 8),
                                                             None, inv_freq, None, "bhsd", 1.0, "neox", "bshd", 4)),
        "mrope grid of another size": (ops.mrope_positions, (torch.tensor([[0, 1, 1]]), torch.tensor([[1, 2, 2]]))),
        "mrope unknown token type": (ops.mrope_positions, (torch.tensor([[0, 3]]),)),
        "zigzag cu_seqlens decreasing": (ops.zigzag_positions_varlen, (torch.tensor([0, 4, 3]), 2, 0)),
        "zigzag length not a multiple": (ops.zigzag_positions_varlen, (torch.tensor([0, 4, 10]), 2, 0)),
    }


def message(error):
    """An error's message without the C++ backtrace that TORCH_SHOW_CPP_STACKTRACES=1 appends (it names the raising
    call site, which differs between an op and check_errors())."""
    return str(error).split("\nException raised from ")[0]


def cpu_error(op, args):
    """The error the CPU op raises for `args`. The suite's re-run of each CPU call on the GPU (conftest.py's
    ShadowDevice) is off for it: in asynchronous mode that re-run would leave a failure of its own on the device."""
    with _disable_current_modes(), pytest.raises(Exception) as raised:
        op(*args)
    return raised.value


@contextlib.contextmanager
def sync_checks_set_to(enabled):
    """posenc.cuda's mode for the block, whatever POSENC_CUDA_SYNC_CHECKS says; the previous mode after."""
    previous = posenc.cuda.sync_checks()
    posenc.cuda.set_sync_checks(enabled)
    try:
        yield
    finally:
        posenc.cuda.set_sync_checks(previous)


@pytest.fixture
def synchronous():
    """Synchronous checks for one test: each op waits for its own checks and raises at the call."""
    with sync_checks_set_to(True):
        yield


@pytest.fixture
def asynchronous():
    """The default mode, for a test that reads failures with check_errors(). A failure the test left unread (it
    failed first) is read and dropped after it, so that it does not fail the next test's first op."""
    with sync_checks_set_to(False):
        yield
        try:
            posenc.cuda.check_errors()
        except RuntimeError:
            pass


def good_call_after_an_error():
    """A call with index data on the GPU, against the CPU: it raises nothing once the failure has been raised."""
    inv_freq, _ = FQ.rope(8)
    run_both(ops.rope, torch.randn(2, 3, 2, 8), torch.tensor([4, 0, 2]), inv_freq)


def check_errors_raises_once(expected):
    """posenc.cuda.check_errors() raises the CPU's error `expected`, then nothing: the failure is raised once."""
    with pytest.raises(RuntimeError) as raised:
        posenc.cuda.check_errors()
    assert message(raised.value) == message(expected)
    posenc.cuda.check_errors()


@cuda_only
@pytest.mark.parametrize("name", list(bad_index_calls()))
def test_synchronous_checks_raise_the_cpu_error_at_the_call(name, synchronous):
    op, args = bad_index_calls()[name]
    expected = cpu_error(op, args)
    with pytest.raises(type(expected)) as raised:
        op(*[to_cuda(a) for a in args])
    assert message(raised.value) == message(expected)
    posenc.cuda.check_errors()  # raised at the call, so not again
    good_call_after_an_error()


@cuda_only
@pytest.mark.parametrize("name", list(bad_index_calls()))
def test_asynchronous_checks_raise_the_cpu_error_at_check_errors(name, asynchronous):
    """The call returns without waiting for the GPU and raises nothing (its kernels stay in bounds: an access out
    of them would surface at check_errors() as a CUDA error, not the CPU's message); check_errors() raises the CPU's
    error once, and the ops work on."""
    op, args = bad_index_calls()[name]
    expected = cpu_error(op, args)
    assert type(expected) is RuntimeError
    op(*[to_cuda(a) for a in args])
    check_errors_raises_once(expected)
    good_call_after_an_error()


@cuda_only
@pytest.mark.parametrize("mode", ["synchronous", "asynchronous"])
@pytest.mark.parametrize("name", list(host_checked_calls()))
def test_errors_known_on_the_host_raise_at_the_call_in_both_modes(name, mode, request):
    request.getfixturevalue(mode)
    op, args = host_checked_calls()[name]
    expected = cpu_error(op, args)
    with pytest.raises(type(expected)) as raised:
        op(*[to_cuda(a) for a in args])
    # The first line: zigzag_positions_varlen's message goes on to print cu_seqlens, with its tensor type.
    assert message(raised.value).splitlines()[0] == message(expected).splitlines()[0]
    posenc.cuda.check_errors()


@cuda_only
def test_the_next_cuda_op_raises_a_failure_once_its_kernel_has_run(asynchronous):
    """Without check_errors(): after the GPU has run the failing call, the next posenc CUDA op raises its error
    (every op reads the record at its start, with no wait), once."""
    op, args = bad_index_calls()["token id past the vocabulary"]
    expected = cpu_error(op, args)
    op(*[to_cuda(a) for a in args])
    torch.cuda.synchronize()
    inv_freq, _ = FQ.rope(8)
    x = torch.randn(2, 3, 2, 8)
    with pytest.raises(RuntimeError) as raised:
        ops.rope(x.cuda(), None, inv_freq.cuda())
    assert message(raised.value) == message(expected)
    posenc.cuda.check_errors()
    run_both(ops.rope, x, None, inv_freq)


@cuda_only
def test_the_first_of_several_failures_is_raised(asynchronous):
    """Two failing calls in a row on one stream: the record keeps the first in call order, and the second's failure,
    found while the record was held, is not raised later. The GPU sleeps before the first call's kernels, so that
    neither has run when the second call starts (a call that started after the first failure had run would raise it
    at its start instead of running); every argument is on the GPU before that, since a copy from the host waits."""
    first_op, first_args = bad_index_calls()["negative table row"]
    second_op, second_args = bad_index_calls()["cache slot taken twice"]
    expected = cpu_error(first_op, first_args)
    assert message(cpu_error(second_op, second_args)) != message(expected)
    first_args, second_args = [to_cuda(a) for a in first_args], [to_cuda(a) for a in second_args]
    # A first run of each loads its kernels and caches its memory (either could wait for the GPU once).
    for op, args in ((first_op, first_args), (second_op, second_args)):
        op(*args)
        with pytest.raises(RuntimeError):
            posenc.cuda.check_errors()
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # clock cycles: about a quarter of a second
    first_op(*first_args)
    second_op(*second_args)
    check_errors_raises_once(expected)
    good_call_after_an_error()


@cuda_only
def test_graph_replays_check_their_own_index_data(asynchronous):
    """The checks are captured with the kernels: a replay whose static inputs hold a bad token id, or a bad pair_axis,
    records the CPU's error for those values, as an eager call would; a replay of good values records nothing and
    gives the CPU's bits."""
    inv_freq, pair_axis = FQ.mrope(32, [4, 6, 6])
    x = torch.randn(2, 5, 4, 32)
    positions = torch.randint(0, 1000, (3, 2, 5))
    tokens = torch.randint(0, 50, (2, 5))
    wte, wpe = torch.randn(50, 32), torch.randn(40, 32)
    cuda = {name: t.cuda() for name, t in dict(inv_freq=inv_freq, pair_axis=pair_axis, x=x, positions=positions,
                                                tokens=tokens, wte=wte, wpe=wpe).items()}

    def step():
        return (ops.rope(cuda["x"], cuda["positions"], cuda["inv_freq"], 1.0, "neox", "bshd", 0, None,
                         cuda["pair_axis"]),
                ops.embed_learned(cuda["tokens"], cuda["wte"], cuda["wpe"], None))

    graph, captured = captured_graph(step)
    posenc.cuda.check_errors()  # the warm-up's good values
    bad_tokens = tokens.clone()
    bad_tokens[1, 3] = 50
    bad_pair_axis = pair_axis.clone()
    bad_pair_axis[9] = 3
    for name, bad, error in [
            ("tokens", bad_tokens, cpu_error(ops.embed_learned, (bad_tokens, wte, wpe, None))),
            ("pair_axis", bad_pair_axis, cpu_error(ops.rope, (x, positions, inv_freq, 1.0, "neox", "bshd", 0, None,
                                                              bad_pair_axis)))]:
        good = cuda[name].clone()
        cuda[name].copy_(bad)
        graph.replay()
        check_errors_raises_once(error)
        cuda[name].copy_(good)
    graph.replay()
    posenc.cuda.check_errors()
    same(captured, (ops.rope(x, positions, inv_freq, 1.0, "neox", "bshd", 0, None, pair_axis),
                    ops.embed_learned(tokens, wte, wpe, None)))


# ---------------------------------------------------------------- posenc.cuda, on any machine

def test_posenc_cuda_switches_mode_and_checks_without_a_gpu():
    """The Python API exists on every build; the mode switch holds whether or not a GPU is there, and check_errors()
    returns (no GPU: nothing to wait for; a GPU: nothing failed)."""
    import posenc.cuda
    previous = posenc.cuda.sync_checks()
    assert isinstance(previous, bool)
    try:
        for enabled in (not previous, previous, True, False):
            posenc.cuda.set_sync_checks(enabled)
            assert posenc.cuda.sync_checks() is enabled
    finally:
        posenc.cuda.set_sync_checks(previous)
    assert posenc.cuda.sync_checks() is previous
    posenc.cuda.check_errors()


@pytest.mark.parametrize("value, expected", [(None, False), ("1", True), ("0", False)])
def test_posenc_cuda_sync_checks_start_from_the_environment(value, expected):
    """POSENC_CUDA_SYNC_CHECKS, read when posenc loads (a fresh process): "1" turns synchronous checks on; unset or
    "0" leaves the default, asynchronous."""
    env = {k: v for k, v in os.environ.items() if k != "POSENC_CUDA_SYNC_CHECKS"}
    if value is not None:
        env["POSENC_CUDA_SYNC_CHECKS"] = value
    code = "import posenc.cuda; print(posenc.cuda.sync_checks())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(expected)


# ---------------------------------------------------------------- positions and frequencies

@cuda_only
def test_mrope_positions_on_the_inputs_device():
    row = [0] * 3 + [1] * 6 + [0] * 2 + [2] * 12 + [0] * 4
    token_types = torch.tensor([row, [0] * 2 + row[:-2]], dtype=torch.int32)
    mask = torch.ones_like(token_types)
    mask[1, :2] = 0
    grids = torch.tensor([[1, 4, 6], [1, 4, 6]]), torch.tensor([[3, 4, 4], [3, 4, 4]])
    run_both(ops.mrope_positions, token_types, *grids, mask, 2, 2.0, torch.tensor([0.5, 1.0 / 3.0]))
    run_both(ops.mrope_positions, token_types, *grids, mask.bool(), 2, None, None)
    run_both(ops.mrope_positions, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="image_grid_thw is on cpu but the other inputs are on cuda"):
        ops.mrope_positions(token_types.cuda(), grids[0])


@cuda_only
@pytest.mark.parametrize("scaling", [
    {}, {"rope_type": "linear", "factor": 4.0}, {"rope_type": "llama3", "factor": 8.0,
                                                 "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 1024},
    {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(300)],
     "long_factor": [2.0 + 0.5 * i for i in range(300)], "original_max_position_embeddings": 1024,
     "max_position_embeddings": 8192},
    {"rope_type": "dynamic", "factor": 3.0, "max_position_embeddings": 1024}])
def test_rope_inv_freq_for_length_on_the_lengths_device(scaling):
    # 300 pairs: more than one launch's worth of frequencies in the kernel's parameters.
    rope_type, keywords = FQ.rope_arguments(scaling)
    for length in [torch.tensor(0), torch.tensor(1000, dtype=torch.int32), torch.tensor(1024.0),
                   torch.tensor(1025), torch.tensor(5000.5, dtype=torch.float64), torch.tensor(float("nan"))]:
        expected = ops.rope_inv_freq_for_length(length, 600, 5e5, rope_type, **keywords)
        actual = ops.rope_inv_freq_for_length(length.cuda(), 600, 5e5, rope_type, **keywords)
        same(actual, expected)  # past the context, dynamic NTK's formula evaluated on the GPU
    with pytest.raises(RuntimeError, match=r"seq_len must be a 0-d tensor, got shape \[1\]"):
        ops.rope_inv_freq_for_length(torch.tensor([5], device="cuda"), 8, 1e4)


@cuda_only
def test_zigzag_positions_and_the_ops_given_a_device_on_cuda():
    for seq_len, cp_size, rank in [(12, 3, 2), (0, 2, 1), (16, 2, 0)]:
        expected = ops.zigzag_positions(seq_len, cp_size, rank, None)
        actual = ops.zigzag_positions(seq_len, cp_size, rank, torch.device("cuda"))
        same(actual, expected)
    # The ops without a tensor argument run one composite kernel and place their result on `device`.
    cuda = torch.device("cuda")
    for op, args in [(ops.sinusoidal_inv_freq, (64, 1e4, 1)), (ops.alibi_slopes, (12, torch.float64)),
                     (ops.mrope_pair_axis, ([16, 24, 24], True)), (ops.image_positions, (3, 5)),
                     (ops.video_positions, (4, 2, 3, 2.5))]:
        same(op(*args, device=cuda), op(*args))
    for cu in [torch.tensor([0, 4, 12]), torch.tensor([0, 8, 8, 16], dtype=torch.int32), torch.tensor([0])]:
        run_both(ops.zigzag_positions_varlen, cu, 2, 1)


# ---------------------------------------------------------------- streams and graphs

@cuda_only
def test_ops_run_on_the_current_stream_and_under_graph_capture():
    inv_freq, _ = FQ.rope(64)
    q, k = torch.randn(2, 16, 4, 64, device="cuda"), torch.randn(2, 16, 4, 64, device="cuda")
    positions = torch.randint(0, 1000, (2, 16), device="cuda")
    tokens = torch.randint(0, 50, (2, 16), device="cuda")
    wte, wpe = torch.randn(50, 64, device="cuda"), torch.randn(40, 64, device="cuda")

    inv_freq = inv_freq.cuda()  # (a host-to-device copy cannot be captured)

    def step():
        rq, rk = ops.rope_qk(q, k, positions, inv_freq, 1.0, "neox", "bshd", 3)
        return rq, rk, ops.embed_learned(tokens, wte, wpe, positions % 40, 1.0, None, 0, None)

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = step()
    torch.cuda.current_stream().wait_stream(side)
    for a, e in zip(on_side, eager):
        assert torch.equal(a, e)
    replays_follow_new_values(*captured_graph(step), step, q)


@cuda_only
def test_multiaxis_rope_and_per_length_frequencies_under_graph_capture():
    # Neither reads anything back under capture: pair_axis is checked on the device (each replay checks its own), and
    # the frequencies for a length travel in the kernel's parameters.
    inv_freq, pair_axis = FQ.mrope(32, [4, 6, 6])
    inv_freq, pair_axis = inv_freq.cuda(), pair_axis.cuda()
    q = torch.randn(2, 16, 4, 32, device="cuda")
    positions = torch.randint(0, 1000, (3, 2, 16), device="cuda")
    length = torch.tensor(900, device="cuda")
    rope_type, keywords = FQ.rope_arguments({"rope_type": "longrope", "short_factor": [1.0] * 16,
                                             "long_factor": [4.0] * 16, "original_max_position_embeddings": 1024,
                                             "max_position_embeddings": 4096})

    def step():
        freq = ops.rope_inv_freq_for_length(length, 32, 1e4, rope_type, **keywords)
        return ops.rope(q, positions, inv_freq, 1.0, "neox", "bshd", 0, None, pair_axis), freq

    eager = step()
    graph, captured = captured_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    for a, e in zip(captured, eager):
        assert torch.equal(a, e)
    length.fill_(2000)  # past the original context: the long factors, chosen on the device at replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[1].cpu(), ops.rope_inv_freq_for_length(torch.tensor(2000), 32, 1e4, rope_type,
                                                                       **keywords))


# ---------------------------------------------------------------- a patched Hugging Face Llama under graph capture
# posenc.integrations.transformers.patch puts rope_qk, given the model's position_ids, in place of the cos/sin tables:
# a whole training step, or a decoding step against a StaticCache, must still capture (nothing read back, not even
# the positions' checks) and replay with new inputs.

VOCAB = 64
# Graph and eager run the same ops on the same values, but not on the same stream: cuBLAS keeps a workspace per stream
# and may pick another algorithm (another order of sums) on the capture stream, within a few float32 roundings.
LLAMA_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
GRAD_TOLERANCE = dict(atol=1e-6, rtol=1e-5)


def patched_llama():
    """(transformers, a patched two-layer Llama on the GPU): hidden 64, 4 query heads and 2 key/value heads of 16
    channels, seeded random weights from a config (nothing downloaded), as test_integrations_transformers.py builds
    them. Eager attention: SDPA would take is_causal outside capture but a materialized mask under it, another kernel.
    Eval mode (dropout is 0 anyway): no random numbers in the graph."""
    transformers = pytest.importorskip("transformers")
    integration = pytest.importorskip("posenc.integrations.transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=32, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    record = integration.patch(model)
    assert "model.rotary_emb" in [change.target for change in record.changes]
    return transformers, model.cuda()


def cache_keywords(model, cache, position_ids):
    """model()'s keywords for a step with a StaticCache at position_ids [B, S]. transformers 5 names it `cache` and
    takes the slots from the cache's own step counter (a device tensor that each step, and each replay, advances);
    earlier versions name it `past_key_values` and take the slots from cache_position, given here as the positions."""
    parameters = inspect.signature(model.forward).parameters
    keywords = {"cache" if "cache" in parameters else "past_key_values": cache, "position_ids": position_ids,
                "use_cache": True}
    if "cache_position" in parameters:
        keywords["cache_position"] = position_ids[0]
    return keywords


@cuda_only
def test_patched_llama_training_step_under_graph_capture(asynchronous):
    """Forward, loss and backward captured whole, as PyTorch's whole-network capture does it: warm-up iterations on a
    side stream, gradients set to None before capture so that backward allocates them from the graph's pool, then
    replays with new token ids copied into the static input. The logits, the loss and every parameter's gradient
    follow the new ids, as an eager step on them gives."""
    _, model = patched_llama()
    parameters = list(model.parameters())
    static_ids = torch.randint(0, VOCAB, (2, 8), device="cuda")
    # Without a mask, transformers looks for packed sequences in the positions: with .all() eagerly, which it skips
    # under capture, taking another path to the same mask. With one, both build it alike.
    mask = torch.ones_like(static_ids)

    def step():
        output = model(input_ids=static_ids, attention_mask=mask, labels=static_ids, use_cache=False)
        output.loss.backward()
        return output.logits, output.loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, loss = step()
    assert all(p.grad is not None for p in parameters)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 8), device="cuda")
        static_ids.copy_(ids)
        graph.replay()
        # Eager: torch.autograd.grad, since backward() would add into the .grad tensors that the graph writes.
        output = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
        grads = torch.autograd.grad(output.loss, parameters)
        assert_close(logits, output.logits, **LLAMA_TOLERANCE)
        assert_close(loss, output.loss, **LLAMA_TOLERANCE)
        for (name, p), grad in zip(model.named_parameters(), grads):
            assert_close(p.grad, grad, **GRAD_TOLERANCE, msg=name)
    posenc.cuda.check_errors()


@cuda_only
def test_patched_llama_decoding_step_under_graph_capture(asynchronous):
    """One decoding step (a new token per row at position_ids [B, 1], attending to a StaticCache) captured once and
    replayed for each next token, as a graph-captured generation loop runs it: each replay's logits are an eager
    step's on a second cache filled alike, and the last one those of the whole sequence run without a cache (so the
    replays wrote each token's keys at its own slot, rotated by its own position)."""
    transformers, model = patched_llama()
    batch, prompt, steps = 2, 8, 4
    tokens = torch.randint(0, VOCAB, (batch, prompt + steps), device="cuda")

    def new_cache():
        return transformers.StaticCache(config=model.config, max_cache_len=16)

    def decode(cache, token, position_ids):
        return model(input_ids=token, **cache_keywords(model, cache, position_ids)).logits

    def at(position):
        return tokens[:, position:position + 1], torch.full((batch, 1), position, device="cuda")

    graph_cache, eager_cache = new_cache(), new_cache()
    static_token, static_position = (t.clone() for t in at(prompt))
    with torch.no_grad():
        # The prompt, eagerly, into both caches (which allocates them: no allocation happens in the graph).
        for cache in (graph_cache, eager_cache):
            decode(cache, tokens[:, :prompt], torch.arange(prompt, device="cuda").expand(batch, prompt))
        # The first new token: the warm-up, on a side stream, and the same eager step on the other cache.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode(graph_cache, static_token, static_position)
        torch.cuda.current_stream().wait_stream(side)
        decode(eager_cache, *at(prompt))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = decode(graph_cache, static_token, static_position)
        for position in range(prompt + 1, prompt + steps):
            token, position_ids = at(position)
            static_token.copy_(token)
            static_position.copy_(position_ids)
            graph.replay()
            assert_close(logits, decode(eager_cache, token, position_ids), **LLAMA_TOLERANCE)
        whole = model(input_ids=tokens, use_cache=False).logits[:, -1:]
    assert_close(logits, whole, **LLAMA_TOLERANCE)
    posenc.cuda.check_errors()


# ---------------------------------------------------------------- opcheck, compile, export on every device

def opcheck_samples(device):
    inv_freq, _ = FQ.rope(8)
    x = torch.randn(2, 3, 2, 8, device=device, requires_grad=True)
    slopes = PF.alibi_slopes(2).to(device)
    table = torch.randn(6, 8, device=device, requires_grad=True)
    inv = inv_freq.to(device)
    return [
        (ops.rope, (x, torch.tensor([1, 2, 3], device=device), inv), {}),
        (ops.rope_qk, (x, x.detach()[:, :, :1].clone().requires_grad_(), None, inv), {}),
        (ops.rope_, (x.detach().clone(), None, inv), {}),
        (ops.rope_cos_sin, (x, torch.randn(3, 8, device=device), torch.randn(3, 8, device=device)), {}),
        (ops.add_sinusoidal, (torch.randn(2, 3, 8, device=device, requires_grad=True), None,
                              FQ.sinusoidal(8).to(device)), {}),
        (ops.embed_learned, (torch.randint(0, 6, (2, 3), device=device), table, table, None), {}),
        (ops.embedding_backward, (torch.randn(2, 3, 8, device=device), torch.randint(0, 6, (2, 3), device=device), 6),
         {}),
        (ops.add_alibi, (torch.randn(1, 2, 3, 4, device=device, requires_grad=True), slopes), {}),
        (ops.add_alibi_, (torch.randn(1, 2, 3, 4, device=device), slopes), {}),
        (ops.t5_bias, (torch.randn(32, 2, device=device, requires_grad=True), 3, 5, True, 32, 128), {}),
        (ops.relative_position_bucket, (torch.arange(-5, 5, device=device),), {}),
    ]


@pytest.mark.parametrize("index", range(11))
def test_opcheck_on_each_device(device, index):
    op, args, kwargs = opcheck_samples(device)[index]
    torch.library.opcheck(op, args, kwargs)


def test_compile_inductor_on_each_device(device):
    torch._dynamo.reset()
    inv_freq, _ = FQ.rope(32)
    inv_freq = inv_freq.to(device)
    slopes = PF.alibi_slopes(4).to(device)
    table = torch.randn(32, 4, device=device, requires_grad=True)
    sin_freq = FQ.sinusoidal(32).to(device)  # a model's constant, formed once outside the compiled step

    def attend(q, k, x):
        q, k = PF.rope_qk(q, k, None, inv_freq)
        scores = PF.add_alibi(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2), slopes)
        scores = scores + PF.t5_bias(table, q.shape[1], k.shape[1], True, 32, 128)
        return scores.softmax(-1).sum() + PF.add_sinusoidal(x, None, sin_freq).square().sum()

    q = torch.randn(2, 6, 4, 32, device=device, requires_grad=True)
    k = torch.randn(2, 6, 4, 32, device=device, requires_grad=True)
    x = torch.randn(2, 6, 32, device=device, requires_grad=True)
    # Inductor generates Triton kernels on CUDA; on the CPU (C++ code generation, slow to build) the AOT graphs run.
    compiled = torch.compile(attend, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    expected, actual = attend(q, k, x), compiled(q, k, x)
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    for a, e in zip(torch.autograd.grad(actual, (q, k, x, table)), torch.autograd.grad(expected, (q, k, x, table))):
        assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_export_on_each_device(device):
    model = posenc.nn.RotaryEmbedding(16).to(device)

    class Rotate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary = model

        def forward(self, q, k):
            return self.rotary(q, k)

    q, k = torch.randn(2, 5, 2, 16, device=device), torch.randn(2, 5, 2, 16, device=device)
    program = torch.export.export(Rotate(), (q, k))
    for a, e in zip(program.module()(q, k), model(q, k)):
        assert torch.equal(a, e)


# ---------------------------------------------------------------- scripts/gpu_smoke.py, on any machine

def test_gpu_smoke_runs_every_op_and_names_the_first_difference():
    """scripts/gpu_check.sh's first step: every op's sample on two devices (here the CPU twice: equal), and
    first_difference's report of one changed element (its index and ULP distance)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "gpu_smoke", Path(__file__).resolve().parents[2] / "scripts" / "gpu_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    for name in [*tensor_ops(), *smoke.EXTRA]:
        assert smoke.check(name, torch.float32, device="cpu") == [], name
    x = torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(3, 4)
    y = x.clone()
    y.view(torch.int16)[2, 1] += 1  # the next bf16 away from zero
    assert first_difference(x, x.clone()) is None
    report = first_difference(y, x)
    assert report.startswith("1 of 12 differ; first at (2, 1):") and report.endswith(", 1 ULP"), report
