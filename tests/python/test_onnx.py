"""ONNX export (posenc.onnx): every forward op, translated to standard ONNX operators, run by ONNX Runtime and
compared with the posenc op in PyTorch (float32 within 1e-5), at the export shapes and at other batch and sequence
sizes (dynamic shapes). Each export takes a second or two, so every model below calls many ops at once."""
import re
from pathlib import Path

import onnxruntime
import pytest
import torch

import posenc
import posenc.onnx
from posenc import functional as PF

DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"


class Calls(torch.nn.Module):
    """A model whose forward is fn(*inputs), returning a tuple of tensors."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def export_and_compare(fn, inputs, dynamic=None, other_inputs=(), atol=1e-5, rtol=0.0):
    """Exports Calls(fn) with dynamic_shapes (one dict per input, or None), runs ONNX Runtime on the export inputs and
    on every tuple of other_inputs, and compares each output with fn's. Returns the ONNX model."""
    program = posenc.onnx.export(Calls(fn), tuple(inputs),
                                 dynamic_shapes=None if dynamic is None else (tuple(dynamic),))
    model = program.model_proto
    assert not [n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")], "non-standard ONNX ops"
    session = onnxruntime.InferenceSession(model.SerializeToString())
    for values in [inputs, *other_inputs]:
        expected = fn(*values)
        feed = {i.name: v.numpy() for i, v in zip(session.get_inputs(), values)}
        actual = session.run(None, feed)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(torch.from_numpy(a), e, atol=atol, rtol=rtol)
    return model


def op_types(model):
    return {node.op_type for node in model.graph.node}


def seq(name="seq"):
    return torch.export.Dim(name, min=2, max=4096)


# ---------------------------------------------------------------- sinusoidal

def test_sinusoidal_family():
    inv_freq = posenc.frequencies.sinusoidal(16, shift=1)
    table = torch.randn(11, 17)
    odd_inv_freq = posenc.frequencies.sinusoidal(17)

    def fn(x, x_odd, tokens, steps, positions):
        return (PF.add_sinusoidal(x, None, inv_freq, 2.0, "interleaved", 7),
                PF.add_sinusoidal(x, None, inv_freq, 1.0, "half"),
                PF.add_sinusoidal(x, positions, inv_freq, 0.5, "half_cos_first", 3),       # [B, S] positions
                PF.add_sinusoidal(x, positions[0], inv_freq),                              # [S] positions
                PF.add_sinusoidal(x_odd, None, odd_inv_freq, 1.0, "half", 1),               # odd width
                PF.embed_sinusoidal(tokens, table, None, odd_inv_freq, 4.0, 1, "half", 2),
                PF.sinusoidal(steps, inv_freq, "half_cos_first", None, 1),                  # float timesteps
                PF.sinusoidal(positions, inv_freq, "interleaved", torch.float64, 5))

    def inputs(b, s):
        return (torch.randn(b, s, 16), torch.randn(b, s, 17), torch.randint(0, 11, (b, s)), torch.rand(s) * 1000,
                torch.randint(0, 100000, (b, s)))

    batch, s = torch.export.Dim("batch", min=2, max=64), seq()
    dims = ({0: batch, 1: s}, {0: batch, 1: s}, {0: batch, 1: s}, {0: s}, {0: batch, 1: s})
    export_and_compare(fn, inputs(2, 5), dims, [inputs(3, 11), inputs(2, 2)])


def test_sinusoidal_in_float16_and_float64():
    inv_freq = posenc.frequencies.sinusoidal(8)

    def fn(x16, x64):
        return PF.add_sinusoidal(x16, None, inv_freq), PF.add_sinusoidal(x64, None, inv_freq, 3.0)

    x16, x64 = torch.randn(2, 6, 8).half(), torch.randn(2, 6, 8, dtype=torch.float64)
    # float16: both round the same float32 result once (at most one float16 step apart)
    export_and_compare(fn, (x16, x64), atol=1e-3, rtol=0.0)


def test_the_issue_repro_sinusoidal_module_exports():
    module = posenc.nn.SinusoidalPositionalEncoding(32, layout="half", shift=1, x_scale=2.0)
    x = torch.randn(2, 7, 32)
    program = posenc.onnx.export(module, (x,), dynamic_shapes=({1: seq()},))
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
    for shape in [(2, 7, 32), (2, 50, 32)]:
        x = torch.randn(shape)
        torch.testing.assert_close(torch.from_numpy(session.run(None, {"x": x.numpy()})[0]), module(x),
                                   atol=1e-5, rtol=0.0)


# ---------------------------------------------------------------- learned absolute

def test_learned_family():
    wpe, wte = torch.randn(70, 8), torch.randn(11, 8)

    def fn(x, tokens, positions, mask, bool_mask, float_mask):
        return (PF.learned(wpe, positions, 3),
                PF.learned(wpe, positions.int()),
                PF.add_learned(x, wpe, None, 4),
                PF.add_learned(x, wpe, positions[0], 1),
                PF.embed_learned(tokens, wte, wpe, None, 2.0, 1, 5),
                PF.embed_learned(tokens, wte, wpe, PF.positions_from_mask(mask, -1), 1.0, None, 2),
                PF.make_positions(tokens, 1),
                PF.positions_from_mask(mask, -1),
                PF.positions_from_mask(bool_mask),
                PF.positions_from_mask(float_mask, 3))

    def inputs(b, s):
        mask = torch.randint(0, 2, (b, s))
        return (torch.randn(b, s, 8), torch.randint(0, 11, (b, s)), torch.randint(0, 60, (b, s)), mask,
                mask.bool(), mask.float())

    batch, s = torch.export.Dim("batch", min=2, max=64), seq()
    export_and_compare(fn, inputs(2, 6), [{0: batch, 1: s}] * 6, [inputs(3, 13), inputs(4, 2)], atol=0)


# ---------------------------------------------------------------- rotary

FORMATS = {"bshd": (1, lambda b, s: (b, s, 3, 16)), "bhsd": (2, lambda b, s: (b, 3, s, 16)),
           "sbhd": (0, lambda b, s: (s, b, 3, 16))}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rope_uses_rotary_embedding_in_every_layout_and_position_form(fmt):
    seq_dim, shape = FORMATS[fmt]
    partial = posenc.frequencies.rope(8)[0]                                 # 8 of 16 channels rotate
    full, scale = posenc.frequencies.rope(16, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 64})

    def fn(x, k, positions):
        return (PF.rope(x, None, partial, 1.0, "neox", fmt, 3),
                PF.rope(x, None, full, scale, "gptj", fmt),
                PF.rope(x, positions, full, scale, "neox", fmt, 2),             # [B, S]
                PF.rope(x, positions[0], partial, 1.0, "gptj", fmt),            # [S]
                *PF.rope_qk(x, k, positions, full, scale, "neox", fmt))         # GQA: 3 and 1 heads

    def inputs(b, s):
        k_shape = list(shape(b, s))
        k_shape[{"bshd": 2, "bhsd": 1, "sbhd": 2}[fmt]] = 1
        return torch.randn(shape(b, s)), torch.randn(k_shape), torch.randint(0, 1 << 20, (b, s))

    batch, s = torch.export.Dim("batch", min=2, max=64), seq()
    x_dims = {seq_dim: s, 1 - seq_dim if fmt == "sbhd" else 0: batch}
    model = export_and_compare(fn, inputs(2, 5), [x_dims, x_dims, {0: batch, 1: s}], [inputs(3, 9)])
    assert "RotaryEmbedding" in op_types(model)


def test_rope_packed_sequences():
    inv_freq = posenc.frequencies.rope(16)[0]

    def fn(x, cu_seqlens, positions):
        return (PF.rope(x, None, inv_freq, 1.0, "neox", "thd", 1, cu_seqlens),    # positions restart per sequence
                PF.rope(x, positions, inv_freq, 0.5, "gptj", "thd"),
                PF.rope(x, None, inv_freq, 1.0, "neox", "thd", 4))

    tokens = seq("tokens")
    export_and_compare(fn, (torch.randn(7, 2, 16), torch.tensor([0, 3, 3, 7]), torch.randint(0, 100, (7,))),
                       [{0: tokens}, None, {0: tokens}],
                       [(torch.randn(12, 2, 16), torch.tensor([0, 1, 10, 12]), torch.randint(0, 100, (12,)))])


def test_rope_multiaxis_gathers_each_pairs_axis():
    """pair_axis in the graph: M-RoPE positions [3, B, S] and axial [2, S] in each format, rope and rope_qk."""
    mrope, mrope_axis = posenc.frequencies.mrope(16, [2, 3, 3])
    axial, axial_axis = posenc.frequencies.axial(12, 2)  # partial rotary: 12 of 16 channels

    def fn(x, k, rows, grid):
        return (PF.rope(x, rows, mrope, 0.5, "neox", "bshd", 2, None, mrope_axis),
                *PF.rope_qk(x.transpose(1, 2), k.transpose(1, 2), grid, axial, 1.0, "gptj", "bhsd", 0, None,
                            axial_axis),
                PF.rope(x.transpose(0, 1), rows, mrope, 1.0, "gptj", "sbhd", 0, None, mrope_axis.int()),
                PF.rope(x[0], grid, axial, 1.0, "neox", "thd", 1, torch.tensor([0, 2, x.shape[1]]), axial_axis))

    def inputs(b, s):
        return torch.randn(b, s, 3, 16), torch.randn(b, s, 1, 16), torch.randint(0, 5000, (3, b, s)), \
            torch.randint(0, 64, (2, s))

    batch, s = torch.export.Dim("batch", min=2, max=64), seq()
    export_and_compare(fn, inputs(2, 5), [{0: batch, 1: s}, {0: batch, 1: s}, {1: batch, 2: s}, {1: s}],
                       [inputs(3, 9)])


def test_rope_far_positions_keep_float32_accuracy():
    # Angles in float64, as the op forms them: an eager float32 p * inv_freq is off by far more than 1e-5 here.
    inv_freq = posenc.frequencies.rope(64)[0]
    positions = torch.arange((1 << 20) - 64, 1 << 20)
    x = torch.randn(1, 64, 2, 64)
    export_and_compare(lambda x, p: (PF.rope(x, p, inv_freq),), (x, positions), atol=1e-5)


def test_rope_cos_sin_with_any_tables():
    def fn(x_bshd, x_bhsd, x_sbhd, x_thd, cos, sin, cos_b, sin_b):
        return (PF.rope_cos_sin(x_bshd, cos, sin, "neox", "bshd"),
                PF.rope_cos_sin(x_bshd, cos_b, sin_b, "gptj", "bshd"),
                PF.rope_cos_sin(x_bhsd, cos_b[:1], sin_b[:1], "neox", "bhsd"),
                PF.rope_cos_sin(x_bhsd, cos, sin, "gptj", "bhsd"),
                PF.rope_cos_sin(x_sbhd, cos_b, sin_b, "neox", "sbhd"),
                PF.rope_cos_sin(x_sbhd, cos, sin, "gptj", "sbhd"),
                PF.rope_cos_sin(x_thd, cos, sin, "neox", "thd"))

    def inputs(s):
        return (torch.randn(2, s, 3, 16), torch.randn(2, 3, s, 16), torch.randn(s, 2, 3, 16), torch.randn(s, 3, 16),
                torch.randn(s, 12), torch.randn(s, 12), torch.randn(2, s, 12), torch.randn(2, s, 12))

    s = seq()
    dims = [{1: s}, {2: s}, {0: s}, {0: s}, {0: s}, {0: s}, {1: s}, {1: s}]
    model = export_and_compare(fn, inputs(5), dims, [inputs(9)])
    assert "RotaryEmbedding" not in op_types(model)


# ---------------------------------------------------------------- ALiBi

def test_alibi():
    slopes, per_batch = PF.alibi_slopes(6), torch.rand(2, 4)

    def fn(scores, keys):
        q_len, k_len = scores.shape[2], keys.shape[0]
        return (PF.add_alibi(scores, slopes, "causal", 2),
                PF.add_alibi(scores, per_batch, "symmetric"),
                PF.alibi_bias(slopes, q_len, k_len),
                PF.alibi_bias(per_batch, q_len, k_len, "symmetric", 1, 2, torch.float64),
                PF.alibi_bias(slopes, 1, k_len, "causal", 0, None, torch.float32))    # one query (decoding)

    q, k = seq("q"), seq("k")
    export_and_compare(fn, (torch.randn(2, 4, 5, 7), torch.randn(7)), [{2: q, 3: k}, {0: k}],
                       [(torch.randn(2, 4, 9, 30), torch.randn(30)), (torch.randn(2, 4, 12, 3), torch.randn(3))])


# ---------------------------------------------------------------- T5

@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_and_bias(bidirectional):
    weight = torch.randn(16, 3)
    extremes = torch.tensor([-(1 << 63), (1 << 63) - 1, -4000, 4000, -40, 40, -41, 41, -39, 39, 0, -1, 1])

    def fn(relative, queries, keys):
        return (PF.relative_position_bucket(relative, bidirectional, 32, 128),
                PF.relative_position_bucket(relative.int(), bidirectional, 16, 40),
                PF.t5_bias(weight, queries.shape[0], keys.shape[0], bidirectional, 16, 40),
                PF.t5_bias(weight, 1, keys.shape[0], bidirectional, 16, 40, keys.shape[0] - 1))  # decoding step

    grid = torch.arange(-300, 300)
    q, k, n = seq("q"), seq("k"), seq("n")
    export_and_compare(fn, (grid, torch.zeros(5), torch.zeros(9)), [{0: n}, {0: q}, {0: k}],
                       [(extremes.clamp(-(1 << 31), (1 << 31) - 1), torch.zeros(60), torch.zeros(70))], atol=0)
    export_and_compare(lambda r: (PF.relative_position_bucket(r, bidirectional, 32, 128),), (extremes,), atol=0)


# ---------------------------------------------------------------- the API, its errors, the documentation

def test_translation_table_covers_every_forward_op():
    names = {op.name() for op in posenc.onnx.translation_table()}
    assert names == {f"posenc::{name}" for name in (
        "sinusoidal", "add_sinusoidal", "embed_sinusoidal", "learned", "add_learned", "embed_learned",
        "make_positions", "positions_from_mask", "rope", "rope_qk", "rope_cos_sin", "alibi_bias", "add_alibi",
        "relative_position_bucket", "t5_bias")}


def test_opset_below_23_is_refused():
    with pytest.raises(ValueError, match=r"posenc.onnx.export: opset_version must be at least 23"):
        posenc.onnx.export(posenc.nn.SinusoidalPositionalEncoding(8), (torch.randn(1, 2, 8),), opset_version=18)


def test_dynamic_head_count_is_refused_with_a_clear_error():
    inv_freq = posenc.frequencies.rope(8)[0]
    heads = torch.export.Dim("heads", min=2, max=16)
    with pytest.raises(Exception, match=r"posenc.onnx: rope needs a fixed head count to export"):
        posenc.onnx.export(Calls(lambda x: PF.rope(x, None, inv_freq)), (torch.randn(1, 4, 3, 8),),
                           dynamic_shapes=(({2: heads},),))


def test_in_place_ops_are_not_exported_by_torch_2_13():
    # torch.export turns a mutable custom op into auto_functionalized_v2, which torch.onnx cannot translate
    # (docs/export.md); models meant for ONNX call the functional ops.
    inv_freq = posenc.frequencies.rope(8)[0]

    def fn(x):
        y = x * 2
        PF.rope_(y, None, inv_freq)
        return y

    with pytest.raises(Exception, match=r"auto_functionalized_v2"):
        posenc.onnx.export(Calls(fn), (torch.randn(1, 4, 2, 8),))


def test_the_example_in_docs_export_md(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    model_block, onnx_block = blocks[0], next(b for b in blocks if "posenc.onnx" in b)
    monkeypatch.chdir(tmp_path)
    namespace = {"other": torch.randint(0, 100, (3, 17))}
    exec(compile(model_block, str(DOC), "exec"), namespace)
    exec(compile(onnx_block, str(DOC), "exec"), namespace)
    assert (tmp_path / "tiny_attention.onnx").exists()
