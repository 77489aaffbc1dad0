"""Multi-axis rotary: rope / rope_qk / rope_ and their backwards with pair_axis against a float64 reference written
here, the frequency builders, the position grids, the modules, and parity with the reference implementations
(Hugging Face transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotary and get_rope_index, diffusers' Flux
rotary); gradients, opcheck, torch.compile, torch.export, TorchScript and the bad inputs."""
import itertools
import math
import re
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch.testing import assert_close

import posenc
from mutations import grow, not_index, on_meta, put, set_value, small, to_dtype, wrong_rank
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import frequencies as FQ
from posenc import functional as PF
from strategies import INT64_MAX, INT64_MIN, arrange, call, generator, integers
# The rotary tests' dtypes, formats, tolerances and layout helpers: the multi-axis calls share the op and its layouts.
from helpers import assert_exports, rotate_pairs
from test_rope import DTYPES, FORMATS, from_format, to_format, tolerance


def reference_axes(x, positions, pair_axis, inv_freq, layout="neox", scale=1.0):
    """float64 multi-axis RoPE of bshd x from the definition: pair i of the layout rotates by
    positions[pair_axis[i], ...] * inv_freq[i]; positions [n_axes, S] (shared) or [n_axes, B, S]."""
    per_pair = positions.double()[pair_axis.long()]  # [pairs, (B,) S]
    return rotate_pairs(x, per_pair.movedim(0, -1) * inv_freq.double(), layout, scale)


# ---------------------------------------------------------------- the ops against the float64 reference

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("fmt, kind", [(fmt, kind) for fmt in FORMATS for kind in ("shared", "rows")
                                       if not (fmt == "thd" and kind == "rows")])  # thd: [n_axes, T] only
def test_rope_values(dtype, layout, fmt, kind):
    batch = 1 if fmt == "thd" else 3
    x = torch.randn(batch, 7, 2, 14).to(dtype)  # partial rotary: 10 of 14 channels
    inv_freq = FQ.rope(10, 100.0)[0]
    pair_axis = torch.tensor([2, 0, 1, 1, 0], dtype=torch.int32)
    shape = (3, 7) if kind == "shared" else (3, batch, 7)
    positions = torch.randint(-50, 3000, shape)
    out = PF.rope(to_format(x, fmt), positions, inv_freq, 0.75, layout, fmt, 4, None, pair_axis)
    expected = reference_axes(x, positions + 4, pair_axis, inv_freq, layout, 0.75)
    assert_close(from_format(out, fmt).double(), expected, **tolerance(dtype))
    assert out.dtype == dtype and out.is_contiguous()


def test_equal_axes_give_the_bits_of_the_one_axis_rotation(same_bits_for_any_thread_count):
    """Text tokens of Qwen2-VL sit at the same position on every axis: the result must be one-axis rope's bits."""
    q, k = torch.randn(2, 9, 4, 16), torch.randn(2, 9, 2, 16)
    inv_freq, pair_axis = FQ.mrope(16, [2, 3, 3])
    positions = torch.randint(0, 2 ** 30, (2, 9))  # far positions: the libm path too
    one = PF.rope_qk(q, k, positions, inv_freq)
    three = same_bits_for_any_thread_count(
        lambda: PF.rope_qk(q, k, positions.expand(3, 2, 9), inv_freq, pair_axis=pair_axis))
    assert all(torch.equal(a, b) for a, b in zip(one, three))
    shared = PF.rope(q, torch.arange(9).expand(3, 9), inv_freq, pair_axis=pair_axis)
    assert torch.equal(shared, PF.rope(q, None, inv_freq))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
def test_positions_of_few_values_give_the_bits_of_each_token_alone(dtype, layout, fmt):
    """Where positions take few values (an M-RoPE prompt holding an image; [B, S] rows that repeat one another), the
    CPU forms sin and cos once per value for the tokens to gather: the bits must be those of each token rotated alone,
    which forms its own. The reference values too, against the float64 formula."""
    types = torch.tensor([[0] * 5 + [1] * 24 + [0] * 3])
    positions = PF.mrope_positions(types, torch.tensor([[1, 8, 12]]))[0] - 7  # [3, 1, 32], 14 values
    inv_freq, pair_axis = FQ.mrope(128, [16, 24, 24], 1e4)
    q, k = torch.randn(1, 32, 3, 128).to(dtype), torch.randn(1, 32, 2, 128).to(dtype)
    token_axis = 1 if fmt == "bshd" else 2
    q, k = (t.movedim(1, token_axis).contiguous() for t in (q, k))
    tail = (1.0, layout, fmt, 0, None, pair_axis)

    def alone(op, *tensors):  # each token rotated by a call of its own
        rows = [op(*(t.narrow(token_axis, s, 1) for t in tensors), positions[..., s:s + 1], inv_freq, *tail)
                for s in range(32)]
        return [torch.cat(parts, token_axis) for parts in zip(*rows)] if isinstance(rows[0], tuple) else \
            torch.cat(rows, token_axis)

    for op in (PF.rope_qk, PF.rope_qk_backward):
        together = op(q, k, positions, inv_freq, *tail)
        assert all(torch.equal(a, b) for a, b in zip(together, alone(op, q, k)))
    inplace = q.clone()
    PF.rope_(inplace, positions, inv_freq, *tail)
    assert torch.equal(inplace, alone(PF.rope, q))
    assert_close(inplace.movedim(token_axis, 1).double(),
                 reference_axes(q.movedim(token_axis, 1), positions, pair_axis, inv_freq, layout), **tolerance(dtype))
    # one axis, positions per batch row: three rows of the same 16 values in different orders
    x = torch.randn(3, 16, 2, 64).to(dtype)
    row = torch.arange(-3, 13)
    rows, one_axis = torch.stack([row, row.flip(0), row.roll(5)]), FQ.rope(64, 1e4)[0]
    out = PF.rope(x, rows, one_axis, 1.0, layout)
    assert torch.equal(out, torch.cat([PF.rope(x[b:b + 1], rows[b:b + 1], one_axis, 1.0, layout) for b in range(3)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_rows_of_equal_positions_give_the_bits_of_shared_ones(dtype):
    """Hugging Face passes position_ids [B, S] whose rows are equal: the CPU then takes them as shared by the batch
    (one table of coefficients); every row must hold the bits of its own call, one axis and three, plain, with the
    query scale and through QK-norm, and rows that differ in one value must not be taken so."""
    q, k = torch.randn(3, 20, 4, 128).to(dtype), torch.randn(3, 20, 2, 128).to(dtype)
    inv_freq, pair_axis = FQ.mrope(128, [16, 24, 24], 1e4)
    one_axis = FQ.rope(128, 1e4)[0]
    row = torch.randint(0, 500, (20,))
    for positions, axes in ((row.repeat(3, 1), None), (torch.stack([row, row // 2, row % 7])[:, None].repeat(1, 3, 1),
                                                        pair_axis)):
        freq = one_axis if axes is None else inv_freq
        together = PF.rope_qk(q, k, positions, freq, 0.5, "neox", "bshd", 3, None, axes)
        each = [PF.rope_qk(q[b:b + 1], k[b:b + 1], positions[..., b:b + 1, :], freq, 0.5, "neox", "bshd", 3, None, axes)
                for b in range(3)]
        assert all(torch.equal(t, torch.cat(parts)) for t, parts in zip(together, zip(*each)))
        if axes is not None:
            assert_close(together[0].double(), reference_axes(q, positions + 3, axes, freq, "neox", 0.5),
                         **tolerance(dtype))
        backward = PF.rope_qk_backward(q, k, positions, freq, 0.5, "gptj", "bshd", 0, None, axes)
        assert all(torch.equal(t, s) for t, s in zip(backward, PF.rope_qk_backward(
            q, k, positions[..., 0, :], freq, 0.5, "gptj", "bshd", 0, None, axes)))
    rows = row.repeat(3, 1)
    scaled = torch.ops.posenc.rope_qk(q, k, rows, one_axis, 1.0, "neox", "bshd", 0, None, None, 0.1, 8, 0)
    assert all(torch.equal(t, s) for t, s in zip(scaled, torch.ops.posenc.rope_qk(
        q, k, row, one_axis, 1.0, "neox", "bshd", 0, None, None, 0.1, 8, 0)))
    weights = torch.rand(128).to(dtype) + 0.5, torch.rand(128).to(dtype) + 0.5
    normed = PF.qk_norm_rope(q, k, *weights, rows, one_axis, 1e-6)
    assert all(torch.equal(t, s) for t, s in zip(normed, PF.qk_norm_rope(q, k, *weights, row, one_axis, 1e-6)))
    rows[2, 7] += 1  # one value differs: row 2 keeps its own
    out = PF.rope(q, rows, one_axis)
    assert torch.equal(out[2], PF.rope(q[2:], rows[2:], one_axis)[0])
    assert torch.equal(out[:2], PF.rope(q[:2], row, one_axis))


def test_far_positions_take_the_exact_path():
    x = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    inv_freq, pair_axis = FQ.axial(8, 2)
    positions = torch.tensor([[0, 2 ** 40 + 1, 5, -(2 ** 52)], [2 ** 30, 3, 2 ** 27 + 9, 1]])
    expected = reference_axes(x, positions, pair_axis, inv_freq)
    assert_close(PF.rope(x, positions, inv_freq, pair_axis=pair_axis).double(), expected, atol=1e-12, rtol=0)
    assert_close(PF.rope(x.float(), positions, inv_freq, pair_axis=pair_axis).double(), expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rope_qk_inplace_and_backward(fmt):
    batch = 1 if fmt == "thd" else 2
    q, k = torch.randn(batch, 6, 4, 12), torch.randn(batch, 6, 1, 12)
    inv_freq, pair_axis = FQ.multiaxis([4, 8], [100.0, 1000.0])
    positions = torch.randint(0, 40, (2, 6))
    args = (positions, inv_freq, 1.0, "gptj", fmt, 0, None, pair_axis)
    out_q, out_k = PF.rope_qk(to_format(q, fmt), to_format(k, fmt), *args)
    assert_close(from_format(out_q, fmt).double(), reference_axes(q, positions, pair_axis, inv_freq, "gptj"),
                 atol=2e-6, rtol=1e-6)
    assert torch.equal(out_k, PF.rope(to_format(k, fmt), *args))
    inplace = to_format(q, fmt).clone()
    PF.rope_(inplace, *args)
    assert torch.equal(inplace, out_q)
    # The backward rotates by -angle: it undoes the forward.
    back_q, back_k = PF.rope_qk_backward(out_q, out_k, *args)
    assert_close(back_q, to_format(q, fmt), atol=2e-6, rtol=1e-6)
    assert torch.equal(PF.rope_backward(out_k, *args), back_k)


def test_cu_seqlens_do_not_change_given_positions():
    x = torch.randn(9, 2, 8)
    inv_freq, pair_axis = FQ.axial(8)
    positions = torch.randint(0, 9, (2, 9))
    packed = PF.rope(x, positions, inv_freq, 1.0, "neox", "thd", 0, torch.tensor([0, 4, 9]), pair_axis)
    assert torch.equal(packed, PF.rope(x, positions, inv_freq, 1.0, "neox", "thd", 0, None, pair_axis))


def test_strided_views_and_int64_pair_axis():
    qkv = torch.randn(2, 5, 3, 4, 16)
    q = qkv[:, :, 0]  # a view of a fused projection
    inv_freq, pair_axis = FQ.mrope(16, [4, 2, 2], interleaved=True)
    positions = torch.randint(0, 30, (3, 2, 5))
    assert_close(PF.rope(q, positions, inv_freq, pair_axis=pair_axis).double(),
                 reference_axes(q, positions, pair_axis, inv_freq), atol=2e-6, rtol=1e-6)


def test_gradients():
    inv_freq, pair_axis = FQ.mrope(8, [2, 1, 1], 50.0)
    positions = torch.randint(0, 20, (3, 2, 3))
    q = torch.randn(2, 3, 2, 10, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 1, 10, dtype=torch.float64, requires_grad=True)

    def fn(q, k):
        return PF.rope_qk(q, k, positions, inv_freq, 0.5, "neox", "bshd", 2, None, pair_axis)

    assert torch.autograd.gradcheck(fn, (q, k))
    assert torch.autograd.gradgradcheck(fn, (q, k))
    out = PF.rope(q, positions, inv_freq, 0.5, "gptj", "bshd", 2, None, pair_axis)
    grad = torch.randn_like(out)
    (grad_q,) = torch.autograd.grad(out, q, grad)
    assert_close(grad_q, PF.rope_backward(grad, positions, inv_freq, 0.5, "gptj", "bshd", 2, None, pair_axis))


def test_inplace_autograd_through_a_non_leaf():
    inv_freq, pair_axis = FQ.axial(8)
    positions = PF.image_positions(2, 3)
    x = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    y = x * 1.0
    PF.rope_(y, positions, inv_freq, pair_axis=pair_axis)
    grad = torch.randn_like(y)
    (grad_x,) = torch.autograd.grad(y, x, grad)
    assert_close(grad_x, PF.rope_backward(grad, positions, inv_freq, pair_axis=pair_axis))


# ---------------------------------------------------------------- frequency builders

def test_multiaxis_and_axial_frequencies():
    inv_freq, pair_axis = FQ.multiaxis([16, 56, 56], 10000.0)
    expected = torch.cat([torch.tensor([10000.0 ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
                          for d in (16, 56, 56)])
    assert_close(inv_freq, expected, rtol=1e-14, atol=0)
    assert pair_axis.tolist() == [0] * 8 + [1] * 28 + [2] * 28
    inv_freq, pair_axis = FQ.multiaxis([4, 6], [10.0, 20.0])
    assert_close(inv_freq, torch.tensor([1.0, 10 ** -0.5, 1.0, 20 ** (-1 / 3), 20 ** (-2 / 3)], dtype=torch.float64))
    assert pair_axis.tolist() == [0, 0, 1, 1, 1]
    inv_freq, pair_axis = FQ.axial(16, 2, 100.0)  # base ** (-4 i / 16) per axis
    assert_close(inv_freq, torch.tensor([100.0 ** (-4 * i / 16) for i in range(4)] * 2, dtype=torch.float64))
    assert pair_axis.tolist() == [0] * 4 + [1] * 4


def test_mrope_pair_axis_consecutive_and_interleaved():
    assert FQ.mrope_pair_axis([16, 24, 24]).tolist() == [0] * 16 + [1] * 24 + [2] * 24
    # Qwen3-VL: pairs 1, 4, 7, ... < 60 follow height, 2, 5, 8, ... < 60 width, the rest time.
    axis = FQ.mrope_pair_axis([24, 20, 20], interleaved=True).tolist()
    assert axis == [(i % 3 if i < 60 else 0) for i in range(64)]
    assert [axis.count(a) for a in range(3)] == [24, 20, 20]
    inv_freq, pair_axis = FQ.mrope(128, [16, 24, 24], 1e6)
    assert_close(inv_freq, FQ.rope(128, 1e6)[0], rtol=0, atol=0)


@pytest.mark.parametrize("call, message", [
    (lambda: FQ.mrope(128, [16, 24, 23]), "mrope_section .* holds 63 frequency pairs but rotary_dim 128 has 64"),
    (lambda: FQ.mrope_pair_axis([]), "mrope_section is empty"),
    (lambda: FQ.mrope_pair_axis([2, -1]), r"mrope_section\[1\] must not be negative"),
    (lambda: FQ.axial(12, 4), "rotary_dim 12 must be a positive multiple of 2 \\* n_axes = 8"),
    (lambda: FQ.multiaxis([16, 7]), r"axes_dim\[1\] must be even"),
    (lambda: FQ.multiaxis([16, 8], [1.0, 2.0, 3.0]), "got 3 bases for 2 axes"),
])
def test_frequency_builders_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- position grids

def test_image_and_video_positions():
    assert PF.image_positions(2, 3).tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]]
    video = PF.video_positions(2, 2, 2, time_interval=2.5)
    assert video.tolist() == [[0] * 4 + [2] * 4, [0, 0, 1, 1] * 2, [0, 1, 0, 1] * 2]
    assert PF.image_positions(0, 3).shape == (2, 0) and PF.video_positions(3, 2, 0).shape == (3, 0)


def hf_get_rope_index(model_class, config, *args, **kwargs):
    """transformers' get_rope_index (a method of the VL model that reads only its config) on a stand-in."""
    stand_in = types.SimpleNamespace(config=config)
    stand_in.get_vision_position_ids = types.MethodType(model_class.get_vision_position_ids, stand_in)
    return model_class.get_rope_index(stand_in, *args, **kwargs)


def multimodal_batch():
    """Two rows, left padding on the second: text, an image (grid 1x4x6, merge 2: 6 tokens), text, a video
    (grid 3x4x4: 12 tokens), text."""
    row = [0] * 3 + [1] * 6 + [0] * 2 + [2] * 12 + [0] * 4
    types_ = torch.tensor([row, [0] * 2 + row[:-2]], dtype=torch.int32)
    mask = torch.ones_like(types_)
    mask[1, :2] = 0
    image_grid = torch.tensor([[1, 4, 6], [1, 4, 6]])
    video_grid = torch.tensor([[3, 4, 4], [3, 4, 4]])
    return types_, mask, image_grid, video_grid


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_match_hugging_face_get_rope_index(model):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    token_types, mask, image_grid, video_grid = multimodal_batch()
    input_ids = torch.zeros_like(token_types, dtype=torch.long)
    kwargs = dict(attention_mask=mask)
    if model == "qwen2_vl":
        expected = hf_get_rope_index(Qwen2VLModel, Qwen2VLConfig(), input_ids, token_types, image_grid, video_grid,
                                     **kwargs)
        ours = PF.mrope_positions(token_types, image_grid, video_grid, mask, 2)
    elif model == "qwen2_5_vl":
        config = Qwen2_5_VLConfig()
        seconds = torch.tensor([0.5, 1.0 / 3.0])  # float32, as the processor makes them
        expected = hf_get_rope_index(Qwen2_5_VLModel, config, input_ids, token_types, image_grid, video_grid, seconds,
                                     **kwargs)
        ours = PF.mrope_positions(token_types, image_grid, video_grid, mask, 2,
                                  config.vision_config.tokens_per_second, seconds)
    else:
        # Qwen3-VL separates a video's frames by timestamps (text): one run of video tokens per frame.
        row = [0] * 3 + [1] * 6 + [0] * 2 + ([2] * 4 + [0]) * 3 + [0] * 3
        token_types = torch.tensor([row, [0] * 2 + row[:-2]], dtype=torch.int32)
        input_ids = torch.zeros_like(token_types, dtype=torch.long)
        mask = torch.ones_like(token_types)
        mask[1, :2] = 0
        expected = hf_get_rope_index(Qwen3VLModel, Qwen3VLConfig(), input_ids, token_types, image_grid,
                                     video_grid.clone(), attention_mask=mask)
        ours = PF.mrope_positions(token_types, image_grid, video_grid, mask, 2, split_video_frames=True)
    positions, deltas = ours
    assert torch.equal(positions, expected[0]) and torch.equal(deltas, expected[1])
    assert positions.dtype == deltas.dtype == torch.int64


def test_mrope_positions_without_vision_count_up_and_meta():
    token_types = torch.zeros(2, 5, dtype=torch.long)
    positions, deltas = PF.mrope_positions(token_types)
    assert torch.equal(positions, torch.arange(5).expand(3, 2, 5)) and deltas.tolist() == [[0], [0]]
    meta = PF.mrope_positions(token_types.to("meta"))
    assert meta[0].shape == (3, 2, 5) and meta[1].shape == (2, 1)


@pytest.mark.parametrize("call, message", [
    (lambda: PF.mrope_positions(torch.tensor([[0, 1, 1]]), torch.tensor([[1, 2, 2]])),
     r"row 0 has a run of 2 image tokens at position 1 but its grid \(1, 2, 2\) with spatial_merge_size 2 has 1"),
    (lambda: PF.mrope_positions(torch.tensor([[0, 2]])), "row 0 has more runs of video tokens than the 0 grids"),
    (lambda: PF.mrope_positions(torch.tensor([[0, 3]])), r"token_types holds 3 at \[0, 1\]"),
    (lambda: PF.mrope_positions(torch.tensor([0, 1])), r"token_types must be 2-D \[batch, seq\]"),
    (lambda: PF.mrope_positions(torch.tensor([[0.0]])), "token_types must be an integer tensor"),
    (lambda: PF.mrope_positions(torch.tensor([[1]]), torch.tensor([1, 2, 2])),
     r"image_grid_thw must be \[num_grids, 3\]"),
    (lambda: PF.mrope_positions(torch.tensor([[1]]), torch.tensor([[0, 2, 2]])),
     r"image_grid_thw\[0\] = \(0, 2, 2\) must be positive"),
    (lambda: PF.mrope_positions(torch.tensor([[0]]), attention_mask=torch.ones(1, 2)), "attention_mask has shape"),
    (lambda: PF.mrope_positions(torch.tensor([[0]]), spatial_merge_size=0), "spatial_merge_size must be at least 1"),
])
def test_mrope_positions_bad_input(call, message):
    with pytest.raises(RuntimeError, match="posenc.mrope_positions: " + message):
        call()


# ---------------------------------------------------------------- parity with Hugging Face and diffusers

def tiny_text_config(model):
    from transformers import Qwen2_5_VLTextConfig, Qwen2VLTextConfig, Qwen3VLTextConfig
    section = [2, 3, 3]
    if model == "qwen3_vl":
        return Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                  "mrope_section": section, "mrope_interleaved": True})
    config_class = Qwen2VLTextConfig if model == "qwen2_vl" else Qwen2_5_VLTextConfig
    return config_class(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        rope_scaling={"type": "mrope", "rope_theta": 1000.0, "mrope_section": section})


def assert_rotates_like(ours, expected, inputs):
    """Our rotated (q, k) equal the library's within 1e-5, and so do the gradients of `inputs` for one random
    output gradient."""
    for a, b in zip(ours, expected):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    grads = [torch.randn_like(t) for t in expected]
    assert_close(torch.autograd.grad(ours, inputs, grads), torch.autograd.grad(expected, inputs, grads), atol=1e-5,
                 rtol=1e-5)


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_multimodal_module_matches_hugging_face(model):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen2_5
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3

    config = tiny_text_config(model)
    hf_rotary = {"qwen2_vl": qwen2.Qwen2VLRotaryEmbedding, "qwen2_5_vl": qwen2_5.Qwen2_5_VLRotaryEmbedding,
                 "qwen3_vl": qwen3.Qwen3VLTextRotaryEmbedding}[model](config)
    apply = {"qwen2_vl": qwen2, "qwen2_5_vl": qwen2_5, "qwen3_vl": qwen3}[model].apply_rotary_pos_emb
    token_types, mask, image_grid, video_grid = multimodal_batch()
    positions, _ = PF.mrope_positions(token_types, image_grid, video_grid, mask, 2)
    q = torch.randn(2, 4, token_types.shape[1], 16, requires_grad=True)  # bhsd, as transformers' attention
    k = torch.randn(2, 2, token_types.shape[1], 16, requires_grad=True)
    cos, sin = hf_rotary(q, positions)
    expected = apply(q, k, cos, sin)
    rotary = posenc.nn.MultimodalRotaryEmbedding.from_hf_config(config, format="bhsd")
    assert rotary.interleaved == (model == "qwen3_vl")
    ours = rotary(q, k, positions)
    assert_rotates_like(ours, expected, (q, k))


def test_multimodal_from_full_hf_configs():
    from transformers import Qwen2VLConfig, Qwen3VLConfig
    qwen2 = posenc.nn.MultimodalRotaryEmbedding.from_hf_config(Qwen2VLConfig())
    assert qwen2.mrope_section == [16, 24, 24] and not qwen2.interleaved and qwen2.head_dim == 128
    assert_close(qwen2.inv_freq, FQ.rope(128, 1e6)[0], rtol=0, atol=0)
    qwen3 = posenc.nn.MultimodalRotaryEmbedding.from_hf_config(Qwen3VLConfig().to_dict())
    assert qwen3.mrope_section == [24, 20, 20] and qwen3.interleaved and qwen3.base == 500000.0
    yarn = posenc.nn.MultimodalRotaryEmbedding.from_hf_config(
        {"model_type": "qwen2_vl_text", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 4096,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mrope_section": [2, 3, 3], "rope_theta": 1e4}})
    inv_freq, scale = FQ.rope(16, 1e4, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    assert_close(yarn.inv_freq, inv_freq, rtol=0, atol=0) and yarn.attention_scale == scale


def test_axial_module_matches_hugging_face_qwen2_vl_vision():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (Qwen2VLVisionRotaryEmbedding,
                                                                apply_rotary_pos_emb_vision)
    config = Qwen2VLConfig(vision_config={"embed_dim": 64, "num_heads": 4}).vision_config
    positions = PF.image_positions(4, 6)  # [2, 24]: (row, column) of packed patches
    q, k = torch.randn(24, 4, 16), torch.randn(24, 4, 16)
    cos, sin = Qwen2VLVisionRotaryEmbedding(config)(q, positions.T)  # it takes [T, 2]
    expected = apply_rotary_pos_emb_vision(q, k, cos, sin)
    rotary = posenc.nn.AxialRotaryEmbedding.from_hf_config(config)
    for a, b in zip(rotary(q, k, positions), expected):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_axial_module_matches_diffusers_flux():
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    axes_dim = [4, 6, 6]
    text_ids = torch.zeros(3, 3)
    image_ids = torch.zeros(4, 5, 3)
    image_ids[..., 1] += torch.arange(4)[:, None]
    image_ids[..., 2] += torch.arange(5)[None, :]
    ids = torch.cat([text_ids, image_ids.reshape(20, 3)])  # [S, 3] as the Flux pipeline builds them
    cos, sin = FluxPosEmbed(10000, axes_dim)(ids)
    q = torch.randn(2, 3, 23, 16, requires_grad=True)  # [B, H, S, D]; 16 channels, the axes rotate all of them
    k = torch.randn(2, 3, 23, 16, requires_grad=True)
    expected = (apply_rotary_emb(q, (cos, sin)), apply_rotary_emb(k, (cos, sin)))
    rotary = posenc.nn.AxialRotaryEmbedding(16, axes_dim=axes_dim, layout="gptj", format="bhsd")
    ours = rotary(q, k, ids.T.long())
    assert_rotates_like(ours, expected, (q, k))


def test_axial_2d_matches_a_float64_reference_written_here():
    """Axial RoPE of a ViT: half the pairs rotate by the patch row, half by the column, each with
    base ** (-4 i / head_dim), on every (row, column) of a 3 x 5 grid."""
    head_dim, base, rows, cols = 16, 100.0, 3, 5
    x = torch.randn(2, rows * cols, 3, head_dim, dtype=torch.float64)
    w = torch.tensor([base ** (-4 * i / head_dim) for i in range(head_dim // 4)], dtype=torch.float64)
    expected = torch.empty_like(x)
    for token in range(rows * cols):
        r, c = divmod(token, cols)
        angles = torch.cat([r * w, c * w])  # pairs (j, j + 8), neox
        for j, angle in enumerate(angles.tolist()):
            x1, x2 = x[:, token, :, j], x[:, token, :, j + head_dim // 2]
            expected[:, token, :, j] = x1 * torch.cos(torch.tensor(angle, dtype=torch.float64)) - \
                x2 * torch.sin(torch.tensor(angle, dtype=torch.float64))
            expected[:, token, :, j + head_dim // 2] = x2 * torch.cos(torch.tensor(angle, dtype=torch.float64)) + \
                x1 * torch.sin(torch.tensor(angle, dtype=torch.float64))
    rotary = posenc.nn.AxialRotaryEmbedding(head_dim, base=base)
    out, _ = rotary(x, x, PF.image_positions(rows, cols))
    assert_close(out, expected, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- modules

def test_modules_script_and_keep_frequencies_exact():
    multimodal = posenc.nn.MultimodalRotaryEmbedding(16, [2, 3, 3], 1e4, interleaved=True)
    axial = posenc.nn.AxialRotaryEmbedding(16, axes_dim=[4, 8], layout="gptj")
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    positions = torch.randint(0, 30, (3, 2, 5))
    for module, pos in ((multimodal, positions), (axial, positions[:2, 0])):
        expected = module(q, k, pos)
        scripted = torch.jit.script(module)
        for a, b in zip(scripted(q, k, pos), expected):
            assert torch.equal(a, b)
        exact = module.inv_freq.clone()
        for converted in (module.to(torch.bfloat16), scripted.to(torch.bfloat16), module.half()):
            assert converted.inv_freq.dtype == torch.float64 and torch.equal(converted.inv_freq, exact)
            assert converted.pair_axis.dtype == torch.int64
        assert "inv_freq" not in module.state_dict()
    # Text alone: positions of one dimension, or none.
    assert torch.equal(multimodal(q, k, torch.arange(5))[0], PF.rope(q, None, multimodal.inv_freq))
    assert torch.equal(multimodal(q, k)[1], PF.rope(k, None, multimodal.inv_freq))


@pytest.mark.parametrize("call, message", [
    (lambda: posenc.nn.MultimodalRotaryEmbedding(16, [2, 3, 2]), "holds 7 frequency pairs but head_dim 16 has 8"),
    (lambda: posenc.nn.MultimodalRotaryEmbedding(16, [2, 3, 3], scaling={"rope_type": "dynamic", "factor": 2.0}),
     'rope_type "dynamic" picks its frequencies per call'),
    (lambda: posenc.nn.AxialRotaryEmbedding(16, axes_dim=[8, 10]), "rotate 18 channels, more than head_dim 16"),
    (lambda: posenc.nn.AxialRotaryEmbedding(16, layout="half"), 'layout must be "neox" or "gptj"'),
    (lambda: posenc.nn.MultimodalRotaryEmbedding.from_hf_config({"model_type": "llama", "hidden_size": 8,
                                                                 "num_attention_heads": 1}), "hold no mrope_section"),
])
def test_module_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- opcheck, compile, export

def opcheck_samples():
    inv_freq, pair_axis = FQ.mrope(8, [2, 1, 1])
    q = torch.randn(2, 5, 3, 10, requires_grad=True)
    k = torch.randn(2, 5, 1, 10, requires_grad=True)
    rows = torch.randint(0, 50, (3, 2, 5))
    shared = torch.randint(0, 50, (3, 5))
    yield "rope", torch.ops.posenc.rope.default, (q, rows, inv_freq, 0.5, "gptj", "bshd", 3, None, pair_axis)
    yield "rope_thd", torch.ops.posenc.rope.default, (q[0], shared, inv_freq, 1.0, "neox", "thd", 0,
                                                      torch.tensor([0, 2, 5]), pair_axis.int())
    yield "rope_backward", torch.ops.posenc.rope_backward.default, (q.transpose(1, 2), shared, inv_freq, 1.0, "neox",
                                                                    "bhsd", 0, None, pair_axis)
    yield "rope_qk", torch.ops.posenc.rope_qk.default, (q, k, shared, inv_freq, 1.0, "neox", "bshd", 0, None, pair_axis)
    yield "rope_qk_backward", torch.ops.posenc.rope_qk_backward.default, (q, k, rows, inv_freq, 1.0, "gptj", "bshd",
                                                                          0, None, pair_axis)
    yield "rope_", torch.ops.posenc.rope_.default, (q.detach().clone(), rows, inv_freq, 1.0, "neox", "bshd", 0, None,
                                                    pair_axis)
    token_types, mask, image_grid, video_grid = multimodal_batch()
    yield "mrope_positions", torch.ops.posenc.mrope_positions.default, (token_types, image_grid, video_grid, mask)


@pytest.mark.parametrize("sample", list(opcheck_samples()), ids=lambda s: s[0])
def test_opcheck(sample):
    _, op, args = sample
    torch.library.opcheck(op, args)


class VisionBlock(torch.nn.Module):
    """A tiny ViT attention block with 2-D axial rotary q/k over a patch grid."""

    def __init__(self, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(16, 3 * heads * head_dim)
        self.rotary = posenc.nn.AxialRotaryEmbedding(head_dim)

    def forward(self, x, positions):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        q, k = self.rotary(q, k, positions)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2))
        return out.transpose(1, 2).reshape(b, s, -1)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    model = VisionBlock()
    compiled_matches_eager(model, [torch.randn(2, 12, 16), PF.image_positions(3, 4)], [model.qkv.weight])
    rotary = posenc.nn.MultimodalRotaryEmbedding(8, [2, 1, 1])
    q = torch.randn(2, 6, 2, 8, requires_grad=True)
    positions = torch.randint(0, 9, (3, 2, 6))
    compiled_matches_eager(lambda q: rotary(q, q, positions)[0], [q], [q])


def test_export():
    model = VisionBlock()
    x, positions = torch.randn(2, 12, 16), PF.image_positions(3, 4)
    assert_exports(model, (x, positions), "rope_qk")


# ---------------------------------------------------------------- bad input

X = torch.randn(2, 4, 3, 8)
INV, AXIS = FQ.axial(8)
POS = torch.zeros(2, 4, dtype=torch.long)


@pytest.mark.parametrize("call, message", [
    (lambda: PF.rope(X, None, INV, pair_axis=AXIS),
     r"posenc.rope: pair_axis needs positions with a leading axis dimension, \[n_axes, seq\] or \[n_axes, batch, "
     r"seq\]; got none"),
    (lambda: PF.rope(X, POS, INV, pair_axis=AXIS[:3]),
     r"posenc.rope: pair_axis has shape \[3\] but needs \[4\], one axis per frequency pair of inv_freq"),
    (lambda: PF.rope(X, POS, INV, pair_axis=AXIS.double()), "posenc.rope: pair_axis must be an int64 or int32 tensor"),
    (lambda: PF.rope(X, POS, INV, pair_axis=AXIS + 1),
     r"posenc.rope: pair_axis holds 2 at index 2, outside \[0, 2\) of the 2 axes of positions"),
    (lambda: PF.rope(X, POS, INV, pair_axis=AXIS - 1), r"posenc.rope: pair_axis holds -1 at index 0"),
    (lambda: PF.rope(X, torch.zeros(2, 5, dtype=torch.long), INV, pair_axis=AXIS),
     r"posenc.rope: positions has shape \[2, 5\] but with pair_axis needs \[n_axes, 4\] or \[n_axes, 2, 4\]"),
    (lambda: PF.rope(X, torch.zeros(4, dtype=torch.long), INV, pair_axis=AXIS), r"positions has shape \[4\]"),
    (lambda: PF.rope(X[0], torch.zeros(2, 3, 4, dtype=torch.long), INV, format="thd", pair_axis=AXIS),
     r"with pair_axis needs \[n_axes, 4\] \(n_axes >= 1\)"),
    (lambda: PF.rope(X, POS.half(), INV, pair_axis=AXIS), "posenc.rope: positions must be an int64, .* got Half"),
    (lambda: PF.rope(X, POS.double().fill_(float("inf")), INV, pair_axis=AXIS), "posenc.rope: position inf is outside"),
    (lambda: PF.rope_qk(X, X, POS + 2 ** 53 + 1, INV, pair_axis=AXIS), "posenc.rope_qk: position 9007199254740993"),
    (lambda: PF.rope_(X.expand(2, 4, 3, 8), POS, INV, pair_axis=AXIS[:1]), "posenc.rope_: pair_axis has shape"),
])
def test_bad_input_messages(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_pair_axis_values_are_checked_before_any_read():
    out = torch.zeros(2, 4, 3, 8)
    with pytest.raises(RuntimeError, match="pair_axis holds 5"):
        PF.rope_(out, POS, INV, pair_axis=torch.tensor([0, 1, 5, 0]))
    assert torch.equal(out, torch.zeros_like(out))


def test_bad_input_meta_matches_cpu_and_values_need_data():
    x = X.to("meta")
    with pytest.raises(RuntimeError, match=r"pair_axis has shape \[3\] but needs \[4\]"):
        PF.rope(x, POS.to("meta"), INV.to("meta"), pair_axis=AXIS[:3].to("meta"))
    assert PF.rope(x, POS.to("meta"), INV.to("meta"), pair_axis=(AXIS + 7).to("meta")).shape == X.shape


def test_empty_inputs():
    assert PF.rope(torch.randn(2, 0, 3, 8), torch.zeros(2, 0, dtype=torch.long), INV, pair_axis=AXIS).shape == \
        (2, 0, 3, 8)
    assert PF.rope(torch.randn(0, 4, 3, 8), torch.zeros(2, 0, 4, dtype=torch.long), INV,
                   pair_axis=AXIS).shape == (0, 4, 3, 8)


# ---------------------------------------------------------------- the worked examples of docs/multiaxis-rope.md

DOC = Path(__file__).resolve().parents[2] / "docs" / "multiaxis-rope.md"


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", DOC.read_text()))))
def test_docs_examples_run(index):
    """Every Python block of the guide runs (its own asserts check the values)."""
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[index]
    exec(compile(block, f"{DOC.name}[{index}]", "exec"), {})


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (which imports this file to find
# them): each op's sample call (op_registry.SAMPLES: determinism, concurrency, no_grad, CUDA and CPU-capability
# tests), its hypothesis property (test_properties.py) and its bad-input cases (bad_input_fuzzer.py).

# ---- sample calls

@sample("mrope_positions")
def _build_mrope_positions(m):
    """Rows of text and vision tokens, the last tokens padding. Small: 16 rows of text, an image (grid 1 x 8 x 8,
    merge 2: 16 tokens), text, a video (grid 2 x 4 x 8: 16 tokens, Qwen2.5-VL's time interval) and text; large:
    256 rows of 4096 tokens: 100 of text, an image (grid 1 x 16 x 16: 64 tokens) and text."""
    if m.large:
        row, rows = [0] * 100 + [1] * 64 + [0] * (4096 - 164), 256
    else:
        row, rows = [0] * 10 + [1] * 16 + [0] * 6 + [2] * 16 + [0] * 16, 16
    token_types = torch.tensor(row).expand(rows, -1).contiguous()
    mask = torch.ones_like(token_types)
    mask[:, -m.size(4, 40):] = 0
    images = torch.tensor([m.size([1, 8, 8], [1, 16, 16])] * rows)
    if m.large:
        return call_args(token_types, images, None, mask)
    videos = torch.tensor([[2, 4, 8]] * rows)
    return call_args(token_types, images, videos, mask, 2, 2.0, torch.full((rows,), 0.5))


# ---- properties: random valid inputs against float64 references (test_properties.py)

def vision_run(draw, merge):
    """A grid (t, h, w) with t * (h // merge) * (w // merge) tokens, 1 to 8 of them."""
    t, height, width = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    return [t, height * merge + draw(st.integers(0, merge - 1)), width * merge + draw(st.integers(0, merge - 1))]


def mrope_reference(rows, masks, image_grids, video_grids, merge, intervals):
    """Qwen2-VL's M-RoPE positions ([3, B, S] lists) and rope_deltas, per row from the description: text tokens
    count up on every axis; a run of vision tokens is the next grid's (time, row, column) patches (time = trunc(frame
    * interval)) after the running position p, and the text after it starts at p + max(h, w) // merge; a row's delta
    is its largest position + 1 - its real token count; tokens outside the mask stay 0."""
    positions = [[[0] * len(row) for row in rows] for _ in range(3)]
    deltas = []
    grids = {1: iter(image_grids), 2: iter(video_grids)}
    for b, (row, mask) in enumerate(zip(rows, masks)):
        real = [s for s in range(len(row)) if mask[s]]
        runs = [list(group) for _, group in itertools.groupby(real, key=lambda s: row[s])]
        p, largest = 0, -1
        for run in runs:
            if row[run[0]] == 0:
                triples = [(p + j,) * 3 for j in range(len(run))]
                p += len(run)
            else:
                (t, h, w), interval = next(grids[row[run[0]]])
                triples = [(p + math.trunc(f * interval), p + i, p + j)
                           for f in range(t) for i in range(h // merge) for j in range(w // merge)]
                p += max(h, w) // merge
            for s, triple in zip(run, triples):
                for axis in range(3):
                    positions[axis][b][s] = triple[axis]
            largest = max([largest] + [v for triple in triples for v in triple])
        deltas.append([largest + 1 - len(real)])
    return positions, deltas


@property_check("mrope_positions")
@given(st.data())
def check_mrope_positions(data):
    draw = data.draw
    merge = draw(st.integers(1, 3))
    split = draw(st.booleans())
    tokens_per_second = draw(st.sampled_from([None, 1.0, 2.0, 0.5, 25.0]))
    batch = draw(st.integers(0, 3))
    rows, masks, image_grids, video_grids, seconds = [], [], [], [], []
    for _ in range(batch):
        row = [0] * draw(st.integers(0, 2))
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from([1, 2]))
            grid = vision_run(draw, merge)
            frames = grid[0] if kind == 2 and split else 1
            tokens_per_frame = grid[0] // frames * (grid[1] // merge) * (grid[2] // merge)
            for _ in range(frames):  # text after each run (Qwen3-VL: between the frames of a split video)
                row += [kind] * tokens_per_frame + [0] * draw(st.integers(1, 2))
            (image_grids if kind == 1 else video_grids).append(grid)
            if kind == 2:
                seconds.append(draw(st.sampled_from([0.5, 1.0, 2.0, 0.25, 1.5])))
        while row and row[-1] == 0 and draw(st.booleans()):  # rows may end with vision tokens
            row.pop()
        rows.append(row)
    seq = max((len(row) for row in rows), default=draw(st.integers(0, 3)))
    pad = draw(st.sampled_from(["left", "right"]))
    for b, row in enumerate(rows):  # padding (type 0) outside the mask
        padding = seq - len(row)
        masks.append([0] * padding + [1] * len(row) if pad == "left" else [1] * len(row) + [0] * padding)
        rows[b] = [0] * padding + row if pad == "left" else row + [0] * padding
    gen = generator(draw)
    index_dtype = draw(st.sampled_from([torch.long, torch.int]))
    token_types = arrange(draw, torch.tensor(rows, dtype=index_dtype).reshape(batch, seq), expand=False)
    mask_dtype = draw(st.sampled_from([torch.long, torch.bool, torch.float32]))
    with_mask = draw(st.booleans()) or any(0 in m for m in masks)
    # Padding of any type outside the mask: the op must not read it.
    padded = torch.tensor(masks, dtype=torch.bool).reshape(batch, seq).logical_not()
    token_types = torch.where(padded, integers(gen, [batch, seq], 0, 3, index_dtype), token_types) if with_mask \
        else token_types
    mask = arrange(draw, torch.tensor(masks).reshape(batch, seq).to(mask_dtype), expand=False) if with_mask else None

    def grid_tensor(grids):
        if not grids and draw(st.booleans()):
            return None
        return arrange(draw, torch.tensor(grids, dtype=index_dtype).reshape(len(grids), 3), expand=False)

    per_grid = draw(st.booleans())
    seconds_dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    second_per_grid_ts = torch.tensor(seconds, dtype=seconds_dtype) if per_grid else None
    scale = 1.0 if tokens_per_second is None else tokens_per_second
    intervals = [scale * sec for sec in seconds] if per_grid else [scale] * len(video_grids)
    note(f"rows {rows}, masks {masks}, images {image_grids}, videos {video_grids}, merge {merge}, split {split}, "
         f"tokens_per_second {tokens_per_second}, seconds {second_per_grid_ts}")
    positions, deltas = call("mrope_positions", token_types, grid_tensor(image_grids), grid_tensor(video_grids), mask,
                             merge, tokens_per_second, second_per_grid_ts, split)
    split_videos = [[1, h, w] for t, h, w in video_grids for _ in range(t)] if split else video_grids
    split_intervals = [i for (t, _, _), i in zip(video_grids, intervals) for _ in range(t)] if split else intervals
    expected, expected_deltas = mrope_reference(
        rows, masks if with_mask else [[1] * seq] * batch, [(g, 1.0) for g in image_grids],
        list(zip(split_videos, split_intervals)), merge, None)
    assert positions.dtype == deltas.dtype == torch.long
    assert positions.tolist() == expected and positions.shape == (3, batch, seq)
    assert deltas.tolist() == expected_deltas and deltas.shape == (batch, 1)


# ---- bad inputs: a small valid call of each op, and the mutations that each make one argument wrong

def mrope_positions(draw):
    """Rows of text, an image (grid 1x4x4, merge 2: 4 tokens) and a video (the same grid), one grid of each a row."""
    batch = small(draw)
    row = [0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0]
    return dict(token_types=torch.tensor([row] * batch), image_grid_thw=torch.tensor([[1, 4, 4]] * batch),
                video_grid_thw=torch.tensor([[1, 4, 4]] * batch), attention_mask=torch.ones(batch, len(row)),
                spatial_merge_size=2, tokens_per_second=2.0, second_per_grid_ts=torch.ones(batch),
                split_video_frames=False)


bad_inputs("mrope_positions", base=mrope_positions, mutations=dict(
    token_types_not_integer=to_dtype("token_types", torch.float32, torch.float64, torch.bool, torch.complex64),
    token_types_wrong_rank=wrong_rank("token_types", [0, 1, 3]),
    token_type_unknown=put("token_types", [3, -1, INT64_MAX, INT64_MIN]),
    grid_not_index=not_index("image_grid_thw"), grid_wrong_shape=grow("video_grid_thw", 1),
    grid_wrong_rank=wrong_rank("image_grid_thw", [1, 3]),
    grid_not_positive=put("video_grid_thw", [0, -1, INT64_MIN]),
    # Sizes whose tokens differ from the run's: too many, too few, or more than int64 counts.
    grid_does_not_match_its_run=put("image_grid_thw", [2, 3, 6, INT64_MAX, 2 ** 62 + 1]),
    fewer_grids_than_runs=lambda draw, kw: kw.update(**{draw(st.sampled_from(["image_grid_thw", "video_grid_thw"])):
                                                        None}),
    attention_mask_wrong_shape=grow("attention_mask", 1),
    spatial_merge_size_below_1=set_value("spatial_merge_size", st.sampled_from([0, -1, INT64_MIN])),
    second_per_grid_ts_too_few=lambda draw, kw: kw.update(second_per_grid_ts=kw["second_per_grid_ts"][:-1]),
    second_per_grid_ts_wrong_rank=wrong_rank("second_per_grid_ts", [0, 2]),
    second_per_grid_ts_not_real=to_dtype("second_per_grid_ts", torch.bool, torch.complex64),
    grid_on_meta=on_meta("image_grid_thw"), attention_mask_on_meta=on_meta("attention_mask")))


# ---------------------------------------------------------------- real-valued positions (DINOv3's patch centres)

@pytest.mark.parametrize("position_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("multiaxis", [False, True])
@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_rope_qk_real_positions_against_float64(position_dtype, multiaxis, layout):
    """Floating positions are read exactly (float32 ones widened) and rotate by position * inv_freq in float64."""
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, 6, 3, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    if multiaxis:
        inv_freq, pair_axis = FQ.axial(16)
        positions = (torch.rand(2, 6, generator=gen) * 4 - 2).to(position_dtype)  # [n_axes, S] in [-2, 2]
        angle = positions.double()[pair_axis].T * inv_freq
    else:
        inv_freq, pair_axis = FQ.rope(16)[0], None
        positions = (torch.rand(6, generator=gen) * 1e4 - 5e3).to(position_dtype)
        angle = positions.double()[:, None] * inv_freq
    out_q, out_k = PF.rope_qk(q, k, positions, inv_freq, 1.0, layout, offset=3 if not multiaxis else 0,
                              pair_axis=pair_axis)
    if not multiaxis:
        angle = (positions.double() + 3)[:, None] * inv_freq
    assert_close(out_q, rotate_pairs(q, angle, layout), rtol=0, atol=1e-12)
    assert_close(out_k, rotate_pairs(k, angle, layout), rtol=0, atol=1e-12)
    # the in-place op and the backward rotate by the same angles
    buffer = q.clone()
    PF.rope_(buffer, positions, inv_freq, 1.0, layout, offset=3 if not multiaxis else 0, pair_axis=pair_axis)
    assert torch.equal(buffer, out_q)
    grad = PF.rope_backward(out_q, positions, inv_freq, 1.0, layout, offset=3 if not multiaxis else 0,
                            pair_axis=pair_axis)
    assert_close(grad, q, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"),
                                        (2.0 ** 54, "1.80144e")])
@pytest.mark.parametrize("op", ["rope_qk", "qk_norm_rope"])
def test_non_finite_real_positions_are_refused(bad, shown, op):
    inv_freq, pair_axis = FQ.axial(8)
    positions = torch.zeros(2, 4, dtype=torch.float64)
    positions[1, 2] = bad
    q = torch.randn(1, 4, 2, 8)
    args = (q, q) if op == "rope_qk" else (q, q, torch.ones(8), torch.ones(8))
    with pytest.raises(RuntimeError, match=rf"posenc.{op}: position {shown}.* is outside \[-2\^53, 2\^53\].* "
                                           r"\(floating positions: finite\); it is positions.flatten\(\)\[6\]"):
        getattr(PF, op)(*args, positions, inv_freq, pair_axis=pair_axis)


def test_real_positions_need_cache_positions_for_the_cache():
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    k_cache, v_cache = torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)
    inv_freq = FQ.rope(8)[0]
    positions = torch.tensor([0.5, 1.5, 2.5])
    with pytest.raises(RuntimeError, match="positions are Float coordinates, not cache slots; pass cache_positions"):
        PF.rope_qk_cache_(q.clone(), k, v, k_cache, v_cache, positions, inv_freq)
    q_out = q.clone()
    PF.rope_qk_cache_(q_out, k, v, k_cache, v_cache, positions, inv_freq, cache_positions=torch.tensor([1, 2, 3]))
    ref_q, ref_k = PF.rope_qk(q, k, positions, inv_freq)
    assert torch.equal(q_out, ref_q)
    assert torch.equal(k_cache[:, :, 1:4], ref_k.transpose(1, 2))
    assert torch.equal(v_cache[:, :, 1:4], v.transpose(1, 2))


def test_compile_and_export_with_real_positions(compiled_matches_eager):
    inv_freq, pair_axis = FQ.axial(16)
    positions = PF.patch_center_positions(3, 4, 1)
    q = torch.randn(2, 2, 13, 16, requires_grad=True)

    def fn(q):
        out_q, out_k = PF.rope_qk(q, q * 2, positions, inv_freq * (2 * math.pi), 1.0, "neox", "bhsd",
                                  pair_axis=pair_axis)
        return out_q + out_k

    compiled_matches_eager(fn, (q,), (q,))

    class Model(torch.nn.Module):
        def forward(self, q):
            return fn(q)

    assert_exports(Model(), (q.detach(),), "rope_qk")


def _dinov3():
    modeling = pytest.importorskip("transformers.models.dinov3_vit.modeling_dinov3_vit")
    from transformers import DINOv3ViTConfig
    config = DINOv3ViTConfig(hidden_size=64, num_attention_heads=2, image_size=48, patch_size=8,
                             num_register_tokens=4, pos_embed_shift=0.1, pos_embed_jitter=1.5, pos_embed_rescale=2.0)
    return modeling, config


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("size", [(6, 5), (4, 4), (1, 7)])
def test_patch_center_positions_are_dinov3s(training, size):
    """Bit for bit transformers' get_patches_center_coordinates (+ augment_patches_center_coordinates with the
    same seed), with zeros for the prefix tokens."""
    modeling, config = _dinov3()
    height, width = size
    augment = (config.pos_embed_shift, config.pos_embed_jitter, config.pos_embed_rescale) if training else (None,) * 3
    for seed in (0, 3):
        torch.manual_seed(seed)
        reference = modeling.get_patches_center_coordinates.__wrapped__(height, width, torch.float32, "cpu") \
            if hasattr(modeling.get_patches_center_coordinates, "__wrapped__") else \
            modeling.get_patches_center_coordinates(height, width, torch.float32, "cpu")
        if training:
            reference = modeling.augment_patches_center_coordinates(reference, *augment)
        ours = PF.patch_center_positions(height, width, 5, *augment, generator=torch.Generator().manual_seed(seed))
        assert ours.dtype == torch.float32 and ours.shape == (2, 5 + height * width)
        assert torch.equal(ours[:, 5:].T, reference)
        assert torch.equal(ours[:, :5], torch.zeros(2, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [False, True])
def test_dinov3_rotary_forward_and_backward(dtype, training):
    """DINOv3ViTRopePositionEmbedding + its apply_rotary_pos_emb (prefix tokens unrotated) against rope_qk with
    patch_center_positions and axial frequencies times 2 pi: transformers forms its angle in float32, posenc in
    float64, so float32 results agree to the float32 rounding of the angle; bf16 ones to two bf16 roundings."""
    modeling, config = _dinov3()
    embedding = modeling.DINOv3ViTRopePositionEmbedding(config).train(training)
    pixels = torch.randn(2, 3, 48, 40)
    torch.manual_seed(11)
    cos, sin = embedding(pixels)
    augment = (config.pos_embed_shift, config.pos_embed_jitter, config.pos_embed_rescale) if training else (None,) * 3
    positions = PF.patch_center_positions(6, 5, 5, *augment, generator=torch.Generator().manual_seed(11))
    inv_freq, pair_axis = FQ.axial(32, 2, config.rope_theta)
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 2, 35, 32, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    ref_q, ref_k = modeling.apply_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype))
    out_q, out_k = PF.rope_qk(q, k, positions, inv_freq * (2 * math.pi), 1.0, "neox", "bhsd", pair_axis=pair_axis)
    # bf16: transformers rounds cos, sin, both products and their sum to bf16, posenc the result once
    # float32: the angle's float32 rounding, |angle| * 2^-24 with |angle| <= 2 pi * |coordinate| (augmented: up to 3)
    rtol, atol = (0, 2 * math.pi * positions.abs().max().item() * 2 ** -23) if dtype == torch.float32 else \
        (2 ** -6, 2 ** -6)
    assert_close(out_q, ref_q, rtol=rtol, atol=atol)
    assert_close(out_k, ref_k, rtol=rtol, atol=atol)
    assert torch.equal(out_q[:, :, :5], q[:, :, :5]) and torch.equal(out_k[:, :, :5], k[:, :, :5])
    grads = torch.randn_like(out_q), torch.randn_like(out_k)
    ours = torch.autograd.grad((out_q, out_k), (q, k), grads)
    theirs = torch.autograd.grad((ref_q, ref_k), (q, k), grads)
    for a, b in zip(ours, theirs):
        assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("call, message", [
    (lambda: PF.patch_center_positions(-1, 4), "posenc.patch_center_positions: height -1 and width 4 must not be"),
    (lambda: PF.patch_center_positions(2, 2, -3), "num_prefix_tokens must not be negative, got -3"),
    (lambda: PF.patch_center_positions(2, 2, jitter=0.5), r"jitter must be finite and at least 1 .* got 0.5"),
    (lambda: PF.patch_center_positions(2, 2, rescale=float("nan")), r"rescale must be finite and at least 1"),
    (lambda: PF.patch_center_positions(2, 2, shift=-0.1), r"shift must be finite and not negative, got -0.1"),
])
def test_patch_center_positions_bad_arguments(call, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        call()


# ---------------------------------------------------------------- learned frequencies (timm's mixed 2-D RoPE)

def test_axial_module_with_learned_frequencies_trains_them():
    module = posenc.nn.AxialRotaryEmbedding(16, 2, learned_freq=True)
    assert isinstance(module.inv_freq, torch.nn.Parameter) and module.inv_freq.dtype == torch.float64
    assert [name for name, _ in module.named_parameters()] == ["inv_freq"]
    module.to(torch.bfloat16)  # the frequencies stay float64
    assert module.inv_freq.dtype == torch.float64 and isinstance(module.inv_freq, torch.nn.Parameter)
    positions = PF.image_positions(3, 4)
    q = torch.randn(2, 12, 2, 16, dtype=torch.float64, requires_grad=True)
    out_q, out_k = module(q, q.detach() * 0.5, positions)
    weights = torch.randn_like(out_q)  # a rotation leaves norms alone: a weighted sum feels the angle
    ((out_q * weights).sum() + out_k.sum()).backward()
    expected = FQ.axial(16, 2)[0].clone().requires_grad_()
    ref_q, ref_k = PF.rope_qk(q.detach(), q.detach() * 0.5, positions, expected, pair_axis=FQ.axial(16, 2)[1])
    ((ref_q * weights).sum() + ref_k.sum()).backward()
    assert torch.equal(module.inv_freq.grad, expected.grad) and module.inv_freq.grad.abs().sum() > 0
    before = module.inv_freq.detach().clone()
    torch.optim.SGD(module.parameters(), lr=0.1).step()
    assert not torch.equal(module.inv_freq.detach(), before)
    scripted = torch.jit.script(module)
    assert torch.equal(scripted(q.detach(), q.detach(), positions)[0], module(q.detach(), q.detach(), positions)[0])
