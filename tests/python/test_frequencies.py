"""Frequencies and slopes: one C++ implementation behind Python, every invalid scaling value refused, frequencies
that no dtype conversion rounds (eager, TorchScript, TorchScript saved and loaded), and the ops' inv_freq dtype."""
import io
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import posenc
from mutations import not_index, set_value, small, to_dtype, unknown_string, wrong_rank
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import frequencies as FQ
from posenc import functional as PF
from strategies import INT64_MAX, INT64_MIN, OPS, arrange, assert_rounds_within, call

# TorchScript is this project's C++ export path: its deprecation notices are expected here.
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.save` is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")]

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(64)],
            "long_factor": [2.0 + 0.5 * i for i in range(64)], "original_max_position_embeddings": 1024,
            "max_position_embeddings": 8192}
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "max_position_embeddings": 1024},
    "ntk": {"rope_type": "ntk", "alpha": 3.0},
    "hunyuan": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0},
    "yarn": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 1024, "mscale": 0.707,
             "mscale_all_dim": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024},
    "longrope": LONGROPE,
}


def reference_rope(x, positions, inv_freq):
    """float64 neox RoPE of bshd x at positions [S], written from the definition."""
    x, half = x.double(), inv_freq.numel()
    angle = positions.double()[:, None] * inv_freq.double()
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], -1)


def script_copy(module, save_and_load):
    scripted = torch.jit.script(module)
    if save_and_load:
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        buffer.seek(0)
        scripted = torch.jit.load(buffer)
    return scripted


# ---------------------------------------------------------------- frequencies no conversion rounds

@pytest.mark.parametrize("save_and_load", [False, True], ids=["scripted", "saved_and_loaded"])
@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half()], ids=["bfloat16", "half"])
@pytest.mark.parametrize("scaling", ["default", "longrope"])
def test_scripted_rotary_keeps_float64_frequencies(save_and_load, convert, scaling):
    module = posenc.nn.RotaryEmbedding(128, scaling=SCALINGS[scaling])
    scripted = convert(script_copy(module, save_and_load))
    exact = FQ.rope(128, scaling=SCALINGS[scaling])[0]
    assert scripted.inv_freq.dtype == torch.float64 and torch.equal(scripted.inv_freq, exact)
    assert scripted.long_inv_freq.dtype == torch.float64
    assert torch.equal(scripted.long_inv_freq, FQ.rope(128, scaling=SCALINGS[scaling], seq_len=10 ** 6)[0])
    # Positions up to 4000: bf16 frequencies would be off by up to 5.5 there.
    positions = torch.arange(3990, 4000)
    q, k = torch.randn(1, 10, 2, 128).bfloat16(), torch.randn(1, 10, 1, 128).bfloat16()
    out_q, out_k = scripted(q, k, positions)
    expected_q, expected_k = convert(module)(q, k, positions)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    inv_freq = FQ.rope(128, scaling=SCALINGS[scaling], seq_len=4000)[0]
    assert_close(out_q.double(), reference_rope(q, positions, inv_freq) * module.attention_scale, atol=4e-2, rtol=1e-2)


@pytest.mark.parametrize("save_and_load", [False, True], ids=["scripted", "saved_and_loaded"])
def test_scripted_alibi_half_is_exact_at_distance_2048(save_and_load):
    module = posenc.nn.ALiBi(12)
    scripted = script_copy(module, save_and_load).half()
    assert scripted.slopes.dtype == torch.float32 and torch.equal(scripted.slopes, PF.alibi_slopes(12))
    # The bias at distance 2048 from float32 slopes; an fp16 slope would move it by up to 1.0.
    slopes = PF.alibi_slopes(12, torch.float64)
    bias = scripted.bias(1, 2049, torch.float32)[0, :, 0, 0].double()
    assert_close(bias, -2048 * slopes, atol=5e-4, rtol=0)
    scores = torch.zeros(1, 12, 1, 2049, dtype=torch.float16)
    assert torch.equal(scripted(scores), module.half()(scores))


@pytest.mark.parametrize("save_and_load", [False, True], ids=["scripted", "saved_and_loaded"])
def test_scripted_sinusoidal_modules_keep_float64_frequencies(save_and_load):
    encoding = posenc.nn.SinusoidalPositionalEncoding(64)
    embedding = posenc.nn.SinusoidalEmbedding(10, 64)
    exact = FQ.sinusoidal(64)
    for module in (encoding, embedding):
        scripted = script_copy(module, save_and_load).to(torch.bfloat16)
        assert scripted.inv_freq.dtype == torch.float64 and torch.equal(scripted.inv_freq, exact)
        assert "inv_freq" not in scripted.state_dict()
    x = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    positions = torch.arange(9996, 10000)
    scripted = script_copy(encoding, save_and_load).to(torch.bfloat16)
    angle = positions.double()[:, None] * exact
    expected = torch.stack([angle.sin(), angle.cos()], -1).flatten(-2)
    assert_close(scripted(x, positions)[0].double(), expected, atol=4e-3, rtol=0)


@pytest.mark.parametrize("make", [lambda: posenc.nn.RotaryEmbedding(16, scaling=SCALINGS["dynamic"]),
                                  lambda: posenc.nn.SinusoidalPositionalEncoding(16), lambda: posenc.nn.ALiBi(4)])
def test_modules_keep_frequencies_out_of_the_state_dict_and_buffers(make):
    module = make()
    assert list(module.buffers()) == [] and module.state_dict() == {}
    assert torch.jit.script(module).state_dict() == {}


def test_frequencies_follow_device_moves():
    module = posenc.nn.RotaryEmbedding(16, scaling={"rope_type": "linear", "factor": 2.0})
    exact = FQ.rope(16, scaling={"rope_type": "linear", "factor": 2.0})[0]
    module.to("meta")
    assert module.inv_freq.device.type == "meta"
    module.to_empty(device="cpu")  # recomputed from the configuration, not left uninitialised
    assert torch.equal(module.inv_freq, exact) and torch.equal(module.long_inv_freq, exact)
    # A scripted module's .to() runs no Python: forward moves the frequencies to its input's device.
    scripted = torch.jit.script(posenc.nn.RotaryEmbedding(16))
    q = torch.empty(1, 3, 2, 16, device="meta")
    assert scripted(q, q)[0].device.type == "meta" and scripted.inv_freq.device.type == "meta"
    alibi = torch.jit.script(posenc.nn.ALiBi(4))
    assert alibi(torch.empty(1, 4, 2, 2, device="meta")).device.type == "meta"


# ---------------------------------------------------------------- one implementation

@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("seq_len", [0, 1000, 1024, 1025, 5000])
def test_for_length_equals_rope_bit_for_bit(scaling, seq_len):
    expected, _ = FQ.rope(128, 5e5, SCALINGS[scaling], seq_len)
    rope_type, keywords = FQ.rope_arguments(SCALINGS[scaling])
    for length in (torch.tensor(seq_len), torch.tensor(float(seq_len), dtype=torch.float64)):
        got = torch.ops.posenc.rope_inv_freq_for_length(length, 128, 5e5, rope_type, **keywords)
        assert got.dtype == torch.float64 and torch.equal(got, expected)


@pytest.mark.parametrize("scaling", ["dynamic", "longrope", "hunyuan"])
def test_module_per_call_frequencies_equal_the_function_bit_for_bit(scaling):
    module = posenc.nn.RotaryEmbedding(128, base=5e5, scaling=SCALINGS[scaling])
    scripted = torch.jit.script(module)
    q, k = torch.randn(1, 6, 2, 128), torch.randn(1, 6, 1, 128)
    for positions, offset, length in [(None, 0, 6), (None, 2000, 2006), (torch.tensor([5, 1, 3000, 2, 9, 0]), 7, 3008)]:
        inv_freq, scale = FQ.rope(128, 5e5, SCALINGS[scaling], length)
        assert torch.equal(module.inv_freq_for(q, positions, offset), inv_freq)
        expected = PF.rope_qk(q, k, positions, inv_freq, scale, "neox", "bshd", offset)
        for out in (module(q, k, positions, offset), scripted(q, k, positions, offset)):
            assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])


def test_ops_without_tensors_run_in_torchscript():
    @torch.jit.script
    def constants(num_heads: int):
        return (torch.ops.posenc.alibi_slopes(num_heads, torch.float64),
                torch.ops.posenc.sinusoidal_inv_freq(8, 100.0, 1),
                torch.ops.posenc.rope_inv_freq(8, 1e4, "linear", factor=2.0),
                torch.ops.posenc.zigzag_positions(8, 2, 1, None))

    slopes, sinusoidal, (inv_freq, scale), zigzag = constants(8)
    assert slopes.tolist() == [2.0 ** -k for k in range(1, 9)]
    assert_close(sinusoidal, torch.tensor([100.0 ** (-i / 3) for i in range(4)], dtype=torch.float64),
                 rtol=1e-15, atol=0)
    assert_close(inv_freq, torch.tensor([1e4 ** (-2 * i / 8) / 2 for i in range(4)], dtype=torch.float64),
                 rtol=1e-15, atol=0)
    assert scale == 1.0 and zigzag.tolist() == [2, 3, 4, 5]


def test_for_length_op_opcheck_and_meta():
    rope_type, keywords = FQ.rope_arguments(LONGROPE)
    torch.library.opcheck(torch.ops.posenc.rope_inv_freq_for_length.default, (torch.tensor(2000), 128, 1e4, rope_type),
                          keywords)
    meta = torch.ops.posenc.rope_inv_freq_for_length(torch.empty((), device="meta"), 128, 1e4, rope_type, **keywords)
    assert meta.shape == (64,) and meta.dtype == torch.float64 and meta.device.type == "meta"
    with pytest.raises(ValueError, match="posenc.frequencies.rope: llama3 factor must be positive, got 0.0"):
        torch.ops.posenc.rope_inv_freq_for_length(torch.empty((), device="meta"), 8, 1e4, "llama3", factor=0.0)
    with pytest.raises(RuntimeError, match=r"seq_len must be a 0-d tensor, got shape \[1\]"):
        torch.ops.posenc.rope_inv_freq_for_length(torch.tensor([5]), 8, 1e4)
    with pytest.raises(RuntimeError, match="seq_len must be an integer or floating tensor, got Bool"):
        torch.ops.posenc.rope_inv_freq_for_length(torch.tensor(True), 8, 1e4)


# ---------------------------------------------------------------- invalid scaling values

def bad(rope_type, **keys):
    return dict(keys, rope_type=rope_type)


YARN = dict(factor=4.0, original_max_position_embeddings=1024)
LONG = dict(short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=1024, factor=4.0)


@pytest.mark.parametrize("args, message", [
    ((8, 0.0), "base must be positive, got 0.0"),
    ((8, float("nan")), "base must be finite, got nan"),
    ((8, 1e4, {"rope_theta": -5.0}), "rope_theta must be positive, got -5.0"),
    ((8, 1e4, {"rope_theta": 0}), "rope_theta must be positive, got 0.0"),
    ((8, 1e4, None, -1), "seq_len must be non-negative, got -1"),
    ((8, 1e4, bad("linear", factor=0.0)), "linear factor must be positive, got 0.0"),
    ((8, 1e4, bad("linear", factor=-2.0)), "linear factor must be positive, got -2.0"),
    ((8, 1e4, bad("linear", factor=float("inf"))), "linear factor must be finite, got inf"),
    ((8, 1e4, bad("dynamic", factor=0.0, max_position_embeddings=64)), "dynamic factor must be positive, got 0.0"),
    ((8, 1e4, bad("dynamic", factor=2.0, max_position_embeddings=0)),
     "dynamic max_position_embeddings must be positive, got 0.0"),
    ((8, 1e4, bad("ntk", alpha=0.0)), "ntk alpha must be positive, got 0.0"),
    ((8, 1e4, bad("dynamic", alpha=-1.0)), "ntk alpha must be positive, got -1.0"),
    ((8, 1e4, bad("ntk", factor=-3.0)), "ntk factor must be positive, got -3.0"),
    ((8, 1e4, bad("ntk")), 'rope_type "ntk" needs alpha \\(or factor\\)'),
    ((8, 1e4, bad("yarn", **dict(YARN, factor=0.0))), "yarn factor must be positive, got 0.0"),
    ((8, 1e4, bad("yarn", **dict(YARN, original_max_position_embeddings=-8))),
     "yarn original_max_position_embeddings must be positive, got -8.0"),
    ((8, 1e4, bad("yarn", original_max_position_embeddings=64, max_position_embeddings=0)),
     "yarn max_position_embeddings must be positive, got 0.0"),
    ((8, 1e4, bad("yarn", **dict(YARN, beta_fast=0.0))), "yarn beta_fast must be positive, got 0.0"),
    ((8, 1e4, bad("yarn", **dict(YARN, beta_slow=-1.0))), "yarn beta_slow must be positive, got -1.0"),
    ((8, 1e4, bad("yarn", **dict(YARN, beta_fast=1.0, beta_slow=32.0))),
     "yarn beta_fast 1.0 must not be below beta_slow 32.0"),
    ((8, 1e4, bad("yarn", **dict(YARN, mscale=0.0, mscale_all_dim=1.0))), "yarn mscale must be positive, got 0.0"),
    ((8, 1e4, bad("yarn", **dict(YARN, mscale=1.0, mscale_all_dim=-1.0))),
     "yarn mscale_all_dim must be positive, got -1.0"),
    ((8, 1e4, bad("yarn", **dict(YARN, attention_factor=0.0))), "yarn attention_factor must be positive, got 0.0"),
    ((8, 1.0, bad("yarn", **YARN)), "yarn base must exceed 1"),
    ((8, 1e4, bad("llama3", factor=0.0)), "llama3 factor must be positive, got 0.0"),
    ((8, 1e4, bad("llama3", factor=-8.0)), "llama3 factor must be positive, got -8.0"),
    ((8, 1e4, bad("llama3", low_freq_factor=0.0)), "llama3 low_freq_factor must be positive, got 0.0"),
    ((8, 1e4, bad("llama3", high_freq_factor=-4.0)), "llama3 high_freq_factor must be positive, got -4.0"),
    ((8, 1e4, bad("llama3", low_freq_factor=4.0, high_freq_factor=1.0)),
     "llama3 high_freq_factor 1.0 must exceed low_freq_factor 4.0"),
    ((8, 1e4, bad("llama3", low_freq_factor=2.0, high_freq_factor=2.0)),
     "llama3 high_freq_factor 2.0 must exceed low_freq_factor 2.0"),
    ((8, 1e4, bad("llama3", original_max_position_embeddings=0)),
     "llama3 original_max_position_embeddings must be positive, got 0.0"),
    ((8, 1e4, bad("longrope", **dict(LONG, short_factor=[1.0, 0.0, 1.0, 1.0]))),
     r"longrope short_factor\[1\] must be positive, got 0.0"),
    ((8, 1e4, bad("longrope", **dict(LONG, long_factor=[1.0, 1.0, 1.0, -2.0]))),
     r"longrope long_factor\[3\] must be positive, got -2.0"),
    ((8, 1e4, bad("longrope", **dict(LONG, long_factor=[1.0, float("nan"), 1.0, 1.0]))),
     r"longrope long_factor\[1\] must be finite, got nan"),
    ((8, 1e4, bad("longrope", **dict(LONG, factor=0.0))), "longrope factor must be positive, got 0.0"),
    ((8, 1e4, bad("longrope", **dict(LONG, original_max_position_embeddings=0))),
     "longrope original_max_position_embeddings must be positive, got 0.0"),
    ((8, 1e4, bad("longrope", **dict(LONG, attention_factor=-1.0))),
     "longrope attention_factor must be positive, got -1.0"),
    ((8, 1e4, bad("longrope", **dict(LONG, original_max_position_embeddings=1))),
     "longrope original_max_position_embeddings must exceed 1"),
    ((8, 1e4, bad("proportional", partial_rotary_factor=0.0)),
     "proportional partial_rotary_factor must be positive, got 0.0"),
    ((8, 1e4, bad("proportional", partial_rotary_factor=1.5)),
     "proportional partial_rotary_factor must not exceed 1, got 1.5"),
    ((8, 1e4, bad("proportional", factor=-1.0)), "proportional factor must be positive, got -1.0"),
    ((8, 1e4, bad("linear", factor="2")), "factor must be a number, got '2'"),
    ((8, 1e4, bad("longrope", **dict(LONG, short_factor=2.0))), "short_factor must be a list of numbers, got 2.0"),
])
def test_invalid_scaling_values_are_refused(args, message):
    with pytest.raises(ValueError, match=f"posenc.frequencies.rope: {message}"):
        FQ.rope(*args)


def test_defaults_apply_only_to_absent_keys():
    plain = FQ.rope(128, 5e5, {"rope_type": "llama3"})[0]
    given = FQ.rope(128, 5e5, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})[0]
    assert torch.equal(plain, given)
    assert torch.equal(FQ.rope(128, 5e5, {"rope_type": "llama3", "factor": None})[0], plain)  # None is absent
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert torch.equal(FQ.rope(16, 1e4, dict(yarn, beta_fast=None, beta_slow=None))[0],
                       FQ.rope(16, 1e4, dict(yarn, beta_fast=32, beta_slow=1))[0])
    # Kimi K2 sets beta_fast == beta_slow; HunYuan's dynamic dict with an alpha is fixed NTK.
    assert FQ.rope(16, 1e4, dict(yarn, beta_fast=1.0, beta_slow=1.0))[0].isfinite().all()
    assert torch.equal(FQ.rope(16, 1e4, {"rope_type": "dynamic", "alpha": 2.0})[0],
                       FQ.rope(16, 1e4, {"rope_type": "ntk", "alpha": 2.0})[0])
    with pytest.raises(ValueError, match="rope_theta must be positive, got 0.0"):
        FQ.rope(16, 1e4, {"rope_theta": 0.0})


def test_modules_refuse_invalid_scaling_at_construction():
    with pytest.raises(ValueError, match="posenc.frequencies.rope: llama3 factor must be positive, got 0.0"):
        posenc.nn.RotaryEmbedding(64, scaling={"rope_type": "llama3", "factor": 0.0})
    config = {"head_dim": 16, "num_attention_heads": 2, "max_position_embeddings": 64, "partial_rotary_factor": 0.0}
    with pytest.raises(ValueError, match="rotary_dim must be even and at least 2, got 0"):
        posenc.nn.RotaryEmbedding.from_hf_config(config)


@pytest.mark.parametrize("call, message", [
    (lambda: FQ.sinusoidal(1), "posenc.frequencies.sinusoidal: dim must be at least 2, got 1"),
    (lambda: FQ.sinusoidal(8, 0.0), "posenc.frequencies.sinusoidal: base must be positive, got 0.0"),
    (lambda: FQ.sinusoidal(8, -10.0), "posenc.frequencies.sinusoidal: base must be positive, got -10.0"),
    (lambda: FQ.sinusoidal(8, float("inf")), "posenc.frequencies.sinusoidal: base must be finite, got inf"),
    (lambda: FQ.sinusoidal(8, shift=2), "posenc.frequencies.sinusoidal: shift must be 0 or 1, got 2"),
    (lambda: FQ.sinusoidal(3, shift=1), "posenc.frequencies.sinusoidal: dim 3 has 1 frequency pairs"),
    (lambda: PF.alibi_slopes(0), "posenc.alibi_slopes: num_heads must be positive, got 0"),
    (lambda: PF.alibi_slopes(-4), "posenc.alibi_slopes: num_heads must be positive, got -4"),
    (lambda: PF.alibi_slopes(4, torch.int32), "posenc.alibi_slopes: dtype must be floating, got Int"),
])
def test_invalid_sinusoidal_and_alibi_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- inv_freq dtype of the ops

X = torch.randn(1, 5, 2, 8, generator=torch.Generator().manual_seed(0))
TOKEN_WEIGHT = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def rope_family_calls(inv_freq):
    x = X
    yield "rope", lambda: PF.rope(x, None, inv_freq)
    yield "rope_backward", lambda: PF.rope_backward(x, None, inv_freq)
    yield "rope_qk", lambda: PF.rope_qk(x, x, None, inv_freq)
    yield "rope_qk_backward", lambda: PF.rope_qk_backward(x, x, None, inv_freq)
    yield "rope_", lambda: PF.rope_(x.clone(), None, inv_freq)
    tokens = torch.tensor([[1, 2, 3, 4, 0]])
    yield "sinusoidal", lambda: PF.sinusoidal(torch.arange(5), inv_freq)
    yield "add_sinusoidal", lambda: PF.add_sinusoidal(x[..., 0, :], None, inv_freq)
    yield "embed_sinusoidal", lambda: PF.embed_sinusoidal(tokens, TOKEN_WEIGHT, None, inv_freq)


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "BFloat16"), (torch.float16, "Half")])
def test_ops_refuse_low_precision_inv_freq(dtype, name):
    for op, call in rope_family_calls(FQ.rope(8)[0].to(dtype)):
        with pytest.raises(RuntimeError, match=rf"posenc.{op}: inv_freq must be float64 \(or float32\), got {name}"):
            call()


def test_ops_take_float32_inv_freq_as_its_float64_value():
    inv_freq = FQ.rope(8)[0].float()
    for (op, call32), (_, call64) in zip(rope_family_calls(inv_freq), rope_family_calls(inv_freq.double())):
        out32, out64 = call32(), call64()
        for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (out32, out64))):
            assert torch.equal(a, b), op


def test_zigzag_positions_keep_their_contract():
    assert PF.zigzag_positions(12, 3, 2).tolist() == [4, 5, 6, 7]
    assert PF.zigzag_positions(0, 2, 1).tolist() == []
    positions, indices, local_cu = PF.zigzag_positions_varlen(torch.tensor([0, 4, 12]), 2, 1)
    assert positions.tolist() == [1, 2, 2, 3, 4, 5] and indices.tolist() == [1, 2, 6, 7, 8, 9]
    assert local_cu.tolist() == [0, 2, 6] and local_cu.dtype == torch.int64
    with pytest.raises(ValueError, match="posenc.zigzag_positions: cp_size must be at least 1, got 0"):
        PF.zigzag_positions(8, 0, 0)



# ---------------------------------------------------------------- inside compiled and exported code

class _BuildsItsConstants(torch.nn.Module):
    """Calls every builder in forward: frequencies with a scale, slopes, pair axes, patch positions."""

    def forward(self, x):
        inv_freq, scale = FQ.rope(8, 500.0, {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 64})
        axial, axial_axis = FQ.axial(8, 2, 100.0)
        mrope, mrope_axis = FQ.mrope(8, [2, 1, 1], 100.0, interleaved=True)
        multiaxis, multiaxis_axis = FQ.multiaxis([4, 4], [10.0, 1000.0])
        return (x + inv_freq.float() * scale, x + FQ.sinusoidal(8).float(), x + axial.float() * axial_axis,
                x + mrope.float() * mrope_axis, x + multiaxis.float() * multiaxis_axis,
                x + PF.alibi_slopes(4, device=x.device), x + FQ.mrope_pair_axis([2, 2]), x + PF.image_positions(2, 2))


def test_builders_inside_torch_compile_and_torch_export_are_the_eager_constants():
    """No graph break under torch.compile(fullgraph=True), and torch.export (strict and not) records them."""
    x = torch.zeros(4)
    eager = _BuildsItsConstants()(x)
    i = torch.arange(4, dtype=torch.float64)
    assert_close(eager[1].double(), 10000.0 ** (-2 * i / 8), rtol=1e-7, atol=0)
    assert_close(eager[2].double(), 100.0 ** (-torch.tensor([0, 1, 0, 1], dtype=torch.float64) / 2) *
                 torch.tensor([0, 0, 1, 1]))
    assert_close(eager[5].double(), 2.0 ** (-2 * (i + 1)))
    assert eager[6].tolist() == [0, 0, 1, 1]
    assert eager[7].tolist() == [[0, 0, 1, 1], [0, 1, 0, 1]]
    # (Each output uses x: torch 2.13's compiler cannot return a constant tensor unchanged from a function that
    # reaches it through a module attribute such as FQ.)
    torch._dynamo.reset()
    compiled = torch.compile(_BuildsItsConstants(), fullgraph=True)(x)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
    for strict in (True, False):
        exported = torch.export.export(_BuildsItsConstants(), (x,), strict=strict).module()(x)
        assert all(torch.equal(c, e) for c, e in zip(exported, eager)), strict


def test_import_posenc_loads_neither_dynamo_nor_dtensor():
    """The builders' compile mark is set without torch._dynamo, whose import costs about a second."""
    code = "import sys, posenc; print('torch._dynamo' in sys.modules, 'torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (which imports this file to find
# them): each op's sample call (op_registry.SAMPLES: determinism, concurrency, no_grad, CUDA and CPU-capability
# tests), its hypothesis property (test_properties.py) and its bad-input cases (bad_input_fuzzer.py).

# ---- sample calls
# The configuration ops that take tensors (csrc/families.h's POSENC_CONFIG_OPS).

@sample("rope_inv_freq_for_length")
def _build_rope_inv_freq_for_length(m):
    """Small: dynamic NTK past its context; large: LongRoPE past its original context (the size changes nothing:
    the result has rotary_dim / 2 values)."""
    if m.large:
        rope_type, keywords = posenc.frequencies.rope_arguments({
            "rope_type": "longrope", "original_max_position_embeddings": 2048.0, "max_position_embeddings": 8192.0,
            "short_factor": [1.0 + i / 64 for i in range(64)], "long_factor": [4.0 + i for i in range(64)]})
        return call_args(torch.tensor(3000), 128, 1e4, rope_type, **keywords)
    return call_args(torch.tensor(5000), 64, 1e4, "dynamic", factor=2.0, max_position_embeddings=4096.0)


@sample("zigzag_positions_varlen")
def _build_zigzag_positions_varlen(m):
    """Packed sequences of multiples of 8 tokens (some empty): small 16 of them, large 4096 (about 800 k tokens)."""
    lengths = m.ints(50, m.size(16, 4096), seed=66) * 8
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long, device=lengths.device), lengths.cumsum(0)])
    return call_args(cu_seqlens, 4, m.size(2, 1))


# ---- properties: random valid inputs against float64 references (test_properties.py)

def rope_for_length_reference(rotary_dim, base, rope_type, keywords, length):
    """float64 inv_freq of the length-dependent types and the plain ones, from the formulas: theta^(-2i/r), over
    factor (linear); dynamic NTK's theta (factor L / max - (factor - 1))^(r / (r - 2)) with L = max(length, max);
    fixed NTK's theta alpha^(r / (r - 2)); LongRoPE's long factors beyond the original context, else short."""
    exponents = [2 * i / rotary_dim for i in range(rotary_dim // 2)]
    ntk = rotary_dim / (rotary_dim - 2) if rotary_dim > 2 else None
    if rope_type == "dynamic":
        context, factor = keywords["max_position_embeddings"], keywords["factor"]
        longest = max(length, context)
        base = base * (factor * longest / context - (factor - 1)) ** ntk
    elif rope_type == "ntk":
        base = base * keywords["alpha"] ** ntk
    values = [base ** -e for e in exponents]
    if rope_type == "linear":
        values = [v / keywords["factor"] for v in values]
    elif rope_type == "longrope":
        factors = keywords["long_factor" if length > keywords["original_max_position_embeddings"] else "short_factor"]
        values = [v / f for v, f in zip(values, factors)]
    return torch.tensor(values, dtype=torch.float64)


@property_check("rope_inv_freq_for_length")
@given(st.data())
def check_rope_inv_freq_for_length(data):
    draw = data.draw
    rotary_dim = 2 * draw(st.integers(2, 8))
    base = draw(st.sampled_from([10000.0, 500000.0, 2.0, 1e6]))
    rope_type = draw(st.sampled_from(["default", "linear", "dynamic", "ntk", "longrope"]))
    context = draw(st.sampled_from([2, 64, 4096, 2 ** 20]))
    keywords = {"default": {}, "linear": {"factor": draw(st.sampled_from([2.0, 0.5, 8.0]))},
                "dynamic": {"factor": draw(st.sampled_from([2.0, 4.0, 1.0])), "max_position_embeddings": float(context)},
                "ntk": {"alpha": draw(st.sampled_from([1.0, 3.0, 1000.0]))},
                "longrope": {"original_max_position_embeddings": float(context), "factor": 4.0,
                             "short_factor": [draw(st.sampled_from([1.0, 1.5])) for _ in range(rotary_dim // 2)],
                             "long_factor": [draw(st.sampled_from([2.0, 40.0])) for _ in range(rotary_dim // 2)]},
                }[rope_type]
    dtype = draw(st.sampled_from([torch.long, torch.int, torch.int16, torch.uint8, torch.float64, torch.float32]))
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    length = draw(st.one_of(st.sampled_from([-1, 0, 1, context - 1, context, context + 1, 2 * context]),
                            st.integers(0, 2 ** 40)))
    length = min(max(length, info.min), min(info.max, 2 ** 24 if dtype == torch.float32 else 2 ** 40))
    seq_len = torch.tensor(length, dtype=dtype)
    out = call("rope_inv_freq_for_length", seq_len, rotary_dim, base, rope_type, **keywords)
    assert out.dtype == torch.float64 and out.shape == (rotary_dim // 2,)
    reference = rope_for_length_reference(rotary_dim, base, rope_type, keywords, seq_len.item())
    # exp(-e log theta) against theta ** -e: a few units of roundoff of the exponent, |log inv_freq|.
    assert_rounds_within(out, reference, 16 * 2.0 ** -53 * reference.abs() * (1 + reference.log().abs()))


@property_check("zigzag_positions_varlen")
@given(st.data())
def check_zigzag_positions_varlen(data):
    draw = data.draw
    cp_size = draw(st.integers(1, 4))
    cp_rank = draw(st.integers(0, cp_size - 1))
    lengths = [2 * cp_size * draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 4)))]
    bounds = [sum(lengths[:n]) for n in range(len(lengths) + 1)]
    dtype = draw(st.sampled_from([torch.long, torch.int]))
    cu_seqlens = arrange(draw, torch.tensor(bounds, dtype=dtype), expand=False)
    # The output's length follows cu_seqlens' values: no Meta kernel to compare with.
    positions, indices, local = OPS.zigzag_positions_varlen(cu_seqlens, cp_size, cp_rank)
    # Each sequence is cut into 2 cp_size chunks; this rank holds chunks cp_rank and 2 cp_size - 1 - cp_rank.
    expected_positions, expected_indices = [], []
    for start, length in zip(bounds, lengths):
        chunk = length // (2 * cp_size)
        mine = [c * chunk + i for c in (cp_rank, 2 * cp_size - 1 - cp_rank) for i in range(chunk)]
        expected_positions += mine
        expected_indices += [start + p for p in mine]
    assert positions.dtype == indices.dtype == torch.long and local.dtype == dtype
    assert positions.tolist() == expected_positions and indices.tolist() == expected_indices
    assert local.tolist() == [b // cp_size for b in bounds]


# ---- bad inputs: a small valid call of each op, and the mutations that each make one argument wrong

def rope_inv_freq_for_length(draw):
    return dict(seq_len=torch.tensor(small(draw, 0, 8)), rotary_dim=2 * small(draw, 2, 4), base=10000.0,
                rope_type="dynamic", factor=2.0, max_position_embeddings=4.0)


def zigzag_positions_varlen(draw):
    cp_size = small(draw, 1, 3)
    lengths = [2 * cp_size * small(draw, 0, 2) for _ in range(small(draw))]
    return dict(cu_seqlens=torch.tensor([sum(lengths[:n]) for n in range(len(lengths) + 1)]), cp_size=cp_size,
                cp_rank=cp_size - 1)


bad_inputs("rope_inv_freq_for_length", base=rope_inv_freq_for_length, mutations=dict(
    seq_len_not_0d=wrong_rank("seq_len", [1, 2]), seq_len_not_real=to_dtype("seq_len", torch.bool, torch.complex64),
    rotary_dim_invalid=set_value("rotary_dim", st.sampled_from([0, 1, 2, 3, 7, -2, INT64_MIN])),
    base_not_positive=set_value("base", st.sampled_from([0.0, -1.0, float("nan"), float("inf")])),
    rope_type_unknown=unknown_string("rope_type", {"default", "linear", "dynamic", "ntk", "ntk_alpha", "yarn",
                                                   "llama3", "longrope"}),
    factor_not_positive=set_value("factor", st.sampled_from([0.0, -2.0, float("nan"), float("inf")])),
    max_position_embeddings_missing=lambda draw, kw: kw.pop("max_position_embeddings"),
    longrope_factors_wrong_length=lambda draw, kw: kw.update(
        rope_type="longrope", original_max_position_embeddings=4.0,
        short_factor=[1.0] * (kw["rotary_dim"] // 2 + draw(st.sampled_from([1, -1]))),
        long_factor=[2.0] * (kw["rotary_dim"] // 2))))
bad_inputs("zigzag_positions_varlen", base=zigzag_positions_varlen, mutations=dict(
    cu_seqlens_not_index=not_index("cu_seqlens"), cu_seqlens_wrong_rank=wrong_rank("cu_seqlens", [0, 2]),
    cu_seqlens_empty=lambda draw, kw: kw.update(cu_seqlens=torch.empty(0, dtype=torch.long)),
    cu_seqlens_not_from_0=lambda draw, kw: kw.update(cu_seqlens=kw["cu_seqlens"] + draw(st.sampled_from(
        [1, -2 * kw["cp_size"], INT64_MIN // 2]))),
    # Decreasing, directly or by a step so large that the difference wraps around.
    cu_seqlens_decreasing=lambda draw, kw: kw.update(cu_seqlens=torch.cat([kw["cu_seqlens"], torch.tensor(
        draw(st.sampled_from([[-2 * kw["cp_size"]], [2 ** 62, INT64_MIN + 2 * kw["cp_size"]],
                              [INT64_MAX - 1, -2]])))])),
    length_not_a_multiple=lambda draw, kw: kw.update(cu_seqlens=torch.cat([kw["cu_seqlens"], kw["cu_seqlens"][-1:] +
                                                                           draw(st.integers(1, 2 * kw["cp_size"] - 1
                                                                                            ) if kw["cp_size"] > 1
                                                                                else st.just(1))])),
    cp_size_invalid=set_value("cp_size", st.sampled_from([0, -1, INT64_MIN, 2 ** 62 + 1, INT64_MAX])),
    cp_rank_outside=lambda draw, kw: kw.update(cp_rank=draw(st.sampled_from([-1, kw["cp_size"], INT64_MAX])))))
