"""Rotary family: frequencies of every scaling type, the ops against float64 formulas written here and the
reference libraries (Hugging Face transformers, rotary-embedding-torch), RoPE's properties, gradients,
context parallelism, the module, opcheck, torch.compile, torch.export and the bad inputs (docs/errors.md)."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch.testing import assert_close

import posenc
from helpers import assert_exports, randn, rotate_pairs, same_bits, tolerance
from mutations import (F64, grow, not_floating, not_index, on_meta, overlapping, positions_beyond_domain,
                       positions_length, put, small, to_dtype, unknown_string, wrong_rank)
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import functional as PF
from posenc import frequencies as FQ
from strategies import (FLOAT_DTYPES, OPS, arrange, assert_rounds_within, buffer_of, call, covered_offsets,
                        drawn_tensor, frequencies, generator, math_eps, normal, positions_and_offset, trig_error)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
FORMATS = ["bshd", "bhsd", "sbhd", "thd"]
# Where a bshd tensor's dims go in each format (thd: batch 1 dropped).
PERMUTE = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}


def to_format(x, fmt):
    """bshd [B, S, H, D] -> the layout of `fmt` (thd needs B = 1)."""
    return x[0] if fmt == "thd" else x.permute(PERMUTE[fmt])


def from_format(x, fmt):
    return x[None] if fmt == "thd" else x.permute(PERMUTE[fmt])  # these permutations are their own inverses


def reference_rope(x, positions, inv_freq, layout="neox", scale=1.0):
    """float64 RoPE of bshd x, written from the definition: angle = p * inv_freq; positions [S] or [B, S]."""
    return rotate_pairs(x, positions.double()[..., None] * inv_freq.double(), layout, scale)


# ---------------------------------------------------------------- frequencies (formulas written here)

def powers(rotary_dim, theta):
    return torch.tensor([theta ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)], dtype=torch.float64)


@pytest.mark.parametrize("rotary_dim, base", [(2, 10000.0), (64, 10000.0), (128, 500000.0), (96, 1e6)])
def test_frequencies_default(rotary_dim, base):
    inv_freq, scale = FQ.rope(rotary_dim, base)
    assert inv_freq.dtype == torch.float64 and scale == 1.0
    assert_close(inv_freq, powers(rotary_dim, base), rtol=1e-14, atol=0)


def test_frequencies_linear_ntk_and_dynamic():
    r = 16
    assert_close(FQ.rope(r, scaling={"type": "linear", "factor": 4.0})[0], powers(r, 1e4) / 4, rtol=1e-14, atol=0)
    fixed = powers(r, 1e4 * 3.0 ** (r / (r - 2)))
    assert_close(FQ.rope(r, scaling={"rope_type": "ntk", "alpha": 3.0})[0], fixed, rtol=1e-13, atol=0)
    # HunYuan checkpoints label fixed NTK "dynamic" with an alpha.
    assert_close(FQ.rope(r, scaling={"rope_type": "dynamic", "alpha": 3.0})[0], fixed, rtol=1e-13, atol=0)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 100}
    for seq_len in [None, 50, 100]:  # up to max_position_embeddings: the original frequencies
        assert_close(FQ.rope(r, scaling=dynamic, seq_len=seq_len)[0], powers(r, 1e4), rtol=1e-14, atol=0)
    grown = 1e4 * (2.0 * 300 / 100 - 1.0) ** (r / (r - 2))
    assert_close(FQ.rope(r, scaling=dynamic, seq_len=300)[0], powers(r, grown), rtol=1e-13, atol=0)


def test_frequencies_rope_theta_in_the_dict_replaces_base():
    assert_close(FQ.rope(8, 10.0, {"rope_theta": 500.0})[0], powers(8, 500.0), rtol=1e-14, atol=0)


def yarn_reference(r, theta, factor, original, beta_fast=32, beta_slow=1):
    """YaRN as the paper and Hugging Face write it, loop by loop."""
    def corr(n):
        return r * math.log(original / (n * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), r - 1)
    high = high + 0.001 if high == low else high
    out = []
    for i in range(r // 2):
        inv = theta ** (-2 * i / r)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(inv / factor * ramp + inv * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def test_frequencies_yarn_and_deepseek_mscale():
    scaling = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}
    inv_freq, scale = FQ.rope(64, 1e4, scaling)
    assert_close(inv_freq, yarn_reference(64, 1e4, 16.0, 4096), rtol=1e-13, atol=0)
    assert scale == pytest.approx(0.1 * math.log(16.0) + 1)
    deepseek = dict(scaling, mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2)
    inv_freq, scale = FQ.rope(64, 1e4, deepseek)
    assert_close(inv_freq, yarn_reference(64, 1e4, 16.0, 4096, 16, 2), rtol=1e-13, atol=0)
    assert scale == pytest.approx((0.1 * 0.707 * math.log(16) + 1) / (0.1 * math.log(16) + 1))
    # No factor: max_position_embeddings / original; an explicit attention_factor wins.
    implicit = {"rope_type": "yarn", "original_max_position_embeddings": 1024, "max_position_embeddings": 4096,
                "attention_factor": 0.5}
    inv_freq, scale = FQ.rope(32, 1e4, implicit)
    assert_close(inv_freq, yarn_reference(32, 1e4, 4.0, 1024), rtol=1e-13, atol=0)
    assert scale == 0.5


def test_frequencies_llama3():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    expected = []
    for inv in powers(128, 500000.0).tolist():
        wavelength = 2 * math.pi / inv
        if wavelength < 8192 / 4:
            expected.append(inv)
        elif wavelength > 8192 / 1:
            expected.append(inv / 8)
        else:
            smooth = (8192 / wavelength - 1) / (4 - 1)
            expected.append((1 - smooth) * inv / 8 + smooth * inv)
    inv_freq, scale = FQ.rope(128, 500000.0, scaling)
    assert_close(inv_freq, torch.tensor(expected, dtype=torch.float64), rtol=1e-13, atol=0)
    assert scale == 1.0
    # The three bands are all present, so each branch above was checked.
    ratio = inv_freq / powers(128, 500000.0)
    assert (ratio == 1).any() and (ratio == 0.125).any() and ((ratio > 0.125) & (ratio < 1)).any()


def test_frequencies_longrope_picks_factors_by_sequence_length():
    short, long = [1.0 + 0.1 * i for i in range(8)], [2.0 + 0.5 * i for i in range(8)]
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": 4096, "max_position_embeddings": 131072}
    for seq_len, factors in [(None, short), (4096, short), (4097, long)]:
        inv_freq, scale = FQ.rope(16, 1e4, scaling, seq_len)
        assert_close(inv_freq, powers(16, 1e4) / torch.tensor(factors, dtype=torch.float64), rtol=1e-14, atol=0)
        assert scale == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


@pytest.mark.parametrize("args, message", [
    ((7,), "rotary_dim must be even and at least 2, got 7"),
    ((0,), "rotary_dim must be even and at least 2, got 0"),
    ((8, -1.0), "base must be positive, got -1.0"),
    ((8, 1e4, {"rope_type": "su"}), 'unknown rope_type "su"'),
    ((8, 1e4, {"rope_type": "linear"}), 'rope_type "linear" needs factor'),
    ((8, 1e4, {"rope_type": "dynamic", "factor": 2.0}), "needs max_position_embeddings"),
    ((2, 1e4, {"rope_type": "ntk", "alpha": 2.0}), "undefined for rotary_dim 2"),
    ((8, 1e4, {"rope_type": "yarn", "factor": 2.0}), "needs original_max_position_embeddings"),
    ((8, 1e4, {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 3,
               "original_max_position_embeddings": 10}), "long_factor of rotary_dim / 2 = 4 values, got 3"),
])
def test_frequencies_bad_arguments(args, message):
    with pytest.raises(ValueError, match=f"posenc.frequencies.rope: .*{message}"):
        FQ.rope(*args)


# ---------------------------------------------------------------- frequencies against Hugging Face

HF_CASES = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
    "yarn_deepseek": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 256, "mscale": 0.707,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(16)],
                 "long_factor": [1.5 + 0.3 * i for i in range(16)], "original_max_position_embeddings": 512},
}


def hf_config(params, partial=1.0, max_position_embeddings=4096):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                    max_position_embeddings=max_position_embeddings,
                                    rope_parameters=dict(params, rope_theta=50000.0),
                                    partial_rotary_factor=partial if partial != 1.0 else None)


@pytest.mark.parametrize("name", list(HF_CASES))
@pytest.mark.parametrize("seq_len", [None, 3000, 9000])
def test_frequencies_match_hugging_face(name, seq_len):
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    config = hf_config(HF_CASES[name], partial=0.5)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        head_dim = 32  # the default init lives on the model class: inv_freq = theta^(-2i/d), d = 64 * 0.5
        hf_inv_freq, hf_scale = 1.0 / (50000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 1.0
    else:
        hf_inv_freq, hf_scale = rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    module = posenc.nn.RotaryEmbedding.from_hf_config(config)
    assert module.rotary_dim == 32 and module.head_dim == 64
    ours, scale = FQ.rope(32, 50000.0, module.scaling, seq_len)
    # HF computes in float32: agreement to its rounding (the float32 accuracy target: <= 1e-6 relative).
    assert_close(ours, hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf_scale, rel=1e-12)
    assert module.attention_scale == pytest.approx(hf_scale, rel=1e-12)


@pytest.mark.parametrize("partial, factor, head_dim", [(0.25, 1.0, 256), (0.5, 8.0, 64), (1.0, 1.0, 16),
                                                      (0.3, 2.0, 64), (0.125, 1.0, 24)])
def test_proportional_frequencies_match_hugging_face_gemma4(partial, factor, head_dim):
    """Gemma 4's "proportional" rope (transformers' _compute_proportional_rope_parameters): the whole head's
    exponents, its first int(partial * head_dim // 2) pairs turning at theta^(-2i / head_dim) / factor, the others
    not at all; from_hf_config takes the whole head and the rope parameters' partial_rotary_factor."""
    transformers = pytest.importorskip("transformers")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    full = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": partial, "factor": factor}
    sliding = {"rope_type": "default", "rope_theta": 1e4}
    config = transformers.Gemma4TextConfig(head_dim=8, global_head_dim=head_dim, hidden_size=64, num_attention_heads=4,
                                           rope_parameters={"full_attention": full, "sliding_attention": sliding})
    hf_inv_freq, hf_scale = rope_utils.ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type="full_attention")
    rotated = int(partial * head_dim // 2)
    ours, scale = FQ.rope(head_dim, 1e4, full)
    expected = torch.cat([1e6 ** (-torch.arange(0, 2 * rotated, 2, dtype=torch.float64) / head_dim) / factor,
                          torch.zeros(head_dim // 2 - rotated, dtype=torch.float64)])
    assert_close(ours, expected, rtol=1e-15, atol=0)  # float64 formula written here
    assert_close(ours, hf_inv_freq.double(), rtol=1e-6, atol=0)  # HF's float32
    assert torch.equal(ours == 0, hf_inv_freq == 0) and scale == hf_scale == 1.0
    module = posenc.nn.RotaryEmbedding.from_hf_config(config, layer_type="full_attention")
    assert module.rotary_dim == module.head_dim == head_dim and torch.equal(module.inv_freq, ours)
    q = torch.randn(1, 5, 2, head_dim, dtype=torch.float64)  # the unrotated pairs come back bit for bit
    out = module(q, q)[0]
    tail = torch.cat([torch.arange(rotated, head_dim // 2), torch.arange(rotated, head_dim // 2) + head_dim // 2])
    assert torch.equal(out[..., tail], q[..., tail])


def test_fixed_ntk_matches_hugging_face_hunyuan():
    """Fixed NTK (alpha) lives in transformers' HunYuan models: checkpoints label it "dynamic" with an alpha."""
    hunyuan = pytest.importorskip("transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense")
    parameters = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}
    config = hunyuan.HunYuanDenseV1Config(hidden_size=256, num_attention_heads=4, head_dim=64,
                                          max_position_embeddings=128, rope_parameters=parameters)
    rotary = hunyuan.HunYuanDenseV1RotaryEmbedding(config)
    module = posenc.nn.RotaryEmbedding.from_hf_config(config)
    assert_close(module.inv_freq, rotary.inv_freq.double(), rtol=1e-6, atol=0)
    assert module.attention_scale == rotary.attention_scaling == 1.0
    q = torch.randn(1, 300, 2, 64)  # 300 > max_position_embeddings would rescale a true dynamic NTK, not this one
    assert torch.equal(module(q, q, None)[0], PF.rope(q, None, module.inv_freq))


def test_from_hf_config_phi3_keeps_original_length_outside_rope_scaling():
    """Phi-3: original_max_position_embeddings beside rope_scaling; factor = 131072 / 4096."""
    config = {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
              "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48}}
    module = posenc.nn.RotaryEmbedding.from_hf_config(config)
    assert module.rotary_dim == 96
    assert module.attention_scale == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert_close(module.long_inv_freq, powers(96, 1e4) / 4, rtol=1e-14, atol=0)


def test_from_hf_config_per_layer_type_parameters():
    config = {"head_dim": 16, "num_attention_heads": 2, "max_position_embeddings": 64,
              "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="pass layer_type"):
        posenc.nn.RotaryEmbedding.from_hf_config(config)
    module = posenc.nn.RotaryEmbedding.from_hf_config(config, layer_type="full_attention")
    assert_close(module.inv_freq, powers(16, 1e6) / 8, rtol=1e-14, atol=0)


# ---------------------------------------------------------------- rope values over dtypes, layouts, formats

def positions_for(kind, batch, seq):
    if kind == "none":
        return None, torch.arange(seq) + 3
    p = torch.randint(-100, 5000, (seq,) if kind == "shared" else (batch, seq))
    return p, p + 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("fmt, kind", [(fmt, kind) for fmt in FORMATS for kind in ["none", "shared", "per_row"]
                                       if (fmt, kind) != ("thd", "per_row")])  # thd: one position per token
def test_rope_values(dtype, layout, fmt, kind):
    batch = 1 if fmt == "thd" else 2
    x = torch.randn(batch, 7, 3, 12, dtype=dtype)
    positions, reference_positions = positions_for(kind, batch, 7)
    inv_freq = FQ.rope(8, 100.0)[0]  # partial: 4 of 12 channels pass through
    out = PF.rope(to_format(x, fmt), positions, inv_freq, 0.75, layout, fmt, offset=3)
    assert out.dtype == dtype and out.shape == to_format(x, fmt).shape and out.is_contiguous()
    expected = reference_rope(x, reference_positions, inv_freq, layout, 0.75)
    assert_close(from_format(out, fmt).double(), expected, **tolerance(dtype))
    assert torch.equal(from_format(out, fmt)[..., 8:], x[..., 8:])  # pass-through channels are copied exactly


def test_rope_accuracy_float32_up_to_2_pow_20():
    """The accuracy target: max abs error <= 1e-6 against float64 for |p| <= 2^20, where a float32 angle is
    off by ~1e-1."""
    positions = torch.cat([torch.arange(0, 2 ** 20 + 1, 4099), torch.tensor([2 ** 20, -(2 ** 20), 2 ** 20 - 1])])
    inv_freq = FQ.rope(128)[0]
    x = torch.randn(1, positions.numel(), 1, 128, dtype=torch.float64)
    out = PF.rope(x.float(), positions, inv_freq)
    error = (out.double() - reference_rope(x.float(), positions, inv_freq)).abs().max().item()
    assert error <= 1e-6
    angle = positions.float()[:, None] * inv_freq.float()  # the eager float32 recipe
    naive = x[0, :, 0, :64].float() * angle.cos() - x[0, :, 0, 64:].float() * angle.sin()
    naive_error = (naive.double() - reference_rope(x.float(), positions, inv_freq)[0, :, 0, :64]).abs().max().item()
    assert naive_error > 100 * error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_qk_inv_freq_read_in_its_dtype_and_stride(dtype):
    """inv_freq of either dtype, strided, is read as float64 holds its values: the float64 formula of the same
    frequencies, to float32 rounding, and the bits of the same values given contiguous in float64."""
    wide = FQ.rope(64)[0].repeat_interleave(2).to(dtype)
    inv_freq = wide[::2]  # stride 2
    assert not inv_freq.is_contiguous()
    positions = torch.tensor([[0, 7, 1000, -3], [5, 2 ** 20, 9, 1]])
    q, k = torch.randn(2, 4, 3, 64), torch.randn(2, 4, 1, 64)
    q_out, k_out = PF.rope_qk(q, k, positions, inv_freq)
    assert_close(q_out.double(), reference_rope(q, positions, inv_freq.double()), atol=1e-6, rtol=0)
    assert_close(k_out.double(), reference_rope(k, positions, inv_freq.double()), atol=1e-6, rtol=0)
    same = PF.rope_qk(q, k, positions, inv_freq.double().contiguous())
    assert torch.equal(q_out, same[0]) and torch.equal(k_out, same[1])


def test_scores_depend_only_on_relative_position():
    """The defining property: <rope(q, m), rope(k, n)> is a function of m - n alone (float64)."""
    inv_freq = FQ.rope(32)[0]
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    m = torch.randint(-3000, 3000, (400,))
    delta = torch.randint(-50, 50, (400,))
    for layout in ["neox", "gptj"]:
        def rotated(v, p):
            return PF.rope(v.expand(1, p.numel(), 1, 32), p, inv_freq, layout=layout)[0, :, 0]
        scores = (rotated(q, m) * rotated(k, m - delta)).sum(-1)
        at_zero = (rotated(q, delta) * rotated(k, torch.zeros_like(delta))).sum(-1)
        assert_close(scores, at_zero, atol=1e-11, rtol=0)
        assert scores.std() > 0.1  # the scores do vary with m - n


def test_gptj_equals_neox_after_channel_permutation():
    """Meta's interleaved pairs are HF's halves after the permutation q/k weights get in conversion."""
    x = torch.randn(2, 5, 3, 10, dtype=torch.float64)
    positions = torch.randint(0, 1000, (2, 5))
    inv_freq = FQ.rope(8)[0]
    perm = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2), torch.arange(8, 10)])
    neox = PF.rope(x[..., perm], positions, inv_freq, layout="neox")
    assert_close(PF.rope(x, positions, inv_freq, layout="gptj"), neox[..., torch.argsort(perm)], atol=1e-12, rtol=0)


# ---------------------------------------------------------------- strides

def test_rope_reads_views_of_a_fused_qkv_projection():
    batch, seq, heads, head_dim = 2, 6, 4, 16
    qkv = torch.randn(batch, seq, 3 * heads * head_dim)
    q, k, v = qkv.view(batch, seq, 3, heads, head_dim).unbind(2)
    assert not q.is_contiguous()
    inv_freq = FQ.rope(head_dim)[0]
    out_q, out_k = PF.rope_qk(q, k, None, inv_freq)
    assert_close(out_q, PF.rope(q.contiguous(), None, inv_freq), atol=0, rtol=0)
    assert_close(out_k, PF.rope(k.contiguous(), None, inv_freq), atol=0, rtol=0)
    # In place on the view: only q's slots of qkv change.
    before = qkv.clone()
    PF.rope_(q, None, inv_freq)
    fused = qkv.view(batch, seq, 3, heads, head_dim)
    assert_close(fused[:, :, 0], out_q, atol=0, rtol=0)
    assert torch.equal(fused[:, :, 1:], before.view(batch, seq, 3, heads, head_dim)[:, :, 1:])


@pytest.mark.parametrize("make", [
    lambda x: x[..., ::2],                                   # channel stride 2
    lambda x: x[:, ::2, 1:, 3:11],                           # sliced
    lambda x: x[:1, :1].expand(2, 3, 4, 16),                 # stride 0
    lambda x: x.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0),  # channels outermost in memory
], ids=["channel_stride", "sliced", "expanded", "channels_outermost"])
def test_rope_any_strides(make):
    x = make(torch.randn(2, 6, 4, 16, dtype=torch.float64))
    inv_freq = FQ.rope(x.shape[-1] - 2)[0]
    positions = torch.randint(0, 500, (x.shape[1],))
    out = PF.rope(x, positions, inv_freq, 1.0, "gptj")
    assert out.is_contiguous()
    assert_close(out, reference_rope(x, positions, inv_freq, "gptj"), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (40, 36)])
@pytest.mark.parametrize("kind", ["none", "shared", "per_row"])
def test_bhsd_rotated_head_by_head_over_tiles_of_tokens(dtype, layout, head_dim, rotary_dim, kind):
    """A bhsd view's heads lie a sequence apart, so its tokens are rotated a few heads at a time (four, then the
    two left here) over tiles of a few hundred tokens, which end mid-sequence and span batch rows here; a bshd
    view's are rotated token by token. Both give the float64 formula within rounding and the same bits, also where
    a channel stride sends the bhsd rows through the strided path, in place, and with explicit cos/sin tables."""
    batch, seq, heads = 3, 1100, 6
    x = randn(batch, seq, heads, head_dim, dtype=dtype)
    positions, reference_positions = positions_for(kind, batch, seq)
    inv_freq = FQ.rope(rotary_dim, 10000.0)[0]
    by_token = PF.rope(x, positions, inv_freq, 1.0, layout, "bshd", offset=3)
    assert_close(by_token.double(), reference_rope(x, reference_positions, inv_freq, layout), **tolerance(dtype))
    x_bhsd = x.transpose(1, 2).contiguous()
    by_head = PF.rope(x_bhsd, positions, inv_freq, 1.0, layout, "bhsd", offset=3)
    assert torch.equal(by_head.transpose(1, 2), by_token)
    wide = torch.zeros(batch, heads, seq, 2 * head_dim, dtype=dtype)
    wide[..., ::2] = x_bhsd
    assert torch.equal(PF.rope(wide[..., ::2], positions, inv_freq, 1.0, layout, "bhsd", offset=3), by_head)
    PF.rope_(x_bhsd, positions, inv_freq, 1.0, layout, "bhsd", offset=3)
    assert torch.equal(x_bhsd, by_head)
    # Explicit tables take the same walks.
    cos, sin = (table.float() for table in hf_cos_sin(reference_positions, inv_freq, layout))
    tables_by_token = PF.rope_cos_sin(x, cos, sin, layout, "bshd")
    assert_close(tables_by_token.double(), reference_rope(x, reference_positions, inv_freq, layout), **tolerance(dtype))
    tables_by_head = PF.rope_cos_sin(x.transpose(1, 2).contiguous(), cos, sin, layout, "bhsd")
    assert torch.equal(tables_by_head.transpose(1, 2), tables_by_token)


# ---------------------------------------------------------------- packed sequences, qk, in place

def test_thd_cu_seqlens_equals_each_sequence_alone():
    lengths = [5, 0, 1, 9]
    cu_seqlens = torch.tensor([0, 5, 5, 6, 15], dtype=torch.int32)
    x = torch.randn(15, 2, 8)
    inv_freq = FQ.rope(8)[0]
    out = PF.rope(x, None, inv_freq, 0.9, "gptj", "thd", 4, cu_seqlens)
    start = 0
    for n in lengths:
        alone = PF.rope(x[start:start + n], None, inv_freq, 0.9, "gptj", "thd", 4)
        assert torch.equal(out[start:start + n], alone)
        start += n
    # Explicit positions take precedence over the restart rule.
    positions = torch.arange(15)
    assert torch.equal(PF.rope(x, positions, inv_freq, 1.0, "neox", "thd", 0, cu_seqlens),
                       PF.rope(x, None, inv_freq, 1.0, "neox", "thd"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rope_qk_equals_two_rope_calls_with_different_head_counts(fmt):
    batch = 1 if fmt == "thd" else 2
    q = to_format(torch.randn(batch, 5, 8, 16), fmt)
    k = to_format(torch.randn(batch, 5, 2, 12), fmt)  # GQA, and a smaller head_dim for k
    positions = torch.randint(0, 100, (5,))
    inv_freq = FQ.rope(12)[0]
    out_q, out_k = PF.rope_qk(q, k, positions, inv_freq, 0.5, "gptj", fmt, 7)
    assert torch.equal(out_q, PF.rope(q, positions, inv_freq, 0.5, "gptj", fmt, 7))
    assert torch.equal(out_k, PF.rope(k, positions, inv_freq, 0.5, "gptj", fmt, 7))
    grad_q, grad_k = torch.randn_like(out_q), torch.randn_like(out_k)
    back_q, back_k = PF.rope_qk_backward(grad_q, grad_k, positions, inv_freq, 0.5, "gptj", fmt, 7)
    assert torch.equal(back_q, PF.rope_backward(grad_q, positions, inv_freq, 0.5, "gptj", fmt, 7))
    assert torch.equal(back_k, PF.rope_backward(grad_k, positions, inv_freq, 0.5, "gptj", fmt, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_rope_qk_over_tiles_of_tokens_equals_each_view_alone(dtype, layout, same_bits_for_any_thread_count):
    """Where a token's q and k rows span a page or more and each token forms its own coefficients (positions per
    row), rope_qk walks tiles of a hundred-odd tokens, q's rows, then k's; a single view walks token by token. Both
    give the same bits for any thread count, across tiles that end mid-sequence and span batch rows, and the
    float64 formula."""
    batch, seq = 2, 301
    q = randn(batch, seq, 16, 128, dtype=dtype, seed=1)
    k = randn(batch, seq, 8, 128, dtype=dtype, seed=2)
    positions = torch.randint(-100, 9000, (batch, seq), generator=torch.Generator().manual_seed(3))
    inv_freq = FQ.rope(128, 10000.0)[0]
    args = (positions, inv_freq, 1.0, layout, "bshd", 5)

    def both_ways():
        fused = PF.rope_qk(q, k, *args)
        fused_back = PF.rope_qk_backward(*fused, *args)
        alone = PF.rope(q, *args), PF.rope(k, *args)
        alone_back = PF.rope_backward(fused[0], *args), PF.rope_backward(fused[1], *args)
        return fused, fused_back, alone, alone_back

    (out_q, out_k), fused_back, alone, alone_back = same_bits_for_any_thread_count(both_ways)
    assert torch.equal(out_q, alone[0]) and torch.equal(out_k, alone[1])
    assert torch.equal(fused_back[0], alone_back[0]) and torch.equal(fused_back[1], alone_back[1])
    assert_close(out_q.double(), reference_rope(q, positions + 5, inv_freq, layout), **tolerance(dtype))
    assert_close(out_k.double(), reference_rope(k, positions + 5, inv_freq, layout), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["bhsd", "thd"])
def test_rope_inplace_equals_rope(dtype, fmt):
    x = to_format(torch.randn(1, 6, 3, 10, dtype=dtype), fmt)
    positions = torch.randint(0, 9000, (6,))
    inv_freq = FQ.rope(8)[0]
    expected = PF.rope(x, positions, inv_freq, 2.0, "neox", fmt, 1)
    y = x.clone()
    version = y._version
    assert PF.rope_(y, positions, inv_freq, 2.0, "neox", fmt, 1) is y
    assert torch.equal(y, expected) and y._version > version


def test_rope_inplace_without_grad_invalidates_tensors_saved_for_backward():
    weight = torch.randn(2, 4, 2, 8, requires_grad=True)
    x = torch.randn(2, 4, 2, 8)
    y = x * weight  # saves x for weight's gradient
    PF.rope_(x, None, FQ.rope(8)[0])  # nothing requires grad: the call records no node
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_rope_inplace_autograd_through_a_non_leaf():
    leaf = torch.randn(2, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    inv_freq = FQ.rope(8)[0]
    x = leaf * 3
    PF.rope_(x, None, inv_freq)
    grad = torch.randn_like(x)
    x.backward(grad)
    assert_close(leaf.grad, 3 * PF.rope_backward(grad, None, inv_freq))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        PF.rope_(leaf, None, inv_freq)


def test_rope_inplace_rejects_overlapping_memory():
    x = torch.randn(1, 1, 1, 8).expand(2, 3, 1, 8)
    with pytest.raises(RuntimeError, match="posenc.rope_: x has elements that share memory"):
        PF.rope_(x, None, FQ.rope(8)[0])


# ---------------------------------------------------------------- kept tables

KEPT_CALLS = """
def rotations(q, k, w, inv_freq, scale, rows, scattered):
    out = list(PF.rope_qk(q, k, None, inv_freq, scale, offset=5))  # shared arange: the batch's table
    out += PF.rope_qk(q.float(), k.float(), rows, inv_freq, scale)  # a position row per batch row: token by token
    out += PF.rope_qk(q[:1].half(), k[:1].half(), rows[:1], inv_freq, scale, "gptj")
    out.append(PF.rope(q.double(), scattered, inv_freq, scale))  # float64: the exact path's table
    out.append(PF.rope_backward(q, rows, inv_freq, scale, "gptj"))  # the inverse rotation
    out += PF.qk_norm_rope(q[:1], k[:1], w, w, rows[:1], inv_freq)  # QK-norm, batch 1
    out.append(PF.rope(q, scattered + 0.5, inv_freq))  # not whole numbers, negative, far: computed either way
    out.append(PF.rope(q, rows - 100, inv_freq))
    out.append(PF.rope(q, None, inv_freq, offset=5000))
    out += PF.rope_qk(q, k, rows, inv_freq)  # unscaled: the tokens read the table's rows as they are
    out += PF.rope_qk(q[:1].half(), k[:1].half(), None, inv_freq, q_scale_beta=0.1, q_scale_length=64)  # q's scaled
    out += PF.rope_qk(q[0], k[0], None, inv_freq, format="thd", cu_seqlens=torch.tensor([0, 100, 300]))  # packed
    return out
"""


def test_kept_tables_give_the_bits_of_computed_rotations(tmp_path):
    """Whole-number positions >= 0 of one axis read their sin and cos from the kept encoding tables (calls of at
    least 8192 position-frequency pairs, here 300 positions of 64 pairs, whose table holds at most 4 rows a
    position); POSENC_ENCODING_CACHE_MB=0 keeps none and computes every one. The same bits, for each way positions
    come, each dtype, scaled and unscaled rotations (whose tokens read the table's rows as they are), the backward
    and the QK-norm."""
    torch.manual_seed(0)
    q = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 2, 128, dtype=torch.bfloat16)
    w = torch.rand(128, dtype=torch.bfloat16) + 0.5
    inv_freq, scale = FQ.rope(128, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 64})
    rows = torch.stack([torch.arange(300), torch.arange(300) * 3 + 7])
    scattered = torch.randint(0, 1200, (300,))
    inputs = [q, k, w, inv_freq, scale, rows, scattered]
    namespace = {"PF": PF, "torch": torch}
    exec(KEPT_CALLS, namespace)
    kept = namespace["rotations"](*inputs)
    assert all(same_bits(a, b) for a, b in zip(kept, namespace["rotations"](*inputs)))  # tables found, not made
    assert_close(kept[6], reference_rope(q.double(), scattered, inv_freq, "neox", scale))
    torch.save(inputs, tmp_path / "inputs")
    code = ("import sys, torch, posenc.functional as PF\n" + KEPT_CALLS +
            "torch.save(rotations(*torch.load(sys.argv[1] + '/inputs')), sys.argv[1] + '/out')\n")
    env = dict(os.environ, POSENC_LIBRARY=posenc.library_path, POSENC_ENCODING_CACHE_MB="0")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=True, timeout=300)
    computed = torch.load(tmp_path / "out")
    assert len(computed) == len(kept) == 19
    assert all(same_bits(a, b) for a, b in zip(kept, computed))



def test_kept_tables_under_concurrent_rotations(tmp_path):
    """Threads that compute, grow, replace and read kept tables at once (four frequency sets in a budget of 2 MiB,
    so tables are dropped while other calls hold them) each get the bits of the same call made alone."""
    code = """
import concurrent.futures, torch, posenc.functional as PF, posenc.frequencies as FQ
freqs = [FQ.rope(128, base)[0] for base in (100.0, 1000.0, 10000.0, 500000.0)]
q, k = torch.randn(1, 256, 2, 128), torch.randn(1, 256, 1, 128)
cases = [(i % 4, (i // 4) % 4 * 256) for i in range(32)]
expected = [PF.rope_qk(q, k, None, freqs[f], 1.0, offset=o) for f, o in cases]
def call(i):
    f, o = cases[i]
    return all(torch.equal(a, b) for a, b in zip(PF.rope_qk(q, k, None, freqs[f], 1.0, offset=o), expected[i]))
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    assert all(pool.map(call, list(range(32)) * 4))
"""
    env = dict(os.environ, POSENC_LIBRARY=posenc.library_path, POSENC_ENCODING_CACHE_MB="2")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)


# ---------------------------------------------------------------- gradients

def test_backward_is_the_inverse_rotation():
    x = torch.randn(2, 5, 3, 10, requires_grad=True)
    positions = torch.randint(0, 3000, (2, 5))
    inv_freq = FQ.rope(8)[0]
    out = PF.rope(x, positions, inv_freq, 0.6, "gptj", "bshd", 2)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert_close(x.grad.double(), reference_rope(grad, positions + 2, -inv_freq, "gptj", 0.6), atol=2e-6, rtol=0)
    # An unscaled rotation is orthogonal: backward of forward gives the gradient back.
    rotated = PF.rope(grad, positions, inv_freq, 1.0, "gptj", "bshd", 2)
    assert_close(PF.rope_backward(rotated, positions, inv_freq, 1.0, "gptj", "bshd", 2), grad, atol=2e-6, rtol=0)


def test_only_positions_and_frequencies_are_saved():
    x = torch.randn(2, 5, 3, 8, requires_grad=True)
    positions, inv_freq = torch.randint(0, 9, (2, 5)), FQ.rope(8)[0]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        PF.rope(x, positions, inv_freq)
        PF.rope_qk(x, x, None, inv_freq)
    assert [t.shape for t in saved] == [positions.shape, inv_freq.shape, inv_freq.shape]
    assert torch.equal(saved[0], positions) and all(torch.equal(t, inv_freq) for t in saved[1:])


@pytest.mark.parametrize("learned", [False, True], ids=["fixed", "learned_freq"])
def test_non_reentrant_checkpointing_recomputes_the_rotations(learned):
    """torch.utils.checkpoint(use_reentrant=False), transformers' default for gradient checkpointing, allows each
    saved tensor to be read once per backward: rope, rope_qk and rope_ (on a non-leaf) run under it and give the
    inverse rotation (float64 formula) as x's gradient, and, with learned frequencies, the plain backward's."""
    positions = torch.randint(0, 3000, (2, 5))
    inv_freq = FQ.rope(8)[0].requires_grad_(learned)
    q, k, v = (torch.randn(2, 5, 3, 8, requires_grad=True) for _ in range(3))
    grads = [torch.randn(2, 5, 3, 8) for _ in range(4)]

    def rotations(q, k, v, inv_freq):
        q_out, k_out = PF.rope_qk(q, k, positions, inv_freq, 0.6, "gptj")
        v_out = PF.rope(v, positions, inv_freq, 0.6)
        outs = [q_out, k_out, v_out]
        if not learned:  # rope_ takes no learned frequencies
            outs.append(PF.rope_(v * 1.0, positions, inv_freq))
        return sum((out * grad).sum() for out, grad in zip(outs, grads))

    torch.utils.checkpoint.checkpoint(rotations, q, k, v, inv_freq, use_reentrant=False).backward()
    assert_close(q.grad.double(), reference_rope(grads[0], positions, -inv_freq.detach(), "gptj", 0.6), atol=2e-6,
                 rtol=0)
    assert_close(k.grad.double(), reference_rope(grads[1], positions, -inv_freq.detach(), "gptj", 0.6), atol=2e-6,
                 rtol=0)
    expected_v = reference_rope(grads[2], positions, -inv_freq.detach(), "neox", 0.6)
    if not learned:
        expected_v = expected_v + reference_rope(grads[3], positions, -inv_freq.detach())
    assert_close(v.grad.double(), expected_v, atol=4e-6, rtol=0)
    if learned:
        checkpointed = inv_freq.grad.clone()
        inv_freq.grad = None
        rotations(q, k, v, inv_freq).backward()
        assert torch.equal(checkpointed, inv_freq.grad)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_gradcheck(layout):
    def f64(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    inv_freq = FQ.rope(4)[0]
    positions = torch.randint(0, 50, (2, 3))
    x, q, k = f64(2, 3, 2, 6), f64(2, 3, 2, 6), f64(2, 3, 1, 6)
    cos, sin = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 2, 5])
    packed = f64(5, 2, 6)
    checks = [
        (lambda t: PF.rope(t, positions, inv_freq, 0.8, layout, "bshd", 1), (x,)),
        (lambda t: PF.rope_backward(t, None, inv_freq, 0.8, layout, "bhsd", 1), (x,)),
        (lambda a, b: PF.rope_qk(a, b, None, inv_freq, 1.3, layout), (q, k)),
        (lambda t: PF.rope_(t * 1, None, inv_freq, 1.0, layout), (x,)),
        (lambda t: PF.rope_cos_sin(t, cos, sin, layout), (x,)),
        (lambda t: PF.rope(t, None, inv_freq, 1.0, layout, "thd", 0, cu_seqlens), (packed,)),
    ]
    for fn, inputs in checks:
        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


# ---------------------------------------------------------------- rope_cos_sin and the reference libraries

def hf_cos_sin(positions, inv_freq, layout):
    angle = positions.double()[..., None] * inv_freq
    emb = torch.cat([angle, angle], -1) if layout == "neox" else angle.repeat_interleave(2, -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("table_shape", ["[S,r]", "[1,S,r]", "[B,S,r]"])
def test_rope_cos_sin_equals_rope(layout, table_shape):
    x = torch.randn(2, 6, 3, 10, dtype=torch.float64)
    inv_freq = FQ.rope(8)[0]
    positions = torch.randint(0, 100, (6,)) if table_shape != "[B,S,r]" else torch.randint(0, 100, (2, 6))
    cos, sin = hf_cos_sin(positions, inv_freq, layout)
    if table_shape == "[1,S,r]":
        cos, sin = cos[None], sin[None]
    out = PF.rope_cos_sin(x, cos, sin, layout)
    assert_close(out, PF.rope(x, positions, inv_freq, 1.0, layout), atol=1e-12, rtol=0)
    # Tables of another dtype are read in the maths type of x.
    out32 = PF.rope_cos_sin(x.float(), cos.float(), sin.float(), layout)
    assert_close(out32.double(), out, atol=2e-6, rtol=0)


@pytest.mark.parametrize("unsqueeze_dim, fmt", [(1, "bhsd"), (2, "bshd")])
def test_rope_cos_sin_matches_hugging_face_apply_rotary_pos_emb(unsqueeze_dim, fmt):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = hf_config({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64})
    rotary = llama.LlamaRotaryEmbedding(config)
    q = torch.randn(2, 4, 7, 64) if fmt == "bhsd" else torch.randn(2, 7, 4, 64)
    k = torch.randn(2, 2, 7, 64) if fmt == "bhsd" else torch.randn(2, 7, 2, 64)
    position_ids = torch.randint(0, 64, (2, 7))  # HF's float32 angles are exact enough only at small p
    cos, sin = rotary(q, position_ids)
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert_close(PF.rope_cos_sin(q, cos, sin, "neox", fmt), hf_q, atol=1e-6, rtol=0)
    assert_close(PF.rope_cos_sin(k, cos, sin, "neox", fmt), hf_k, atol=1e-6, rtol=0)
    # And the module built from the same config gives the same result.
    module = posenc.nn.RotaryEmbedding.from_hf_config(config, format=fmt)
    ours_q, ours_k = module(q, k, position_ids)
    assert_close(ours_q, hf_q, atol=1e-5, rtol=0)
    assert_close(ours_k, hf_k, atol=1e-5, rtol=0)


def test_rope_cos_sin_matches_hugging_face_partial_rotary():
    """HF's partial rotary (e.g. Phi, GPT-NeoX): rotate the first r channels, concatenate the rest."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q = torch.randn(2, 3, 5, 16)  # bhsd
    positions = torch.arange(5)
    cos, sin = hf_cos_sin(positions, FQ.rope(6)[0], "neox")
    cos, sin = cos.float()[None], sin.float()[None]
    rotated, _ = llama.apply_rotary_pos_emb(q[..., :6], q[..., :6], cos, sin)
    expected = torch.cat([rotated, q[..., 6:]], -1)
    assert_close(PF.rope_cos_sin(q, cos, sin, "neox", "bhsd"), expected, atol=1e-6, rtol=0)


def test_gptj_matches_rotary_embedding_torch():
    ret = pytest.importorskip("rotary_embedding_torch")
    rotary = ret.RotaryEmbedding(dim=12)
    t = torch.randn(2, 3, 17, 20)  # [B, H, S, D]: rotates the first 12 channels, interleaved
    expected = rotary.rotate_queries_or_keys(t, offset=5)
    inv_freq = rotary.freqs.detach().double()
    assert_close(PF.rope(t, None, inv_freq, 1.0, "gptj", "bhsd", 5), expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- context parallelism (dual-chunk split)

def test_zigzag_positions_split_the_sequence():
    parts = [PF.zigzag_positions(24, 3, rank) for rank in range(3)]
    assert parts[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert parts[2].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert sorted(torch.cat(parts).tolist()) == list(range(24))


@pytest.mark.parametrize("fmt, seq_dim", [("bshd", 1), ("sbhd", 0), ("bhsd", 2)])
def test_context_parallel_shards_equal_the_unsharded_result(fmt, seq_dim):
    x = to_format(torch.randn(2, 16, 3, 8), fmt)
    inv_freq = FQ.rope(8)[0]
    full = PF.rope(x, None, inv_freq, 1.0, "neox", fmt, 5)
    for rank in range(4):
        positions = PF.zigzag_positions(16, 4, rank)
        local = PF.rope(x.index_select(seq_dim, positions), positions, inv_freq, 1.0, "neox", fmt, 5)
        assert torch.equal(local, full.index_select(seq_dim, positions))


def test_context_parallel_packed_sequences():
    cu_seqlens = torch.tensor([0, 8, 12, 28], dtype=torch.int32)
    x = torch.randn(28, 2, 8)
    inv_freq = FQ.rope(8)[0]
    full = PF.rope(x, None, inv_freq, 1.0, "gptj", "thd", 0, cu_seqlens)
    covered = []
    for rank in range(2):
        positions, indices, local_cu = PF.zigzag_positions_varlen(cu_seqlens, 2, rank)
        assert local_cu.tolist() == [0, 4, 6, 14] and local_cu.dtype == torch.int32
        local = PF.rope(x[indices], positions, inv_freq, 1.0, "gptj", "thd")
        assert torch.equal(local, full[indices])
        covered += indices.tolist()
    assert sorted(covered) == list(range(28))
    first_positions, _, _ = PF.zigzag_positions_varlen(cu_seqlens, 2, 0)
    assert first_positions[:4].tolist() == [0, 1, 6, 7]  # chunks 0 and 3 of the first sequence (chunk 2)


@pytest.mark.parametrize("call, message", [
    (lambda: PF.zigzag_positions(10, 2, 0), "seq_len 10 must be a multiple of 2 \\* cp_size = 4"),
    (lambda: PF.zigzag_positions(8, 2, 2), r"cp_rank 2 is outside \[0, 2\)"),
    (lambda: PF.zigzag_positions_varlen(torch.tensor([0, 4, 6]), 2, 0), "every sequence length must be a multiple"),
    (lambda: PF.zigzag_positions_varlen(torch.tensor([0, 8, 4]), 2, 0), "never decrease"),
])
def test_context_parallel_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- the module

def test_module_matches_functional_and_scripts():
    module = posenc.nn.RotaryEmbedding(16, 12, base=500.0, layout="gptj", scaling={"rope_type": "linear", "factor": 2})
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 1, 16)
    positions = torch.randint(0, 100, (2, 5))
    out_q, out_k = module(q, k, positions, 3)
    inv_freq = powers(12, 500.0) / 2
    assert_close(out_q.double(), reference_rope(q, positions + 3, inv_freq, "gptj"), atol=2e-6, rtol=0)
    assert_close(out_k.double(), reference_rope(k, positions + 3, inv_freq, "gptj"), atol=2e-6, rtol=0)
    scripted = torch.jit.script(module)
    for a, b in zip(scripted(q, k, positions, 3), (out_q, out_k)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double().float()])
def test_module_frequencies_stay_float64(convert):
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [3.0] * 32,
               "original_max_position_embeddings": 64, "max_position_embeddings": 256}
    module = posenc.nn.RotaryEmbedding(64, scaling=scaling)
    convert(module)
    assert module.inv_freq.dtype == torch.float64 and module.long_inv_freq.dtype == torch.float64
    assert torch.equal(module.inv_freq, FQ.rope(64, scaling=scaling)[0])
    assert torch.equal(module.long_inv_freq, FQ.rope(64, scaling=scaling, seq_len=65)[0])
    q = torch.randn(1, 3, 2, 64, dtype=torch.bfloat16)
    out_q, _ = module(q, q)
    assert out_q.dtype == torch.bfloat16


@pytest.mark.parametrize("call", [
    dict(seq=20, positions=None, offset=0),     # L = 20 > 16: rescaled
    dict(seq=10, positions=None, offset=0),     # L = 10: original
    dict(seq=4, positions=None, offset=30),     # L = 34 from the offset
    dict(seq=4, positions=[1, 2, 40, 3], offset=2),  # L = 43 from the largest position
])
def test_module_dynamic_ntk_and_longrope_follow_the_sequence_length(call):
    positions = None if call["positions"] is None else torch.tensor(call["positions"])
    length = (call["offset"] + call["seq"]) if positions is None else int(positions.max()) + call["offset"] + 1
    q, k = torch.randn(2, call["seq"], 2, 8), torch.randn(2, call["seq"], 1, 8)
    for scaling in [{"rope_type": "dynamic", "factor": 3.0, "max_position_embeddings": 16},
                    {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 3, 4, 5],
                     "original_max_position_embeddings": 16, "max_position_embeddings": 64}]:
        module = posenc.nn.RotaryEmbedding(8, scaling=scaling)
        inv_freq, scale = FQ.rope(8, scaling=scaling, seq_len=length)
        expected = PF.rope_qk(q, k, positions, inv_freq, scale, "neox", "bshd", call["offset"])
        for a, b in zip(module(q, k, positions, call["offset"]), expected):
            assert_close(a, b, atol=1e-6, rtol=0)
        for a, b in zip(torch.jit.script(module)(q, k, positions, call["offset"]), expected):
            assert_close(a, b, atol=1e-6, rtol=0)


def test_module_bad_arguments():
    with pytest.raises(ValueError, match="rotary_dim 10 exceeds head_dim 8"):
        posenc.nn.RotaryEmbedding(8, 10)
    with pytest.raises(ValueError, match='layout must be "neox" or "gptj", got "half"'):
        posenc.nn.RotaryEmbedding(8, layout="half")
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        posenc.nn.RotaryEmbedding(8, 5)


# ---------------------------------------------------------------- opcheck, compile, export

def opcheck_samples():
    inv_freq = FQ.rope(6)[0]
    q = torch.randn(2, 5, 3, 8, requires_grad=True)
    k = torch.randn(2, 5, 1, 8, requires_grad=True)
    packed = torch.randn(9, 2, 8, requires_grad=True)
    cu_seqlens = torch.tensor([0, 4, 9])
    yield "rope", torch.ops.posenc.rope.default, (q, torch.randint(0, 99, (2, 5)), inv_freq, 0.5, "gptj", "bshd", 3)
    yield "rope_thd", torch.ops.posenc.rope.default, (packed, None, inv_freq, 1.0, "neox", "thd", 0, cu_seqlens)
    yield "rope_bhsd", torch.ops.posenc.rope.default, (q.transpose(1, 2), torch.arange(5), inv_freq, 1.0, "neox",
                                                       "bhsd")
    yield "rope_backward", torch.ops.posenc.rope_backward.default, (q, None, inv_freq, 0.5, "neox", "sbhd", 1)
    yield "rope_qk", torch.ops.posenc.rope_qk.default, (q, k, None, inv_freq, 1.0, "gptj")
    yield "rope_qk_backward", torch.ops.posenc.rope_qk_backward.default, (q, k, torch.arange(5), inv_freq)
    yield "rope_", torch.ops.posenc.rope_.default, (q.detach().clone(), None, inv_freq, 2.0, "gptj")
    yield "rope_cos_sin", torch.ops.posenc.rope_cos_sin.default, (q, torch.randn(5, 6), torch.randn(5, 6))
    yield "rope_cos_sin_backward", torch.ops.posenc.rope_cos_sin_backward.default, (
        q, torch.randn(2, 5, 6), torch.randn(2, 5, 6), "gptj")


@pytest.mark.parametrize("sample", list(opcheck_samples()), ids=lambda s: s[0])
def test_opcheck(sample):
    _, op, args = sample
    torch.library.opcheck(op, args)


class Attention(torch.nn.Module):
    """A tiny attention block: fused qkv projection, rotary q/k (GQA), scaled dot-product attention."""

    def __init__(self, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = torch.nn.Linear(16, (heads + 2 * kv_heads) * head_dim)
        self.rotary = posenc.nn.RotaryEmbedding(head_dim, scaling={"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 32})

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, self.head_dim).split([self.heads, self.kv_heads, self.kv_heads], 2)
        q, k = self.rotary(q, k)
        k, v = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2).reshape(b, s, -1)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    model = Attention()
    compiled_matches_eager(model, [torch.randn(2, 6, 16)], [model.qkv.weight])


@pytest.mark.parametrize("scaling", [None, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8},
                                     {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5],
                                      "long_factor": [3.0, 4.0, 5.0, 6.0], "original_max_position_embeddings": 8,
                                      "max_position_embeddings": 32}])
def test_compile_dynamic_no_recompilation_when_the_sequence_length_changes(scaling):
    import torch._dynamo.testing
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    module = posenc.nn.RotaryEmbedding(8, scaling=scaling)
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counter)
    frames = None
    for seq in [5, 9, 13, 30]:  # beyond 8 the dynamic base (LongRoPE: the factors) changes, the graph does not
        q, k = torch.randn(3, seq, 4, 8), torch.randn(3, seq, 1, 8)
        with torch._dynamo.config.patch(error_on_recompile=frames is not None):
            out = compiled(q, k)
        frames = counter.frame_count if frames is None else frames
        for a, b in zip(out, module(q, k)):
            assert_close(a, b)
    assert counter.frame_count == frames


def test_compile_inductor_inplace():
    torch._dynamo.reset()
    inv_freq = FQ.rope(8)[0]

    def f(x):
        y = x * 2
        PF.rope_(y, None, inv_freq, 1.0, "gptj")
        return y + 1

    x = torch.randn(2, 5, 3, 8)
    assert_close(torch.compile(f, fullgraph=True)(x), f(x))


def test_export():
    model = Attention()
    x = torch.randn(2, 6, 16)
    assert_exports(model, (x,), "rope_qk")


# ---------------------------------------------------------------- query scale (Llama 4, Ministral 3)

def q_scale_formula(positions, beta, length, shift):
    """float64 s(p) = 1 + beta * log(1 + max(floor((p + shift) / length), 0)), written here."""
    steps = torch.floor((positions.double() + shift) / length).clamp_min(0)
    return 1 + beta * torch.log(1 + steps)


def llama4_attn_scale(positions, attn_scale, floor_scale):
    """Llama 4's attention temperature tuning, the expression of transformers/models/llama4/modeling_llama4.py
    (Llama4TextAttention.forward, attn_temperature_tuning): q times it, i.e. beta=attn_scale, length=floor_scale,
    shift=1."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def ministral3_attn_scale(positions, beta, max_position_embeddings):
    """Ministral 3's get_llama_4_attn_scale, imported from transformers ([B, S] positions -> [B, 1, S, 1], bhsd)."""
    modeling = pytest.importorskip("transformers.models.ministral3.modeling_ministral3")
    return modeling.get_llama_4_attn_scale(positions, beta, max_position_embeddings)


def model_q_scale(model, positions):
    """(beta, length, shift) of Llama 4's (0.1, 8, 1) or Ministral 3's (0.5, 16, 0) query scale, and the scale the
    model's own expression gives at positions [2, 40], shaped [2, 1, 40, 1] (bhsd) and above 1.2 somewhere."""
    if model == "llama4":
        beta, length, shift = 0.1, 8, 1
        scale = llama4_attn_scale(positions, beta, length)[:, None, :, None]
    else:
        beta, length, shift = 0.5, 16, 0
        scale = ministral3_attn_scale(positions, beta, length)
    assert scale.shape == (2, 1, 40, 1) and scale.max() > 1.2
    return beta, length, shift, scale


@pytest.mark.parametrize("model", ["llama4", "ministral3"])
def test_rope_qk_q_scale_matches_the_models_formulas(model):
    """q rotated then times the model's own scale (bhsd, positions [B, S] spanning several steps of the length, as
    the models call it); k only rotated, bit for bit."""
    q, k = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16)
    positions = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(3))
    positions[0, :3] = torch.tensor([0, 6, 7])  # Llama 4 (length 8, shift 1): 7 -> floor(8 / 8) = 1
    inv_freq = FQ.rope(16)[0]
    beta, length, shift, scale = model_q_scale(model, positions)
    out_q, out_k = PF.rope_qk(q, k, positions, inv_freq, 1.0, "neox", "bhsd", 0, None, None, beta, length, shift)
    rotated_q, rotated_k = PF.rope_qk(q, k, positions, inv_freq, 1.0, "neox", "bhsd")
    assert_close(out_q, rotated_q * scale, atol=1e-6, rtol=1e-6)
    assert torch.equal(out_k, rotated_k)
    assert_close(scale, q_scale_formula(positions, beta, length, shift)[:, None, :, None].float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_rope_qk_q_scale_against_the_float64_formula(fmt):
    """float64 q and k, every format: positions [B, S] (bshd), [S] (bhsd), none with an offset (sbhd), packed
    sequences restarting per sequence (thd); the scale at positions + offset; a shift and negative positions among
    them (below -shift: 1)."""
    batch = 1 if fmt == "thd" else 2
    g = torch.Generator().manual_seed(4)
    q = torch.randn(batch, 12, 3, 8, dtype=F64, generator=g)
    k = torch.randn(batch, 12, 1, 8, dtype=F64, generator=g)
    inv_freq = FQ.rope(8)[0]
    beta, length, shift, offset, cu_seqlens = 0.3, 3, 2, 0, None
    if fmt == "bshd":
        positions = torch.randint(-10, 5000, (batch, 12), generator=g)
        positions[:, 0] = torch.tensor([-9, -3])
        absolute = positions
    elif fmt == "bhsd":
        positions = torch.arange(-6, 18, 2)
        absolute = positions[None].expand(batch, 12)
    elif fmt == "sbhd":
        positions, offset = None, 7
        absolute = torch.arange(12)[None].expand(batch, 12) + offset
    else:
        positions, offset, cu_seqlens = None, 1, torch.tensor([0, 5, 5, 12])
        absolute = torch.cat([torch.arange(5), torch.arange(7)])[None] + offset
    out_q, out_k = PF.rope_qk(to_format(q, fmt), to_format(k, fmt), positions, inv_freq, 0.7, "gptj", fmt, offset,
                              cu_seqlens, None, beta, length, shift)
    scale = q_scale_formula(absolute, beta, length, shift)[..., None, None]
    assert_close(from_format(out_q, fmt), reference_rope(q, absolute, inv_freq, "gptj", 0.7) * scale,
                 atol=1e-12, rtol=1e-12)
    assert_close(from_format(out_k, fmt), reference_rope(k, absolute, inv_freq, "gptj", 0.7), atol=1e-12, rtol=1e-12)


def test_rope_qk_q_scale_is_one_at_and_below_minus_shift():
    """Positions p + shift < length give floor 0 (scale 1); those below -shift too (the models' log would be of
    zero or less): q equals the unscaled rotation bit for bit, while a position at length - shift is scaled."""
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 1, 8)
    inv_freq = FQ.rope(8)[0]
    positions = torch.tensor([-1000, -50, -6, -5, -3, 0])  # shift 5, length 4: p + 5 in [-995, 5) -> floor <= 0 ...
    out_q, _ = PF.rope_qk(q, k, positions, inv_freq, 1.0, "neox", "bshd", 0, None, None, 2.0, 4, 5)
    plain_q, _ = PF.rope_qk(q, k, positions, inv_freq)
    assert torch.equal(out_q[:, :5], plain_q[:, :5])
    assert_close(out_q[:, 5], plain_q[:, 5] * (1 + 2.0 * math.log(2)))  # 0 + 5 -> floor(5 / 4) = 1


def test_rope_qk_q_scale_with_an_empty_q_leaves_k_unscaled():
    k = torch.randn(1, 6, 2, 8)
    positions = torch.arange(100, 106)
    out_q, out_k = PF.rope_qk(torch.randn(1, 6, 0, 8), k, positions, FQ.rope(8)[0], 1.0, "neox", "bshd", 0, None,
                              None, 0.5, 2, 0)
    assert out_q.shape == (1, 6, 0, 8) and torch.equal(out_k, PF.rope(k, positions, FQ.rope(8)[0]))


def test_rope_qk_q_scale_gradcheck_and_the_backward_op():
    """float64 gradcheck with beta != 0 (positions [B, S] with an offset; packed sequences); rope_qk_backward with
    the same arguments gives autograd's gradients."""
    def f64(*shape):
        return torch.randn(*shape, dtype=F64, requires_grad=True)
    inv_freq = FQ.rope(6)[0]
    positions = torch.tensor([[3, 40, 7], [-4, 11, 900]])
    q, k, packed_q, packed_k = f64(2, 3, 2, 6), f64(2, 3, 1, 6), f64(5, 2, 6), f64(5, 1, 6)
    checks = [
        ((positions, inv_freq, 0.8, "gptj", "bshd", 2, None, None, 0.4, 4, 1), (q, k)),
        ((None, inv_freq, 1.0, "neox", "thd", 3, torch.tensor([0, 2, 5]), None, 1.5, 2, 0), (packed_q, packed_k)),
    ]
    for direct_args, inputs in checks:
        def fn(a, b):
            return PF.rope_qk(a, b, *direct_args)
        assert torch.autograd.gradcheck(fn, inputs)
        out = fn(*inputs)
        grads = [torch.randn_like(o) for o in out]
        got = torch.autograd.grad(out, inputs, grads)
        direct = PF.rope_qk_backward(*grads, *direct_args)
        assert all(torch.equal(a, b) for a, b in zip(direct, got))
        # The scale reaches the gradient: q's differs from the unscaled backward's, k's does not.
        unscaled = PF.rope_qk_backward(*grads, *direct_args[:8])
        assert not torch.allclose(direct[0], unscaled[0]) and torch.equal(direct[1], unscaled[1])


Q8, K8, INV8 = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 1, 8), FQ.rope(8)[0]


# The query scale's refusals (rope_qk's and the QK-norm ops'), for q [2, 4, 3, 8]: arguments and message.
Q_SCALE_REFUSALS = [
    (dict(q_scale_length=0), "q_scale_length must be >= 1, got 0"),
    (dict(q_scale_beta=0.1, q_scale_length=-3), "q_scale_length must be >= 1, got -3"),
    (dict(q_scale_beta=float("nan")), "q_scale_beta must be finite, got nan"),
    (dict(q_scale_beta=float("inf")), "q_scale_beta must be finite, got inf"),
    (dict(q_scale_beta=float("-inf")), "q_scale_beta must be finite, got -inf"),
    (dict(q_scale_beta=0.1, inv_freq=FQ.rope(4)[0]),
     "q_scale_beta needs q's heads fully rotated, but rotary_dim 4 < head_dim 8"),
    (dict(q_scale_beta=0.1, positions=torch.zeros(2, 4, dtype=torch.long), inv_freq=FQ.axial(8, 2)[0],
          pair_axis=FQ.axial(8, 2)[1]), "q_scale_beta takes one position per token; with pair_axis"),
]


@pytest.mark.parametrize("op_name", ["rope_qk", "rope_qk_backward"])
@pytest.mark.parametrize("kwargs, message", Q_SCALE_REFUSALS)
def test_q_scale_bad_arguments(op_name, kwargs, message):
    args = dict(positions=None, inv_freq=INV8)
    args.update(kwargs)
    fn = getattr(PF, op_name)
    with pytest.raises(RuntimeError, match=rf"posenc\.{op_name}: {re.escape(message)}"):
        fn(Q8, K8, args.pop("positions"), args.pop("inv_freq"), **args)
    # beta 0 with partial rotary or pair_axis is the plain rotation.
    if "q_scale_beta" in kwargs and "q_scale_length" not in kwargs and math.isfinite(kwargs["q_scale_beta"]):
        args = dict(positions=None, inv_freq=INV8)
        args.update(kwargs, q_scale_beta=0.0)
        fn(Q8, K8, args.pop("positions"), args.pop("inv_freq"), **args)


# ---------------------------------------------------------------- bad input

X = torch.randn(2, 4, 3, 8)
INV = FQ.rope(8)[0]


@pytest.mark.parametrize("call, message", [
    (lambda: PF.rope(X, None, FQ.rope(10)[0]), "posenc.rope: rotary_dim 10 exceeds the head_dim 8 of x"),
    (lambda: PF.rope_cos_sin(X, torch.randn(4, 5), torch.randn(4, 5)),
     "posenc.rope_cos_sin: rotary_dim 5 .* must be even and positive"),
    (lambda: PF.rope(X, torch.arange(4.0).half(), INV),
     "posenc.rope: positions must be an int64, int32, float32 or float64 tensor, got Half"),
    (lambda: PF.rope(X, torch.tensor([0.0, 1.0, float("nan"), 3.0]), INV),
     r"posenc.rope: position nan is outside \[-2\^53, 2\^53\].* \(floating positions: finite\); it is "
     r"positions.flatten\(\)\[2\] = nan"),
    (lambda: PF.rope(X, torch.arange(5), INV),
     r"posenc.rope: positions has shape \[5\] but needs \[4\] or \[batch, seq\]"),
    (lambda: PF.rope(X, torch.zeros(3, 4, dtype=torch.long), INV), r"positions has shape \[3, 4\]"),
    (lambda: PF.rope(X[0], torch.zeros(1, 4, dtype=torch.long), INV, format="thd"), r"positions has shape \[1, 4\]"),
    (lambda: PF.rope(X.long(), None, INV), "posenc.rope: x must be a floating tensor, got Long"),
    (lambda: PF.rope(X, None, torch.arange(4)), r"posenc.rope: inv_freq must be float64 \(or float32\), got Long"),
    (lambda: PF.rope(X[0], None, INV), r"posenc.rope: x must be 4-D for its format, got shape \[4, 3, 8\]"),
    (lambda: PF.rope(X, None, INV, layout="half"), 'posenc.rope: layout must be "neox" or "gptj", got "half"'),
    (lambda: PF.rope(X, None, INV, format="bsd"), 'posenc.rope: format must be .* got "bsd"'),
    (lambda: PF.rope(X, None, INV, cu_seqlens=torch.tensor([0, 4])), 'cu_seqlens needs format "thd"'),
    (lambda: PF.rope(X[0], None, INV, format="thd", cu_seqlens=torch.tensor([0, 3, 2, 4])),
     "posenc.rope: cu_seqlens must not decrease, got 3 then 2 at index 2"),
    (lambda: PF.rope(X[0], None, INV, format="thd", cu_seqlens=torch.tensor([1, 4])),
     "cu_seqlens must start at 0, got 1"),
    (lambda: PF.rope(X[0], None, INV, format="thd", cu_seqlens=torch.tensor([0, 3])),
     "cu_seqlens must end at the token count T = 4, got 3"),
    (lambda: PF.rope(X[0], None, INV, format="thd", cu_seqlens=torch.tensor([0.0, 4.0])),
     "cu_seqlens must be an int64 or int32 tensor, got Float"),
    (lambda: PF.rope_qk(X, X.double(), None, INV), "posenc.rope_qk: k is Double but q is Float"),
    (lambda: PF.rope_qk(X, X[:, :3], None, INV), "posenc.rope_qk: k has shape .* sequence sizes differ"),
    (lambda: PF.rope_(X.clone(), None, INV.clone().requires_grad_()),
     "posenc.rope_: inv_freq is not differentiable in place; learned frequencies train through rope or rope_qk"),
    (lambda: PF.rope_cos_sin(X, torch.randn(4, 8), torch.randn(4, 6)), "posenc.rope_cos_sin: cos has shape"),
    (lambda: PF.rope_cos_sin(X, torch.randn(3, 4, 8), torch.randn(3, 4, 8)), "which does not match x"),
])
def test_bad_input_messages(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_bad_input_meta_matches_cpu():
    x = torch.empty(2, 4, 3, 8, device="meta")
    with pytest.raises(RuntimeError, match="posenc.rope: rotary_dim 10 exceeds the head_dim 8 of x"):
        PF.rope(x, None, FQ.rope(10)[0].to("meta"))


def test_empty_inputs_give_empty_results():
    assert PF.rope(torch.randn(2, 0, 3, 8), None, INV).shape == (2, 0, 3, 8)
    assert PF.rope(torch.randn(0, 4, 3, 8), torch.zeros(0, 4, dtype=torch.long), INV).shape == (0, 4, 3, 8)
    assert PF.rope(torch.randn(0, 2, 8), None, INV, format="thd", cu_seqlens=torch.tensor([0])).shape == (0, 2, 8)
    k = torch.randn(1, 4, 2, 8)
    out_q, out_k = PF.rope_qk(torch.randn(1, 4, 0, 8), k, None, INV)
    assert out_q.shape == (1, 4, 0, 8) and torch.equal(out_k, PF.rope(k, None, INV))


def test_nan_and_inf_propagate():
    x = torch.randn(1, 3, 1, 8)
    x[0, 1, 0, 2] = float("nan")
    out = PF.rope(x, None, INV)
    assert torch.isnan(out[0, 1, 0, [2, 6]]).all() and torch.isfinite(out[0, [0, 2]]).all()
    inf_freq = INV.clone()
    inf_freq[1] = float("inf")
    out = PF.rope(torch.randn(1, 3, 1, 8), None, inf_freq)  # angles 0 * inf and p * inf are NaN
    assert torch.isnan(out[..., [1, 5]]).all() and torch.isfinite(out[..., [0, 2, 3, 4, 6, 7]]).all()


def test_bf16_results_keep_denormals_and_quiet_every_nan_to_one_pattern():
    """At position 0 (cos 1, sin 0) the rotation is x itself: in bf16 heads of 128 channels a denormal among normal
    values is kept, not flushed to zero, and a NaN becomes 0x7FC0 whatever its payload (c10's rounding)."""
    bits = torch.full((1, 1, 2, 128), 0x3FC0, dtype=torch.int16)  # 1.5
    bits[0, 0, 0, 5], bits[0, 0, 1, 100] = 0x0003, -0x7FFF  # denormals
    bits[0, 0, 1, 3] = 0x7F81  # NaN: channel 3 and its partner 67 (times sin 0) are NaN
    out = PF.rope(bits.view(torch.bfloat16), None, posenc.frequencies.rope(128)[0]).view(torch.int16)
    expected = bits.clone()
    expected[0, 0, 1, [3, 67]] = 0x7FC0
    assert torch.equal(out, expected)


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (which imports this file to find
# them): each op's sample call (op_registry.SAMPLES: determinism, concurrency, no_grad, CUDA and CPU-capability
# tests), its hypothesis property (test_properties.py) and its bad-input cases (bad_input_fuzzer.py).

# ---- sample calls
# Small: partial rotary (65 pairs in 134 channels; rope_qk: M-RoPE), the four formats and both layouts between
# the ops, views, varlen, multi-axis; large: [2, 512, H, 128] bshd with Llama 3 frequencies and per-row positions
# up to 1e5, GQA (8 and 2 heads).

def _rope_frequencies(m):
    """(large) Llama 3's 64 frequencies; (small) partial rotary: 65 pairs (odd) of 134-channel heads."""
    if m.large:
        return posenc.frequencies.rope(128, 500000.0, {"rope_type": "llama3", "factor": 8.0})[0]
    return posenc.frequencies.rope(130, 500.0)[0]


def _rope_positions(m):
    return m.ints(100000, 2, 512, seed=40)


def _large_rope_args(m, *seeds):
    """The large sample of a rope op: the bshd tensors made from `seeds` (x; or q with 8 heads then k with 2, GQA),
    gradients flowing to them, positions [2, 512] and Llama 3's frequencies."""
    heads = [8, 2][:len(seeds)]
    tensors = [m.grad(m.floats(2, 512, h, 128, seed=seed)) for h, seed in zip(heads, seeds)]
    return call_args(*tensors, _rope_positions(m), _rope_frequencies(m))


@sample("rope")
def _build_rope(m):
    """Small: bhsd as a transposed view of bshd data, positions absent, offset 5, gptj, scale 0.9."""
    if m.large:
        return _large_rope_args(m, 41)
    x = m.grad(m.floats(2, 8, 3, 134, seed=41).transpose(1, 2))
    return call_args(x, None, _rope_frequencies(m), 0.9, "gptj", "bhsd", 5)


@sample("rope_backward")
def _build_rope_backward(m):
    """Small: sbhd, a channel-strided view (the element-by-element path), positions absent, offset 2."""
    if m.large:
        return _large_rope_args(m, 42)
    grad = m.grad(m.floats(8, 2, 3, 268, seed=42)[..., ::2])
    return call_args(grad, None, _rope_frequencies(m), 0.5, "neox", "sbhd", 2)


@sample("rope_qk")
def _build_rope_qk(m):
    """GQA. Small: multi-axis (M-RoPE sections [8, 12, 12], positions [3, B, S]), offset 3."""
    if m.large:
        return _large_rope_args(m, 43, 44)
    q, k = m.grad(m.floats(2, 16, 4, 64, seed=43)), m.grad(m.floats(2, 16, 2, 64, seed=44))
    inv_freq, pair_axis = posenc.frequencies.mrope(64, [8, 12, 12])
    return call_args(q, k, m.ints(100000, 3, 2, 16, seed=45), inv_freq, 1.0, "neox", "bshd", 3, None, pair_axis)


@sample("rope_qk_backward")
def _build_rope_qk_backward(m):
    """GQA. Small: positions [S] shared by the batch, gptj, scale 0.5, offset 1."""
    if m.large:
        return _large_rope_args(m, 46, 47)
    grad_q, grad_k = m.grad(m.floats(2, 8, 4, 134, seed=46)), m.grad(m.floats(2, 8, 2, 134, seed=47))
    return call_args(grad_q, grad_k, m.ints(5000, 8, seed=48), _rope_frequencies(m), 0.5, "gptj", "bshd", 1)


@sample("rope_")
def _build_rope_(m):
    """Small: thd, packed sequences (cu_seqlens, an empty one among them), positions absent, offset 1."""
    if m.large:
        return _large_rope_args(m, 49)
    x = m.grad(m.floats(16, 3, 134, seed=49))
    return call_args(x, None, _rope_frequencies(m), 1.0, "neox", "thd", 1, torch.tensor([0, 5, 5, 16]))


@sample("rope_cos_sin")
def _build_rope_cos_sin(m):
    """float32 tables; small: per-batch tables [B, S, 130], gptj."""
    x = m.grad(m.floats(*m.size((2, 8, 3, 134), (2, 512, 8, 128)), seed=50))
    shape = m.size((2, 8, 130), (512, 128))
    cos, sin = m.floats(*shape, seed=51, dtype=torch.float32), m.floats(*shape, seed=52, dtype=torch.float32)
    return call_args(x, cos, sin, m.size("gptj", "neox"), "bshd")


@sample("rope_cos_sin_backward")
def _build_rope_cos_sin_backward(m):
    """Small: bhsd, a float64 cos and a float16 sin (tables need not share x's dtype)."""
    grad = m.grad(m.floats(*m.size((2, 3, 8, 134), (2, 512, 8, 128)), seed=53))
    shape = m.size((8, 130), (512, 128))
    cos = m.floats(*shape, seed=54, dtype=m.size(torch.float64, torch.float32))
    sin = m.floats(*shape, seed=55, dtype=m.size(torch.float16, torch.float32))
    return call_args(grad, cos, sin, "neox", m.size("bhsd", "bshd"))


# ---- properties: random valid inputs against float64 references (test_properties.py)

ROPE_FORMATS = ["bshd", "bhsd", "sbhd", "thd"]
# Where the bshd dimensions of a 4-D x sit in each format.
BSHD_ORDER = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}


def pair_indices(pairs, layout):
    if layout == "neox":
        return torch.arange(pairs), torch.arange(pairs) + pairs
    return torch.arange(0, 2 * pairs, 2), torch.arange(1, 2 * pairs, 2)


def rotate(x, angle, layout, scale, inverse=False):
    """float64 rotation of the pairs of x [..., D] by angle [..., F] (broadcast over heads by the caller),
    times scale; channels past 2F copied unscaled. inverse: by -angle."""
    x = x.double()
    first, second = pair_indices(angle.shape[-1], layout)
    cos, sin = angle.cos() * scale, angle.sin() * scale
    sin = -sin if inverse else sin
    out = x.clone()
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x2 * cos + x1 * sin
    return out


def rotate_half(x, rotary_dim, layout):
    """The per-channel partner of x's first rotary_dim channels, signed: (-x2, x1) per pair."""
    first, second = pair_indices(rotary_dim // 2, layout)
    out = torch.zeros_like(x[..., :rotary_dim])
    out[..., first] = -x[..., second]
    out[..., second] = x[..., first]
    return out


def rope_input(draw, gen, fmt, batch, seq, heads, head_dim, dtype, expand=True):
    """x of bshd sizes [batch, seq, heads, head_dim] in `fmt` (thd: [seq, heads, head_dim], batch 1), laid out
    at random. Returns (x, x as bshd)."""
    if fmt == "thd":
        x = drawn_tensor(draw, [seq, heads, head_dim], lambda s: normal(gen, s, dtype), expand)
        return x, x[None]
    order = BSHD_ORDER[fmt]
    bshd = [batch, seq, heads, head_dim]
    x = drawn_tensor(draw, [bshd[d] for d in order], lambda s: normal(gen, s, dtype), expand)
    return x, x.permute(order)


def rope_positions(draw, gen, fmt, batch, seq, pairs):
    """positions, offset, cu_seqlens, pair_axis, and the absolute position of each pair as float64
    [batch or 1, seq, pairs]. A third of the draws are multi-axis: pair_axis [pairs] (int64 or int32) names an
    axis of positions [n_axes, S], [n_axes, B, S] or, for thd, [n_axes, T] (cu_seqlens do not change given
    positions)."""
    cu_seqlens = None
    if fmt == "thd" and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, seq), max_size=3)))
        cu_seqlens = torch.tensor([0] + cuts + [seq], dtype=draw(st.sampled_from([torch.long, torch.int])))
    rows = [1, seq] if fmt == "thd" else [batch, seq]
    if draw(st.integers(0, 2)) == 0:
        n_axes = draw(st.integers(1, 3))
        axes = [draw(st.integers(0, n_axes - 1)) for _ in range(pairs)]
        pair_axis = arrange(draw, torch.tensor(axes, dtype=draw(st.sampled_from([torch.long, torch.int]))),
                            expand=False)
        shared = fmt == "thd" or draw(st.booleans())
        shape = [n_axes, seq] if shared else [n_axes, batch, seq]
        positions, offset, absolute = positions_and_offset(draw, shape, floating_ok=False, required=True)
        per_pair = absolute[torch.tensor(axes, dtype=torch.long)].movedim(0, -1)  # [(B,) S, pairs]
        return positions, offset, cu_seqlens, pair_axis, per_pair.expand(rows + [pairs])
    positions, offset, absolute = positions_and_offset(draw, [seq] if fmt == "thd" else rows, floating_ok=False)
    if positions is None and cu_seqlens is not None:
        # Packed sequences restart at offset: token t of the sequence starting at b sits at offset + t - b.
        bounds = cu_seqlens.tolist()
        starts = [max(b for b in bounds[:-1] if b <= t) for t in range(seq)]
        absolute = torch.tensor([offset + t - b for t, b in zip(range(seq), starts)], dtype=torch.float64)
    return positions, offset, cu_seqlens, None, absolute.expand(rows)[..., None].expand(rows + [pairs])


def rope_reference(x_bshd, absolute, inv_freq, layout, scale, inverse=False):
    """float64 rotation of bshd x: pair i by absolute[b, s, i] * inv_freq[i] (absolute [batch or 1, seq, pairs],
    each pair's position on its axis)."""
    angle = absolute[:, :, None, :] * inv_freq.double()  # [B, S, 1, F]
    return rotate(x_bshd, angle, layout, scale, inverse)


def rope_tolerance(x_bshd, pairs, scale, dtype):
    """On rotated channels (trig + 4 eps) * |scale| * (the sum of the head's rotary magnitudes, a bound on
    |x1| + |x2| of any pair); past them, nothing (a copy)."""
    x = x_bshd.double().abs()
    tol = torch.zeros_like(x)
    rotary = x[..., :2 * pairs].sum(-1, keepdim=True)
    tol[..., :2 * pairs] = (trig_error(dtype) + 4 * math_eps(dtype)) * abs(scale) * rotary
    return tol


def rope_case(draw, gen, with_k=False, expand=True):
    fmt = draw(st.sampled_from(ROPE_FORMATS))
    batch = 1 if fmt == "thd" else draw(st.integers(0, 3))
    seq = draw(st.integers(0, 5))
    pairs = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    inv_freq = frequencies(draw, pairs)
    heads = draw(st.integers(0, 3))
    x, x_bshd = rope_input(draw, gen, fmt, batch, seq, heads, 2 * pairs + draw(st.integers(0, 3)), dtype, expand)
    k = k_bshd = None
    if with_k:
        k, k_bshd = rope_input(draw, gen, fmt, batch, seq, draw(st.integers(0, 3)),
                               2 * pairs + draw(st.integers(0, 3)), dtype, expand)
    positions, offset, cu_seqlens, pair_axis, absolute = rope_positions(draw, gen, fmt, batch, seq, pairs)
    scale = draw(st.sampled_from([1.0, 0.5, 1.25]))
    layout = draw(st.sampled_from(["neox", "gptj"]))
    note(f"{fmt} x {list(x.shape)} stride {x.stride()} {dtype}, positions "
         f"{None if positions is None else (positions.dtype, list(positions.shape))}, offset {offset}, "
         f"cu_seqlens {cu_seqlens}, pair_axis {None if pair_axis is None else pair_axis.tolist()}")
    return dict(fmt=fmt, x=x, x_bshd=x_bshd, k=k, k_bshd=k_bshd, positions=positions, offset=offset,
                cu_seqlens=cu_seqlens, pair_axis=pair_axis, absolute=absolute, inv_freq=inv_freq, scale=scale,
                layout=layout, dtype=dtype, pairs=pairs)


def check_rope_output(out, case, x, x_bshd, inverse=False):
    fmt = case["fmt"]
    assert out.dtype == case["dtype"] and out.shape == x.shape and out.is_contiguous()
    out_bshd = out[None] if fmt == "thd" else out.permute(BSHD_ORDER[fmt])
    reference = rope_reference(x_bshd, case["absolute"], case["inv_freq"], case["layout"], case["scale"], inverse)
    assert_rounds_within(out_bshd, reference, rope_tolerance(x_bshd, case["pairs"], case["scale"], case["dtype"]))


@property_check("rope", "rope_backward")
@given(data=st.data())
def check_rope_and_its_backward(op, data):
    case = rope_case(data.draw, generator(data.draw))
    out = call(op, case["x"], case["positions"], case["inv_freq"], case["scale"], case["layout"], case["fmt"],
               case["offset"], case["cu_seqlens"], case["pair_axis"])
    check_rope_output(out, case, case["x"], case["x_bshd"], inverse=op == "rope_backward")


@property_check("rope_qk", "rope_qk_backward")
@given(data=st.data())
def check_rope_qk_and_its_backward(op, data):
    case = rope_case(data.draw, generator(data.draw), with_k=True)
    q_out, k_out = call(op, case["x"], case["k"], case["positions"], case["inv_freq"], case["scale"],
                        case["layout"], case["fmt"], case["offset"], case["cu_seqlens"], case["pair_axis"])
    check_rope_output(q_out, case, case["x"], case["x_bshd"], inverse=op.endswith("backward"))
    check_rope_output(k_out, case, case["k"], case["k_bshd"], inverse=op.endswith("backward"))


@property_check("rope_")
@given(st.data())
def check_rope_inplace(data):
    case = rope_case(data.draw, generator(data.draw), expand=False)
    x = case["x"]
    storage, before = buffer_of(x), buffer_of(x).clone()
    original_bshd = case["x_bshd"].clone()
    assert OPS.rope_(x, case["positions"], case["inv_freq"], case["scale"], case["layout"], case["fmt"],
                     case["offset"], case["cu_seqlens"], case["pair_axis"]) is None
    bshd = x[None] if case["fmt"] == "thd" else x.permute(BSHD_ORDER[case["fmt"]])
    reference = rope_reference(original_bshd, case["absolute"], case["inv_freq"], case["layout"], case["scale"])
    assert_rounds_within(bshd, reference, rope_tolerance(original_bshd, case["pairs"], case["scale"],
                                                         case["dtype"]))
    outside = torch.ones(storage.numel(), dtype=torch.bool)
    outside[covered_offsets(x)] = False
    assert torch.equal(storage[outside].isnan(), before[outside].isnan())
    assert torch.equal(storage[outside].nan_to_num(), before[outside].nan_to_num()), "wrote outside the view"


@property_check("rope_cos_sin", "rope_cos_sin_backward")
@given(data=st.data())
def check_rope_cos_sin_and_its_backward(op, data):
    draw = data.draw
    gen = generator(draw)
    fmt = draw(st.sampled_from(ROPE_FORMATS))
    batch = 1 if fmt == "thd" else draw(st.integers(0, 3))
    seq, heads = draw(st.integers(0, 4)), draw(st.integers(0, 3))
    rotary_dim = 2 * draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    x, x_bshd = rope_input(draw, gen, fmt, batch, seq, heads, rotary_dim + draw(st.integers(0, 3)), dtype)
    table_batch = draw(st.sampled_from([None, 1] if fmt == "thd" else [None, 1, batch]))
    if fmt == "thd":
        table_batch = None
    table_shape = ([] if table_batch is None else [table_batch]) + [seq, rotary_dim]
    table_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    cos = drawn_tensor(draw, table_shape, lambda s: normal(gen, s, table_dtype))
    sin = drawn_tensor(draw, table_shape, lambda s: normal(gen, s, table_dtype))
    layout = draw(st.sampled_from(["neox", "gptj"]))
    out = call(op, x, cos, sin, layout, fmt)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    # Tables as [B or 1, S, 1, r] against bshd x; any table values (not only real cos/sin).
    table_rows = cos.shape[0] if cos.dim() == 3 else 1
    c = cos.double().reshape(table_rows, seq, 1, rotary_dim)
    s = sin.double().reshape(table_rows, seq, 1, rotary_dim)
    xd = x_bshd.double()
    if op == "rope_cos_sin":
        reference = xd.clone()
        reference[..., :rotary_dim] = xd[..., :rotary_dim] * c + rotate_half(xd, rotary_dim, layout) * s
    else:  # the transpose of the map above: grad * cos - rotate(grad * sin)
        x_var = torch.zeros_like(xd, requires_grad=True)
        y = x_var.clone()
        y = torch.cat([x_var[..., :rotary_dim] * c + rotate_half(x_var, rotary_dim, layout) * s,
                       x_var[..., rotary_dim:]], -1)
        (reference,) = torch.autograd.grad(y, x_var, xd)
    magnitude = xd.abs().sum(-1, keepdim=True) * (c.abs().amax(-1, keepdim=True) + s.abs().amax(-1, keepdim=True))
    tolerance = 4 * math_eps(dtype) * magnitude.expand_as(xd)
    if table_dtype != torch.float64 or dtype != torch.float64:  # tables are read in x's maths type
        tolerance = tolerance + 2 * math_eps(torch.float32) * magnitude
    out_bshd = out[None] if fmt == "thd" else out.permute(BSHD_ORDER[fmt])
    assert_rounds_within(out_bshd, reference, tolerance)


# ---- bad inputs: a small valid call of each op, and the mutations that each make one argument wrong

def rope_common(draw, *names):
    pairs, batch, seq = small(draw), small(draw), small(draw)
    tensors = {name: randn(batch, seq, small(draw), 2 * pairs + small(draw, 0, 2)) for name in names}
    return dict(tensors, positions=None, inv_freq=torch.rand(pairs, dtype=F64), attention_scale=1.0, layout="neox",
                format="bshd", offset=0, cu_seqlens=None)


def rope(draw):
    return rope_common(draw, "x")


def rope_backward(draw):
    return rope_common(draw, "grad")


def rope_qk(draw):
    return rope_common(draw, "q", "k")


def rope_qk_backward(draw):
    return rope_common(draw, "grad_q", "grad_k")


def rope_inplace(draw):
    return rope_common(draw, "x")


def tables_other_seq(draw, kw):
    grow("cos", 0)(draw, kw)
    grow("sin", 0)(draw, kw)


def rope_cos_sin_common(draw, name):
    pairs, batch, seq, heads = small(draw), small(draw), small(draw), small(draw)
    return {name: randn(batch, seq, heads, 2 * pairs), "cos": randn(seq, 2 * pairs), "sin": randn(seq, 2 * pairs),
            "layout": "neox", "format": "bshd"}


def rope_cos_sin(draw):
    return rope_cos_sin_common(draw, "x")


def rope_cos_sin_backward(draw):
    return rope_cos_sin_common(draw, "grad")


def cu_seqlens_bad(draw, kw):
    """Packed rope with cu_seqlens that do not describe the T tokens: not starting at 0, decreasing, not
    ending at T, 2-D, floating, or given with a batched format."""
    x_name = next(n for n in ("x", "grad", "q", "grad_q") if n in kw)
    how = draw(st.sampled_from(["start", "decreasing", "end", "rank", "float", "batched"]))
    if how == "batched":
        kw["cu_seqlens"] = torch.tensor([0, kw[x_name].shape[1]])
        return
    for name in ("x", "grad", "q", "k", "grad_q", "grad_k"):
        if name in kw:
            kw[name] = kw[name][0]
    kw["format"] = "thd"
    total = kw[x_name].shape[0]
    kw["cu_seqlens"] = {"start": torch.tensor([1, total]), "decreasing": torch.tensor([0, total, total - 1, total]),
                        "end": torch.tensor([0, total + 1]), "rank": torch.tensor([[0, total]]),
                        "float": torch.tensor([0.0, float(total)])}[how]


def multiaxis(mutate):
    """A valid multi-axis call (pair_axis over n_axes axes, positions [n_axes, B, S] or [n_axes, S]), then
    mutate(draw, kw, n_axes) makes one of its parts wrong."""
    def build(draw, kw):
        x = next(kw[n] for n in ("x", "grad", "q", "grad_q") if n in kw)
        n_axes, pairs = small(draw), kw["inv_freq"].numel()
        kw["pair_axis"] = torch.randint(0, n_axes, (pairs,), dtype=draw(st.sampled_from([torch.long, torch.int])))
        shape = [n_axes, x.shape[0], x.shape[1]] if draw(st.booleans()) else [n_axes, x.shape[1]]
        kw["positions"] = torch.randint(0, 100, shape)
        mutate(draw, kw, n_axes)
    return build


def pair_axis_out_of_range(draw, kw, n_axes):
    """One pair's axis outside [0, n_axes): n_axes, -1, or its dtype's extremes."""
    info = torch.iinfo(kw["pair_axis"].dtype)
    put("pair_axis", [n_axes, -1, info.max, info.min])(draw, kw)


def positions_not_finite(draw, kw):
    """Floating positions (the given ones, or an arange) with one NaN or infinity: refused by the rotary ops."""
    positions = kw.get("positions")
    values = (torch.arange(positions_length(kw)) if positions is None else positions).to(
        draw(st.sampled_from([F64, torch.float32]))).clone()
    values.view(-1)[draw(st.integers(0, values.numel() - 1))] = draw(st.sampled_from(
        [float("nan"), float("inf"), -float("inf")]))
    kw["positions"] = values


def rope_mutations(names, inplace=False):
    first = names[0]
    out = {
        f"{first}_not_floating": not_floating(first),
        f"{first}_wrong_rank": wrong_rank(first, [0, 1, 2, 3, 5]),
        "rotary_dim_exceeds_head_dim": lambda draw, kw: kw.update(
            inv_freq=torch.rand(kw[first].shape[-1] // 2 + small(draw), dtype=F64)),
        "inv_freq_not_floating": not_floating("inv_freq"),
        "inv_freq_wrong_rank": wrong_rank("inv_freq", [0, 2]),
        "inv_freq_empty": lambda draw, kw: kw.update(inv_freq=torch.empty(0, dtype=F64)),
        "inv_freq_on_meta": on_meta("inv_freq"),
        "positions_not_finite": positions_not_finite,
        "positions_half": lambda draw, kw: kw.update(positions=(
            torch.arange(positions_length(kw)) if kw.get("positions") is None else kw["positions"]).half()),
        "positions_wrong_shape": lambda draw, kw: kw.update(positions=torch.arange(positions_length(kw) + 1)),
        "layout_unknown": unknown_string("layout", {"neox", "gptj"}),
        "format_unknown": unknown_string("format", {"bshd", "bhsd", "sbhd", "thd"}),
        "cu_seqlens_invalid": cu_seqlens_bad,
        "positions_beyond_domain": positions_beyond_domain(floating=True),
        "pair_axis_out_of_range": multiaxis(pair_axis_out_of_range),
        "pair_axis_wrong_length": multiaxis(lambda draw, kw, n_axes: grow("pair_axis", 0, by=draw(st.sampled_from(
            [1, -1] if kw["pair_axis"].numel() > 1 else [1])))(draw, kw)),
        "pair_axis_not_index": multiaxis(lambda draw, kw, n_axes: not_index("pair_axis")(draw, kw)),
        "pair_axis_wrong_rank": multiaxis(lambda draw, kw, n_axes: kw.update(pair_axis=kw["pair_axis"][None])),
        # No positions, [n_axes * S...] flattened (rank 1), or one dimension too many (rank 4 or 5).
        "pair_axis_positions_wrong_rank": multiaxis(lambda draw, kw, n_axes: kw.update(positions=draw(st.sampled_from(
            [None, kw["positions"].reshape(-1), kw["positions"].reshape(*kw["positions"].shape, 1, 1)])))),
        "pair_axis_positions_other_seq": multiaxis(lambda draw, kw, n_axes: grow("positions", -1)(draw, kw)),
        "pair_axis_on_meta": multiaxis(lambda draw, kw, n_axes: on_meta("pair_axis")(draw, kw)),
    }
    if len(names) == 2:
        second = names[1]
        out[f"{second}_other_dtype"] = to_dtype(second, torch.float64, torch.bfloat16)
        out[f"{second}_other_batch"] = grow(second, 0)
        out[f"{second}_other_seq"] = grow(second, 1)
    if inplace:
        out[f"{first}_overlapping"] = overlapping(first)
    return out


bad_inputs("rope", base=rope, mutations=rope_mutations(["x"]))
bad_inputs("rope_backward", base=rope_backward, mutations=rope_mutations(["grad"]))
bad_inputs("rope_qk", base=rope_qk, mutations=rope_mutations(["q", "k"]))
bad_inputs("rope_qk_backward", base=rope_qk_backward, mutations=rope_mutations(["grad_q", "grad_k"]))
bad_inputs("rope_", base=rope_inplace, mutations=rope_mutations(["x"], inplace=True))

ROPE_COS_SIN_MUTATIONS = {
    "x_not_floating": not_floating("x"), "cos_not_floating": not_floating("cos"),
    "cos_sin_shapes_differ": grow("sin", 0), "cos_wrong_rank": wrong_rank("cos", [0, 1, 4]),
    "rotary_dim_odd": lambda draw, kw: kw.update(cos=kw["cos"][..., :-1], sin=kw["sin"][..., :-1]),
    "rotary_dim_exceeds_head_dim": lambda draw, kw: kw.update(cos=torch.cat([kw["cos"]] * 2, -1),
                                                             sin=torch.cat([kw["sin"]] * 2, -1)),
    "tables_other_seq": tables_other_seq,
    "tables_other_batch": lambda draw, kw: kw.update(cos=kw["cos"].expand(kw["x"].shape[0] + 1, *kw["cos"].shape),
                                                     sin=kw["sin"].expand(kw["x"].shape[0] + 1, *kw["sin"].shape)),
    "layout_unknown": unknown_string("layout", {"neox", "gptj"}),
    "format_unknown": unknown_string("format", {"bshd", "bhsd", "sbhd", "thd"}),
    "cos_on_meta": on_meta("cos"),
}
bad_inputs("rope_cos_sin", base=rope_cos_sin, mutations=ROPE_COS_SIN_MUTATIONS)
# rope_cos_sin_backward takes a gradient where rope_cos_sin takes x: the first tensor's name differs, nothing else.
_BACKWARD_MUTATIONS = {k.replace("x_", "grad_", 1) if k.startswith("x_") else k: v
                       for k, v in ROPE_COS_SIN_MUTATIONS.items()}
_BACKWARD_MUTATIONS["grad_not_floating"] = not_floating("grad")
_BACKWARD_MUTATIONS["tables_other_batch"] = lambda draw, kw: kw.update(
    cos=kw["cos"].expand(kw["grad"].shape[0] + 1, *kw["cos"].shape),
    sin=kw["sin"].expand(kw["grad"].shape[0] + 1, *kw["sin"].shape))
bad_inputs("rope_cos_sin_backward", base=rope_cos_sin_backward, mutations=_BACKWARD_MUTATIONS)


# ---------------------------------------------------------------- learned frequencies

def _learned_case(format, layout, positions_kind, multiaxis, seed=0):
    """q, k in `format` (partial rotary: 3 of 4 pairs), inv_freq requiring grad, and positions of a kind."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq, heads, dim = 2, 5, 3, 8
    shape = {"bshd": (batch, seq, heads, dim), "bhsd": (batch, heads, seq, dim), "sbhd": (seq, batch, heads, dim),
             "thd": (batch * seq, heads, dim)}[format]
    tokens = batch * seq if format == "thd" else seq
    q, k = (torch.randn(shape, dtype=F64, generator=gen).requires_grad_() for _ in range(2))
    inv_freq = (torch.rand(3, dtype=F64, generator=gen) + 0.1).requires_grad_()
    kw = {"pair_axis": torch.tensor([0, 1, 1])} if multiaxis else {}
    if positions_kind == "absent":
        positions = None
    elif positions_kind == "packed":
        positions, kw["cu_seqlens"] = None, torch.tensor([0, 4, tokens])
    elif positions_kind == "shared":
        positions = torch.randn((2, tokens) if multiaxis else (tokens,), dtype=F64, generator=gen) * 3
    else:  # per row
        positions = torch.randn((2, batch, seq) if multiaxis else (batch, seq), dtype=F64, generator=gen) * 3
    return q, k, positions, inv_freq, kw


LEARNED_CASES = [(f, layout, kind, multi) for f in ("bshd", "bhsd", "sbhd", "thd") for layout in ("neox", "gptj")
                 for kind, multi in (("absent", False), ("shared", False), ("per_row", False), ("shared", True),
                                     ("per_row", True), ("packed", False))
                 if (kind != "packed" or f == "thd") and (kind != "per_row" or f != "thd")]


@pytest.mark.parametrize("format, layout, kind, multiaxis", LEARNED_CASES)
def test_learned_frequencies_gradcheck(format, layout, kind, multiaxis):
    """d/d inv_freq of rope and rope_qk, and their double backward, against finite differences in float64: every
    format, layout, kind of positions, one axis or several."""
    q, k, positions, inv_freq, kw = _learned_case(format, layout, kind, multiaxis)

    def one(x, w):
        return PF.rope(x, positions, w, 1.3, layout, format, 2, **kw)

    def both(x, y, w):
        return PF.rope_qk(x, y, positions, w, 1.3, layout, format, 2, **kw)

    assert torch.autograd.gradcheck(one, (q, inv_freq))
    assert torch.autograd.gradgradcheck(one, (q, inv_freq))
    assert torch.autograd.gradcheck(both, (q, k, inv_freq))


def test_learned_frequencies_with_the_query_scale():
    """rope_qk's query scale (Llama 4's) multiplies q's output by a factor of the position alone."""
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 6, 2, 8, dtype=F64, generator=gen).requires_grad_() for _ in range(2))
    inv_freq = (torch.rand(4, dtype=F64, generator=gen) + 0.1).requires_grad_()

    def fn(x, y, w):
        return PF.rope_qk(x, y, torch.arange(6), w, 1.0, "neox", "bshd", 3, q_scale_beta=0.25, q_scale_length=2)

    assert torch.autograd.gradcheck(fn, (q, k, inv_freq))
    assert torch.autograd.gradgradcheck(fn, (q, k, inv_freq))


def test_learned_frequencies_against_autograd_of_the_eager_formula():
    """The inv_freq gradient equals autograd's through the float64 formula (angles = positions * inv_freq,
    rotate_half), and is the same bits run after run."""
    q, k, positions, inv_freq, _ = _learned_case("bshd", "neox", "per_row", False, seed=3)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    out = PF.rope_qk(q, k, positions, inv_freq)
    ours = torch.autograd.grad(out, inv_freq, (grad_q, grad_k))[0]
    again = torch.autograd.grad(PF.rope_qk(q, k, positions, inv_freq), inv_freq, (grad_q, grad_k))[0]
    assert torch.equal(ours, again)
    w = inv_freq.detach().clone().requires_grad_()
    angle = positions.to(F64)[..., None] * w  # [B, S, pairs]
    cos, sin = angle.cos()[:, :, None], angle.sin()[:, :, None]

    def rotate(x):
        x1, x2, rest = x[..., :3], x[..., 3:6], x[..., 6:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)

    theirs = torch.autograd.grad((rotate(q.detach()), rotate(k.detach())), w, (grad_q, grad_k))[0]
    assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_learned_frequencies_in_float32_return_float32():
    x = torch.randn(2, 6, 2, 8, requires_grad=True)
    inv_freq = FQ.rope(8)[0].float().requires_grad_()
    weights = torch.randn(2, 6, 2, 8)  # a rotation leaves norms alone: a weighted sum feels the angle
    (PF.rope(x, torch.arange(6), inv_freq) * weights).sum().backward()
    expected = inv_freq.detach().double().requires_grad_()
    (PF.rope(x.detach().double(), torch.arange(6), expected) * weights.double()).sum().backward()
    assert inv_freq.grad.dtype == torch.float32
    assert_close(inv_freq.grad, expected.grad.float(), rtol=1e-4, atol=1e-4)
    assert inv_freq.grad.abs().sum() > 0


@pytest.mark.parametrize("call", [
    lambda w: PF.rope_(torch.randn(1, 4, 2, 8), None, w),
    lambda w: PF.qk_norm_rope(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.ones(8), torch.ones(8), None, w),
])
def test_learned_frequencies_elsewhere_are_refused(call):
    with pytest.raises(RuntimeError, match="learned frequencies train through rope or rope_qk"):
        call(FQ.rope(8)[0].clone().requires_grad_())


def test_learned_frequencies_compile(compiled_matches_eager):
    q, k, positions, inv_freq, kw = _learned_case("bshd", "gptj", "shared", True)

    def fn(q, w):
        out_q, out_k = PF.rope_qk(q, k.detach(), positions, w, 1.0, "gptj", **kw)
        return out_q + out_k

    compiled_matches_eager(fn, (q, inv_freq), (q, inv_freq))
