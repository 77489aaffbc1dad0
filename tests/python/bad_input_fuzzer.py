"""Random bad inputs for every posenc op, run in a subprocess by test_properties.py so that a crash (segfault,
abort) fails the test that started it instead of ending pytest.

Two kinds of case, each run with hypothesis:
- "<op>/<mutation>": a small valid call with one argument made wrong (dtype, rank, size, device, string,
  index or position out of range, overlapping memory, ...). It must raise a RuntimeError that names
  posenc.<op>.
- "<op>/anything": every argument drawn at random from its schema type (any dtype, rank, size, NaN/Inf, int64
  extremes, unknown strings). The call may succeed; if it fails, it must be a RuntimeError naming posenc.<op>.

Usage: python bad_input_fuzzer.py --examples N [--derandomize] [--only SUBSTRING] [--after CASE]
Prints one JSON line per case when it starts and when it ends: {"case", "status": start|ok|fail, "detail"}.
--after resumes after a case (the one that crashed the previous run).
"""
import argparse
import faulthandler
import json
import re
import sys
import traceback

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import posenc  # noqa: F401  (loads libposenc.so, or POSENC_LIBRARY)
from helpers import randn

OPS = torch.ops.posenc
LIMIT = 2 ** 53
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
F64 = torch.float64


def small(draw, low=1, high=3):
    return draw(st.integers(low, high))


# ---------------------------------------------------------------- one small valid call per op

def sinusoidal(draw):
    pairs, seq = small(draw), small(draw)
    return dict(positions=torch.arange(seq), inv_freq=torch.rand(pairs, dtype=F64), layout="half", dtype=None,
                offset=0)


def add_sinusoidal(draw):
    pairs, batch, seq = small(draw), small(draw), small(draw)
    return dict(x=randn(batch, seq, 2 * pairs), positions=None, inv_freq=torch.rand(pairs, dtype=F64), x_scale=1.0,
                layout="interleaved", offset=0)


def embed_sinusoidal(draw):
    pairs, batch, seq, vocab = small(draw), small(draw), small(draw), small(draw, 2, 5)
    return dict(tokens=torch.randint(0, vocab, (batch, seq)), token_weight=randn(vocab, 2 * pairs), positions=None,
                inv_freq=torch.rand(pairs, dtype=F64), token_scale=1.0, padding_idx=None, layout="half", offset=0)


def embedding_backward(draw):
    batch, seq, width, rows = small(draw), small(draw), small(draw), small(draw, 2, 5)
    return dict(grad=randn(batch, seq, width), indices=torch.randint(0, rows, (batch, seq)), num_rows=rows, scale=1.0,
                padding_idx=None)


def learned(draw):
    rows, width, seq = small(draw, 2, 5), small(draw), small(draw)
    return dict(weight=randn(rows, width), positions=torch.randint(0, rows, (seq,)), offset=0, padding_idx=None)


def add_learned(draw):
    batch, seq, width = small(draw), small(draw), small(draw)
    return dict(x=randn(batch, seq, width), weight=randn(seq + small(draw, 0, 2), width), positions=None, offset=0,
                padding_idx=None)


def embed_learned(draw):
    batch, seq, width, vocab = small(draw), small(draw), small(draw), small(draw, 2, 5)
    return dict(tokens=torch.randint(0, vocab, (batch, seq)), token_weight=randn(vocab, width),
                pos_weight=randn(seq + small(draw, 0, 2), width), positions=None, token_scale=1.0, padding_idx=None,
                offset=0, pos_padding_idx=None)


def make_positions(draw):
    return dict(tokens=torch.randint(0, 5, (small(draw), small(draw))), padding_idx=1)


def positions_from_mask(draw):
    return dict(attention_mask=torch.randint(0, 2, (small(draw), small(draw))), pad_position=0)


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


def relative_position_bucket(draw):
    return dict(relative_position=torch.randint(-200, 200, (small(draw), small(draw))), bidirectional=True,
                num_buckets=32, max_distance=128)


def t5_bias(draw):
    return dict(weight=randn(32, small(draw)), q_len=small(draw), k_len=small(draw), bidirectional=True,
                num_buckets=32, max_distance=128, q_offset=0)


def t5_bias_backward(draw):
    return dict(grad=randn(1, small(draw), small(draw), small(draw)), bidirectional=False, num_buckets=32,
                max_distance=128, q_offset=0)


def mrope_positions(draw):
    """Rows of text, an image (grid 1x4x4, merge 2: 4 tokens) and a video (the same grid), one grid of each a row."""
    batch = small(draw)
    row = [0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0]
    return dict(token_types=torch.tensor([row] * batch), image_grid_thw=torch.tensor([[1, 4, 4]] * batch),
                video_grid_thw=torch.tensor([[1, 4, 4]] * batch), attention_mask=torch.ones(batch, len(row)),
                spatial_merge_size=2, tokens_per_second=2.0, second_per_grid_ts=torch.ones(batch),
                split_video_frames=False)


def rope_inv_freq_for_length(draw):
    return dict(seq_len=torch.tensor(small(draw, 0, 8)), rotary_dim=2 * small(draw, 2, 4), base=10000.0,
                rope_type="dynamic", factor=2.0, max_position_embeddings=4.0)


def zigzag_positions_varlen(draw):
    cp_size = small(draw, 1, 3)
    lengths = [2 * cp_size * small(draw, 0, 2) for _ in range(small(draw))]
    return dict(cu_seqlens=torch.tensor([sum(lengths[:n]) for n in range(len(lengths) + 1)]), cp_size=cp_size,
                cp_rank=cp_size - 1)


BASES = {
    "sinusoidal": sinusoidal, "add_sinusoidal": add_sinusoidal, "embed_sinusoidal": embed_sinusoidal,
    "embedding_backward": embedding_backward, "learned": learned, "add_learned": add_learned,
    "embed_learned": embed_learned, "make_positions": make_positions, "positions_from_mask": positions_from_mask,
    "rope": rope, "rope_backward": rope_backward, "rope_qk": rope_qk, "rope_qk_backward": rope_qk_backward,
    "rope_": rope_inplace, "rope_cos_sin": rope_cos_sin, "rope_cos_sin_backward": rope_cos_sin_backward,
    "alibi_bias": alibi_bias, "add_alibi": add_alibi, "add_alibi_": add_alibi_inplace, "alibi_backward": alibi_backward,
    "relative_position_bucket": relative_position_bucket, "t5_bias": t5_bias, "t5_bias_backward": t5_bias_backward,
    "mrope_positions": mrope_positions, "rope_inv_freq_for_length": rope_inv_freq_for_length,
    "zigzag_positions_varlen": zigzag_positions_varlen,
}


# ---------------------------------------------------------------- mutations: each makes one argument wrong

def to_dtype(arg, *dtypes):
    def mutate(draw, kw):
        kw[arg] = kw[arg].to(draw(st.sampled_from(dtypes)))
    return mutate


def not_floating(arg):
    return to_dtype(arg, torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64)


def not_index(arg):
    return to_dtype(arg, torch.float32, torch.float64, torch.bool, torch.int16, torch.uint8)


def wrong_rank(arg, ranks):
    """arg reshaped (or padded) to a rank in `ranks`."""
    def mutate(draw, kw):
        rank = draw(st.sampled_from(ranks))
        t = kw[arg].flatten()
        kw[arg] = t[:1].reshape([]) if rank == 0 else t.reshape([t.numel()] + [1] * (rank - 1))
    return mutate


def grow(arg, dim, by=1):
    """`by` more entries along `dim` (a size mismatch with the other arguments); a negative `by`, fewer."""
    def mutate(draw, kw):
        t = kw[arg]
        kw[arg] = torch.cat([t] + [t.narrow(dim, 0, 1)] * by, dim) if by >= 0 else t.narrow(dim, 0, t.shape[dim] + by)
    return mutate


def on_meta(arg):
    def mutate(draw, kw):
        kw[arg] = kw[arg].to("meta")
    return mutate


def unknown_string(arg, valid):
    def mutate(draw, kw):
        kw[arg] = draw(st.one_of(st.sampled_from(["", "NEOX", "Half", "bshd ", "causal\0", "thd2", "sym"]),
                                 st.text(max_size=6)).filter(lambda s: s not in valid))
    return mutate


def set_value(arg, strategy):
    def mutate(draw, kw):
        kw[arg] = draw(strategy)
    return mutate


def put(arg, values):
    """One element of the (index or position) tensor set to a value drawn from `values`."""
    def mutate(draw, kw):
        t = kw[arg].clone()
        flat = t.view(-1)
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from(values))
        kw[arg] = t
    return mutate


def positions_beyond_domain(floating):
    """Given positions with one beyond [-2^53, 2^53] (or absent positions pushed past it by the offset)."""
    def mutate(draw, kw):
        seq = positions_length(kw)
        may_be_absent = kw.get("positions", 0) is None  # every op but sinusoidal
        how = draw(st.sampled_from(["given", "overflow"] + (["absent"] if may_be_absent else []) +
                                   (["float"] if floating else [])))
        if how == "given":
            values = torch.arange(seq)
            values[draw(st.integers(0, seq - 1))] = draw(st.sampled_from([LIMIT + 1, -LIMIT - 1, INT64_MAX, INT64_MIN]))
            kw["positions"] = values
        elif how == "absent":
            kw["offset"] = draw(st.sampled_from([LIMIT - seq + 2, -LIMIT - 1, min(INT64_MAX, INT64_MAX - seq + 2),
                                                 INT64_MIN]))
        elif how == "overflow":  # the int64 sum wraps, to -2, 5 or int64 min + 4
            position, offset = draw(st.sampled_from([(INT64_MAX, INT64_MAX), (INT64_MIN + 5, INT64_MIN),
                                                     (5, INT64_MAX)]))
            values = torch.zeros(seq, dtype=torch.long)
            values[draw(st.integers(0, seq - 1))] = position
            kw["positions"], kw["offset"] = values, offset
        else:  # finite floating positions past the edge, representable in their dtype (not inf: that is NaN)
            dtype = draw(st.sampled_from([F64, torch.float32]))
            beyond = [LIMIT + 2.0, -LIMIT - 2.0, 1e300] if dtype == F64 else [2.0 ** 54, -2.0 ** 54, 1e30]
            values = torch.arange(seq, dtype=dtype)
            values[draw(st.integers(0, seq - 1))] = draw(st.sampled_from(beyond))
            kw["positions"] = values
    return mutate


def positions_length(kw):
    if kw.get("positions") is not None:
        return kw["positions"].shape[-1]
    for name in ("x", "grad", "q", "grad_q"):
        if name in kw:
            return kw[name].shape[1] if kw[name].dim() == 4 else kw[name].shape[-2]
    return kw["tokens"].shape[-1]


def rows_outside_table(table):
    """Learned positions reading a row outside [0, L_max): past the end, negative, or an offset overflow."""
    def mutate(draw, kw):
        rows = kw[table].shape[0]
        seq = positions_length(kw)
        how = draw(st.sampled_from(["past_end", "negative", "offset", "overflow"]))
        values = torch.zeros(seq, dtype=torch.long)
        if how == "past_end":
            values[-1] = rows
        elif how == "negative":
            values[0] = -1
        elif how == "offset":
            kw["offset"] = rows
        else:  # the int64 sum wraps (into the table, for int64 min + 5 plus int64 min)
            values[0] = draw(st.sampled_from([INT64_MAX, INT64_MIN + 5]))
            kw["offset"] = INT64_MAX if values[0] > 0 else INT64_MIN
        kw["positions"] = values  # [S]: every learned op takes it
    return mutate


def overlapping(arg):
    """arg replaced by a view whose elements share memory: expanded, or an as_strided with short strides."""
    def mutate(draw, kw):
        t = kw[arg]
        if draw(st.booleans()):
            kw[arg] = t[:1].expand(t.shape[0] + 1, *t.shape[1:]) if t.dim() else t
        else:
            buffer = torch.randn(2 * t.numel() + 8)
            strides = list(t.contiguous().stride())
            dim = draw(st.integers(0, t.dim() - 1))
            strides[dim] = 0 if strides[dim] <= 1 else draw(st.integers(0, strides[dim] - 1))
            shape = list(t.shape)
            shape[dim] = max(shape[dim], 2)
            kw[arg] = buffer.as_strided(shape, strides)
    return mutate


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
        "positions_floating": lambda draw, kw: kw.update(positions=torch.arange(positions_length(kw), dtype=F64)),
        "positions_wrong_shape": lambda draw, kw: kw.update(positions=torch.arange(positions_length(kw) + 1)),
        "layout_unknown": unknown_string("layout", {"neox", "gptj"}),
        "format_unknown": unknown_string("format", {"bshd", "bhsd", "sbhd", "thd"}),
        "cu_seqlens_invalid": cu_seqlens_bad,
        "positions_beyond_domain": positions_beyond_domain(floating=False),
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


def sinusoidal_domain_and_frequencies():
    return {
        "inv_freq_not_floating": not_floating("inv_freq"),
        "inv_freq_wrong_rank": wrong_rank("inv_freq", [0, 2]),
        "inv_freq_empty": lambda draw, kw: kw.update(inv_freq=torch.empty(0, dtype=F64)),
        "inv_freq_on_meta": on_meta("inv_freq"),
        "layout_unknown": unknown_string("layout", {"interleaved", "half", "half_cos_first"}),
        "positions_bool_or_complex": lambda draw, kw: kw.update(positions=torch.zeros(
            positions_length(kw), dtype=draw(st.sampled_from([torch.bool, torch.complex64])))),
        "positions_beyond_domain": positions_beyond_domain(floating=True),
    }


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


def t5_buckets_invalid(draw, kw):
    bidirectional = kw["bidirectional"]
    how = draw(st.sampled_from(["buckets_nonpositive", "too_few", "distance_nonpositive", "distance_small"]))
    if how == "buckets_nonpositive":
        kw["num_buckets"] = draw(st.sampled_from([0, -1, INT64_MIN]))
    elif how == "too_few":
        kw["num_buckets"] = 3 if bidirectional else 1
    elif how == "distance_nonpositive":
        kw["max_distance"] = draw(st.sampled_from([0, -5, INT64_MIN]))
    else:
        kw["max_distance"] = (kw["num_buckets"] // 2 if bidirectional else kw["num_buckets"]) // 2
    if "weight" in kw and how in ("buckets_nonpositive", "too_few"):
        kw["weight"] = randn(max(kw["num_buckets"], 0), kw["weight"].shape[1])


MUTATIONS = {
    "sinusoidal": dict(sinusoidal_domain_and_frequencies(), dtype_not_floating=set_value(
        "dtype", st.sampled_from([torch.int64, torch.bool, torch.complex64]))),
    "add_sinusoidal": dict(sinusoidal_domain_and_frequencies(), x_not_floating=not_floating("x"),
                           x_wrong_rank=wrong_rank("x", [0, 1]), x_width_mismatch=grow("x", -1, by=2),
                           positions_wrong_shape=lambda draw, kw: kw.update(
                               positions=torch.arange(kw["x"].shape[-2] + 1)),
                           positions_on_meta=lambda draw, kw: kw.update(
                               positions=torch.arange(kw["x"].shape[-2], device="meta"))),
    "embed_sinusoidal": dict(sinusoidal_domain_and_frequencies(), tokens_not_index=not_index("tokens"),
                             tokens_out_of_vocab=lambda draw, kw: put("tokens", [kw["token_weight"].shape[0], -1,
                                                                                  INT64_MAX, INT64_MIN])(draw, kw),
                             token_weight_wrong_rank=wrong_rank("token_weight", [1, 3]),
                             token_weight_width_mismatch=grow("token_weight", 1, by=2),
                             token_weight_not_floating=not_floating("token_weight"),
                             padding_idx_out_of_range=lambda draw, kw: kw.update(padding_idx=draw(st.sampled_from(
                                 [-1, kw["token_weight"].shape[0], INT64_MAX, INT64_MIN])))),
    "embedding_backward": dict(
        grad_not_floating=not_floating("grad"), grad_0d=wrong_rank("grad", [0]), indices_not_index=not_index("indices"),
        indices_not_a_suffix=grow("indices", -1),
        index_out_of_range=lambda draw, kw: put("indices", [kw["num_rows"], -1, INT64_MAX, INT64_MIN])(draw, kw),
        num_rows_negative=set_value("num_rows", st.integers(-10, -1)),
        padding_idx_out_of_range=lambda draw, kw: kw.update(padding_idx=draw(st.sampled_from(
            [-1, kw["num_rows"], INT64_MAX, INT64_MIN]))),
        indices_on_meta=on_meta("indices")),
    "learned": dict(weight_wrong_rank=wrong_rank("weight", [1, 3]), weight_not_floating=not_floating("weight"),
                    positions_not_index=not_index("positions"), rows_outside_the_table=rows_outside_table("weight"),
                    padding_idx_out_of_range=lambda draw, kw: kw.update(padding_idx=draw(st.sampled_from(
                        [-1, kw["weight"].shape[0], INT64_MAX]))),
                    positions_on_meta=on_meta("positions")),
    "add_learned": dict(x_not_floating=not_floating("x"), x_wrong_rank=wrong_rank("x", [0, 1]),
                        weight_other_dtype=to_dtype("weight", torch.float64, torch.bfloat16),
                        x_width_mismatch=grow("x", -1), rows_outside_the_table=rows_outside_table("weight"),
                        positions_not_index=lambda draw, kw: kw.update(positions=torch.zeros(kw["x"].shape[-2])),
                        positions_wrong_shape=lambda draw, kw: kw.update(
                            positions=torch.zeros(kw["x"].shape[-2] + 1, dtype=torch.long)),
                        weight_on_meta=on_meta("weight")),
    "embed_learned": dict(tokens_not_index=not_index("tokens"), tokens_0d=wrong_rank("tokens", [0]),
                          tokens_out_of_vocab=lambda draw, kw: put("tokens", [kw["token_weight"].shape[0], -1])(draw, kw),
                          pos_weight_other_dtype=to_dtype("pos_weight", torch.float64, torch.float16),
                          pos_weight_width_mismatch=grow("pos_weight", 1),
                          rows_outside_the_table=rows_outside_table("pos_weight"),
                          pos_padding_idx_out_of_range=lambda draw, kw: kw.update(
                              pos_padding_idx=kw["pos_weight"].shape[0])),
    "make_positions": dict(tokens_not_index=not_index("tokens"), tokens_0d=wrong_rank("tokens", [0]),
                           positions_overflow_int64=lambda draw, kw: kw.update(
                               tokens=torch.zeros_like(kw["tokens"]), padding_idx=INT64_MAX)),
    "positions_from_mask": dict(attention_mask_complex=to_dtype("attention_mask", torch.complex64),
                                attention_mask_0d=wrong_rank("attention_mask", [0])),
    "rope": rope_mutations(["x"]),
    "rope_backward": rope_mutations(["grad"]),
    "rope_qk": rope_mutations(["q", "k"]),
    "rope_qk_backward": rope_mutations(["grad_q", "grad_k"]),
    "rope_": rope_mutations(["x"], inplace=True),
    "rope_cos_sin": {
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
    },
    "alibi_bias": dict(slopes_not_floating=not_floating("slopes"), slopes_wrong_rank=wrong_rank("slopes", [0, 3]),
                       q_len_negative=set_value("q_len", st.integers(-100, -1)),
                       k_len_negative=set_value("k_len", st.integers(-100, -1)),
                       mode_unknown=unknown_string("mode", {"causal", "symmetric"}),
                       head_offset_negative=set_value("head_offset", st.integers(INT64_MIN, -1)),
                       num_heads_too_many=lambda draw, kw: kw.update(num_heads=kw["slopes"].shape[-1] + 1),
                       head_offset_past_the_slopes=lambda draw, kw: kw.update(
                           num_heads=1, head_offset=draw(st.sampled_from([kw["slopes"].shape[-1], INT64_MAX]))),
                       num_heads_negative=set_value("num_heads", st.integers(-5, -1)),
                       dtype_not_floating=set_value("dtype", st.sampled_from([torch.int64, torch.bool]))),
    "add_alibi": alibi_mutations("scores"),
    "add_alibi_": alibi_mutations("scores", "alibi_mode", inplace=True),
    "alibi_backward": alibi_mutations("grad"),
    "relative_position_bucket": dict(relative_position_not_index=not_index("relative_position"),
                                     buckets_invalid=t5_buckets_invalid),
    "t5_bias": dict(weight_not_floating=not_floating("weight"), weight_wrong_rank=wrong_rank("weight", [1, 3]),
                    weight_rows_differ=grow("weight", 0), q_len_negative=set_value("q_len", st.integers(-100, -1)),
                    k_len_negative=set_value("k_len", st.integers(-100, -1)), buckets_invalid=t5_buckets_invalid,
                    q_offset_beyond_2_pow_62=set_value("q_offset", st.sampled_from(
                        [2 ** 62 + 1, -(2 ** 62) - 1, INT64_MAX, INT64_MIN]))),
    "t5_bias_backward": dict(grad_not_floating=not_floating("grad"), grad_wrong_rank=wrong_rank("grad", [0, 3, 5]),
                             grad_batch_not_1=grow("grad", 0), buckets_invalid=t5_buckets_invalid,
                             q_offset_beyond_2_pow_62=set_value("q_offset", st.sampled_from(
                                 [2 ** 62 + 1, -(2 ** 62) - 1, INT64_MAX, INT64_MIN]))),
    "mrope_positions": dict(
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
        grid_on_meta=on_meta("image_grid_thw"), attention_mask_on_meta=on_meta("attention_mask")),
    "rope_inv_freq_for_length": dict(
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
            long_factor=[2.0] * (kw["rotary_dim"] // 2))),
    "zigzag_positions_varlen": dict(
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
        cp_rank_outside=lambda draw, kw: kw.update(cp_rank=draw(st.sampled_from([-1, kw["cp_size"], INT64_MAX])))),
}
# rope_backward and rope_qk_backward take gradients: the first tensor's name differs, nothing else.
MUTATIONS["rope_cos_sin_backward"] = {k.replace("x_", "grad_", 1) if k.startswith("x_") else k: v
                                      for k, v in MUTATIONS["rope_cos_sin"].items()}
MUTATIONS["rope_cos_sin_backward"]["grad_not_floating"] = not_floating("grad")
MUTATIONS["rope_cos_sin_backward"]["tables_other_batch"] = lambda draw, kw: kw.update(
    cos=kw["cos"].expand(kw["grad"].shape[0] + 1, *kw["cos"].shape),
    sin=kw["sin"].expand(kw["grad"].shape[0] + 1, *kw["sin"].shape))


# ---------------------------------------------------------------- "anything": arguments drawn from the schema

CHAOS_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
                torch.uint8, torch.bool, torch.complex64]
STRINGS = ["interleaved", "half", "half_cos_first", "neox", "gptj", "bshd", "bhsd", "sbhd", "thd", "causal",
           "symmetric", "", "bad"]
SIZE_ARGS = {"q_len", "k_len", "num_rows", "num_heads", "rotary_dim"}
SPECIAL_INTS = [INT64_MIN, INT64_MAX, LIMIT, -LIMIT, LIMIT + 1, 2 ** 62, 2 ** 31, -1]


def chaos_tensor(draw):
    dtype = draw(st.sampled_from(CHAOS_DTYPES))
    shape = [draw(st.integers(0, 4)) for _ in range(draw(st.integers(0, 4)))]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    if dtype.is_floating_point or dtype.is_complex:
        values = torch.randn(shape, generator=gen, dtype=torch.float64) * 10
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, 0.0], dtype=torch.float64)
        pick = torch.randint(0, 8, shape, generator=gen)
        values = torch.where(pick < 5, specials[pick.clamp(max=4)], values) if draw(st.booleans()) else values
        t = values.to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(-3, 10, shape, generator=gen).clamp(info.min, info.max).to(dtype)
        if t.numel() and draw(st.booleans()):
            t.view(-1)[0] = draw(st.sampled_from([info.min, info.max]))
    how = draw(st.sampled_from(["plain", "transposed", "expanded", "sliced"]))
    if how == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    elif how == "expanded" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    elif how == "sliced" and t.dim() >= 1:
        t = torch.cat([t, t], 0)[::2]
    return t


def chaos_value(draw, name, type_name):
    optional = type_name.startswith("Optional")
    if optional and draw(st.integers(0, 2)) == 0:
        return None
    if "Tensor" in type_name:
        return chaos_tensor(draw)
    if name == "dtype":
        return draw(st.sampled_from(CHAOS_DTYPES))
    if "List[float]" in type_name:
        return [draw(st.sampled_from([1.0, 2.0, 0.0, -1.0, float("nan")])) for _ in range(draw(st.integers(0, 6)))]
    if "int" in type_name:
        if name in SIZE_ARGS:
            return draw(st.integers(-3, 12))
        return draw(st.one_of(st.integers(-5, 40), st.sampled_from(SPECIAL_INTS)))
    if "float" in type_name:
        return draw(st.sampled_from([1.0, 0.0, -1.5, float("nan"), float("inf"), 1e300]))
    if "str" in type_name:
        return draw(st.sampled_from(STRINGS))
    if "bool" in type_name:
        return draw(st.booleans())
    raise TypeError(f"no strategy for {name}: {type_name}")


def chaos(op):
    arguments = getattr(OPS, op).default._schema.arguments

    def build(draw):
        return {a.name: chaos_value(draw, a.name, str(a.type)) for a in arguments}
    return build


# ---------------------------------------------------------------- the cases

def mutated(op, mutate):
    def build(draw):
        kw = BASES[op](draw)
        mutate(draw, kw)
        return kw
    return build


CASES = {}
for _op, _mutations in MUTATIONS.items():
    for _name, _mutate in _mutations.items():
        CASES[f"{_op}/{_name}"] = (_op, mutated(_op, _mutate), False)
    CASES[f"{_op}/anything"] = (_op, chaos(_op), True)


def describe(kw):
    parts = []
    for name, value in kw.items():
        if isinstance(value, torch.Tensor):
            text = f"{name}={value.dtype} {list(value.shape)} stride {value.stride()} on {value.device}"
            if value.device.type == "cpu" and value.numel() <= 8:
                text += f" {value.tolist()}"
            parts.append(text)
        else:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


# The name an op's errors carry where it is not posenc.<op>: rope_inv_freq_for_length shares its checks, and their
# messages, with posenc.frequencies.rope.
ERROR_NAMES = {"rope_inv_freq_for_length": "frequencies.rope"}
# Ops whose invalid values raise ValueError (documented), their invalid tensors RuntimeError.
VALUE_ERROR_OPS = {"rope_inv_freq_for_length", "zigzag_positions_varlen"}


def names_op(message, op):
    name = ERROR_NAMES.get(op, op)
    return re.search(rf"posenc\.{re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def run_case(op, build, may_succeed, examples, derandomize):
    @settings(max_examples=examples, derandomize=derandomize, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(st.data())
    def check(data):
        kw = build(data.draw)
        expected = (RuntimeError, ValueError) if op in VALUE_ERROR_OPS else RuntimeError
        try:
            getattr(OPS, op)(**kw)
        except expected as error:
            if not names_op(str(error), op):
                raise AssertionError(f"a RuntimeError that does not name posenc.{op}: "
                                     f"{str(error).splitlines()[0][:400]}\ninputs: {describe(kw)}") from None
            return
        except Exception as error:  # noqa: BLE001  (the point: any other exception type is a failure)
            raise AssertionError(f"{type(error).__name__} instead of a RuntimeError: {str(error)[:400]}\n"
                                 f"inputs: {describe(kw)}") from None
        if not may_succeed:
            raise AssertionError(f"no error for bad input: {describe(kw)}")

    check()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--derandomize", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--after", default=None)
    args = parser.parse_args()
    faulthandler.enable()  # a crash prints the Python stack of the case that caused it to stderr
    names = list(CASES)
    start = names.index(args.after) + 1 if args.after else 0
    for name in names[start:]:
        op, build, may_succeed = CASES[name]
        if args.only not in name:
            continue
        print(json.dumps({"case": name, "status": "start"}), flush=True)
        try:
            run_case(op, build, may_succeed, args.examples, args.derandomize)
            record = {"case": name, "status": "ok", "detail": ""}
        except Exception as error:  # noqa: BLE001
            notes = "\n".join(getattr(error, "__notes__", []))
            record = {"case": name, "status": "fail",
                      "detail": "".join(traceback.format_exception_only(type(error), error)) + notes}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())
