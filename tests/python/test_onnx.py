"""ONNX export (posenc.onnx): every forward op, translated to standard ONNX operators, run by ONNX Runtime and
compared with the posenc op in PyTorch (float32 within 1e-5), at the export shapes and at other batch and sequence
sizes (dynamic shapes); plain torch.onnx.export, which finds the translations that import posenc registered, and
Hugging Face models patched with posenc through torch.onnx and transformers' exporter, against the unpatched
models. Each export takes a second or two, so every model below calls many ops at once."""
import re
from pathlib import Path

import onnxruntime
import pytest
import torch

import op_registry
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


def export_and_compare(fn, inputs, dynamic=None, other_inputs=(), atol=1e-5, rtol=0.0, opset=posenc.onnx.OPSET,
                       compare=None):
    """Exports Calls(fn) with dynamic_shapes (one dict per input, or None), runs ONNX Runtime on the export inputs and
    on every tuple of other_inputs, and compares each output with fn's (assert_close, or compare(actual, expected)).
    Below opset 23, plain torch.onnx.export (posenc.onnx.export refuses it). Returns the ONNX model."""
    dynamic_shapes = None if dynamic is None else (tuple(dynamic),)
    if opset >= posenc.onnx.OPSET:
        program = posenc.onnx.export(Calls(fn), tuple(inputs), opset_version=opset, dynamic_shapes=dynamic_shapes)
    else:
        program = torch.onnx.export(Calls(fn), tuple(inputs), dynamo=True, opset_version=opset, verbose=False,
                                    dynamic_shapes=dynamic_shapes)
    model = program.model_proto
    assert not [n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")], "non-standard ONNX ops"
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    session = onnxruntime.InferenceSession(model.SerializeToString())
    for values in [inputs, *other_inputs]:
        expected = fn(*values)
        feed = {i.name: v.numpy() for i, v in zip(session.get_inputs(), values)}
        actual = session.run(None, feed)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            if compare is None:
                torch.testing.assert_close(torch.from_numpy(a), e, atol=atol, rtol=rtol)
            else:
                compare(torch.from_numpy(a), e)
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


def test_sinusoidal_grids():
    """Multi-axis positions, every grid convention's layout, prefix tokens, an odd width, a 3-D table."""
    grids = {c: posenc.frequencies.grid_sinusoidal(32, c) for c in posenc.frequencies.GRID_CONVENTIONS}

    def fn(x, x_odd, positions, video):
        mae, timm, interleaved, cog = (grids[c] for c in ("mae", "timm", "timm_interleaved", "cogvideox"))
        return (PF.add_sinusoidal(x, positions, mae[0], 1.0, mae[2], 0, mae[1], 1),
                PF.add_sinusoidal(x[:, 1:], positions, timm[0], 2.0, timm[2], 0, timm[1]),
                PF.add_sinusoidal(x, positions, interleaved[0], 1.0, interleaved[2], 0, interleaved[1], 1),
                PF.add_sinusoidal(x_odd, positions, mae[0], 1.0, mae[2], 0, mae[1], 1),
                PF.sinusoidal(video, cog[0], cog[2], None, 0, cog[1]),
                PF.sinusoidal(positions, mae[0], mae[2], torch.float64, 2, mae[1]))

    def inputs(n):
        return (torch.randn(2, 1 + n, 32), torch.randn(2, 1 + n, 33), PF.grid_positions([1, n], scale=[0.7, 1.3]),
                PF.grid_positions([2, 3, n], scale=[1.0, 1.875, 1.875]))

    n = seq("n")
    dims = ({1: n + 1}, {1: n + 1}, {1: n}, {1: 6 * n})
    export_and_compare(fn, inputs(6), dims, [inputs(11), inputs(3)])


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


# Llama 4's attention temperature (beta, length, shift) = (attn_scale, floor_scale, 1) and Ministral 3's
# (llama_4_scaling_beta, original_max_position_embeddings, 0): q times 1 + beta * log(1 + floor((p + shift) / length)).
Q_SCALES = {"llama4": (0.1, 8, 1), "ministral3": (0.25, 16, 0)}


def q_scale_calls(q_scale, norm=None):
    """rope_qk (or qk_norm_rope with norm) with a query scale in every format and position form: positions [B, S]
    (negative ones among them), [S], none with an offset, and packed sequences restarting per sequence."""
    inv_freq = posenc.frequencies.rope(16)[0]
    generator = torch.Generator().manual_seed(2)
    q_weight, k_weight = torch.randn(16, generator=generator), torch.randn(32, generator=generator)
    beta, length, shift = q_scale

    def call(q, k, positions, *args, **kwargs):
        kwargs.update(q_scale_beta=beta, q_scale_length=length, q_scale_shift=shift)
        if norm is None:
            return PF.rope_qk(q, k, positions, inv_freq, *args, **kwargs)
        return PF.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, norm=norm, *args, **kwargs)

    def fn(q, k, positions):
        return (*call(q, k, positions, attention_scale=0.5),
                *call(q.transpose(1, 2), k.transpose(1, 2), None, layout="gptj", format="bhsd", offset=37),
                *call(q.transpose(0, 1), k.transpose(0, 1), positions[0].abs(), format="sbhd"),
                *call(q[0], k[0], None, format="thd", offset=21, cu_seqlens=torch.tensor([0, 2, q.shape[1]])))

    return fn


def q_scale_inputs(b, s):
    positions = torch.randint(-40, 1 << 20, (b, s))
    positions[0, :2] = torch.tensor([-1, -30])  # below -shift: scaled by 1
    return torch.randn(b, s, 4, 16), torch.randn(b, s, 2, 16), positions


@pytest.mark.parametrize("opset", [20, 23])
@pytest.mark.parametrize("model", list(Q_SCALES))
def test_rope_qk_and_qk_norm_rope_scale_q_by_position(model, opset):
    """The query scale computed from the positions in the graph, as the cos/sin tables are: k unscaled, q scaled
    (s(p) from 1 at and below -shift to about 1 + beta * log(2^20 / length)), against the op in float32 at every
    opset: RotaryEmbedding fed q's scaled tables from opset 23, the primitives below it."""
    batch, s = torch.export.Dim("batch", min=2, max=64), seq()
    dims = [{0: batch, 1: s}] * 3
    for norm in (None, "llama"):
        fn, inputs = q_scale_calls(Q_SCALES[model], norm), q_scale_inputs(2, 5)
        scaled, unscaled = fn(*inputs), q_scale_calls((0.0, 1, 0), norm)(*inputs)
        for i, (a, b) in enumerate(zip(scaled, unscaled)):  # q scaled, k not
            assert torch.equal(a, b) == (i % 2 == 1)
        export_and_compare(fn, inputs, dims, [q_scale_inputs(3, 9)], opset=opset)


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


@pytest.mark.parametrize("opset", [20, 23])
def test_plain_torch_onnx_export_finds_the_translations_at_any_opset(opset):
    """No custom_translation_table: import posenc registered the translations with torch.onnx. Below opset 23 the
    rotations are built without RotaryEmbedding, from the same products and sums."""
    partial = posenc.frequencies.rope(8)[0]
    full, scale = posenc.frequencies.rope(16, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 64})
    mrope, mrope_axis = posenc.frequencies.mrope(16, [2, 3, 3])

    def fn(q, k, positions, rows, scores):
        return (PF.rope(q, None, partial, 1.0, "neox", "bshd", 3),
                PF.rope(q, positions, full, scale, "gptj", "bshd", 2),
                *PF.rope_qk(q.transpose(1, 2), k.transpose(1, 2), positions[0], full, scale, "neox", "bhsd"),
                PF.rope(q.transpose(0, 1), positions, partial, 1.0, "gptj", "sbhd"),
                PF.rope(q[0], None, full, 1.0, "gptj", "thd", 1, torch.tensor([0, 2, q.shape[1]])),
                PF.rope(q, rows, mrope, 0.5, "neox", "bshd", 0, None, mrope_axis),
                PF.add_alibi(scores, PF.alibi_slopes(3)))

    def inputs(b, s):
        return (torch.randn(b, s, 3, 16), torch.randn(b, s, 1, 16), torch.randint(0, 1 << 20, (b, s)),
                torch.randint(0, 5000, (3, b, s)), torch.randn(b, 3, s, s))

    batch, s = torch.export.Dim("batch", min=2, max=64), seq()
    program = torch.onnx.export(Calls(fn), inputs(2, 5), dynamo=True, opset_version=opset,
                                dynamic_shapes=(({0: batch, 1: s}, {0: batch, 1: s}, {0: batch, 1: s},
                                                 {1: batch, 2: s}, {0: batch, 2: s, 3: s}),))
    model = program.model_proto
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    assert ("RotaryEmbedding" in op_types(model)) == (opset >= 23)
    session = onnxruntime.InferenceSession(model.SerializeToString())
    for values in (inputs(2, 5), inputs(3, 9)):
        actual = session.run(None, {i.name: v.numpy() for i, v in zip(session.get_inputs(), values)})
        for a, e in zip(actual, fn(*values), strict=True):
            torch.testing.assert_close(torch.from_numpy(a), e, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- QK-norm + rotary

QK_NORMS = ["llama", "gemma", "olmo2", "fused"]


def qk_norm_model(norm):
    """qk_norm_rope in every format, with weights per head ([head_dim]) and over all heads of a token ([heads *
    head_dim], OLMo 2), both at once too; GQA (q: 4 heads, k: 2), partial rotary, gptj, positions [B, S], [S] and
    none, an offset, packed sequences and M-RoPE positions. Inputs (q, k, positions, rows) in bshd."""
    partial = posenc.frequencies.rope(12)[0]                                # 12 of 16 channels rotate
    full, scale = posenc.frequencies.rope(16, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 64})
    mrope, mrope_axis = posenc.frequencies.mrope(16, [2, 3, 3])
    generator = torch.Generator().manual_seed(1)
    head_q, head_k, all_q, all_k = (torch.randn(n, generator=generator) for n in (16, 16, 64, 32))

    def fn(q, k, positions, rows):
        def call(q, k, q_weight, k_weight, positions, *args, **kwargs):
            return PF.qk_norm_rope(q, k, q_weight, k_weight, positions, *args, norm=norm, **kwargs)

        bhsd, sbhd = (q.transpose(1, 2), k.transpose(1, 2)), (q.transpose(0, 1), k.transpose(0, 1))
        return (*call(q, k, head_q, head_k, positions, full, 1e-6, attention_scale=scale, offset=2),
                *call(q, k, all_q, all_k, None, partial, 1e-5, layout="gptj", offset=3),
                *call(*bhsd, all_q, all_k, positions[0], full, format="bhsd"),
                *call(*bhsd, head_q, all_k, None, partial, 1e-3, layout="gptj", format="bhsd", offset=1),
                *call(*sbhd, all_q, head_k, positions, full, attention_scale=scale, format="sbhd"),
                *call(q[0], k[0], all_q, all_k, None, full, format="thd",
                      cu_seqlens=torch.tensor([0, 2, q.shape[1]])),
                *call(q, k, head_q, all_k, rows, mrope, attention_scale=0.5, pair_axis=mrope_axis))

    return fn


def qk_norm_inputs(b, s, dtype=torch.float32):
    return (torch.randn(b, s, 4, 16).mul(3).to(dtype), torch.randn(b, s, 2, 16).to(dtype),
            torch.randint(0, 1 << 20, (b, s)), torch.randint(0, 5000, (3, b, s)))


QK_NORM_DIMS = [{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}, {1: "batch", 2: "seq"}]


def qk_norm_dynamic_shapes():
    batch, s = torch.export.Dim("batch", min=2, max=64), seq()
    return [{axis: {"batch": batch, "seq": s}[name] for axis, name in dims.items()} for dims in QK_NORM_DIMS]


@pytest.mark.parametrize("opset", [20, 23])
@pytest.mark.parametrize("norm", QK_NORMS)
def test_qk_norm_rope_per_head_and_over_heads_weights(norm, opset):
    """float32: RMSNormalization and RotaryEmbedding from opset 23, primitives (ReduceMean, Sqrt, Reciprocal, Mul)
    below it; dynamic batch and sequence."""
    model = export_and_compare(qk_norm_model(norm), qk_norm_inputs(2, 5), qk_norm_dynamic_shapes(),
                               [qk_norm_inputs(3, 9), qk_norm_inputs(2, 2)], opset=opset)
    assert {"RMSNormalization", "RotaryEmbedding"} & op_types(model) == \
        ({"RMSNormalization", "RotaryEmbedding"} if opset >= 23 else set())


def within_one_float16_step_at_few_places(actual, expected):
    """The graph and the op compute the same float32 values but for the order of the mean square's sum: a rounding
    to float16 may land one step apart, at a few places. A convention rounding elsewhere (llama's xhat, or none)
    moves a quarter of the outputs."""
    assert actual.dtype == expected.dtype == torch.float16
    torch.testing.assert_close(actual, expected, atol=2 ** -24, rtol=2 ** -10)
    differ = int((actual != expected).sum())
    assert differ <= expected.numel() // 100, f"{differ} of {expected.numel()} differ"


@pytest.mark.parametrize("opset", [20, 23])
@pytest.mark.parametrize("norm", QK_NORMS)
def test_qk_norm_rope_rounds_float16_where_its_convention_rounds(norm, opset):
    """float16 q and k (float32 weights): llama rounds the normalized value and the scaled one, gemma and olmo2 the
    scaled one, fused only the rotated output."""
    export_and_compare(qk_norm_model(norm), qk_norm_inputs(2, 7, torch.float16), qk_norm_dynamic_shapes(),
                       [qk_norm_inputs(3, 11, torch.float16)], opset=opset,
                       compare=within_one_float16_step_at_few_places)


def test_qk_norm_rotary_module_exports():
    """posenc.nn.QKNormRotaryEmbedding (OLMo 2's weights over all heads, trained values) against ONNX Runtime."""
    module = posenc.nn.QKNormRotaryEmbedding(16, scaling={"rope_type": "linear", "factor": 2.0}, norm="olmo2",
                                             q_norm_dim=64, k_norm_dim=32).eval()
    with torch.no_grad():
        module.q_weight.uniform_(0.5, 2.0)
        module.k_weight.uniform_(0.5, 2.0)
    q, k, positions, _ = qk_norm_inputs(2, 6)
    program = posenc.onnx.export(module, (q, k, positions), dynamic_shapes=({1: seq()}, {1: seq()}, {1: seq()}))
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
    for q, k, positions, _ in (qk_norm_inputs(2, 6), qk_norm_inputs(2, 30)):
        actual = session.run(None, {"q": q.numpy(), "k": k.numpy(), "positions": positions.numpy()})
        for a, e in zip(actual, module(q, k, positions), strict=True):
            torch.testing.assert_close(torch.from_numpy(a), e, atol=1e-5, rtol=0.0)


# ---------------------------------------------------------------- frequencies and positions built in the graph

LENGTH_SCALINGS = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "max_position_embeddings": 1024},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 64 for i in range(64)],
                 "long_factor": [2.0 + i / 16 for i in range(64)], "original_max_position_embeddings": 1024,
                 "max_position_embeddings": 8192},
    "dynamic with alpha (fixed NTK)": {"rope_type": "dynamic", "alpha": 3.0, "max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
@pytest.mark.parametrize("name", list(LENGTH_SCALINGS))
def test_rope_frequencies_for_length_below_at_and_beyond_the_context(name, dtype):
    rope_type, keywords = posenc.frequencies.rope_arguments(LENGTH_SCALINGS[name])

    def fn(length):
        return (torch.ops.posenc.rope_inv_freq_for_length(length, 128, 5e5, rope_type, **keywords),)

    lengths = [(torch.tensor(n, dtype=dtype),) for n in (0, 1, 1000, 1024, 1025, 4096, 10 ** 6, 2 ** 40)]
    # float64 rounding: dynamic NTK's powers are formed in another order than the op's (measured: 16 ulps, mostly
    # the op's own rounding, at L = 2^40); the other types are the op's own constants.
    export_and_compare(fn, lengths[2], other_inputs=lengths, rtol=1e-14 if name == "dynamic" else 0.0, atol=0.0)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_rotary_module_with_per_length_frequencies(name):
    scaling = dict(LENGTH_SCALINGS[name], max_position_embeddings=32, original_max_position_embeddings=32)
    if name == "longrope":
        scaling.update(short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[2.0 + i / 4 for i in range(8)],
                       max_position_embeddings=256)
    rotary = posenc.nn.RotaryEmbedding(16, scaling=scaling)

    def fn(q, k, positions):
        return (*rotary(q, k), *rotary(q, k, positions), *rotary(q, k, None, 20))

    def inputs(s, far):
        return torch.randn(2, s, 3, 16), torch.randn(2, s, 1, 16), torch.randint(0, far, (s,))

    s = seq()
    # lengths below the context (8, 28 from offset 20), beyond it (40, 60) and far beyond (positions up to 10^5)
    export_and_compare(fn, inputs(8, 30), [{1: s}, {1: s}, {0: s}],
                       [inputs(8, 30), inputs(40, 30), inputs(3, 10 ** 5), inputs(5, 33)], atol=1e-6)


def vision_batch(row, pad):
    """Two rows of token types: row then right padding, and left padding then row."""
    token_types = torch.tensor([row + [0] * pad, [0] * pad + row], dtype=torch.int32)
    mask = torch.ones_like(token_types)
    mask[0, len(row):] = 0
    mask[1, :pad] = 0
    return token_types, mask


@pytest.mark.parametrize("case", ["qwen2_vl", "qwen2_5_vl", "qwen2_5_vl float16 seconds", "integer seconds",
                                  "qwen3_vl", "text only"])
def test_mrope_positions(case):
    """Runs of text, images and videos (the grids taken in order over both rows), padding on either side."""
    def inputs(images, videos, pad):
        parts = [[0] * 3]
        for i in range(images):
            parts += [[1] * 6, [0] * (2 + i)]
        for _ in range(videos):
            parts += [([2] * 4 + [0]) * 3 if case == "qwen3_vl" else [2] * 12, [0] * 3]
        token_types, mask = vision_batch([t for part in parts for t in part], pad)
        grids = (torch.tensor([[1, 4, 6]] * 2 * images), torch.tensor([[3, 4, 4], [3, 4, 6]][:1] * 2 * videos))
        seconds = torch.tensor([0.5, 1.0 / 3.0, 2.0, 0.25] * videos)[:2 * videos]
        if case == "integer seconds":
            seconds = torch.tensor([3, 2, 1, 4] * videos)[:2 * videos]
        return token_types, mask, *grids, seconds

    def fn(token_types, mask, image_grid, video_grid, seconds):
        if case == "text only":  # the same rows, every token text
            return PF.mrope_positions(token_types * 0, attention_mask=mask)
        if case.startswith("qwen2_5_vl") or case == "integer seconds":
            if case.endswith("float16 seconds"):
                seconds = seconds.half()
            return PF.mrope_positions(token_types, image_grid, video_grid, mask, 2, 2.5 if case == "qwen2_5_vl" else
                                      1.7 if "float16" in case else 2, seconds)
        return PF.mrope_positions(token_types, image_grid, video_grid, mask, 2, split_video_frames=case == "qwen3_vl")

    b, s, n_images, n_videos = (torch.export.Dim(name, min=2, max=256) for name in ("b", "s", "images", "videos"))
    dims = [{0: b, 1: s}, {0: b, 1: s}, {0: n_images}, {0: n_videos}, {0: n_videos}]
    export_and_compare(fn, inputs(1, 1, 2), dims, [inputs(2, 1, 3), inputs(1, 2, 5), inputs(3, 3, 1)], atol=0)


def test_ops_without_tensor_arguments_export_their_values():
    """Frequencies, ALiBi slopes and position grids computed inside forward: constants of the graph, the op's own
    values (the float attention scale included)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

    def fn(x):
        inv_freq, scale = posenc.frequencies.rope(16, 1e4, yarn)
        return (x * scale, inv_freq, PF.alibi_slopes(6), PF.alibi_slopes(5, torch.float16),
                PF.alibi_slopes(12, torch.float64), posenc.frequencies.sinusoidal(17, shift=1),
                *posenc.frequencies.multiaxis([4, 6], [10.0, 20.0]), *posenc.frequencies.axial(16, 2, 100.0),
                *posenc.frequencies.mrope(16, [2, 3, 3], 1e6, True), posenc.frequencies.mrope_pair_axis([1, 2, 1]),
                PF.image_positions(2, 3), PF.video_positions(2, 2, 3, 2.5), PF.zigzag_positions(16, 2, 1))

    export_and_compare(fn, (torch.randn(3),), atol=0)


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


# ---------------------------------------------------------------- Hugging Face models patched with posenc

def small_hf_model(kind):
    import transformers

    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2))
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4))
    if kind == "bloom":
        return transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=64, n_layer=2,
                                                                      n_head=4))
    # Eager attention: torch 2.13 cannot decompose T5's SDPA path for ONNX, patched or not (a view of a
    # transposed tensor).
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, decoder_start_token_id=0, attn_implementation="eager"))


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids=None):
        decoder = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **decoder).logits


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bloom", "t5"])
def test_patched_hugging_face_models_export_through_torch_onnx_and_transformers(kind):
    """No extra argument: torch.onnx.export(dynamo=True) and transformers' own exporter (the prefill and the decode
    step with a cache of its generation stages) both find posenc's translations (rope_qk, embed_learned,
    alibi_slopes and alibi_bias, t5_bias), and ONNX Runtime gives the unpatched model's logits."""
    import copy

    from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter
    from transformers.exporters.utils import decompose_for_generation

    from posenc.integrations import transformers as posenc_hf

    model = small_hf_model(kind).eval()
    reference = copy.deepcopy(model)
    posenc_hf.patch(model)

    def inputs(b, s):
        tokens = torch.randint(0, 64, (b, s))
        return (tokens, torch.ones_like(tokens)) + ((torch.randint(0, 64, (b, s - 2)),) if kind == "t5" else ())

    batch, s = torch.export.Dim("batch", max=64), torch.export.Dim("seq", min=3, max=512)
    dims = [{0: batch, 1: s}] * 2 + ([{0: batch, 1: torch.export.Dim("decoder_seq", max=512)}] if kind == "t5" else [])
    program = torch.onnx.export(Logits(model), inputs(2, 9), dynamo=True, dynamic_shapes=tuple(dims))
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
    for values in (inputs(2, 9), inputs(3, 17)):
        (actual,) = session.run(None, {i.name: v.numpy() for i, v in zip(session.get_inputs(), values)})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(actual), Logits(reference)(*values), atol=1e-5, rtol=0)

    tokens = torch.randint(0, 64, (2, 9))
    stages = decompose_for_generation(model, {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)})
    for stage, (submodel, stage_inputs) in stages.items():
        exported = OnnxExporter().export(submodel, copy.deepcopy(stage_inputs), OnnxConfig(dynamic=True))
        with torch.no_grad():
            expected = reference(**copy.deepcopy(stage_inputs)).logits
        torch.testing.assert_close(exported(**copy.deepcopy(stage_inputs)).logits, expected, atol=1e-5, rtol=0,
                                   msg=lambda m: f"{stage}: {m}")


# ---------------------------------------------------------------- the API, its errors, the documentation

def ops_in_exported_graphs():
    """The posenc ops a forward pass can leave in an exported graph (op_registry.py): the forward and configuration
    ops that return a tensor (not backward ops: ONNX graphs here are inference graphs; nor in-place ones), except
    those torch.export cannot trace (tensor arguments but no Meta kernel: output sizes that follow the input's
    values)."""
    return [op.name for op in op_registry.all_ops()
            if op.kind in ("forward", "configuration") and op.returns_tensors
            and (not op.takes_tensors or torch._C._dispatch_has_kernel_for_dispatch_key(f"posenc::{op.name}", "Meta"))]


def test_every_op_of_an_exported_graph_has_a_translation():
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    expected = ops_in_exported_graphs()
    assert {"rope_qk", "qk_norm_rope", "rope_inv_freq_for_length", "mrope_positions", "alibi_slopes"} <= set(expected)
    assert sorted(op.name() for op in posenc.onnx.translation_table()) == [f"posenc::{n}" for n in expected]
    # torch.onnx's own table holds them too, so that no export needs a custom_translation_table.
    for opset in (18, 20, 23):
        registry = ONNXRegistry.from_torchlib(opset)
        assert [n for n in expected if not registry.is_registered(getattr(torch.ops.posenc, n).default)] == []


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
