"""ONNX export of models that call posenc ops (``torch.onnx.export(..., dynamo=True)``).

ONNX has no posenc ops, so each forward op is translated into standard ONNX operators. ``import posenc`` adds the
translations to torch.onnx's own table once its exporter loads, so every ``torch.onnx.export(..., dynamo=True)``
finds them, at any opset, and so do exporters built on it (transformers'); with opset 23 (RotaryEmbedding's):

    import posenc.onnx
    onnx_program = posenc.onnx.export(model, (tokens,), dynamic_shapes=({1: "seq"},))
    # or, with torch.onnx.export's own arguments:
    torch.onnx.export(model, (tokens,), dynamo=True, opset_version=23,
                      custom_translation_table=posenc.onnx.translation_table())

The translations reproduce the ops' maths: angles = (positions + offset) * inv_freq in float64, sin and cos in
float64, then the data's maths type (float32 for float16/bfloat16/float32 data, float64 for float64 data) and one
rounding to the output dtype. From opset 23, ``rope``, ``rope_qk`` and ``qk_norm_rope`` use ONNX's
``RotaryEmbedding``, fed with per-token cos/sin tables (multi-axis calls gather each pair's position with
``pair_axis`` first); below it, and for ``rope_cos_sin`` (whose tables may hold any values, while
``RotaryEmbedding`` reads half tables and assumes they repeat), the same products and sums are built from
primitives; the query scale of ``rope_qk`` and ``qk_norm_rope`` (``q_scale_*``) multiplies q's tables by
1 + beta * log(1 + max(floor((p + shift) / length), 0)), computed in float64 from the same positions (the op folds
it into q's coefficients the same way). ``qk_norm_rope`` normalizes q and k first, with opset 23's ``RMSNormalization`` (below it, and for
float64 data, from ReduceMean, Sqrt, Reciprocal and Mul), rounding where its ``norm`` convention rounds. T5 buckets
are read from a table of ``max_distance + 1`` entries computed at export time by posenc's own op, so bucket edges
match exactly. The ops without a tensor argument (frequencies, ALiBi slopes, position grids) become constants that
the op itself computes at export time; ``rope_inv_freq_for_length`` switches to (LongRoPE) or computes (dynamic
NTK) its frequencies in float64 from the length in the graph; ``mrope_positions`` walks Qwen2-VL's runs of tokens
with sorts and sums; ``resample_learned`` and ``add_resampled_learned`` use ``Resize`` (opset 18, with antialias),
or two MatMuls by constant per-axis weights where Resize cannot say ATen's interpolation. Sequence lengths, batch
sizes and positions stay dynamic; head counts and channel widths are
fixed at export. The ops' argument checks (position ranges, shapes) are not repeated in the graph: ONNX Runtime
reports an out-of-range index in its own words.

Backward ops and the in-place ``rope_`` / ``qk_norm_rope_`` / ``add_alibi_`` / ``rope_qk_cache_`` have no translation (export graphs
are functional inference graphs; use ``rope`` / ``qk_norm_rope`` / ``add_alibi``), nor has
``zigzag_positions_varlen``, whose output sizes follow its input's values: torch.export cannot trace it.
"""
from fractions import Fraction
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from onnxscript import ir
# Nodes of opset 18, that of torch.onnx's own translations: its exporter converts a graph up to the export's
# opset, never down. RotaryEmbedding is opset 23's.
from onnxscript import opset18 as op
from onnxscript import opset23

__all__ = ["OPSET", "translation_table", "export"]

OPSET = 23  # RotaryEmbedding's first opset

_FLOAT, _DOUBLE, _INT64 = ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.INT64


# ---------------------------------------------------------------- helpers

def _maths_type(dtype: ir.DataType) -> ir.DataType:
    return _DOUBLE if dtype == _DOUBLE else _FLOAT


def _to(x, dtype: ir.DataType):
    return x if x.dtype == dtype else op.Cast(x, to=dtype)


def _double(value: float):
    return op.Constant(value=ir.tensor(float(value), dtype=_DOUBLE))


def _int64(value):
    """A SymInt argument: a Python int when the size is static, an int64 scalar value when it is dynamic."""
    return op.Constant(value_int=value) if isinstance(value, int) else _to(value, _INT64)


def _size(x, axis: int):
    """x.shape[axis] as an int64 scalar (dynamic or not)."""
    return op.Gather(op.Shape(x), op.Constant(value_int=axis), axis=0)


def _static(x, axis: int, op_name: str, what: str) -> int:
    size = x.shape[axis]
    if not isinstance(size, int):
        raise ValueError(f"posenc.onnx: {op_name} needs a fixed {what} to export, got the dynamic size {size}")
    return size


def _arange(length, start=0):
    """int64 [start, start + length)."""
    start = _int64(start)
    return op.Range(start, op.Add(start, length), op.Constant(value_int=1))


def _positions(positions, length, offset: int, dtype: ir.DataType):
    """positions + offset, or offset + arange(length) without positions, as dtype (int64 or float64)."""
    if positions is None:
        return _to(_arange(length, offset), dtype)
    values = _to(positions, dtype)
    if offset == 0:
        return values
    constant = _double(offset) if dtype == _DOUBLE else op.Constant(value_int=offset)
    return op.Add(values, constant)


def _angles(positions_f64, inv_freq):
    """float64 angles [..., F] = positions [...] * inv_freq [F]."""
    return op.Mul(op.Unsqueeze(positions_f64, op.Constant(value_ints=[-1])), _to(inv_freq, _DOUBLE))


def _last_dim(x, start: int, end: int):
    """x[..., start:end]."""
    return op.Slice(x, op.Constant(value_ints=[start]), op.Constant(value_ints=[end]), op.Constant(value_ints=[-1]))


def _rank(x) -> int:
    return len(x.shape)


# ---------------------------------------------------------------- sinusoidal

def _half_per_axis_order(pair_axis, pairs: int):
    """The channel order of "half_per_axis" as Gather indices [2F] into Concat(sin, cos): pair i of the run
    [first, end) of pairs on one axis puts its sine at channel first + i and its cosine at end + i. Built from
    pair_axis over a [F, F] table (a graph constant where pair_axis is one: ONNX Runtime folds it)."""
    axis = _to(pair_axis, _INT64)
    index = _arange(op.Constant(value_int=pairs))
    differs = op.Not(op.Equal(_last_dim(axis, 1, pairs), _last_dim(axis, 0, pairs - 1)))
    true = op.Constant(value=ir.tensor([True]))
    starts, ends = op.Concat(true, differs, axis=0), op.Concat(differs, true, axis=0)
    rows, cols = op.Unsqueeze(index, op.Constant(value_ints=[1])), op.Unsqueeze(index, op.Constant(value_ints=[0]))
    # first(i) = the largest run start j <= i; end(i) = 1 + the smallest run end j >= i
    first = op.ReduceMax(op.Where(op.And(op.LessOrEqual(cols, rows), starts), cols, op.Constant(value_int=0)),
                         op.Constant(value_ints=[1]), keepdims=0)
    one = op.Constant(value_int=1)
    end = op.ReduceMin(op.Where(op.And(op.GreaterOrEqual(cols, rows), ends), op.Add(cols, one),
                                op.Constant(value_int=pairs)), op.Constant(value_ints=[1]), keepdims=0)
    target = op.Concat(op.Add(first, index), op.Add(end, index), axis=0)  # the channel of Concat(sin, cos)[k]
    channels = _arange(op.Constant(value_int=2 * pairs))
    return op.ScatterElements(channels, target, channels, axis=0)  # its inverse: the source of each channel


def _encoding(angles, layout: str, op_name: str, pair_axis=None, pairs: int = 0):
    """The sinusoidal encoding [..., 2F] of float64 angles [..., F] in one of the four layouts."""
    sin, cos = op.Sin(angles), op.Cos(angles)
    if layout == "interleaved":  # sin t0, cos t0, sin t1, ...
        pairs = op.Concat(op.Unsqueeze(sin, op.Constant(value_ints=[-1])),
                          op.Unsqueeze(cos, op.Constant(value_ints=[-1])), axis=-1)
        shape = op.Concat(op.Shape(angles, start=0, end=-1), op.Constant(value_ints=[-1]), axis=0)
        return op.Reshape(pairs, shape)
    if layout == "half" or (layout == "half_per_axis" and pair_axis is None):
        return op.Concat(sin, cos, axis=-1)
    if layout == "half_cos_first":
        return op.Concat(cos, sin, axis=-1)
    if layout == "half_per_axis":
        return op.Gather(op.Concat(sin, cos, axis=-1), _half_per_axis_order(pair_axis, pairs), axis=-1)
    raise ValueError(f'posenc.onnx: {op_name}: layout must be "interleaved", "half", "half_cos_first" or '
                     f'"half_per_axis", got "{layout}"')


def _sinusoidal_angles(positions, length, inv_freq, offset: int, pair_axis):
    """float64 angles [..., F]: one axis, or each pair by the position of its axis (positions [n_axes, ...])."""
    if pair_axis is None:
        return _angles(_positions(positions, length, offset, _DOUBLE), inv_freq)
    if positions is None:
        raise ValueError("posenc.onnx: add_sinusoidal: pair_axis needs positions [n_axes, ...]")
    return _axis_angles(positions, inv_freq, offset, pair_axis)


def _add_encoding(x, width: int, positions, inv_freq, scale: float, layout: str, offset: int, op_name: str,
                  pair_axis=None, num_prefix_tokens: int = 0):
    """x * scale + PE for x [..., S, D], D = width = 2F or 2F + 1 (the odd channel gets no encoding); the first
    num_prefix_tokens tokens get -0.0, which leaves them as they are."""
    frequencies = _static(inv_freq, 0, op_name, "inv_freq length")
    length = _size(x, -2)
    if num_prefix_tokens:
        length = op.Sub(length, op.Constant(value_int=num_prefix_tokens))
    angles = _sinusoidal_angles(positions, length, inv_freq, offset, pair_axis)
    maths = _maths_type(x.dtype)
    pe = _to(_encoding(angles, layout, op_name, pair_axis, frequencies), maths)
    # [S, 2F] or positions' shape (less its axis dimension) + [2F]
    rank = 2 if positions is None else _rank(positions) + (0 if pair_axis is not None else 1)
    if width == 2 * frequencies + 1 or num_prefix_tokens:
        pads = [0] * (2 * rank)
        pads[-1] = 1 if width == 2 * frequencies + 1 else 0
        pads[rank - 2] = num_prefix_tokens
        pe = op.Pad(pe, op.Constant(value_ints=pads), op.CastLike(_double(-0.0), pe))
    data = _to(x, maths)
    if scale != 1.0:
        data = op.Mul(data, op.CastLike(_double(scale), data))
    return _to(op.Add(data, pe), x.dtype)


def sinusoidal(positions, inv_freq, layout: str = "interleaved", dtype: Optional[int] = None, offset: int = 0,
               pair_axis=None):
    if dtype is None:
        dtype = positions.dtype if positions.dtype in (_FLOAT, _DOUBLE, ir.DataType.FLOAT16,
                                                       ir.DataType.BFLOAT16) else _FLOAT
    frequencies = _static(inv_freq, 0, "sinusoidal", "inv_freq length")
    angles = _sinusoidal_angles(positions, None, inv_freq, offset, pair_axis)
    pe = _encoding(angles, layout, "sinusoidal", pair_axis, frequencies)
    return _to(_to(pe, _maths_type(dtype)), dtype)


def add_sinusoidal(x, positions, inv_freq, x_scale: float = 1.0, layout: str = "interleaved", offset: int = 0,
                   pair_axis=None, num_prefix_tokens: int = 0):
    width = _static(x, -1, "add_sinusoidal", "channel count")
    return _add_encoding(x, width, positions, inv_freq, x_scale, layout, offset, "add_sinusoidal", pair_axis,
                         num_prefix_tokens)


def embed_sinusoidal(tokens, token_weight, positions, inv_freq, token_scale: float = 1.0,
                     padding_idx: Optional[int] = None, layout: str = "interleaved", offset: int = 0):
    width = _static(token_weight, -1, "embed_sinusoidal", "channel count")
    rows = op.Gather(token_weight, _to(tokens, _INT64), axis=0)
    return _add_encoding(rows, width, positions, inv_freq, token_scale, layout, offset, "embed_sinusoidal")


# ---------------------------------------------------------------- learned absolute

def _rows(weight, positions, length, offset: int):
    return op.Gather(weight, _positions(positions, length, offset, _INT64), axis=0)


def learned(weight, positions, offset: int = 0, padding_idx: Optional[int] = None):
    return _rows(weight, positions, None, offset)


def add_learned(x, weight, positions=None, offset: int = 0, padding_idx: Optional[int] = None):
    maths = _maths_type(x.dtype)
    table = _to(_rows(weight, positions, _size(x, -2), offset), maths)
    return _to(op.Add(_to(x, maths), table), x.dtype)


def embed_learned(tokens, token_weight, pos_weight, positions=None, token_scale: float = 1.0,
                  padding_idx: Optional[int] = None, offset: int = 0, pos_padding_idx: Optional[int] = None):
    maths = _maths_type(token_weight.dtype)
    token_rows = _to(op.Gather(token_weight, _to(tokens, _INT64), axis=0), maths)
    if token_scale != 1.0:
        token_rows = op.Mul(token_rows, op.CastLike(_double(token_scale), token_rows))
    position_rows = _to(_rows(pos_weight, positions, _size(tokens, -1), offset), maths)
    return _to(op.Add(token_rows, position_rows), token_weight.dtype)


def _axis_weights(size_in: int, size_out: int, mode: str, align_corners: bool, antialias: bool,
                  scale: Optional[float], dtype: torch.dtype):
    """An axis's interpolation weights [size_out, size_in] as a constant, computed by the op itself at export time
    (resampling an identity table) in float64, then rounded to the maths type."""
    eye = torch.eye(size_in, dtype=torch.float64)
    weights = torch.ops.posenc.resample_learned(eye, [size_in, 1], [size_out, 1], mode, align_corners, antialias,
                                                None if scale is None else [scale, 1.0], 0)
    return op.Constant(value=ir.tensor(weights.to(dtype).numpy()))


def _resampled_table(weight, source_grid, grid, mode: str, align_corners: bool, antialias: bool, scale_factor,
                     num_prefix_tokens: int, op_name: str):
    """weight's grid rows resampled by ONNX's Resize on [1, D, Hs, Ws] (cubic_coeff_a -0.75, or antialias's -0.5
    with its filter widened by the downscale and normalized; coordinates half_pixel, align_corners, or the scale's
    with ``scales`` from scale_factor), the prefix rows in front; in float32 (float64 for float64 weights). What
    Resize cannot say, two MatMuls by the axes' weights (constants the op computes at export time): ATen's
    antialiased align_corners (a filter centred at scale * (o + 0.5) with scale (n - 1) / (m - 1)), a
    scale_factor whose floor(source_grid * scale) is not grid (Resize's output size follows its scales), and what
    ONNX Runtime's Resize refuses: a bicubic shrink without antialias, float64."""
    if mode not in ("bicubic", "bilinear"):
        raise ValueError(f'posenc.onnx: {op_name}: mode must be "bicubic" or "bilinear", got "{mode}"')
    (hs, ws), (h, w) = source_grid, grid
    prefix = num_prefix_tokens
    width = _static(weight, 1, op_name, "channel count")
    maths = _maths_type(weight.dtype)
    table = op.Slice(weight, op.Constant(value_ints=[prefix]), op.Constant(value_ints=[prefix + hs * ws]),
                     op.Constant(value_ints=[0]))
    image = op.Transpose(op.Reshape(_to(table, maths), op.Constant(value_ints=[1, hs, ws, width])), perm=[0, 3, 1, 2])
    scales_fit = scale_factor is None or [int(hs * scale_factor[0]), int(ws * scale_factor[1])] == [h, w]
    # ONNX Runtime refuses Resize's cubic mode that shrinks an axis without antialias, and float64 data
    runtime_refuses = (mode == "bicubic" and not antialias and (h < hs or w < ws)) or maths == _DOUBLE
    if (antialias and align_corners) or not (scales_fit or align_corners) or runtime_refuses:
        dtype = torch.float64 if maths == _DOUBLE else torch.float32
        sh, sw = (None, None) if scale_factor is None or align_corners else scale_factor
        rows = _axis_weights(hs, h, mode, align_corners, antialias, sh, dtype)  # [H, Hs]
        cols = _axis_weights(ws, w, mode, align_corners, antialias, sw, dtype)  # [W, Ws]
        resized = op.MatMul(op.MatMul(rows, image), op.Transpose(cols, perm=[1, 0]))  # [1, D, H, W]
    else:
        attributes = dict(mode="cubic" if mode == "bicubic" else "linear",
                          cubic_coeff_a=-0.5 if antialias else -0.75, antialias=int(antialias),
                          exclude_outside=int(antialias),
                          coordinate_transformation_mode="align_corners" if align_corners else "half_pixel")
        if scale_factor is not None and not align_corners:
            scales = op.Constant(value_floats=[1.0, 1.0, float(scale_factor[0]), float(scale_factor[1])])
            resized = op.Resize(image, None, scales, **attributes)
        else:
            resized = op.Resize(image, None, None, op.Constant(value_ints=[1, width, h, w]), **attributes)
    rows = op.Reshape(op.Transpose(resized, perm=[0, 2, 3, 1]), op.Constant(value_ints=[h * w, width]))
    if prefix == 0:
        return rows
    prefix_rows = op.Slice(weight, op.Constant(value_ints=[0]), op.Constant(value_ints=[prefix]),
                           op.Constant(value_ints=[0]))
    return op.Concat(_to(prefix_rows, maths), rows, axis=0)


def resample_learned(weight, source_grid: Sequence[int], grid: Sequence[int], mode: str = "bicubic",
                     align_corners: bool = False, antialias: bool = False,
                     scale_factor: Optional[Sequence[float]] = None, num_prefix_tokens: int = 0):
    table = _resampled_table(weight, source_grid, grid, mode, align_corners, antialias, scale_factor,
                             num_prefix_tokens, "resample_learned")
    return _to(table, weight.dtype)


def add_resampled_learned(x, weight, source_grid: Sequence[int], grid: Sequence[int], mode: str = "bicubic",
                          align_corners: bool = False, antialias: bool = False,
                          scale_factor: Optional[Sequence[float]] = None, num_prefix_tokens: int = 0):
    maths = _maths_type(x.dtype)
    table = _resampled_table(weight, source_grid, grid, mode, align_corners, antialias, scale_factor,
                             num_prefix_tokens, "add_resampled_learned")
    rounded = _to(_to(table, weight.dtype), maths)  # the table rounded to weight's dtype, as the op rounds it
    return _to(op.Add(_to(x, maths), rounded), x.dtype)


def make_positions(tokens, padding_idx: int):
    # fairseq: padding keeps padding_idx, real tokens count padding_idx + 1, padding_idx + 2, ...
    real = op.Cast(op.Not(op.Equal(_to(tokens, _INT64), op.Constant(value_int=padding_idx))), to=_INT64)
    counts = op.CumSum(real, op.Constant(value_int=-1))
    return op.Add(op.Mul(counts, real), op.Constant(value_int=padding_idx))


def positions_from_mask(attention_mask, pad_position: int = 0):
    real = op.Not(op.Equal(attention_mask, op.CastLike(op.Constant(value_int=0), attention_mask)))
    counts = op.CumSum(op.Cast(real, to=_INT64), op.Constant(value_int=-1))
    return op.Where(real, op.Sub(counts, op.Constant(value_int=1)), op.Constant(value_int=pad_position))


# ---------------------------------------------------------------- rotary

_ROPE_FORMATS = ("bshd", "bhsd", "sbhd", "thd")
_SEQ_AXIS = {"bshd": 1, "bhsd": 2, "sbhd": 0}
_BATCH_AXIS = {"bshd": 0, "bhsd": 0, "sbhd": 1}


def _check_rope(op_name: str, layout: str, format: str) -> None:
    if layout not in ("neox", "gptj"):
        raise ValueError(f'posenc.onnx: {op_name}: layout must be "neox" or "gptj", got "{layout}"')
    if format not in _ROPE_FORMATS:
        raise ValueError(f'posenc.onnx: {op_name}: format must be one of {_ROPE_FORMATS}, got "{format}"')


def _packed_positions(cu_seqlens, tokens, offset: int):
    """Positions of a packed batch without explicit positions: t - start of t's sequence, plus offset."""
    t = _arange(tokens)
    starts = _last_dim(_to(cu_seqlens, _INT64), 0, -1)
    # The last start at or before t: starts never decrease and the first is 0.
    inside = op.LessOrEqual(op.Unsqueeze(starts, op.Constant(value_ints=[0])),
                            op.Unsqueeze(t, op.Constant(value_ints=[1])))
    start = op.ReduceMax(op.Where(inside, op.Unsqueeze(starts, op.Constant(value_ints=[0])),
                                  op.Constant(value_int=0)), op.Constant(value_ints=[1]), keepdims=0)
    return op.Add(op.Sub(t, start), op.Constant(value_int=offset))


def _axis_angles(positions, inv_freq, offset: int, pair_axis):
    """Multi-axis angles [(B,) S, F]: pair i by (positions[pair_axis[i], ...] + offset) * inv_freq[i], positions
    [n_axes, S], [n_axes, B, S] or [n_axes, T]."""
    per_pair = op.Gather(_positions(positions, None, offset, _DOUBLE), _to(pair_axis, _INT64), axis=0)
    perm = list(range(1, _rank(positions))) + [0]  # the pair dimension last
    return op.Mul(op.Transpose(per_pair, perm=perm), _to(inv_freq, _DOUBLE))


def _rope_tables(x, positions, inv_freq, attention_scale: float, format: str, offset: int, cu_seqlens,
                 pair_axis=None):
    """cos and sin of every token's angles (times attention_scale) in x's maths type: [S, F], [B, S, F] for per-row
    positions, [T, F] for thd."""
    angles = _angles(_token_positions(x, positions, format, offset, cu_seqlens), inv_freq) if pair_axis is None \
        else _axis_angles(positions, inv_freq, offset, pair_axis)
    maths = _maths_type(x.dtype)
    tables = []
    for table in (op.Cos(angles), op.Sin(angles)):
        if attention_scale != 1.0:
            table = op.Mul(table, _double(attention_scale))
        tables.append(_to(table, maths))
    return tables


def _rotary_embedding(x, cos, sin, rotary_dim: int, layout: str, format: str, op_name: str, data=None):
    """RotaryEmbedding (opset 23) on x in its format, with tables [B, S, F] ([1, T, F] for thd): bhsd is its 4-D
    input; bshd/thd/sbhd become [B, S, H * D]. ``data``: what to rotate in place of x, x's shape in x's maths type
    (qk_norm_rope's normalized q and k); the result has x's dtype."""
    maths = _maths_type(x.dtype)
    heads = _static(x, -2 if format != "bhsd" else 1, op_name, "head count")
    head_dim = _static(x, -1, op_name, "head_dim")
    attributes = dict(interleaved=int(layout == "gptj"),
                      rotary_embedding_dim=rotary_dim if rotary_dim < head_dim else 0)  # 0: every channel
    batch = op.Constant(value_ints=[1]) if format == "thd" else \
        op.Shape(x, start=_BATCH_AXIS[format], end=_BATCH_AXIS[format] + 1)
    cos, sin = (op.Expand(t, op.Concat(batch, op.Shape(t, start=-2), axis=0)) for t in (cos, sin))
    data = _to(x, maths) if data is None else data
    if format == "bhsd":
        return _to(opset23.RotaryEmbedding(data, cos, sin, **attributes), x.dtype)
    if format == "sbhd":
        data = op.Transpose(data, perm=[1, 0, 2, 3])
    elif format == "thd":
        data = op.Unsqueeze(data, op.Constant(value_ints=[0]))
    rows = op.Reshape(data, op.Concat(op.Shape(data, start=0, end=2), op.Constant(value_ints=[heads * head_dim]),
                                      axis=0))
    out = op.Reshape(opset23.RotaryEmbedding(rows, cos, sin, num_heads=heads, **attributes), op.Shape(data))
    if format == "sbhd":
        out = op.Transpose(out, perm=[1, 0, 2, 3])
    elif format == "thd":
        out = op.Squeeze(out, op.Constant(value_ints=[0]))
    return _to(out, x.dtype)


def _full_width(table, layout: str):
    """A table [..., F] of the pairs' values spread over the 2F channels they rotate."""
    if layout == "neox":
        return op.Concat(table, table, axis=-1)
    pairs = op.Unsqueeze(table, op.Constant(value_ints=[-1]))
    return op.Reshape(op.Concat(pairs, pairs, axis=-1),
                      op.Concat(op.Shape(table, start=0, end=-1), op.Constant(value_ints=[-1]), axis=0))


def _token_positions(x, positions, format: str, offset: int, cu_seqlens):
    """Every token's position (positions + offset, offset + arange, or restarting per sequence of a packed batch)
    in float64: [S], [B, S] for per-row positions, [T] for thd."""
    if format == "thd":
        length = _size(x, 0)
        if positions is None and cu_seqlens is not None:
            return _to(_packed_positions(cu_seqlens, length, offset), _DOUBLE)
        return _positions(positions, length, offset, _DOUBLE)
    return _positions(positions, _size(x, _SEQ_AXIS[format]), offset, _DOUBLE)


def _check_q_scale(name: str, beta: float, length: int, rotary_dim: int, head_dim: int, pair_axis) -> None:
    """The op's checks of the query scale, repeated at export time (they read no tensor values)."""
    if not torch.isfinite(torch.tensor(float(beta), dtype=torch.float64)):
        raise ValueError(f"posenc.onnx: {name}: q_scale_beta must be finite, got {beta}")
    if length < 1:
        raise ValueError(f"posenc.onnx: {name}: q_scale_length must be >= 1, got {length}")
    if beta != 0.0 and rotary_dim < head_dim:
        raise ValueError(f"posenc.onnx: {name}: q_scale_beta needs q's heads fully rotated, but rotary_dim "
                         f"{rotary_dim} < head_dim {head_dim}")
    if beta != 0.0 and pair_axis is not None:
        raise ValueError(f"posenc.onnx: {name}: q_scale_beta takes one position per token; with pair_axis, scale q "
                         f"apart")


def _q_scaled(tables, positions_f64, beta: float, length: int, shift: int):
    """q's tables: each token's row times s(p) = 1 + beta * log(1 + max(floor((p + shift) / length), 0)), s computed
    in float64 and multiplied in the tables' maths type, as the op folds it into q's coefficients."""
    steps = op.Floor(op.Div(op.Add(positions_f64, _double(shift)), _double(length)))
    steps = op.Max(steps, _double(0.0))  # a position below -shift is scaled by 1
    factor = op.Add(_double(1.0), op.Mul(_double(beta), op.Log(op.Add(steps, _double(1.0)))))
    factor = op.Unsqueeze(factor, op.Constant(value_ints=[-1]))  # [..., 1] against the tables' [..., F]
    return [op.Mul(table, op.CastLike(factor, table)) for table in tables]


def _rope(name: str, tensors: Sequence[Any], positions, inv_freq, attention_scale: float, layout: str, format: str,
          offset: int, cu_seqlens, pair_axis, opset: int, data: Optional[Sequence[Any]] = None,
          q_scale: Tuple[float, int, int] = (0.0, 1, 0)):
    """The tensors rotated, each rounded once to its dtype; ``data``: the values to rotate in place of the tensors,
    of their shapes in their maths type (qk_norm_rope's normalized q and k). ``q_scale``: (beta, length, shift) of
    the first tensor's (q's) scale by position."""
    _check_rope(name, layout, format)
    data = [None] * len(tensors) if data is None else data
    rotary_dim = 2 * _static(inv_freq, 0, name, "inv_freq length")
    if pair_axis is not None and positions is None:
        raise ValueError(f"posenc.onnx: {name}: pair_axis needs positions [n_axes, ...]")
    beta, length, shift = q_scale
    _check_q_scale(name, beta, length, rotary_dim, _static(tensors[0], -1, name, "head_dim"), pair_axis)
    cos, sin = _rope_tables(tensors[0], positions, inv_freq, attention_scale, format, offset, cu_seqlens, pair_axis)
    tables = [(cos, sin)] * len(tensors)
    if beta != 0.0:
        token_positions = _token_positions(tensors[0], positions, format, offset, cu_seqlens)
        tables[0] = tuple(_q_scaled([cos, sin], token_positions, beta, length, shift))
    if opset >= OPSET:
        return tuple(_rotary_embedding(x, c, s, rotary_dim, layout, format, name, d)
                     for x, (c, s), d in zip(tensors, tables, data))
    # Before RotaryEmbedding: the products and sums it computes, in the same maths type.
    per_row = format != "thd" and positions is not None and _rank(positions) == (2 if pair_axis is None else 3)
    return tuple(_rotate_by_tables(x, _full_width(c, layout), _full_width(s, layout), rotary_dim, per_row, layout,
                                   format, name, d)
                 for x, (c, s), d in zip(tensors, tables, data))


def _rope_for_opset(opset: int):
    def rope(x, positions, inv_freq, attention_scale: float = 1.0, layout: str = "neox", format: str = "bshd",
             offset: int = 0, cu_seqlens=None, pair_axis=None):
        return _rope("rope", [x], positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                     pair_axis, opset)[0]

    def rope_qk(q, k, positions, inv_freq, attention_scale: float = 1.0, layout: str = "neox", format: str = "bshd",
                offset: int = 0, cu_seqlens=None, pair_axis=None, q_scale_beta: float = 0.0, q_scale_length: int = 1,
                q_scale_shift: int = 0):
        return _rope("rope_qk", [q, k], positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                     pair_axis, opset, q_scale=(q_scale_beta, q_scale_length, q_scale_shift))

    def qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps: float = 1e-06, norm: str = "llama",
                     attention_scale: float = 1.0, layout: str = "neox", format: str = "bshd", offset: int = 0,
                     cu_seqlens=None, pair_axis=None, q_scale_beta: float = 0.0, q_scale_length: int = 1,
                     q_scale_shift: int = 0):
        _check_rope("qk_norm_rope", layout, format)
        if norm not in _QK_NORMS:
            raise ValueError(f'posenc.onnx: qk_norm_rope: norm must be one of {_QK_NORMS}, got "{norm}"')
        normalized = [_rms_norm(x, weight, eps, norm, format, opset, name)
                      for x, weight, name in ((q, q_weight, "q_weight"), (k, k_weight, "k_weight"))]
        return _rope("qk_norm_rope", [q, k], positions, inv_freq, attention_scale, layout, format, offset,
                     cu_seqlens, pair_axis, opset, normalized, (q_scale_beta, q_scale_length, q_scale_shift))

    return rope, rope_qk, qk_norm_rope


# ---------------------------------------------------------------- QK-norm + RoPE

_QK_NORMS = ("llama", "gemma", "olmo2", "fused")


def _rms_norm(x, weight, eps: float, norm: str, format: str, opset: int, weight_name: str):
    """qk_norm_rope's norm of x (q or k) in x's maths type, rounded as the convention rounds it before the rotation:
    xhat = x / sqrt(mean(x^2) + eps) over each head (a [head_dim] weight) or over all heads of a token (a
    [heads * head_dim] weight), then w * xhat; "llama" rounds xhat to x's dtype and w * xhat again, "gemma" (w + 1)
    and "olmo2" round w * xhat once, "fused" not at all. From opset 23 ONNX's RMSNormalization; below it, and for
    float64 data (RMSNormalization's epsilon is a float32 attribute), the same sums and products from primitives
    (ReduceMean, Sqrt, Reciprocal, Mul): r = 1 / sqrt(mean + eps) multiplies x, as in the op."""
    maths = _maths_type(x.dtype)
    head_dim = _static(x, -1, "qk_norm_rope", "head_dim")
    width = _static(weight, 0, "qk_norm_rope", f"{weight_name} length")
    over_heads = width != head_dim  # the op checked width == heads * head_dim
    w = _to(weight, maths)
    if norm == "gemma":
        w = op.Add(w, op.CastLike(_double(1.0), w))  # 1 + w in the maths type, as Gemma adds it
    data = _to(x, maths)
    if over_heads:
        w = op.Reshape(w, op.Constant(value_ints=[width // head_dim, head_dim]))
        if format == "bhsd":  # the heads of a token next to each other: [B, S, H, D]
            data = op.Transpose(data, perm=[0, 2, 1, 3])
    # llama multiplies by its weight after rounding xhat; the others inside the norm.
    if opset >= OPSET and maths == _FLOAT:
        shape = [width // head_dim, head_dim] if over_heads else [head_dim]
        scale = op.Constant(value=ir.tensor(torch.ones(shape))) if norm == "llama" else w
        y = opset23.RMSNormalization(data, scale, axis=-2 if over_heads else -1, epsilon=float(eps))
    else:
        squares = op.ReduceMean(op.Mul(data, data), op.Constant(value_ints=[-2, -1] if over_heads else [-1]),
                                keepdims=1)
        r = op.Reciprocal(op.Sqrt(op.Add(squares, op.Constant(value=ir.tensor(float(eps), dtype=maths)))))
        y = op.Mul(data, r)
        if norm != "llama":
            y = op.Mul(y, w)
    if norm == "llama":
        y = op.Mul(_to(_to(y, x.dtype), maths), w)
    if norm != "fused":
        y = _to(_to(y, x.dtype), maths)
    if over_heads and format == "bhsd":
        y = op.Transpose(y, perm=[0, 2, 1, 3])
    return y


rope, rope_qk, qk_norm_rope = _rope_for_opset(OPSET)


def rope_cos_sin(x, cos, sin, layout: str = "neox", format: str = "bshd"):
    """x * cos + rotate(x) * sin over the first r = cos.shape[-1] channels, channel by channel."""
    _check_rope("rope_cos_sin", layout, format)
    rotary_dim = _static(cos, -1, "rope_cos_sin", "table width")
    return _rotate_by_tables(x, cos, sin, rotary_dim, _rank(cos) == 3, layout, format, "rope_cos_sin")


def _rotate_by_tables(x, cos, sin, rotary_dim: int, per_row: bool, layout: str, format: str, op_name: str,
                      data=None):
    """x * cos + rotate(x) * sin over the first rotary_dim channels; tables [S, r], [1 or B, S, r] (per_row) or
    [T, r] (thd). ``data`` as in _rotary_embedding."""
    head_dim = _static(x, -1, op_name, "head_dim")
    maths = _maths_type(x.dtype)
    data = _to(x, maths) if data is None else data
    rotated = _last_dim(data, 0, rotary_dim)
    half = rotary_dim // 2
    if layout == "neox":  # rotate_half: [-x2, x1]
        partner = op.Concat(op.Neg(_last_dim(rotated, half, rotary_dim)), _last_dim(rotated, 0, half), axis=-1)
    else:  # pairs (x_2i, x_2i+1) -> (-x_2i+1, x_2i)
        pairs = op.Reshape(rotated, op.Concat(op.Shape(rotated, start=0, end=-1), op.Constant(value_ints=[half, 2]),
                                              axis=0))
        partner = op.Reshape(op.Concat(op.Neg(_last_dim(pairs, 1, 2)), _last_dim(pairs, 0, 1), axis=-1),
                             op.Shape(rotated))
    tables = [_to(_table_for(t, per_row, format), maths) for t in (cos, sin)]
    out = op.Add(op.Mul(rotated, tables[0]), op.Mul(partner, tables[1]))
    if rotary_dim < head_dim:
        out = op.Concat(out, _last_dim(data, rotary_dim, head_dim), axis=-1)
    return _to(out, x.dtype)


def _table_for(table, per_batch: bool, format: str):
    """A cos/sin table ([S, r], [1 or B, S, r] when per_batch; [T, r] for thd) broadcast against x's layout."""
    if format == "thd":
        return op.Unsqueeze(table, op.Constant(value_ints=[1]))  # [T, 1, r]
    if format == "bshd":
        return op.Unsqueeze(table, op.Constant(value_ints=[-2]))  # [(B,) S, 1, r]
    if format == "bhsd":
        return op.Unsqueeze(table, op.Constant(value_ints=[1])) if per_batch else table  # [B, 1, S, r] / [S, r]
    # sbhd: [S, (B,) 1, r]
    if per_batch:
        return op.Unsqueeze(op.Transpose(table, perm=[1, 0, 2]), op.Constant(value_ints=[2]))
    return op.Unsqueeze(table, op.Constant(value_ints=[1, 2]))


# ---------------------------------------------------------------- ALiBi

def _alibi(slopes, q_len, k_len, mode: str, head_offset: int, num_heads: Optional[int], maths: ir.DataType,
           op_name: str):
    """The bias [1 or B, num_heads, Q, K] in the maths type: -m * d (causal) or -m * |d| (symmetric),
    d = i + (k_len - q_len) - j."""
    if mode not in ("causal", "symmetric"):
        raise ValueError(f'posenc.onnx: {op_name}: mode must be "causal" or "symmetric", got "{mode}"')
    total = _static(slopes, -1, op_name, "slope count")
    count = total - head_offset if num_heads is None else num_heads
    m = _last_dim(_to(slopes, maths), head_offset, head_offset + count)
    if _rank(slopes) == 1:
        m = op.Unsqueeze(m, op.Constant(value_ints=[0]))
    m = op.Unsqueeze(m, op.Constant(value_ints=[2, 3]))  # [1 or B, H, 1, 1]
    q_len, k_len = _int64(q_len), _int64(k_len)
    rows = op.Add(_arange(q_len), op.Sub(k_len, q_len))
    d = op.Sub(op.Unsqueeze(rows, op.Constant(value_ints=[1])), op.Unsqueeze(_arange(k_len),
                                                                             op.Constant(value_ints=[0])))
    d = op.Cast(d, to=maths)
    if mode == "symmetric":
        d = op.Abs(d)
    return op.Mul(op.Neg(m), d)


def alibi_bias(slopes, q_len, k_len, mode: str = "causal", head_offset: int = 0, num_heads: Optional[int] = None,
               dtype: Optional[int] = None):
    dtype = slopes.dtype if dtype is None else dtype
    return _to(_alibi(slopes, q_len, k_len, mode, head_offset, num_heads, _maths_type(dtype), "alibi_bias"), dtype)


def add_alibi(scores, slopes, mode: str = "causal", head_offset: int = 0):
    maths = _maths_type(scores.dtype)
    heads = _static(scores, 1, "add_alibi", "head count")
    bias = _alibi(slopes, _size(scores, -2), _size(scores, -1), mode, head_offset, heads, maths, "add_alibi")
    return _to(op.Add(_to(scores, maths), bias), scores.dtype)


# ---------------------------------------------------------------- T5

def _buckets(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's buckets: the bucket of a distance n < max_distance is read from a table computed by posenc's own op
    (bit-exact bucket edges); every distance from max_distance on shares the last bucket."""
    distances = -torch.arange(max_distance + 1, dtype=torch.int64)  # keys before the query: one direction
    table = torch.ops.posenc.relative_position_bucket(distances, bidirectional, num_buckets, max_distance)
    rel = _to(relative_position, _INT64)
    zero = op.Constant(value_int=0)
    if bidirectional:
        n = op.Abs(rel)
        base = op.Where(op.Greater(rel, zero), op.Constant(value_int=num_buckets // 2), zero)
    else:
        n = op.Neg(op.Min(rel, zero))
        base = zero
    limit = op.Constant(value_int=max_distance)
    n = op.Where(op.Less(n, zero), limit, op.Min(n, limit))  # |INT64_MIN| wraps negative: the farthest key
    return op.Add(base, op.Gather(op.Constant(value=ir.tensor(table.numpy())), n, axis=0))


def relative_position_bucket(relative_position, bidirectional: bool = True, num_buckets: int = 32,
                             max_distance: int = 128):
    return _buckets(relative_position, bidirectional, num_buckets, max_distance)


def t5_bias(weight, q_len, k_len, bidirectional: bool, num_buckets: int, max_distance: int, q_offset=0):
    queries = op.Add(_arange(_int64(q_len)), _int64(q_offset))
    rel = op.Sub(op.Unsqueeze(_arange(_int64(k_len)), op.Constant(value_ints=[0])),
                 op.Unsqueeze(queries, op.Constant(value_ints=[1])))
    values = op.Gather(weight, _buckets(rel, bidirectional, num_buckets, max_distance), axis=0)  # [Q, K, H]
    return op.Unsqueeze(op.Transpose(values, perm=[2, 0, 1]), op.Constant(value_ints=[0]))


# ---------------------------------------------------------------- frequencies and positions

_TORCH_DTYPES = {_FLOAT: torch.float32, _DOUBLE: torch.float64, ir.DataType.FLOAT16: torch.float16,
                 ir.DataType.BFLOAT16: torch.bfloat16}


def _constant(value):
    return op.Constant(value=ir.tensor(value)) if isinstance(value, torch.Tensor) else _double(value)


def _constant_translation(name: str) -> Callable:
    """An op without a tensor argument computes constants of the configuration (frequencies, slopes, position
    grids): the op itself evaluates them at export time, so the graph holds its exact values. An ONNX constant has
    no device: device arguments are dropped."""
    posenc_op = getattr(torch.ops.posenc, name).default

    def translation(*args, **kwargs):
        values = {}
        for i, argument in enumerate(posenc_op._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name, argument.default_value)
            kind = str(argument.real_type)
            if "Device" in kind:
                continue
            if "ScalarType" in kind and value is not None:
                if value not in _TORCH_DTYPES:
                    raise ValueError(f"posenc.onnx: {name}: {argument.name} {ir.DataType(value).name} is not a "
                                     f"floating dtype posenc computes in")
                value = _TORCH_DTYPES[value]
            values[argument.name] = value
        result = posenc_op(**values)
        return tuple(_constant(v) for v in result) if isinstance(result, tuple) else _constant(result)

    translation.__name__ = name
    return translation


def rope_inv_freq_for_length(seq_len, rotary_dim: int, base: float = 10000.0, rope_type: str = "default",
                             **scaling: Any):
    """The frequencies of every length up to the context are constants (posenc's own op, at export time); past it,
    LongRoPE switches to its long factors and dynamic NTK grows its base with L:
    theta'^(-2i / r) = theta^(-2i / r) * (1 + factor (L - C) / C)^(-2i / (r - 2))."""
    within, _ = torch.ops.posenc.rope_inv_freq(rotary_dim, float(base), rope_type, **scaling)
    length = _to(seq_len, _DOUBLE)
    if rope_type == "longrope":
        context = scaling.get("original_max_position_embeddings") or scaling["max_position_embeddings"]
        beyond, _ = torch.ops.posenc.rope_inv_freq(rotary_dim, float(base), rope_type, seq_len=2 ** 62, **scaling)
        return op.Where(op.Greater(length, _double(context)), _constant(beyond), _constant(within))
    if rope_type == "dynamic" and scaling.get("alpha") is None:  # with an alpha, HunYuan's fixed NTK
        context, factor = scaling["max_position_embeddings"], scaling["factor"]
        # max(L, C), keeping a NaN length as the op does
        clamped = op.Where(op.Less(length, _double(context)), _double(context), length)
        growth = op.Add(_double(1.0), op.Div(op.Mul(op.Sub(clamped, _double(context)), _double(factor)),
                                             _double(context)))
        # The exponents -2i / (r - 2) as sums of two doubles: ln(growth) multiplies the rounding error of one
        # double (20 ulps of the result at L = 2^40).
        exponents = [Fraction(-2 * i, rotary_dim - 2) for i in range(rotary_dim // 2)]
        high = [float(e) for e in exponents]
        low = [float(e - Fraction(h)) for e, h in zip(exponents, high)]
        powers = [op.Pow(growth, _constant(torch.tensor(e, dtype=torch.float64))) for e in (high, low)]
        return op.Mul(op.Mul(_constant(within), powers[0]), powers[1])
    return _constant(within)


def mrope_positions(token_types, image_grid_thw=None, video_grid_thw=None, attention_mask=None,
                    spatial_merge_size: int = 2, tokens_per_second: Optional[float] = None, second_per_grid_ts=None,
                    split_video_frames: bool = False):
    """Qwen2-VL's walk over runs of tokens, for every row at once. Each row's real tokens are moved to the front
    (a sort by (padding, index)) and a run starts where the type changes. A text token's position is its index k
    plus, summed over the vision runs before it, advance - length (advance: max(h, w) // spatial_merge_size); a
    vision token's is its run's start (the run's first index plus the same sum) plus its frame time, row or column.
    The vision runs take the grids in order over the whole batch. The positions go back to the tokens' places
    (padding gets 0)."""
    types = _to(token_types, _INT64)
    length = _size(types, 1)
    k = _arange(length)
    if attention_mask is None:
        real = op.Expand(op.Constant(value=ir.tensor(True)), op.Shape(types))
    else:
        real = op.Not(op.Equal(attention_mask, op.CastLike(op.Constant(value_int=0), attention_mask)))
    key = op.Add(op.Mul(op.Cast(op.Not(real), to=_INT64), length), k)
    _, order = op.TopK(key, op.Unsqueeze(length, op.Constant(value_ints=[0])), axis=1, largest=0, sorted=1)
    kind = op.GatherElements(types, order, axis=1)
    count = op.ReduceSum(op.Cast(real, to=_INT64), op.Constant(value_ints=[1]), keepdims=1)  # [B, 1]
    inside = op.Less(k, count)
    no_kind = op.Constant(value=ir.tensor(-1, dtype=_INT64))
    before = op.Pad(_last_dim(kind, 0, -1), op.Constant(value_ints=[0, 1, 0, 0]), no_kind)
    after = op.Pad(_last_dim(kind, 1, 1 << 62), op.Constant(value_ints=[0, 0, 0, 1]), no_kind)
    first = op.And(inside, op.Not(op.Equal(kind, before)))
    last = op.And(inside, op.Or(op.Not(op.Less(op.Add(k, op.Constant(value_int=1)), count)),
                                op.Not(op.Equal(kind, after))))
    one, one_dim = op.Constant(value_int=1), op.Constant(value_ints=[1])
    run = op.Max(op.Sub(op.CumSum(op.Cast(first, to=_INT64), one), one), op.Constant(value_int=0))
    # The runs' first indices in order (the other tokens sort after them), read back by every token of a run.
    starts, _ = op.TopK(op.Where(first, k, op.Add(k, length)), op.Unsqueeze(length, op.Constant(value_ints=[0])),
                        axis=1, largest=0, sorted=1)
    run_start = op.GatherElements(starts, run, axis=1)
    index = op.Sub(k, run_start)  # within the run

    def nth_grid(value: int):
        """The place of each token's run among the batch's runs of this kind, row after row."""
        runs = op.Cast(op.And(first, op.Equal(kind, op.Constant(value_int=value))), to=_INT64)
        earlier_rows = op.CumSum(op.ReduceSum(runs, op.Constant(value_ints=[1]), keepdims=1),
                                 op.Constant(value_int=0), exclusive=1)
        return op.Add(earlier_rows, op.Sub(op.CumSum(runs, one), one))

    no_grids = op.Constant(value=ir.tensor(torch.zeros(0, 3, dtype=torch.int64)))
    images = no_grids if image_grid_thw is None else _to(image_grid_thw, _INT64)
    videos = no_grids if video_grid_thw is None else _to(video_grid_thw, _INT64)
    video_of_grid = _arange(_size(videos, 0))
    if split_video_frames:  # Qwen3-VL: a grid (1, h, w) per frame
        ends = op.CumSum(op.Squeeze(_last_dim(videos, 0, 1), op.Constant(value_ints=[1])), op.Constant(value_int=0))
        frame = _arange(op.ReduceSum(_last_dim(videos, 0, 1), keepdims=0))
        video_of_grid = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(ends, op.Constant(value_ints=[0])),
                                                            op.Unsqueeze(frame, op.Constant(value_ints=[1]))),
                                             to=_INT64), op.Constant(value_ints=[1]), keepdims=0)
        frames = op.Gather(videos, video_of_grid, axis=0)
        single = op.ConstantOfShape(op.Concat(op.Shape(frames, start=0, end=1), one_dim, axis=0),
                                    value=ir.tensor([1], dtype=_INT64))
        videos = op.Concat(single, _last_dim(frames, 1, 3), axis=1)
    image_count, video_count = op.Shape(images, start=0, end=1), op.Shape(videos, start=0, end=1)
    # Text tokens read a last grid (1, m, m): one frame of one token.
    merge = op.Constant(value_int=spatial_merge_size)
    text_grid = op.Constant(value=ir.tensor(torch.tensor([[1, spatial_merge_size, spatial_merge_size]])))
    is_image = op.And(inside, op.Equal(kind, one))
    is_video = op.And(inside, op.Equal(kind, op.Constant(value_int=2)))
    video_grid = op.Where(is_video, nth_grid(2), video_count)
    grid_row = op.Where(is_image, nth_grid(1), op.Add(video_grid, image_count))
    grid = op.Gather(op.Concat(images, videos, text_grid, axis=0), grid_row, axis=0)  # [B, S, 3]
    h, w = (op.Squeeze(_last_dim(grid, i, i + 1), op.Constant(value_ints=[-1])) for i in (1, 2))
    height, width = op.Div(h, merge), op.Div(w, merge)
    cells = op.Mul(height, width)
    frame_of_token, cell = op.Div(index, cells), op.Mod(index, cells)
    time = frame_of_token
    if video_grid_thw is not None:
        video = op.Gather(op.Concat(video_of_grid, op.Constant(value_ints=[0]), axis=0), video_grid, axis=0)
        time = op.Where(is_video, _frame_times(frame_of_token, video, tokens_per_second, second_per_grid_ts), time)
    vision = op.Or(is_image, is_video)
    advance = op.Div(op.Max(h, w), merge)
    extra = op.Where(op.And(last, vision), op.Sub(advance, op.Add(index, one)), op.Constant(value_int=0))
    shift = op.CumSum(extra, one, exclusive=1)
    start, text = op.Add(run_start, shift), op.Add(k, shift)
    axes = [op.Where(vision, op.Add(start, offset), text) for offset in (time, op.Div(cell, width),
                                                                        op.Mod(cell, width))]
    compact = op.Where(inside, op.Concat(*(op.Unsqueeze(a, op.Constant(value_ints=[0])) for a in axes), axis=0),
                       op.Constant(value_int=0))  # [3, B, S]
    largest = op.ReduceMax(op.Where(inside, compact, op.Constant(value_int=-1)), op.Constant(value_ints=[0, 2]),
                           keepdims=0)
    deltas = op.Sub(op.Add(op.Unsqueeze(largest, op.Constant(value_ints=[1])), one), count)
    positions = op.ScatterElements(op.ConstantOfShape(op.Shape(compact), value=ir.tensor([0], dtype=_INT64)),
                                   op.Expand(op.Unsqueeze(order, op.Constant(value_ints=[0])), op.Shape(compact)),
                                   compact, axis=2)
    return positions, deltas


def _frame_times(frame, video, tokens_per_second: Optional[float], second_per_grid_ts):
    """trunc(frame * interval) in the arithmetic of the op: float64 without second_per_grid_ts; with it, torch's
    for interval = second_per_grid_ts[video] * tokens_per_second, then frame * interval (in second_per_grid_ts'
    dtype, float32 for integers times a fractional tokens_per_second)."""
    rate = 1.0 if tokens_per_second is None else tokens_per_second
    if second_per_grid_ts is None:
        return op.Cast(op.Mul(op.Cast(frame, to=_DOUBLE), _double(rate)), to=_INT64)
    seconds = op.Gather(op.Concat(second_per_grid_ts, op.CastLike(op.Constant(value_ints=[0]), second_per_grid_ts),
                                  axis=0), video, axis=0)
    dtype = second_per_grid_ts.dtype
    if not dtype.is_floating_point() and rate == int(rate):
        return op.Mul(op.Mul(_to(seconds, _INT64), op.Constant(value_int=int(rate))), frame)
    dtype = dtype if dtype.is_floating_point() else _FLOAT
    maths = _maths_type(dtype)

    def product(a, b):  # rounded to dtype once, as torch's CPU kernels compute it
        return _to(op.Mul(_to(_to(a, dtype), maths), _to(b, maths)), dtype)

    interval = product(seconds, _double(rate))
    return op.Cast(product(frame, interval), to=_INT64)


# ---------------------------------------------------------------- the table

_TRANSLATIONS: Dict[str, Callable] = {
    "sinusoidal": sinusoidal, "add_sinusoidal": add_sinusoidal, "embed_sinusoidal": embed_sinusoidal,
    "learned": learned, "add_learned": add_learned, "embed_learned": embed_learned,
    "resample_learned": resample_learned, "add_resampled_learned": add_resampled_learned,
    "make_positions": make_positions, "positions_from_mask": positions_from_mask,
    "rope": rope, "rope_qk": rope_qk, "rope_cos_sin": rope_cos_sin, "qk_norm_rope": qk_norm_rope,
    "alibi_bias": alibi_bias, "add_alibi": add_alibi,
    "relative_position_bucket": relative_position_bucket, "t5_bias": t5_bias,
    "rope_inv_freq_for_length": rope_inv_freq_for_length, "mrope_positions": mrope_positions,
    **{name: _constant_translation(name) for name in (
        "alibi_slopes", "sinusoidal_inv_freq", "rope_inv_freq", "multiaxis_inv_freq", "axial_inv_freq",
        "mrope_inv_freq", "mrope_pair_axis", "image_positions", "video_positions", "zigzag_positions",
        "grid_positions", "grid_sinusoidal_inv_freq", "patch_center_positions")},
}


def translation_table() -> Dict[torch._ops.OpOverload, Callable]:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True, opset_version=23)``: every forward
    posenc op mapped to a function that builds it from standard ONNX operators (onnxscript)."""
    return {getattr(torch.ops.posenc, name).default: fn for name, fn in _TRANSLATIONS.items()}


def _register_with_torch_onnx() -> None:
    """Adds the translations to the table torch.onnx builds every export's registry from (``import posenc`` calls
    this once torch.onnx's exporter loads its own translations), so that ``torch.onnx.export(..., dynamo=True)``,
    and exporters built on it, translate posenc ops without a ``custom_translation_table``. Below opset 23 the
    rotations are built without RotaryEmbedding."""
    from torch.onnx._internal.exporter._torchlib._torchlib_registry import onnx_impl

    before_rotary_embedding = {fn.__name__: fn for fn in _rope_for_opset(OPSET - 1)}
    for name, fn in _TRANSLATIONS.items():
        target = getattr(torch.ops.posenc, name).default
        if name in before_rotary_embedding:
            onnx_impl(target, no_compile=True)(before_rotary_embedding[name])
            onnx_impl(target, no_compile=True, opset_introduced=OPSET)(fn)
        else:
            onnx_impl(target, no_compile=True)(fn)


def export(model: Any, args: Tuple[Any, ...] = (), f: Optional[str] = None, *, opset_version: int = OPSET,
           custom_translation_table: Optional[Dict[Callable, Callable]] = None, **options: Any):
    """``torch.onnx.export(model, args, f, dynamo=True, ...)`` with posenc's translations (``options`` pass
    through: ``kwargs``, ``dynamic_shapes``, ``input_names``, ...). Returns the ``ONNXProgram``."""
    if opset_version < OPSET:
        raise ValueError(f"posenc.onnx.export: opset_version must be at least {OPSET} (RotaryEmbedding), "
                         f"got {opset_version}")
    table = translation_table()
    table.update(custom_translation_table or {})
    options.setdefault("verbose", False)
    return torch.onnx.export(model, args, f, dynamo=True, opset_version=opset_version,
                             custom_translation_table=table, **options)
