"""CUDA kernels against the CPU kernels: every op's registry samples (op_registry.SAMPLES), then every op, forward
and backward, over dtypes, layouts, formats, strides, alignments and position kinds, with the CPU's bits (far
angles and float64 data included: both devices run posenc's own sin/cos); the CPU's errors for bad index data;
streams and CUDA-graph capture. The comparisons need a GPU and skip without one; opcheck, torch.compile and
torch.export run on every device of the `device` fixture (the CPU everywhere, CUDA where present)."""
import math

import pytest
import torch
from torch.testing import assert_close

import posenc  # noqa: F401
from helpers import first_difference
from op_registry import SAMPLES, SIZES, sample_outputs, tensor_ops, uses_dtype
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

@cuda_only
def test_bad_index_data_raises_the_cpu_errors():
    inv_freq, _ = FQ.rope(8)
    x = torch.randn(2, 3, 2, 8)
    table = torch.randn(10, 8)
    cases = [
        (ops.rope, (x, torch.tensor([0, 2**53 + 1, 3]), inv_freq)),
        (ops.rope, (x, None, inv_freq, 1.0, "neox", "bshd", 2**63 - 2)),
        (ops.rope, (x[0], None, inv_freq, 1.0, "neox", "thd", 0, torch.tensor([0, 2, 1]))),
        (ops.rope, (x[0], None, inv_freq, 1.0, "neox", "thd", 0, torch.tensor([0, 2]))),
        (ops.add_learned, (torch.randn(2, 3, 8), table, torch.tensor([0, 10, 1]))),
        (ops.add_learned, (torch.randn(2, 3, 8), table, None, 8)),
        (ops.learned, (table, torch.tensor([[1, -1]]), 0)),
        (ops.embed_learned, (torch.tensor([[1, 10]]), table, table, None)),
        (ops.embed_sinusoidal, (torch.tensor([[-1, 2]]), table, None, FQ.sinusoidal(8))),
        (ops.embedding_backward, (torch.randn(2, 8), torch.tensor([3, 10]), 10)),
        (ops.add_sinusoidal, (torch.randn(2, 8), torch.tensor([2.0**60, 1.0]), FQ.sinusoidal(8))),
        (ops.rope, (x, torch.tensor([0.5, float("nan"), 3.0]), inv_freq)),  # real positions: NaN refused
        (ops.add_sinusoidal, (torch.randn(1, 4, 8), torch.zeros(2, 3), FQ.sinusoidal(8), 1.0, "half_per_axis", 0,
                              torch.tensor([0, 1, 2, 1]), 1)),  # pair_axis beyond the 2 axes of positions
        (ops.sinusoidal, (torch.tensor([2**62, 1]), FQ.sinusoidal(8), "interleaved", None, 2**62)),
        # pair_axis: its values, then cu_seqlens before them, then the positions after them, as the CPU orders them.
        (ops.rope, (x, torch.zeros(2, 3, dtype=torch.long), inv_freq, 1.0, "neox", "bshd", 0, None,
                    torch.tensor([0, 1, 2, 1]))),
        (ops.rope, (x[0], torch.zeros(2, 3, dtype=torch.long), inv_freq, 1.0, "neox", "thd", 0,
                    torch.tensor([0, 2]), torch.tensor([0, 1, 2, 1]))),
        (ops.rope, (x, torch.tensor([[0, 1, 2], [3, 2**53, 5]]), inv_freq, 1.0, "neox", "bshd", 1, None,
                    torch.tensor([0, 1, -1, 1]))),
        (ops.rope, (x, torch.tensor([[0, 1, 2], [3, 2**53, 5]]), inv_freq, 1.0, "neox", "bshd", 1, None,
                    torch.tensor([0, 1, 1, 1]))),
        (ops.mrope_positions, (torch.tensor([[0, 1, 1]]), torch.tensor([[1, 2, 2]]))),
        (ops.mrope_positions, (torch.tensor([[0, 3]]),)),
        (ops.zigzag_positions_varlen, (torch.tensor([0, 4, 3]), 2, 0)),
        (ops.zigzag_positions_varlen, (torch.tensor([0, 4, 10]), 2, 0)),
    ]
    for op, args in cases:
        with pytest.raises(Exception) as cpu_error:
            op(*args)
        with pytest.raises(type(cpu_error.value)) as cuda_error:
            op(*[to_cuda(a) for a in args])
        assert str(cuda_error.value).splitlines()[0] == str(cpu_error.value).splitlines()[0], op


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
    # Neither reads anything back under capture: pair_axis is checked on the host only outside it, and the
    # frequencies for a length travel in the kernel's parameters.
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
