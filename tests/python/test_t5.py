"""T5 relative bias: bucketing against a reference written here and against Hugging Face's T5 where installed,
the fused bias and its deterministic backward, opcheck, torch.compile, torch.export, TorchScript and bad input."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import posenc
from helpers import assert_exports, opcheck_test, randn
from mutations import grow, not_floating, not_index, set_value, small, wrong_rank
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import functional as PF
from strategies import FLOAT_DTYPES, assert_rounds_within, call, drawing, drawn_tensor, integers, normal, sizes

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def reference_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Mesh TensorFlow's bucketing as T5 implements it, float32 steps included: per direction N buckets, the
    first N/2 exact distances, the rest log-spaced up to max_distance, everything beyond in the last one."""
    n_dir = num_buckets // 2 if bidirectional else num_buckets
    if bidirectional:
        offset = (relative_position > 0).long() * n_dir
        distance = relative_position.abs()
    else:
        offset = torch.zeros_like(relative_position)
        distance = (-relative_position).clamp(min=0)
    exact = n_dir // 2
    log_part = torch.log(distance.float() / exact) / math.log(max_distance / exact) * (n_dir - exact)
    far = (exact + log_part.long()).clamp(max=n_dir - 1)
    return offset + torch.where(distance < exact, distance, far)


def reference_t5_bias(weight, q_len, k_len, bidirectional, num_buckets, max_distance, q_offset=0):
    """float64 weight[bucket(j - (i + q_offset)), h] as [1, H, Q, K], from an explicit gather."""
    relative = torch.arange(k_len)[None, :] - (torch.arange(q_len)[:, None] + q_offset)
    buckets = reference_bucket(relative, bidirectional, num_buckets, max_distance)
    return weight.double()[buckets].permute(2, 0, 1)[None]


def reference_grad(grad, buckets, num_buckets):
    """d/d weight of sum(bias * grad): grad [1, H, Q, K] summed into the buckets [Q, K], float64."""
    rows = grad[0].double().permute(1, 2, 0).reshape(-1, grad.shape[1])
    return torch.zeros(num_buckets, grad.shape[1], dtype=torch.float64).index_add_(0, buckets.flatten(), rows)


def bucket_grid():
    for bidirectional in [True, False]:
        for num_buckets in [2, 4, 5, 8, 16, 32, 33, 64, 128]:
            exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
            if exact < 1:
                continue
            for max_distance in sorted({exact + 1, 2 * exact, 20, 64, 128, 1000}):
                if max_distance > exact:
                    yield bidirectional, num_buckets, max_distance


# ---------------------------------------------------------------- buckets

def test_bucket_matches_reference_over_grid():
    relative = torch.arange(-1500, 1501)
    for bidirectional, num_buckets, max_distance in bucket_grid():
        out = PF.relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
        expected = reference_bucket(relative, bidirectional, num_buckets, max_distance)
        assert out.dtype == torch.int64
        assert torch.equal(out, expected), (bidirectional, num_buckets, max_distance)


def test_bucket_known_values_t5_defaults():
    """Hand-computed: bidirectional 16 buckets a side, 8 exact, then 8 + trunc(2 log2(n / 8)); causal 32
    buckets, 16 exact, then 16 + trunc(16 log2(n / 16) / 3); from 128 on, the last bucket."""
    relative = torch.tensor([-200, -127, -100, -40, -20, -15, -12, -1, 0, 1, 7, 8, 20, 100, 200])
    assert PF.relative_position_bucket(relative).tolist() == [15, 15, 15, 12, 10, 9, 9, 1, 0, 17, 23, 24, 26, 31, 31]
    assert PF.relative_position_bucket(relative, False).tolist() == [31, 31, 30, 23, 17, 15, 12, 1, 0, 0, 0, 0, 0, 0,
                                                                        0]


def test_bucket_int32_and_shapes():
    relative = torch.randint(-300, 300, (3, 4, 5), dtype=torch.int32)
    out = PF.relative_position_bucket(relative, False, 32, 128)
    assert out.shape == (3, 4, 5) and out.dtype == torch.int64
    assert torch.equal(out, reference_bucket(relative.long(), False, 32, 128))
    strided = relative.transpose(0, 2)
    assert torch.equal(PF.relative_position_bucket(strided, True), reference_bucket(strided.long(), True, 32, 128))


def test_bucket_extreme_positions():
    """Far positions of either sign land in the last bucket of their direction, int64 limits included."""
    relative = torch.tensor([INT64_MIN, -(2 ** 40), 2 ** 40, INT64_MAX])
    assert PF.relative_position_bucket(relative, True, 32, 128).tolist() == [15, 15, 31, 31]
    assert PF.relative_position_bucket(relative, False, 32, 128).tolist() == [31, 31, 0, 0]


def test_bucket_matches_hugging_face_t5():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    relative = torch.arange(-700, 701)
    for bidirectional, num_buckets, max_distance in bucket_grid():
        expected = t5.T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
        assert torch.equal(PF.relative_position_bucket(relative, bidirectional, num_buckets, max_distance), expected)


def test_bucket_at_an_exact_tie_follows_the_correctly_rounded_log():
    """17 causal buckets, max_distance 27, distance 12: T5's log term is exactly 3 (12 / 8 = 1.5, 27 / 8 = 1.5^3).
    The correctly rounded float32 log of 1.5 puts it a hair below and the bucket at 8 + 2; torch's float32 log, one
    ulp high there, gives Hugging Face 8 + 3 (docs/alibi-t5.md)."""
    relative = torch.tensor([-11, -12, -13])
    assert PF.relative_position_bucket(relative, False, 17, 27).tolist() == [10, 10, 11]
    assert t5_bucket(relative, False, 17, 27).tolist() == [10, 10, 11]


# ---------------------------------------------------------------- fused bias

@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("q_len, k_len, q_offset", [(7, 7, 0), (1, 40, 39), (5, 300, 200), (300, 20, 0), (4, 6, -3)])
def test_t5_bias_values(bidirectional, q_len, k_len, q_offset):
    weight = torch.randn(32, 6)
    out = PF.t5_bias(weight, q_len, k_len, bidirectional, 32, 128, q_offset)
    assert out.shape == (1, 6, q_len, k_len)
    expected = reference_t5_bias(weight, q_len, k_len, bidirectional, 32, 128, q_offset).float()
    assert torch.equal(out, expected)  # a gather: exact


@pytest.mark.parametrize("dtype", DTYPES)
def test_t5_bias_dtypes_and_strided_weight(dtype):
    table = torch.randn(3, 16, dtype=torch.float64).to(dtype)  # weight [16, 3] as a transposed view
    out = PF.t5_bias(table.t(), 9, 11, False, 16, 50, 2)
    assert out.dtype == dtype
    assert torch.equal(out, reference_t5_bias(table.t(), 9, 11, False, 16, 50, 2).to(dtype))


def test_t5_bias_backward_matches_scatter_reference():
    weight = torch.randn(32, 4, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(1, 4, 13, 17, dtype=torch.float64)
    PF.t5_bias(weight, 13, 17, True, 32, 8 + 1, 5).backward(upstream)
    relative = torch.arange(17)[None, :] - (torch.arange(13)[:, None] + 5)
    expected = reference_grad(upstream, reference_bucket(relative, True, 32, 9), 32)
    assert_close(weight.grad, expected, atol=1e-12, rtol=0)


def test_t5_bias_backward_deterministic_across_threads(same_bits_for_any_thread_count):
    grad = torch.randn(1, 8, 384, 512)
    two = same_bits_for_any_thread_count(lambda: PF.t5_bias_backward(grad, True, 32, 128, 7))
    relative = torch.arange(512)[None, :] - (torch.arange(384)[:, None] + 7)
    expected = reference_grad(grad, reference_bucket(relative, True, 32, 128), 32)
    assert_close(two.double(), expected, atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_gradcheck(bidirectional):
    weight = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    fn = lambda w: PF.t5_bias(w, 4, 6, bidirectional, 8, 12, 1)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (weight,))
    assert torch.autograd.gradgradcheck(fn, (weight,))


def test_matches_hugging_face_t5_model():
    """Encoder (bidirectional) and decoder (causal, with a cache) bias of a tiny random T5, values and gradients."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_heads=3, num_layers=1,
                                   num_decoder_layers=1, relative_attention_num_buckets=32,
                                   relative_attention_max_distance=20)
    model = transformers.T5Model(config)
    for stack, bidirectional in [(model.encoder, True), (model.decoder, False)]:
        attention = stack.block[0].layer[0].SelfAttention
        table = attention.relative_attention_bias.weight
        for q_len, k_len, past in [(9, 9, 0), (1, 30, 29), (4, 50, 46)]:
            expected = attention.compute_bias(q_len, k_len, past_seen_tokens=past)
            ours = PF.t5_bias(table, q_len, k_len, bidirectional, 32, 20, past)
            assert torch.equal(ours, expected)
            upstream = torch.randn_like(expected)
            (hf_grad,) = torch.autograd.grad(expected, table, upstream)
            (our_grad,) = torch.autograd.grad(ours, table, upstream)
            assert_close(our_grad, hf_grad, atol=1e-5, rtol=1e-6)


# ---------------------------------------------------------------- module

def test_module_matches_functional_and_scripts():
    module = posenc.nn.T5RelativeBias(4, num_buckets=16, max_distance=40, bidirectional=False)
    assert module.weight.shape == (16, 4)
    expected = reference_t5_bias(module.weight.detach(), 5, 9, False, 16, 40, 4).float()
    assert torch.equal(module(5, 9, 4), expected)
    scripted = torch.jit.script(module)
    assert torch.equal(scripted(5, 9, 4), expected)
    module(5, 9).sum().backward()
    # Causal, 8 exact buckets: keys at or after the query share bucket 0 (35 pairs), distance n in bucket n.
    counts = torch.zeros(16)
    counts[:5] = torch.tensor([35.0, 4, 3, 2, 1])
    assert torch.equal(module.weight.grad, counts[:, None].expand(16, 4))


def test_module_loads_hugging_face_table():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=8, d_model=8, d_kv=4, d_ff=8, num_heads=2, num_layers=1)
    attention = transformers.T5Model(config).encoder.block[0].layer[0].SelfAttention
    module = posenc.nn.T5RelativeBias(2, config.relative_attention_num_buckets, config.relative_attention_max_distance)
    module.load_state_dict(attention.relative_attention_bias.state_dict())
    assert torch.equal(module(6, 6), attention.compute_bias(6, 6))


# ---------------------------------------------------------------- opcheck, compile, export

def opcheck_samples():
    yield torch.ops.posenc.relative_position_bucket.default, (torch.arange(-20, 20),), {}
    yield torch.ops.posenc.relative_position_bucket.default, (torch.arange(-9, 9, dtype=torch.int32), False, 8, 16), {}
    for bidirectional in [True, False]:
        weight = torch.randn(16, 3, requires_grad=True)
        yield torch.ops.posenc.t5_bias.default, (weight, 5, 7, bidirectional, 16, 32, 2), {}
        yield torch.ops.posenc.t5_bias_backward.default, (torch.randn(1, 3, 5, 7), bidirectional, 16, 32, 2), {}


test_opcheck = opcheck_test(opcheck_samples())


class TinyT5Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Linear(8, 16, bias=False)
        self.bias = posenc.nn.T5RelativeBias(4, 16, 32)

    def forward(self, x):
        q, k = self.qk(x).view(x.shape[0], x.shape[1], 2, 4, 2).permute(2, 0, 3, 1, 4)
        return (q @ k.transpose(-1, -2) + self.bias(x.shape[1], x.shape[1])).softmax(-1)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    model = TinyT5Attention()
    compiled_matches_eager(model, [torch.randn(2, 6, 8)], [model.bias.weight])


def test_compile_inductor_dynamic_decoding():
    """A growing cache: q_offset and k_len change every step and stay symbolic (no recompile per step)."""
    torch._dynamo.reset()
    module = posenc.nn.T5RelativeBias(2, 32, 128, bidirectional=False)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for past in [3, 4, 5]:
            assert torch.equal(compiled(1, past + 1, past), module(1, past + 1, past))


def test_export():
    model = TinyT5Attention()
    x = torch.randn(2, 6, 8)
    assert_exports(model, (x,), "t5_bias")


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, message", [
    (lambda: PF.relative_position_bucket(torch.arange(4), True, 0),
     "posenc.relative_position_bucket: num_buckets must be positive, got 0"),
    (lambda: PF.relative_position_bucket(torch.arange(4), True, 32, -5),
     "posenc.relative_position_bucket: max_distance must be positive, got -5"),
    (lambda: PF.relative_position_bucket(torch.arange(4), True, 3),
     "posenc.relative_position_bucket: num_buckets 3 is too few; bidirectional buckets need at least 4"),
    (lambda: PF.relative_position_bucket(torch.arange(4), False, 32, 16),
     r"posenc.relative_position_bucket: max_distance 16 must exceed the 16 exact buckets of num_buckets 32 \(causal\)"),
    (lambda: PF.relative_position_bucket(torch.arange(4.0)),
     "posenc.relative_position_bucket: relative_position must be an int64 or int32 tensor, got Float"),
    (lambda: PF.t5_bias(torch.randn(32, 4), -1, 5, True, 32, 128), "posenc.t5_bias: q_len must be non-negative, got -1"),
    (lambda: PF.t5_bias(torch.randn(32, 4), 5, -2, True, 32, 128), "posenc.t5_bias: k_len must be non-negative, got -2"),
    (lambda: PF.t5_bias(torch.randn(16, 4), 5, 5, True, 32, 128), "posenc.t5_bias: weight has 16 rows but num_buckets is 32"),
    (lambda: PF.t5_bias(torch.randn(32), 5, 5, True, 32, 128),
     r"posenc.t5_bias: weight must be \[num_buckets, H\], got shape \[32\]"),
    (lambda: PF.t5_bias(torch.ones(32, 4, dtype=torch.long), 5, 5, True, 32, 128),
     "posenc.t5_bias: weight must be a floating tensor, got Long"),
    (lambda: PF.t5_bias(torch.randn(32, 4), 5, 5, True, 32, 128, 2 ** 62 + 1),
     r"posenc.t5_bias: q_offset 4611686018427387905 is outside \[-2\^62, 2\^62\]"),
    (lambda: PF.t5_bias_backward(torch.randn(2, 4, 5, 5), True, 32, 128),
     r"posenc.t5_bias_backward: grad must be \[1, H, Q, K\], got shape \[2, 4, 5, 5\]"),
    (lambda: PF.t5_bias_backward(torch.randn(1, 4, 5, 5), True, 32, 0),
     "posenc.t5_bias_backward: max_distance must be positive, got 0"),
])
def test_bad_input_messages(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_bad_input_meta_matches_cpu():
    with pytest.raises(RuntimeError, match="posenc.t5_bias: weight has 16 rows but num_buckets is 32"):
        PF.t5_bias(torch.empty(16, 4, device="meta"), 5, 5, True, 32, 128)


def test_empty_inputs_give_empty_results():
    weight = torch.randn(32, 4)
    assert PF.t5_bias(weight, 0, 5, True, 32, 128).shape == (1, 4, 0, 5)
    assert PF.relative_position_bucket(torch.empty(0, 3, dtype=torch.int64)).shape == (0, 3)
    assert torch.equal(PF.t5_bias_backward(torch.randn(1, 4, 3, 0), True, 32, 128), torch.zeros(32, 4))


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (which imports this file to find
# them): each op's sample call (op_registry.SAMPLES: determinism, concurrency, no_grad, CUDA and CPU-capability
# tests), its hypothesis property (test_properties.py) and its bad-input cases (bad_input_fuzzer.py).

# ---- sample calls
# Small: 70 keys (no whole vector); large: [16, 128, 512].

@sample("relative_position_bucket")
def _build_relative_position_bucket(m):
    relative = m.ints(m.size(2000, 4000), *m.size((64, 64), (1024, 1024)), seed=63) - m.size(1000, 2000)
    return call_args(relative, m.large, 32, 128)


@sample("t5_bias")
def _build_t5_bias(m):
    """Small: unidirectional, max_distance 20; large: bidirectional, 512 keys for 128 queries, q_offset 3."""
    table = m.grad(m.floats(32, m.size(4, 16), seed=64))
    return call_args(table, m.size(16, 128), m.size(70, 512), m.large, 32, m.size(20, 128), m.size(2, 3))


@sample("t5_bias_backward")
def _build_t5_bias_backward(m):
    grad = m.grad(m.floats(*m.size((1, 4, 16, 70), (1, 16, 128, 512)), seed=65))
    return call_args(grad, not m.large, 32, 128, m.size(7, 5))


# ---- properties: random valid inputs against float64 references (test_properties.py)

def t5_bucket(relative, bidirectional, num_buckets, max_distance):
    """Mesh TensorFlow's bucketing with T5's float32 steps, from Python integers (no int64 wrap at
    INT64_MIN: its distance 2^63 falls in the last bucket), the float32 log correctly rounded (the float64 log of
    the float32 quotient, rounded): torch's float32 log is 1 ulp off at 1.5, which puts distance 12 of 17 causal
    buckets and max_distance 27 (27 / 8 = 1.5^3) one bucket higher."""
    n_dir = num_buckets // 2 if bidirectional else num_buckets
    exact = n_dir // 2
    flat = relative.flatten().tolist()
    offsets = [n_dir if (bidirectional and r > 0) else 0 for r in flat]
    distances = [abs(r) if bidirectional else max(-r, 0) for r in flat]
    far = torch.tensor([min(d, 2 ** 63 - 1) for d in distances], dtype=torch.long).float()  # T5: .float()
    log_part = torch.log((far / exact).double()).float() / math.log(max_distance / exact) * (n_dir - exact)
    large = (exact + log_part.long()).clamp(max=n_dir - 1).tolist()
    buckets = [o + (d if d < exact else lg) for o, d, lg in zip(offsets, distances, large)]
    return torch.tensor(buckets, dtype=torch.long).reshape(relative.shape)


def t5_config(draw):
    bidirectional = draw(st.booleans())
    num_buckets = draw(st.integers(4 if bidirectional else 2, 40))
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    max_distance = draw(st.one_of(st.integers(exact + 1, exact + 20), st.integers(exact + 1, 2 ** 40)))
    return bidirectional, num_buckets, max_distance


@property_check("relative_position_bucket")
@given(st.data())
def check_relative_position_bucket(data):
    draw, gen = drawing(data)
    bidirectional, num_buckets, max_distance = t5_config(draw)
    dtype = draw(st.sampled_from([torch.long, torch.int]))
    info = torch.iinfo(dtype)
    shape = sizes(draw, draw(st.integers(0, 3)))
    extremes = torch.tensor([min(max(v, info.min), info.max) for v in
                             (info.min, info.max, info.min + 1, 0, -1, 1, max_distance, -max_distance)], dtype=dtype)
    relative = drawn_tensor(draw, shape, lambda s: torch.where(
        integers(gen, s, 0, 2).bool(), integers(gen, s, -3 * max_distance, 3 * max_distance).clamp(info.min, info.max)
        .to(dtype), extremes[integers(gen, s, 0, len(extremes))]))
    out = call("relative_position_bucket", relative, bidirectional, num_buckets, max_distance)
    assert out.dtype == torch.long
    assert torch.equal(out, t5_bucket(relative.long(), bidirectional, num_buckets, max_distance))


@property_check("t5_bias")
@given(st.data())
def check_t5_bias(data):
    draw, gen = drawing(data)
    bidirectional, num_buckets, max_distance = t5_config(draw)
    heads = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    weight = drawn_tensor(draw, [num_buckets, heads], lambda s: normal(gen, s, dtype))
    q_len, k_len = draw(st.integers(0, 6)), draw(st.integers(0, 30))
    q_offset = draw(st.one_of(st.integers(-40, 40), st.integers(-2 ** 62, 2 ** 62 - q_len)))
    out = call("t5_bias", weight, q_len, k_len, bidirectional, num_buckets, max_distance, q_offset)
    relative = torch.arange(k_len)[None, :] - (torch.arange(q_len)[:, None] + q_offset)
    buckets = t5_bucket(relative, bidirectional, num_buckets, max_distance)
    reference = weight.double()[buckets].permute(2, 0, 1)[None]
    assert out.dtype == dtype and out.shape == (1, heads, q_len, k_len)
    assert_rounds_within(out, reference, 0.0)


@property_check("t5_bias_backward")
@given(st.data())
def check_t5_bias_backward(data):
    draw, gen = drawing(data)
    bidirectional, num_buckets, max_distance = t5_config(draw)
    heads, q_len, k_len = draw(st.integers(0, 3)), draw(st.integers(0, 6)), draw(st.integers(0, 30))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    grad = drawn_tensor(draw, [1, heads, q_len, k_len], lambda s: normal(gen, s, dtype))
    q_offset = draw(st.one_of(st.integers(-40, 40), st.integers(-2 ** 62, 2 ** 62 - q_len)))
    out = call("t5_bias_backward", grad, bidirectional, num_buckets, max_distance, q_offset)
    assert out.dtype == dtype and out.shape == (num_buckets, heads)
    relative = torch.arange(k_len)[None, :] - (torch.arange(q_len)[:, None] + q_offset)
    buckets = t5_bucket(relative, bidirectional, num_buckets, max_distance).flatten()
    rows = grad[0].double().permute(1, 2, 0).reshape(q_len * k_len, heads)
    reference = torch.zeros(num_buckets, heads, dtype=torch.float64).index_add_(0, buckets, rows)
    magnitude = torch.zeros(num_buckets, heads, dtype=torch.float64).index_add_(0, buckets, rows.abs())
    assert_rounds_within(out, reference, 1e-12 * magnitude)


# ---- bad inputs: a small valid call of each op, and the mutations that each make one argument wrong

def relative_position_bucket(draw):
    return dict(relative_position=torch.randint(-200, 200, (small(draw), small(draw))), bidirectional=True,
                num_buckets=32, max_distance=128)


def t5_bias(draw):
    return dict(weight=randn(32, small(draw)), q_len=small(draw), k_len=small(draw), bidirectional=True,
                num_buckets=32, max_distance=128, q_offset=0)


def t5_bias_backward(draw):
    return dict(grad=randn(1, small(draw), small(draw), small(draw)), bidirectional=False, num_buckets=32,
                max_distance=128, q_offset=0)


def t5_buckets_invalid(draw, kw):
    bidirectional = kw["bidirectional"]
    how = draw(st.sampled_from(["buckets_nonpositive", "too_few", "too_many", "distance_nonpositive",
                                "distance_small"]))
    if how == "buckets_nonpositive":
        kw["num_buckets"] = draw(st.sampled_from([0, -1, INT64_MIN]))
    elif how == "too_many":  # the weight keeps its rows: the bucket count is refused before they are compared
        kw["num_buckets"] = draw(st.sampled_from([65537, 2 ** 31, INT64_MAX]))
        kw["max_distance"] = INT64_MAX
    elif how == "too_few":
        kw["num_buckets"] = 3 if bidirectional else 1
    elif how == "distance_nonpositive":
        kw["max_distance"] = draw(st.sampled_from([0, -5, INT64_MIN]))
    else:
        kw["max_distance"] = (kw["num_buckets"] // 2 if bidirectional else kw["num_buckets"]) // 2
    if "weight" in kw and how in ("buckets_nonpositive", "too_few"):
        kw["weight"] = randn(max(kw["num_buckets"], 0), kw["weight"].shape[1])


bad_inputs("relative_position_bucket", base=relative_position_bucket, mutations=dict(
    relative_position_not_index=not_index("relative_position"),
    buckets_invalid=t5_buckets_invalid))
bad_inputs("t5_bias", base=t5_bias, mutations=dict(
    weight_not_floating=not_floating("weight"), weight_wrong_rank=wrong_rank("weight", [1, 3]),
    weight_rows_differ=grow("weight", 0), q_len_negative=set_value("q_len", st.integers(-100, -1)),
    k_len_negative=set_value("k_len", st.integers(-100, -1)), buckets_invalid=t5_buckets_invalid,
    q_offset_beyond_2_pow_62=set_value("q_offset", st.sampled_from(
        [2 ** 62 + 1, -(2 ** 62) - 1, INT64_MAX, INT64_MIN]))))
bad_inputs("t5_bias_backward", base=t5_bias_backward, mutations=dict(
    grad_not_floating=not_floating("grad"), grad_wrong_rank=wrong_rank("grad", [0, 3, 5]),
    grad_batch_not_1=grow("grad", 0), buckets_invalid=t5_buckets_invalid,
    q_offset_beyond_2_pow_62=set_value("q_offset", st.sampled_from(
        [2 ** 62 + 1, -(2 ** 62) - 1, INT64_MAX, INT64_MIN]))))
