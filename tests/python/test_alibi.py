"""ALiBi: slopes and biases against float64 formulas written here, BLOOM where transformers is installed,
gradients, opcheck, torch.compile, torch.export, TorchScript and the bad inputs."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import posenc
from helpers import assert_exports, opcheck_test, randn, tolerance
from mutations import not_floating, on_meta, overlapping, set_value, small, unknown_string, wrong_rank
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import functional as PF
from strategies import (FLOAT_DTYPES, INT64_MAX, INT64_MIN, OPS, assert_rounds_within, buffer_of, call, covered_offsets,
                        drawn_tensor, generator, math_eps, normal)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
MODES = ["causal", "symmetric"]
LENGTHS = [(5, 5), (3, 7), (7, 3), (1, 9)]  # q_len == k_len, shorter queries (a cache), longer queries


def reference_slopes(num_heads):
    """The paper's rule, as a geometric series: ratio r = 2^(-8/n); past n heads, every other term of the
    2n-head series (ratio 2^(-4/n)) starting from its first."""
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [(2.0 ** (-8.0 / n)) ** k for k in range(1, n + 1)]
    slopes += [(2.0 ** (-4.0 / n)) ** (2 * j - 1) for j in range(1, num_heads - n + 1)]
    return torch.tensor(slopes, dtype=torch.float64)


def reference_bias(slopes, q_len, k_len, mode, head_offset=0, num_heads=None):
    """float64 -m * d (causal) or -m * |d| (symmetric), d = i + (k_len - q_len) - j: [B or 1, H, Q, K]."""
    m = slopes.to(torch.float64)
    m = m[None] if m.dim() == 1 else m
    num_heads = m.shape[1] - head_offset if num_heads is None else num_heads
    m = m[:, head_offset:head_offset + num_heads, None, None]
    i = torch.arange(q_len, dtype=torch.float64)[:, None]
    j = torch.arange(k_len, dtype=torch.float64)[None, :]
    d = i + (k_len - q_len) - j
    return -m * (d.abs() if mode == "symmetric" else d)


def causal_mask(q_len, k_len):
    """-inf where key j lies after query i, bottom-right aligned."""
    i = torch.arange(q_len)[:, None]
    j = torch.arange(k_len)[None, :]
    return torch.zeros(q_len, k_len, dtype=torch.float64).masked_fill(j > i + (k_len - q_len), -math.inf)


# ---------------------------------------------------------------- slopes

def test_slopes_match_formula_for_1_to_128_heads():
    for num_heads in range(1, 129):
        expected = reference_slopes(num_heads)
        assert_close(PF.alibi_slopes(num_heads, torch.float64), expected, rtol=1e-14, atol=0)
        slopes = PF.alibi_slopes(num_heads)
        assert slopes.dtype == torch.float32
        assert_close(slopes, expected.float(), rtol=1e-7, atol=0)


def test_slopes_known_values():
    assert PF.alibi_slopes(8, torch.float64).tolist() == [2.0 ** -k for k in range(1, 9)]
    # 12 heads: the 8-head series, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 from the 16-head series.
    assert_close(PF.alibi_slopes(12, torch.float64)[8:],
                 torch.tensor([2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5], dtype=torch.float64))


@pytest.mark.parametrize("args, message", [((0,), "num_heads must be positive, got 0"),
                                           ((-3,), "num_heads must be positive, got -3"),
                                           ((4, torch.int64), "dtype must be floating, got Long")])
def test_slopes_bad_arguments(args, message):
    # The value itself: a libposenc.so that carries a copy of libstdc++ of its own (-static-libstdc++, or a compiler
    # that links it so) formats no number in this process, whose libstdc++ set up the locale (docs/install.md).
    with pytest.raises(ValueError, match=f"^posenc.alibi_slopes: {message}$"):
        PF.alibi_slopes(*args)


# ---------------------------------------------------------------- bias values

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("q_len, k_len", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_bias_values(mode, q_len, k_len, dtype):
    slopes = PF.alibi_slopes(6, dtype)
    out = PF.alibi_bias(slopes, q_len, k_len, mode)
    assert out.shape == (1, 6, q_len, k_len) and out.dtype == dtype
    assert_close(out.double(), reference_bias(slopes, q_len, k_len, mode), **tolerance(dtype))


def test_alibi_bias_per_batch_slopes_head_offset_and_dtype():
    slopes = torch.rand(3, 10, dtype=torch.float64)
    out = PF.alibi_bias(slopes, 4, 6, "symmetric", head_offset=5, num_heads=3, dtype=torch.float32)
    assert out.shape == (3, 3, 4, 6) and out.dtype == torch.float32
    assert_close(out.double(), reference_bias(slopes, 4, 6, "symmetric", 5, 3), atol=2e-6, rtol=2e-6)
    # num_heads defaults to every head from head_offset on.
    assert PF.alibi_bias(slopes, 4, 6, "causal", 7).shape == (3, 3, 4, 6)


def test_alibi_bias_float32_at_long_context():
    slopes = PF.alibi_slopes(16)
    out = PF.alibi_bias(slopes, 1, 32768, "causal")
    assert_close(out.double(), reference_bias(slopes, 1, 32768, "causal"), atol=0, rtol=2e-7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len, k_len", LENGTHS)
def test_add_alibi_values(mode, dtype, q_len, k_len):
    scores = torch.randn(2, 4, q_len, k_len).to(dtype)
    slopes = torch.rand(4) + 0.1  # float32 slopes with any scores dtype: maths in float32
    expected = scores.double() + reference_bias(slopes.to(dtype), q_len, k_len, mode)
    out = PF.add_alibi(scores, slopes, mode)
    assert out.dtype == dtype and out.is_contiguous()
    assert_close(out.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("layout", ["transposed", "strided_keys", "expanded"])
def test_add_alibi_any_strides(layout):
    base = torch.randn(2, 6, 3, 10, dtype=torch.float64)
    scores = {"transposed": base.transpose(1, 2),  # [2, 3, 6, 10] viewed from [2, 6, 3, 10]
              "strided_keys": base[:, :3, :, ::2],
              "expanded": base[:1, :3].expand(4, 3, 3, 10)}[layout]
    slopes = torch.rand(scores.shape[1], dtype=torch.float64)
    expected = scores + reference_bias(slopes, scores.shape[2], scores.shape[3], "symmetric")
    assert_close(PF.add_alibi(scores, slopes, "symmetric"), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("slopes_dtype", DTYPES)
def test_add_alibi_slopes_read_in_any_dtype_and_strides(slopes_dtype):
    """Slopes are read in their own dtype and strides, widened exactly: per-batch slopes of a strided view give
    the float64 formula of the same values, head_offset applied."""
    scores = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    wide = (torch.rand(2, 10) + 0.1).to(slopes_dtype)
    slopes = wide[:, ::2]  # [2, 5], stride 2 between heads
    assert not slopes.is_contiguous()
    expected = scores + reference_bias(slopes.double(), 4, 6, "causal", head_offset=1, num_heads=3)
    assert_close(PF.add_alibi(scores, slopes, "causal", head_offset=1), expected, atol=1e-12, rtol=0)


def test_add_alibi_per_batch_slopes_and_head_offset():
    scores = torch.randn(3, 2, 5, 8, dtype=torch.float64)
    slopes = torch.rand(3, 8, dtype=torch.float64)
    out = PF.add_alibi(scores, slopes, "causal", 4)
    assert_close(out, scores + reference_bias(slopes, 5, 8, "causal", 4, 2), atol=1e-12, rtol=0)


def test_tensor_parallel_shards_equal_the_full_model():
    slopes = PF.alibi_slopes(12)
    scores = torch.randn(2, 12, 5, 7)
    full = PF.add_alibi(scores, slopes)
    shards = [PF.add_alibi(scores[:, 4 * r:4 * (r + 1)], slopes, "causal", 4 * r) for r in range(3)]
    assert torch.equal(torch.cat(shards, dim=1), full)


@pytest.mark.parametrize("mode", MODES)
def test_add_alibi_inplace(mode):
    buffer = torch.randn(2, 4, 5, 12)
    untouched = buffer.clone()
    scores = buffer[..., 2:9]  # a view of a larger buffer: written where it lies
    slopes = torch.rand(2, 4)
    expected = PF.add_alibi(scores, slopes, mode)
    assert PF.add_alibi_(scores, slopes, mode) is None
    assert torch.equal(scores, expected)
    assert torch.equal(buffer[..., :2], untouched[..., :2]) and torch.equal(buffer[..., 9:], untouched[..., 9:])


def test_add_alibi_inplace_refuses_autograd_and_shared_memory():
    slopes = torch.rand(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="posenc.add_alibi_: the in-place op records no autograd"):
        PF.add_alibi_(torch.randn(1, 4, 3, 3), slopes)
    with torch.no_grad():
        PF.add_alibi_(torch.randn(1, 4, 3, 3), slopes)  # no autograd to record: allowed
    with pytest.raises(RuntimeError, match="posenc.add_alibi_: scores has elements that share memory"):
        PF.add_alibi_(torch.randn(1, 4, 3, 3).expand(2, 4, 3, 3), slopes.detach())


def test_add_alibi_inplace_bumps_version_counter():
    scores = torch.randn(1, 2, 3, 3)
    version = scores._version
    PF.add_alibi_(scores, PF.alibi_slopes(2))
    assert scores._version > version


# ---------------------------------------------------------------- conventions

@pytest.mark.parametrize("q_len, k_len", LENGTHS)
def test_causal_bias_gives_symmetric_softmax_under_causal_mask(q_len, k_len):
    scores = torch.randn(2, 8, q_len, k_len, dtype=torch.float64)
    slopes = PF.alibi_slopes(8, torch.float64)
    mask = causal_mask(q_len, k_len)
    causal = PF.add_alibi(scores, slopes, "causal") + mask
    symmetric = PF.add_alibi(scores, slopes, "symmetric") + mask
    visible = torch.isfinite(mask).any(-1)  # queries with at least one key (q_len > k_len leaves some with none)
    assert_close(causal.softmax(-1)[..., visible, :], symmetric.softmax(-1)[..., visible, :], atol=1e-14, rtol=0)
    # Where the mask hides keys they differ as raw biases (+m*|d| against -m*|d|): the mask makes them agree.
    hidden = torch.isinf(mask)
    bias = {mode: PF.alibi_bias(slopes, q_len, k_len, mode) for mode in MODES}
    assert torch.equal(bias["causal"][..., ~hidden], bias["symmetric"][..., ~hidden])
    assert (bias["causal"][..., hidden] > 0).all() and (bias["symmetric"][..., hidden] < 0).all()


def test_causal_bias_matches_flash_attention_form_after_softmax():
    """flash-attention adds +m * j; ours is -m * (i + K - Q - j): a per-row constant apart."""
    q_len, k_len = 4, 9
    scores = torch.randn(1, 4, q_len, k_len, dtype=torch.float64)
    slopes = PF.alibi_slopes(4, torch.float64)
    flash = scores + slopes[:, None, None] * torch.arange(k_len, dtype=torch.float64)
    mask = causal_mask(q_len, k_len)
    assert_close((PF.add_alibi(scores, slopes) + mask).softmax(-1), (flash + mask).softmax(-1), atol=1e-14, rtol=0)


@pytest.mark.parametrize("num_heads", [4, 6, 12, 24])
def test_matches_bloom_softmax(num_heads):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    batch, q_len, k_len = 2, 6, 6
    attention_mask = torch.ones(batch, k_len, dtype=torch.long)
    attention_mask[1, :2] = 0  # left padding
    alibi = bloom.build_alibi_tensor(attention_mask, num_heads, torch.float32).view(batch, num_heads, 1, k_len)
    assert_close(PF.alibi_slopes(num_heads), bloom._get_alibi_slopes(num_heads, "cpu"), rtol=1e-6, atol=0)
    scores = torch.randn(batch, num_heads, q_len, k_len)
    mask = causal_mask(q_len, k_len).float()[None, None] + torch.where(
        attention_mask.bool(), 0.0, -math.inf)[:, None, None, :]
    theirs = (scores + alibi + mask).softmax(-1)
    ours = (PF.add_alibi(scores, PF.alibi_slopes(num_heads)) + mask).softmax(-1)
    real = attention_mask.bool()  # padded queries see no key at all: NaN rows in both, not compared
    assert_close(ours.transpose(1, 2)[real], theirs.transpose(1, 2)[real], atol=2e-6, rtol=0)


def test_matches_bloom_model():
    """A tiny random BLOOM with its alibi replaced by ours gives the same hidden states (left padding too)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=40, hidden_size=24, n_layer=2, n_head=6)
    model = transformers.BloomModel(config).eval()
    tokens = torch.randint(0, 40, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, :3] = 0
    with torch.no_grad():
        expected = model(tokens, attention_mask=attention_mask).last_hidden_state

        def our_alibi(mask, num_heads, dtype):
            batch, length = mask.shape
            bias = PF.alibi_bias(PF.alibi_slopes(num_heads), length, length, "causal", dtype=dtype)
            return bias.expand(batch, -1, -1, -1).reshape(batch * num_heads, length, length)

        model.build_alibi_tensor = our_alibi
        ours = model(tokens, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    assert_close(ours[real], expected[real], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("mode", MODES)
def test_add_alibi_gradcheck(mode):
    scores = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, m: PF.add_alibi(s, m, mode, 1), (scores, slopes))
    assert torch.autograd.gradgradcheck(lambda s, m: PF.add_alibi(s, m, mode, 1), (scores, slopes))


@pytest.mark.parametrize("mode", MODES)
def test_alibi_bias_gradcheck(mode):
    slopes = torch.rand(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda m: PF.alibi_bias(m, 3, 5, mode, 2, 3), (slopes,))
    assert torch.autograd.gradgradcheck(lambda m: PF.alibi_bias(m, 3, 5, mode, 2, 3), (slopes,))


def test_slope_gradient_matches_reference_autograd():
    scores = torch.randn(3, 4, 6, 9, requires_grad=True)
    slopes = PF.alibi_slopes(4).requires_grad_()
    upstream = torch.randn(3, 4, 6, 9)
    PF.add_alibi(scores, slopes).backward(upstream)
    reference_slopes_ = slopes.detach().double().requires_grad_()
    (reference_bias(reference_slopes_, 6, 9, "causal") * upstream.double()).sum().backward()
    assert_close(slopes.grad.double(), reference_slopes_.grad, atol=1e-5, rtol=1e-6)
    assert torch.equal(scores.grad, upstream)


def test_fixed_slopes_get_no_gradient_and_scores_get_identity():
    scores = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    slopes = PF.alibi_slopes(2)
    upstream = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16)
    PF.add_alibi(scores, slopes).backward(upstream)
    assert torch.equal(scores.grad, upstream) and slopes.grad is None


def test_alibi_backward_deterministic_across_threads(same_bits_for_any_thread_count):
    grad = torch.randn(4, 8, 256, 512)
    slopes = PF.alibi_slopes(8)
    two = same_bits_for_any_thread_count(lambda: PF.alibi_backward(grad, slopes, "symmetric"))
    expected = (grad.double() * reference_bias(torch.ones(8), 256, 512, "symmetric")).sum((0, 2, 3))
    assert_close(two.double(), expected, atol=0, rtol=1e-6)


# ---------------------------------------------------------------- module

def test_module_matches_functional_and_scripts():
    module = posenc.nn.ALiBi(8, "symmetric")
    scores = torch.randn(2, 8, 4, 6)
    assert torch.equal(module(scores), PF.add_alibi(scores, PF.alibi_slopes(8), "symmetric"))
    assert torch.equal(module.bias(4, 6), PF.alibi_bias(PF.alibi_slopes(8), 4, 6, "symmetric"))
    scripted = torch.jit.script(module)
    assert torch.equal(scripted(scores), module(scores))
    assert torch.equal(scripted.bias(4, 6, torch.float64), module.bias(4, 6, torch.float64))


def test_module_shard_uses_global_heads():
    shard = posenc.nn.ALiBi(16, head_offset=4, num_local_heads=4)
    scores = torch.randn(1, 4, 3, 3)
    assert torch.equal(shard(scores), PF.add_alibi(scores, PF.alibi_slopes(16)[4:8]))
    with pytest.raises(ValueError, match=r"posenc.nn.ALiBi: scores must be \[B, 4, Q, K\], got shape \[1, 16, 3, 3\]"):
        shard(torch.randn(1, 16, 3, 3))
    with pytest.raises(ValueError, match=r"posenc.nn.ALiBi: heads \[14, 18\) are not a non-empty part of the 16 heads"):
        posenc.nn.ALiBi(16, head_offset=14, num_local_heads=4)


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.bfloat16)])
def test_module_fixed_slopes_stay_exact(convert):
    module = convert(posenc.nn.ALiBi(12))
    assert module.slopes.dtype == torch.float32 and torch.equal(module.slopes, PF.alibi_slopes(12))
    assert "slopes" not in module.state_dict()


def test_module_learnable_slopes_train():
    module = posenc.nn.ALiBi(6, learnable=True)
    assert isinstance(module.slopes, torch.nn.Parameter) and "slopes" in module.state_dict()
    scores = torch.randn(2, 6, 5, 5)
    module(scores).square().sum().backward()
    assert module.slopes.grad is not None and (module.slopes.grad != 0).all()


# ---------------------------------------------------------------- opcheck, compile, export

def opcheck_samples():
    slopes = PF.alibi_slopes(6).requires_grad_()
    yield torch.ops.posenc.alibi_bias.default, (slopes, 4, 6), {}
    yield torch.ops.posenc.alibi_bias.default, (torch.rand(2, 6), 5, 3, "symmetric", 2, 3, torch.float64), {}
    for mode in MODES:
        scores = torch.randn(2, 4, 3, 5, requires_grad=True)
        yield torch.ops.posenc.add_alibi.default, (scores, slopes, mode, 1), {}
        per_batch = torch.rand(2, 4, requires_grad=True)
        yield torch.ops.posenc.add_alibi.default, (scores.transpose(2, 3), per_batch, mode), {}
        yield torch.ops.posenc.add_alibi_.default, (torch.randn(2, 4, 3, 5), slopes.detach(), mode, 2), {}
        yield torch.ops.posenc.alibi_backward.default, (torch.randn(2, 4, 3, 5), torch.rand(2, 6), mode, 2), {}


test_opcheck = opcheck_test(opcheck_samples())


class TinyAttention(torch.nn.Module):
    def __init__(self, learnable=True):
        super().__init__()
        self.qk = torch.nn.Linear(8, 16)
        self.alibi = posenc.nn.ALiBi(4, learnable=learnable)

    def forward(self, x):
        q, k = self.qk(x).view(x.shape[0], x.shape[1], 2, 4, 2).permute(2, 0, 3, 1, 4)
        return self.alibi(q @ k.transpose(-1, -2)).softmax(-1)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    model = TinyAttention()
    compiled_matches_eager(model, [torch.randn(2, 6, 8)], [model.alibi.slopes])


def test_compile_inductor_dynamic_with_inplace():
    """Inductor with dynamic shapes: Meta kernels on SymInts, and the in-place op through auto_functionalized."""
    torch._dynamo.reset()

    def attend(scores, slopes):
        out = PF.add_alibi(scores, slopes, "symmetric")
        PF.add_alibi_(out, slopes, "causal")
        return out, PF.alibi_bias(slopes, scores.shape[2], scores.shape[3])

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    slopes = PF.alibi_slopes(4)
    for q_len, k_len in [(3, 5), (1, 8)]:
        scores = torch.randn(2, 4, q_len, k_len)
        assert_close(compiled(scores, slopes), attend(scores, slopes))


def test_export():
    model = TinyAttention(learnable=False)
    x = torch.randn(2, 6, 8)
    assert_exports(model, (x,), "add_alibi")


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, message", [
    (lambda: PF.alibi_bias(PF.alibi_slopes(4), -1, 3), "posenc.alibi_bias: q_len must be non-negative, got -1"),
    (lambda: PF.alibi_bias(PF.alibi_slopes(4), 3, -2), "posenc.alibi_bias: k_len must be non-negative, got -2"),
    (lambda: PF.alibi_bias(PF.alibi_slopes(4), 3, 3, num_heads=-1),
     "posenc.alibi_bias: num_heads must be non-negative, got -1"),
    (lambda: PF.alibi_bias(PF.alibi_slopes(4), 3, 3, head_offset=2, num_heads=3),
     r"posenc.alibi_bias: heads \[2, 5\) need that many slopes but slopes has 4 heads"),
    (lambda: PF.alibi_bias(PF.alibi_slopes(4), 3, 3, head_offset=-1),
     "posenc.alibi_bias: head_offset must be non-negative, got -1"),
    (lambda: PF.alibi_bias(torch.arange(4), 3, 3), "posenc.alibi_bias: slopes must be a floating tensor, got Long"),
    (lambda: PF.alibi_bias(torch.rand(2, 2, 2), 3, 3),
     r"posenc.alibi_bias: slopes must be \[H\] or \[B, H\], got shape \[2, 2, 2\]"),
    (lambda: PF.alibi_bias(PF.alibi_slopes(4), 3, 3, dtype=torch.int32),
     "posenc.alibi_bias: dtype must be floating, got Int"),
    (lambda: PF.alibi_bias(PF.alibi_slopes(4), 3, 3, "alibi"),
     'posenc.alibi_bias: mode must be "causal" or "symmetric", got "alibi"'),
    (lambda: PF.add_alibi(torch.randn(2, 8, 3, 3), PF.alibi_slopes(4)),
     r"posenc.add_alibi: heads \[0, 8\) need that many slopes but slopes has 4 heads"),
    (lambda: PF.add_alibi(torch.randn(2, 4, 3, 3), torch.rand(3, 4)),
     r"posenc.add_alibi: slopes has shape \[3, 4\] but scores has batch 2; per-batch slopes must be \[2, H\]"),
    (lambda: PF.add_alibi(torch.ones(2, 4, 3, 3, dtype=torch.int32), PF.alibi_slopes(4)),
     "posenc.add_alibi: scores must be a floating tensor, got Int"),
    (lambda: PF.add_alibi(torch.randn(4, 3, 3), PF.alibi_slopes(4)),
     r"posenc.add_alibi: scores must be \[B, H, Q, K\], got shape \[4, 3, 3\]"),
    (lambda: PF.add_alibi(torch.randn(1, 4, 3, 3), PF.alibi_slopes(4).to("meta")),
     "posenc.add_alibi: slopes is on meta but the other inputs are on cpu"),
    (lambda: PF.add_alibi_(torch.randn(1, 4, 3, 3), PF.alibi_slopes(4), "left"),
     'posenc.add_alibi_: mode must be "causal" or "symmetric", got "left"'),
    (lambda: PF.alibi_backward(torch.randn(1, 4, 3, 3), PF.alibi_slopes(2)),
     r"posenc.alibi_backward: heads \[0, 4\) need that many slopes but slopes has 2 heads"),
])
def test_bad_input_messages(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_bad_input_meta_matches_cpu():
    with pytest.raises(RuntimeError, match=r"posenc.add_alibi: heads \[0, 8\) need that many slopes"):
        PF.add_alibi(torch.empty(2, 8, 3, 3, device="meta"), PF.alibi_slopes(4).to("meta"))


def test_empty_inputs_give_empty_results():
    slopes = PF.alibi_slopes(4)
    assert PF.alibi_bias(slopes, 0, 5).shape == (1, 4, 0, 5)
    assert PF.add_alibi(torch.randn(0, 4, 3, 3), slopes).shape == (0, 4, 3, 3)
    assert torch.equal(PF.alibi_backward(torch.randn(2, 4, 3, 0), slopes), torch.zeros(4))


def test_nan_and_inf_scores_propagate():
    scores = torch.zeros(1, 2, 2, 3)
    scores[0, 0, 1, 1] = math.nan
    scores[0, 1, 0, 2] = -math.inf
    out = PF.add_alibi(scores, PF.alibi_slopes(2))
    assert torch.isnan(out[0, 0, 1, 1]) and out[0, 1, 0, 2] == -math.inf
    assert torch.isfinite(out).sum() == 10


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (which imports this file to find
# them): each op's sample call (op_registry.SAMPLES: determinism, concurrency, no_grad, CUDA and CPU-capability
# tests), its hypothesis property (test_properties.py) and its bad-input cases (bad_input_fuzzer.py).

# ---- sample calls
# Small: 67 keys (no whole vector), head offsets; large: [2, 16, 128, 256] or [16, 128, 512].

def _slopes(m, differentiable=True):
    slopes = m.fixed(torch.ops.posenc.alibi_slopes(m.size(12, 16), torch.float32, None))
    return m.grad(slopes) if differentiable else slopes


@sample("alibi_bias")
def _build_alibi_bias(m):
    """Small: symmetric, heads 2..5 of 12; large: causal, 512 keys for 128 queries."""
    return call_args(_slopes(m), m.size(16, 128), m.size(67, 512), m.size("symmetric", "causal"), m.size(2, 0),
                     m.size(4, None), m.dtype)


@sample("add_alibi")
def _build_add_alibi(m):
    scores = m.grad(m.floats(*m.size((2, 4, 16, 67), (2, 16, 128, 256)), seed=60))
    return call_args(scores, _slopes(m), m.size("causal", "symmetric"), m.size(3, 0))


@sample("add_alibi_")
def _build_add_alibi_(m):
    """Not differentiable (add_alibi is). Small: scores with a key stride (a transposed view), symmetric (add_alibi's
    small sample is causal), head offset 1."""
    if m.large:
        return call_args(m.floats(2, 16, 128, 256, seed=61), _slopes(m, False), "symmetric", 0)
    return call_args(m.floats(2, 4, 67, 16, seed=61).transpose(2, 3), _slopes(m, False), "symmetric", 1)


@sample("alibi_backward")
def _build_alibi_backward(m):
    """Small: causal, head offset 3. Differentiable along grad only (the slopes' gradient does not depend on the
    slopes)."""
    grad = m.grad(m.floats(*m.size((2, 4, 16, 67), (2, 16, 128, 256)), seed=62))
    return call_args(grad, _slopes(m, False), m.size("causal", "symmetric"), m.size(3, 0))


# ---- properties: random valid inputs against float64 references (test_properties.py)

def alibi_reference(slopes, q_len, k_len, mode, head_offset, num_heads):
    """float64 -m * d (causal) or -m * |d| (symmetric), d = i + (k_len - q_len) - j: [B or 1, H, Q, K]."""
    m = slopes.double()
    m = m[None] if m.dim() == 1 else m
    m = m[:, head_offset:head_offset + num_heads, None, None]
    i = torch.arange(q_len, dtype=torch.float64)[:, None]
    j = torch.arange(k_len, dtype=torch.float64)[None, :]
    d = i + (k_len - q_len) - j
    return -m * (d.abs() if mode == "symmetric" else d)


def alibi_slopes_case(draw, gen, batch):
    """slopes [H_total] or [batch, H_total] in any floating dtype, laid out at random."""
    total = draw(st.integers(0, 5))
    shape = [total] if draw(st.booleans()) else [batch, total]
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    slopes = drawn_tensor(draw, shape, lambda s: (torch.rand(s, generator=gen, dtype=torch.float64) - 0.2).to(dtype))
    return slopes, total


@property_check("alibi_bias")
@given(st.data())
def check_alibi_bias(data):
    draw = data.draw
    gen = generator(draw)
    slopes, total = alibi_slopes_case(draw, gen, draw(st.integers(0, 3)))
    q_len, k_len = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    mode = draw(st.sampled_from(["causal", "symmetric"]))
    head_offset = draw(st.integers(0, total))
    num_heads = draw(st.one_of(st.none(), st.integers(0, total - head_offset)))
    dtype = draw(st.sampled_from([None] + FLOAT_DTYPES))
    out = call("alibi_bias", slopes, q_len, k_len, mode, head_offset, num_heads, dtype)
    heads = total - head_offset if num_heads is None else num_heads
    reference = alibi_reference(slopes, q_len, k_len, mode, head_offset, heads)
    assert out.dtype == (dtype or slopes.dtype)
    assert_rounds_within(out, reference, 2 * math_eps(out.dtype) * reference.abs())


def add_alibi_case(draw, gen, expand=True):
    batch, heads = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    q_len, k_len = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    scores = drawn_tensor(draw, [batch, heads, q_len, k_len], lambda s: normal(gen, s, dtype, 3.0), expand)
    slopes, total = alibi_slopes_case(draw, gen, batch)
    if total < heads:
        slopes = torch.cat([slopes, torch.full([*slopes.shape[:-1], heads - total], 0.5, dtype=slopes.dtype)], -1)
        total = heads
    head_offset = draw(st.integers(0, total - heads))
    mode = draw(st.sampled_from(["causal", "symmetric"]))
    return scores, slopes, mode, head_offset, alibi_reference(slopes, q_len, k_len, mode, head_offset, heads)


@property_check("add_alibi")
@given(st.data())
def check_add_alibi(data):
    scores, slopes, mode, head_offset, bias = add_alibi_case(data.draw, generator(data.draw))
    out = call("add_alibi", scores, slopes, mode, head_offset)
    assert out.dtype == scores.dtype and out.is_contiguous()
    reference = scores.double() + bias
    assert_rounds_within(out, reference, 4 * math_eps(scores.dtype) * (scores.double().abs() + bias.abs()))


@property_check("add_alibi_")
@given(st.data())
def check_add_alibi_inplace(data):
    scores, slopes, mode, head_offset, bias = add_alibi_case(data.draw, generator(data.draw), expand=False)
    original = scores.double().clone()  # .double() of float64 scores is scores itself
    storage, before = buffer_of(scores), buffer_of(scores).clone()
    assert OPS.add_alibi_(scores, slopes, mode, head_offset) is None
    assert_rounds_within(scores, original + bias, 4 * math_eps(scores.dtype) * (original.abs() + bias.abs()))
    outside = torch.ones(storage.numel(), dtype=torch.bool)
    outside[covered_offsets(scores)] = False
    assert torch.equal(storage[outside].nan_to_num(), before[outside].nan_to_num()), "wrote outside the view"


@property_check("alibi_backward")
@given(st.data())
def check_alibi_backward(data):
    draw = data.draw
    gen = generator(draw)
    scores, slopes, mode, head_offset, _ = add_alibi_case(draw, gen)
    grad = scores  # any tensor shaped like scores
    out = call("alibi_backward", grad, slopes, mode, head_offset)
    assert out.dtype == slopes.dtype and out.shape == slopes.shape
    batch, heads, q_len, k_len = grad.shape
    m = slopes.double().detach().requires_grad_(True)
    bias = alibi_reference(m, q_len, k_len, mode, head_offset, heads)
    (reference,) = torch.autograd.grad((grad.double() * bias).sum(), m)
    unit = alibi_reference(torch.ones_like(m), q_len, k_len, mode, head_offset, heads).abs()
    magnitude = (grad.double().abs() * unit)
    magnitude = magnitude.sum((0, 2, 3)) if slopes.dim() == 1 else magnitude.sum((2, 3))
    tol = torch.zeros_like(reference)
    tol[..., head_offset:head_offset + heads] = 8 * math_eps(torch.float32) * magnitude
    assert_rounds_within(out, reference, tol)


# ---- bad inputs: a small valid call of each op, and the mutations that each make one argument wrong

def alibi_bias(draw):
    return dict(slopes=torch.rand(small(draw)), q_len=small(draw), k_len=small(draw), mode="causal", head_offset=0,
                num_heads=None, dtype=None)


def alibi_scores(draw, name, mode_name="mode"):
    batch, heads = small(draw), small(draw)
    return {name: randn(batch, heads, small(draw), small(draw)), "slopes": torch.rand(heads), mode_name: "causal",
            "head_offset": 0}


def add_alibi(draw):
    return alibi_scores(draw, "scores")


def add_alibi_inplace(draw):
    return alibi_scores(draw, "scores", "alibi_mode")


def alibi_backward(draw):
    return alibi_scores(draw, "grad")


def alibi_mutations(name, mode_name="mode", inplace=False):
    out = {
        f"{name}_not_floating": not_floating(name),
        f"{name}_wrong_rank": wrong_rank(name, [0, 1, 3, 5]),
        "slopes_not_floating": not_floating("slopes"),
        "slopes_wrong_rank": wrong_rank("slopes", [0, 3]),
        "slopes_too_few_heads": lambda draw, kw: kw.update(slopes=kw["slopes"][:-1]),
        "slopes_other_batch": lambda draw, kw: kw.update(slopes=torch.rand(kw[name].shape[0] + 1, kw[name].shape[1])),
        "head_offset_negative": set_value("head_offset", st.integers(INT64_MIN, -1)),
        "head_offset_past_the_slopes": lambda draw, kw: kw.update(head_offset=draw(st.sampled_from([1, INT64_MAX]))),
        "mode_unknown": unknown_string(mode_name, {"causal", "symmetric"}),
        "slopes_on_meta": on_meta("slopes"),
    }
    if inplace:
        out[f"{name}_overlapping"] = overlapping(name)
    return out


bad_inputs("alibi_bias", base=alibi_bias, mutations=dict(
    slopes_not_floating=not_floating("slopes"), slopes_wrong_rank=wrong_rank("slopes", [0, 3]),
    q_len_negative=set_value("q_len", st.integers(-100, -1)),
    k_len_negative=set_value("k_len", st.integers(-100, -1)),
    mode_unknown=unknown_string("mode", {"causal", "symmetric"}),
    head_offset_negative=set_value("head_offset", st.integers(INT64_MIN, -1)),
    num_heads_too_many=lambda draw, kw: kw.update(num_heads=kw["slopes"].shape[-1] + 1),
    head_offset_past_the_slopes=lambda draw, kw: kw.update(
        num_heads=1, head_offset=draw(st.sampled_from([kw["slopes"].shape[-1], INT64_MAX]))),
    num_heads_negative=set_value("num_heads", st.integers(-5, -1)),
    dtype_not_floating=set_value("dtype", st.sampled_from([torch.int64, torch.bool]))))
bad_inputs("add_alibi", base=add_alibi, mutations=alibi_mutations("scores"))
bad_inputs("add_alibi_", base=add_alibi_inplace, mutations=alibi_mutations("scores", "alibi_mode", inplace=True))
bad_inputs("alibi_backward", base=alibi_backward, mutations=alibi_mutations("grad"))
