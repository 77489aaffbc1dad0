"""KV-cache family (rope_qk_cache_): one decoding step's attention prologue (q rotated in place, k rotated into
k_cache and v copied into v_cache at each token's slot) against a float64 formula written here (rotate with cos/sin
of p * inv_freq, then place the rows at their slots by hand) for every cache format, every rotary format, positions
absent, shared and per row, offsets, packed sequences, GQA, partial rotary, both layouts and every dtype, and bit for
bit against rope_qk's q and k; against Hugging Face's StaticCache and apply_rotary_pos_emb decoding a small Llama
config; the query scale; the bad inputs (slots out of range or shared, caches of the wrong shape, dtype, device or
rank, autograd, overlapping memory); opcheck, torch.compile, torch.export, TorchScript and the example of
docs/decoding.md. Its registry entries (the sample call, the hypothesis property, the bad-input cases) are at the
end."""
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch.testing import assert_close

from helpers import randn, same_bits
from mutations import (F64, grow, not_floating, not_index, on_meta, overlapping, put, small, to_dtype,
                       unknown_string, wrong_rank)
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import functional as PF
from posenc import frequencies as FQ
from strategies import (FLOAT_DTYPES, OPS, arrange, assert_rounds_within, buffer_of, covered_offsets, drawn_tensor,
                        frequencies, generator, math_eps, normal)
from test_rope import (BSHD_ORDER, FORMATS, q_scale_formula, rope_input, rope_mutations,
                       rope_positions, rope_reference, rope_tolerance, to_format)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
CACHE_FORMATS = ["bhsd", "bshd", "shd"]
LIMIT = 2 ** 53


# ---------------------------------------------------------------- float64 references (formulas written here)

def cache_shape(cache_format, batch, heads, slots, head_dim):
    return {"bhsd": [batch, heads, slots, head_dim], "bshd": [batch, slots, heads, head_dim],
            "shd": [slots, heads, head_dim]}[cache_format]


def slot_rows(cache, cache_format):
    """The cache as [B, S_max, H, D] rows (a view; [1, S_max, H, D] for the pool)."""
    return {"bhsd": lambda c: c.transpose(1, 2), "bshd": lambda c: c, "shd": lambda c: c[None]}[cache_format](cache)


def place(cache, cache_format, rows, slots):
    """float64 copy of `cache` with rows [B, S, H, D] written at slots [B, S] (each row of the batch into its own
    cache row, or every token into the pool for "shd"), by hand."""
    out = cache.double().clone()
    view = slot_rows(out, cache_format)
    rows = rows.double()
    for b in range(slots.shape[0]):
        for s in range(slots.shape[1]):
            view[0 if cache_format == "shd" else b, int(slots[b, s])] = rows[b, s]
    return out


def read_slots(cache, cache_format, slots):
    """The rows of `cache` at slots [B, S], as [B, S, H, D]."""
    view = slot_rows(cache, cache_format)
    rows = torch.arange(slots.shape[0])[:, None] if cache_format != "shd" else torch.zeros(1, 1, dtype=torch.long)
    return view[rows.expand(slots.shape), slots]


def kv_reference(case):
    """float64 q, k_cache and v_cache after the call: q and k rotated by absolute * inv_freq (times the query scale
    for q), k and v placed at their slots; and the tolerances of each (rope_tolerance on the written rows, 0 on the
    rest)."""
    pairs = case["inv_freq"].numel()
    absolute = case["absolute"]  # [B or 1, S, pairs]
    q_ref = rope_reference(case["q_bshd"], absolute, case["inv_freq"], case["layout"], case["scale"])
    q_tol = rope_tolerance(case["q_bshd"], pairs, case["scale"], case["dtype"])
    if case.get("q_scale"):
        factor = q_scale_formula(absolute[..., 0], *case["q_scale"])[..., None, None]  # [B or 1, S, 1, 1]
        q_ref = q_ref * factor
        q_tol = q_tol * factor + 4 * math_eps(case["dtype"]) * q_ref.abs()
    k_ref = rope_reference(case["k_bshd"], absolute, case["inv_freq"], case["layout"], case["scale"])
    k_tol = rope_tolerance(case["k_bshd"], pairs, case["scale"], case["dtype"])
    fmt, slots = case["cache_format"], case["slots"]
    k_cache = place(case["k_cache_before"], fmt, k_ref, slots)
    k_cache_tol = place(torch.zeros_like(case["k_cache_before"], dtype=F64), fmt, k_tol, slots)
    v_cache = place(case["v_cache_before"], fmt, case["v_bshd"], slots)
    return q_ref, q_tol, k_cache, k_cache_tol, v_cache


def bshd_of(x, fmt):
    return x[None] if fmt == "thd" else x.permute(BSHD_ORDER[fmt])


def run_case(case):
    """Calls the op on the case (q, k_cache and v_cache written where they lie)."""
    return OPS.rope_qk_cache_(case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["positions"],
                              case["inv_freq"], case["cache_positions"], case["cache_format"], case["scale"],
                              case["layout"], case["fmt"], case["offset"], case["cu_seqlens"], case["pair_axis"],
                              *(case.get("q_scale") or ()))


def check_case(case, before_q):
    """The op's q and caches against the float64 formula (within rounding), v copied bit for bit, the slots nobody
    writes unchanged bit for bit; and q and the written k rows are rope_qk's bits."""
    q_ref, q_tol, k_cache_ref, k_cache_tol, v_cache_ref = kv_reference(case)
    fmt, cache_format, slots = case["fmt"], case["cache_format"], case["slots"]
    assert_rounds_within(bshd_of(case["q"], fmt), q_ref, q_tol)
    assert_rounds_within(case["k_cache"], k_cache_ref, k_cache_tol)
    assert same_bits(case["v_cache"], v_cache_ref.to(case["dtype"]), any_nan=True)
    untouched = torch.ones(slot_rows(case["k_cache"], cache_format).shape[:2], dtype=torch.bool)
    untouched[(torch.arange(slots.shape[0])[:, None] if cache_format != "shd" else 0), slots] = False
    assert same_bits(slot_rows(case["k_cache"], cache_format)[untouched],
                     slot_rows(case["k_cache_before"], cache_format)[untouched], any_nan=True)
    rq, rk = OPS.rope_qk(before_q, case["k"], case["positions"], case["inv_freq"], case["scale"], case["layout"], fmt,
                         case["offset"], case["cu_seqlens"], case["pair_axis"], *(case.get("q_scale") or ()))
    assert same_bits(case["q"], rq, any_nan=True), "q differs from rope_qk's"
    assert same_bits(read_slots(case["k_cache"], cache_format, slots), bshd_of(rk, fmt), any_nan=True), \
        "k_cache's rows differ from rope_qk's k"


# ---------------------------------------------------------------- values: every format, positions, dtype

POSITION_KINDS = ["absent", "shared", "per_row"]


def make_case(fmt, kind, cache_format, dtype, seed=0, layout="neox", rotary_dim=8, head_dim=10, heads=4,
              kv_heads=2, v_head_dim=6, batch=2, seq=5, extra_slots=4, scale=1.0):
    """A call of the op: q, k, v in `fmt` (views of bshd data), caches filled with values that must survive where
    nothing is written. Positions: "absent" (offset 3: token s at 3 + s), "shared" ([S], distinct) or "per_row"
    ([B, S]); for thd, "per_row" packs sequences (cu_seqlens, positions restarting at the offset) with
    cache_positions [T]. The pool ("shd") of a batch gets [B, S] cache_positions where rows would share slots."""
    g = torch.Generator().manual_seed(seed)
    B = 1 if fmt == "thd" else batch
    slots_count = B * seq + extra_slots + 3
    q_bshd = randn(B, seq, heads, head_dim, dtype=dtype, generator=g)
    k_bshd = randn(B, seq, kv_heads, head_dim, dtype=dtype, generator=g)
    v_bshd = randn(B, seq, kv_heads, v_head_dim, dtype=dtype, generator=g)
    inv_freq = FQ.rope(rotary_dim, 500.0)[0]
    positions, offset, cu_seqlens, cache_positions = None, 0, None, None
    if kind == "absent":
        offset = 3
        absolute = (torch.arange(seq) + offset)[None].expand(B, seq)
    elif kind == "shared":
        offset = -2
        positions = torch.randperm(slots_count, generator=g)[:seq] + 2
        absolute = (positions + offset)[None].expand(B, seq)
    elif fmt == "thd":
        offset, cu_seqlens = 1, torch.tensor([0, 2, 2, seq])
        absolute = torch.cat([torch.arange(2), torch.arange(seq - 2)])[None] + offset
        cache_positions = torch.randperm(slots_count, generator=g)[:seq]
    else:
        positions = torch.randperm(slots_count, generator=g)[:B * seq].view(B, seq).to(torch.int32)
        absolute = positions.long()
    slots = absolute if cache_positions is None else cache_positions[None]
    if cache_format == "shd" and B > 1 and kind != "per_row":  # rows would share the pool's slots
        cache_positions = torch.randperm(slots_count, generator=g)[:B * seq].view(B, seq)
        slots = cache_positions
    k_cache = randn(*cache_shape(cache_format, B, kv_heads, slots_count, head_dim), dtype=dtype, generator=g)
    v_cache = randn(*cache_shape(cache_format, B, kv_heads, slots_count, v_head_dim), dtype=dtype, generator=g)
    pairs = rotary_dim // 2
    return dict(fmt=fmt, cache_format=cache_format, dtype=dtype, layout=layout, scale=scale,
                q=to_format(q_bshd, fmt).clone(), k=to_format(k_bshd, fmt), v=to_format(v_bshd, fmt),
                q_bshd=q_bshd, k_bshd=k_bshd, v_bshd=v_bshd, k_cache=k_cache, v_cache=v_cache,
                k_cache_before=k_cache.clone(), v_cache_before=v_cache.clone(), positions=positions, offset=offset,
                cu_seqlens=cu_seqlens, pair_axis=None, cache_positions=cache_positions, inv_freq=inv_freq,
                absolute=absolute.double()[..., None].expand(*absolute.shape, pairs), slots=slots.expand(B, seq))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", POSITION_KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
def test_values_against_the_float64_formula(cache_format, fmt, kind, dtype):
    """GQA (4 and 2 heads), partial rotary (8 of 10 channels), v of its own head_dim (6), q in every format as a
    view of bshd data (bhsd and sbhd: permuted strides)."""
    seed = 100 * CACHE_FORMATS.index(cache_format) + 10 * FORMATS.index(fmt) + POSITION_KINDS.index(kind)
    case = make_case(fmt, kind, cache_format, dtype, seed=seed)
    before_q = case["q"].clone()
    assert PF.rope_qk_cache_(case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["positions"],
                             case["inv_freq"], case["cache_positions"], cache_format, 1.0, "neox", fmt,
                             case["offset"], case["cu_seqlens"]) is case["q"]
    check_case(case, before_q)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
def test_gptj_scale_and_full_rotary(cache_format, layout):
    case = make_case("bshd", "per_row", cache_format, torch.float32, seed=7, layout=layout, rotary_dim=16,
                     head_dim=16, scale=0.75)
    before_q = case["q"].clone()
    run_case(case)
    check_case(case, before_q)


def test_k_and_v_are_left_unchanged_and_partial_channels_copied():
    case = make_case("bshd", "per_row", "bhsd", torch.float32, rotary_dim=4, head_dim=12)
    k, v = case["k"].clone(), case["v"].clone()
    run_case(case)
    assert same_bits(case["k"], k) and same_bits(case["v"], v)
    written = read_slots(case["k_cache"], "bhsd", case["slots"])
    assert same_bits(written[..., 4:], case["k_bshd"][..., 4:])  # past rotary_dim: copied as they are


def test_strided_caches_and_inputs():
    """Caches that are views (a bhsd cache as a transposed bshd buffer, every other slot of a larger one), k and v
    slices of one fused projection, positions int32: written where they lie, nothing else touched."""
    g = torch.Generator().manual_seed(3)
    qkv = randn(2, 4, 4 + 2 + 2, 8, generator=g)
    q, k, v = qkv[:, :, :4].clone(), qkv[:, :, 4:6], qkv[:, :, 6:]
    big_k = randn(2, 20, 2, 8, generator=g)
    big_v = randn(2, 2, 40, 8, generator=g)
    k_cache = big_k.transpose(1, 2)  # bhsd view of bshd memory
    v_cache = big_v[:, :, ::2]  # every other slot
    positions = torch.tensor([[0, 5, 9, 2], [7, 1, 3, 8]], dtype=torch.int32)
    inv_freq = FQ.rope(8)[0]
    k_before, v_before, q_before = big_k.clone(), big_v.clone(), q.clone()
    PF.rope_qk_cache_(q, k, v, k_cache, v_cache, positions, inv_freq)
    rq, rk = PF.rope_qk(q_before, k, positions, inv_freq)
    assert same_bits(q, rq)
    assert same_bits(read_slots(k_cache, "bhsd", positions.long()), rk)
    assert same_bits(read_slots(v_cache, "bhsd", positions.long()), v)
    expected_k = big_k.clone()
    expected_k[torch.arange(2)[:, None], positions.long()] = rk
    assert same_bits(big_k, expected_k)
    expected_v = v_before.clone()
    expected_v[:, :, ::2].transpose(1, 2)[torch.arange(2)[:, None], positions.long()] = v
    assert same_bits(big_v, expected_v)  # the odd slots, between the view's, untouched
    assert not torch.equal(k_before, big_k)


def test_decoding_step_by_step_fills_the_cache_like_one_prefill():
    """A prefill of 4 tokens then 3 single-token steps (positions absent, offset = tokens so far) leave the caches
    as one call on all 7 tokens does; q of each step equals that call's q rows."""
    g = torch.Generator().manual_seed(5)
    q, k, v = randn(2, 7, 4, 16, generator=g), randn(2, 7, 2, 16, generator=g), randn(2, 7, 2, 16, generator=g)
    inv_freq = FQ.rope(16)[0]
    k_all, v_all = torch.zeros(2, 2, 10, 16), torch.zeros(2, 2, 10, 16)
    q_all = q.clone()
    PF.rope_qk_cache_(q_all, k, v, k_all, v_all, None, inv_freq)
    k_step, v_step = torch.zeros(2, 2, 10, 16), torch.zeros(2, 2, 10, 16)
    for start, end in ((0, 4), (4, 5), (5, 6), (6, 7)):
        q_part = q[:, start:end].clone()
        PF.rope_qk_cache_(q_part, k[:, start:end], v[:, start:end], k_step, v_step, None, inv_freq, offset=start)
        assert same_bits(q_part, q_all[:, start:end])
    assert same_bits(k_step, k_all) and same_bits(v_step, v_all)


def test_thd_pool_with_packed_sequences_equals_each_sequence_alone():
    """Packed sequences into one pool: each sequence's tokens rotated from the offset, at its own cache_positions."""
    g = torch.Generator().manual_seed(6)
    q, k, v = randn(7, 3, 8, generator=g), randn(7, 1, 8, generator=g), randn(7, 1, 8, generator=g)
    inv_freq = FQ.rope(8)[0]
    cache_positions = torch.tensor([10, 11, 12, 0, 1, 2, 3])
    k_pool, v_pool = torch.zeros(16, 1, 8), torch.zeros(16, 1, 8)
    q_packed = q.clone()
    PF.rope_qk_cache_(q_packed, k, v, k_pool, v_pool, None, inv_freq, cache_positions, "shd", 1.0, "gptj", "thd", 2,
                      torch.tensor([0, 3, 7]))
    for start, end in ((0, 3), (3, 7)):
        q_alone = q[start:end].clone()
        k_alone, v_alone = torch.zeros(16, 1, 8), torch.zeros(16, 1, 8)
        PF.rope_qk_cache_(q_alone, k[start:end], v[start:end], k_alone, v_alone, None, inv_freq,
                          cache_positions[start:end], "shd", 1.0, "gptj", "thd", 2)
        assert same_bits(q_alone, q_packed[start:end])
        slots = cache_positions[start:end]
        assert same_bits(k_alone[slots], k_pool[slots]) and same_bits(v_alone[slots], v_pool[slots])


def test_multiaxis_with_cache_positions():
    """pair_axis (M-RoPE sections): q and k rotated as rope_qk rotates them, placed at cache_positions."""
    g = torch.Generator().manual_seed(8)
    q, k, v = randn(2, 4, 4, 16, generator=g), randn(2, 4, 2, 16, generator=g), randn(2, 4, 2, 16, generator=g)
    inv_freq, pair_axis = FQ.mrope(16, [2, 3, 3])
    positions = torch.randint(0, 500, (3, 2, 4), generator=g)
    cache_positions = torch.tensor([[4, 5, 6, 7], [0, 2, 4, 6]])
    k_cache, v_cache = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    rq, rk = PF.rope_qk(q, k, positions, inv_freq, pair_axis=pair_axis)
    PF.rope_qk_cache_(q, k, v, k_cache, v_cache, positions, inv_freq, cache_positions, "bshd", pair_axis=pair_axis)
    assert same_bits(q, rq)
    assert same_bits(read_slots(k_cache, "bshd", cache_positions), rk)
    assert same_bits(read_slots(v_cache, "bshd", cache_positions), v)


def test_empty_inputs():
    inv_freq = FQ.rope(8)[0]
    k_cache, v_cache = randn(2, 2, 6, 8), randn(2, 2, 6, 8)
    before = k_cache.clone(), v_cache.clone()
    PF.rope_qk_cache_(torch.randn(2, 0, 4, 8), torch.randn(2, 0, 2, 8), torch.randn(2, 0, 2, 8), k_cache, v_cache,
                      None, inv_freq)
    assert same_bits(k_cache, before[0]) and same_bits(v_cache, before[1])
    q = torch.randn(2, 3, 0, 8)  # no query heads: the caches are still written
    PF.rope_qk_cache_(q, torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8), k_cache, v_cache, None, inv_freq)
    assert not same_bits(k_cache, before[0])


# ---------------------------------------------------------------- Hugging Face's StaticCache and apply_rotary_pos_emb

def llama_config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_hidden_layers=1, intermediate_size=64, vocab_size=32,
                                    max_position_embeddings=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_matches_transformers_static_cache(dtype):
    """Batch 2, a prefill of 5 tokens then 3 decoding steps of 1, as a Llama attention layer runs them: HF's
    LlamaRotaryEmbedding's cos/sin, apply_rotary_pos_emb on [B, H, S, D] q and k, then StaticCache.update. Ours:
    one rope_qk_cache_ per step into [B, H_kv, S_max, D] caches, slots from the positions. q and the cache contents
    agree within HF's float32 angles' error (positions < 8: 8 * 2^-23 rad + float32 ulps; bf16: the cos/sin tables
    rounded to bf16 and each of HF's products and sum rounded, 2^-7 of |x1| + |x2|); v and unwritten slots equal."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    config = llama_config()
    cache = transformers.StaticCache(config=config, max_cache_len=12)
    rotary = LlamaRotaryEmbedding(config)
    inv_freq = FQ.rope(16, 10000.0)[0]
    assert_close(rotary.inv_freq, inv_freq.float(), rtol=1e-6, atol=0)
    k_cache, v_cache = torch.zeros(2, 2, 12, 16, dtype=dtype), torch.zeros(2, 2, 12, 16, dtype=dtype)
    g = torch.Generator().manual_seed(9)
    per_unit = 8 * 2.0 ** -23 + 2.0 ** -20 if dtype == torch.float32 else 2.0 ** -7
    start = 0
    for length in (5, 1, 1, 1):
        q, k, v = (randn(2, heads, length, 16, dtype=dtype, generator=g) for heads in (4, 2, 2))
        position_ids = torch.arange(start, start + length)[None].expand(2, length)
        cos, sin = rotary(v, position_ids)
        with torch.no_grad():
            hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = cache.update(hf_k, v, 0)
        ours = q.clone()
        PF.rope_qk_cache_(ours, k, v, k_cache, v_cache, position_ids, inv_freq, None, "bhsd", 1.0, "neox", "bhsd")
        for got, theirs, x in ((ours, hf_q, q), (k_cache[:, :, start:start + length], hf_k, k)):
            pair_sum = x.double().abs()[..., :8] + x.double().abs()[..., 8:]
            tolerance = per_unit * torch.cat([pair_sum, pair_sum], -1)
            difference = (got.double() - theirs.double()).abs()
            assert (difference <= tolerance).all(), f"max excess {(difference - tolerance).max().item()}"
        assert keys.shape == k_cache.shape and keys.dtype == dtype
        assert torch.equal(values, v_cache)
        assert torch.equal(keys[:, :, start + length:], k_cache[:, :, start + length:])  # zeros, not yet written
        start += length
    # Compared as a whole at the end: every slot HF filled, within the tolerance of its k.
    assert_close(keys.double(), k_cache.double(), atol=4e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_matches_transformers_with_explicit_cache_positions_per_row():
    """Left-padded batch rows: HF's position_ids differ per row ([B, S]) while both rows write the same cache slots
    (StaticCache's cache_position): cache_positions [S] shared by the rows, rotary positions per row."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    rotary = LlamaRotaryEmbedding(llama_config())
    g = torch.Generator().manual_seed(10)
    q, k, v = (randn(2, heads, 3, 16, generator=g) for heads in (4, 2, 2))
    position_ids = torch.tensor([[4, 5, 6], [1, 2, 3]])  # row 1 had 3 pad tokens
    cache_position = torch.tensor([4, 5, 6])
    cos, sin = rotary(v, position_ids)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    hf_keys, hf_values = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    hf_keys.index_copy_(2, cache_position, hf_k)
    hf_values.index_copy_(2, cache_position, v)
    k_cache, v_cache = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    ours = q.clone()
    PF.rope_qk_cache_(ours, k, v, k_cache, v_cache, position_ids, FQ.rope(16)[0], cache_position, "bhsd", 1.0, "neox",
                      "bhsd")
    assert_close(ours, hf_q, atol=1e-5, rtol=0)
    assert_close(k_cache, hf_keys, atol=1e-5, rtol=0)
    assert torch.equal(v_cache, hf_values)


# ---------------------------------------------------------------- the query scale (Llama 4, Ministral 3)

@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_q_scale_equals_rope_qk_with_the_same_arguments(fmt, cache_format):
    """q scaled as rope_qk scales it (bits), k into its cache unscaled, for every format (positions [B, S] up to
    5000, thd packed with cache_positions)."""
    case = make_case(fmt, "per_row", cache_format, torch.float32, seed=11, rotary_dim=16, head_dim=16)
    if case["positions"] is not None:
        case["positions"] = case["positions"] * 200  # several steps of the length; cache_positions place them
        case["cache_positions"] = case["slots"].clone()
        case["absolute"] = case["positions"].double()[..., None].expand_as(case["absolute"])
    case["q_scale"] = (0.3, 2, 1)
    before_q = case["q"].clone()
    run_case(case)
    check_case(case, before_q)
    unscaled = PF.rope_qk(before_q, case["k"], case["positions"], case["inv_freq"], 1.0, "neox", fmt, case["offset"],
                          case["cu_seqlens"])[0]
    assert not torch.equal(case["q"], unscaled)


def test_q_scale_refusals_name_the_op():
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
    caches = torch.zeros(2, 1, 8, 8), torch.zeros(2, 1, 8, 8)
    with pytest.raises(RuntimeError, match=r"posenc\.rope_qk_cache_: q_scale_length must be >= 1, got 0"):
        PF.rope_qk_cache_(q, k, v, *caches, None, FQ.rope(8)[0], q_scale_length=0)
    with pytest.raises(RuntimeError, match=r"posenc\.rope_qk_cache_: q_scale_beta needs q's heads fully rotated"):
        PF.rope_qk_cache_(q, k, v, *caches, None, FQ.rope(4)[0], q_scale_beta=0.1)


# ---------------------------------------------------------------- bad input

Q, K, V = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
INV = FQ.rope(8)[0]


def caches(shape=(2, 2, 6, 8), dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def call(q=None, k=K, v=V, k_cache=None, v_cache=None, positions=None, inv_freq=INV, **kwargs):
    k_cache = caches()[0] if k_cache is None else k_cache
    v_cache = caches()[1] if v_cache is None else v_cache
    return PF.rope_qk_cache_(Q.clone() if q is None else q, k, v, k_cache, v_cache, positions, inv_freq, **kwargs)


OP = r"posenc\.rope_qk_cache_: "
BAD_CALLS = {
    "slot from the offset past S_max": (
        lambda: call(offset=4), OP + r"position 6 is outside \[0, S_max\) with S_max = 6"),
    "slot from positions past S_max": (
        lambda: call(positions=torch.tensor([0, 6, 1])), OP + r"position 6 is outside \[0, S_max\)"),
    "negative slot from positions": (
        lambda: call(positions=torch.tensor([[0, 1, 2], [3, -1, 4]])), OP + r"position -1 is outside \[0, S_max\)"),
    "cache_positions past S_max": (
        lambda: call(cache_positions=torch.tensor([0, 1, 6])),
        OP + r"cache_positions holds 6 at flat index 2, outside \[0, S_max\) with S_max = 6"),
    "negative cache_positions": (
        lambda: call(cache_positions=torch.tensor([[0, 1, 2], [-1, 3, 4]])),
        OP + r"cache_positions holds -1 at flat index 3"),
    "int64 max cache position": (
        lambda: call(cache_positions=torch.tensor([0, 1, 2 ** 63 - 1])),
        OP + r"cache_positions holds 9223372036854775807"),
    "duplicate slots in a row": (
        lambda: call(cache_positions=torch.tensor([[0, 1, 2], [3, 4, 3]])),
        OP + r"tokens 3 and 5 .* both go to slot 3 of their batch row's caches"),
    "duplicate slots from positions": (
        lambda: call(positions=torch.tensor([2, 1, 2])), OP + r"tokens 0 and 2 .* both go to slot 2"),
    "pooled caches with shared positions": (
        lambda: call(k_cache=torch.zeros(6, 2, 8), v_cache=torch.zeros(6, 2, 8), cache_format="shd"),
        OP + r"tokens 0 and 3 .* both go to slot 0 of the pooled caches"),
    "pooled caches with shared cache_positions": (
        lambda: call(k_cache=torch.zeros(6, 2, 8), v_cache=torch.zeros(6, 2, 8), cache_format="shd",
                     cache_positions=torch.tensor([3, 4, 5])),
        OP + r"tokens 0 and 3 .* both go to slot 3 of the pooled caches"),
    "packed sequences restart into the same slots": (
        lambda: call(Q[0].clone(), K[0], V[0], torch.zeros(6, 2, 8), torch.zeros(6, 2, 8), format="thd",
                     cache_format="shd", cu_seqlens=torch.tensor([0, 1, 3])),
        OP + r"tokens 0 and 1 .* both go to slot 0 of the pooled caches"),
    "k_cache wrong rank": (lambda: call(k_cache=torch.zeros(2, 6, 8)),
                           OP + r'k_cache must be 4-D for cache_format "bhsd", got shape \[2, 6, 8\]'),
    "shd cache of rank 4": (lambda: call(k_cache=torch.zeros(1, 6, 2, 8), v_cache=torch.zeros(1, 6, 2, 8),
                                         cache_format="shd"), OP + r'k_cache must be 3-D for cache_format "shd"'),
    "k_cache other heads": (lambda: call(k_cache=torch.zeros(2, 4, 6, 8)),
                            OP + r"k_cache has shape \[2, 4, 6, 8\] in cache_format \"bhsd\", whose batch, heads"),
    "v_cache other batch": (lambda: call(v_cache=torch.zeros(1, 2, 6, 8)), OP + r"v_cache has shape \[1, 2, 6, 8\]"),
    "k_cache other head_dim": (lambda: call(k_cache=torch.zeros(2, 2, 6, 10)), OP + r"k_cache has shape"),
    "bshd cache in bhsd order": (lambda: call(k_cache=torch.zeros(2, 6, 2, 8), v_cache=torch.zeros(2, 6, 2, 8)),
                                 OP + r"k_cache has shape \[2, 6, 2, 8\]"),
    "caches of different slots": (lambda: call(v_cache=torch.zeros(2, 2, 7, 8)),
                                  OP + r"k_cache has shape \[2, 2, 6, 8\] but v_cache has shape \[2, 2, 7, 8\]"),
    "k_cache other dtype": (lambda: call(k_cache=torch.zeros(2, 2, 6, 8, dtype=torch.bfloat16)),
                            OP + r"k_cache is BFloat16 but k is Float"),
    "v_cache other dtype": (lambda: call(v_cache=torch.zeros(2, 2, 6, 8, dtype=F64)), OP + r"v_cache is Double"),
    "k_cache on meta": (lambda: call(k_cache=torch.zeros(2, 2, 6, 8, device="meta")),
                        OP + r"k_cache is on meta but the other inputs are on cpu"),
    "v other dtype": (lambda: call(v=V.double()), OP + r"v is Double but k is Float"),
    "v other heads": (lambda: call(v=torch.randn(2, 3, 3, 8)), OP + r"v has shape \[2, 3, 3, 8\] but needs"),
    "v not floating": (lambda: call(v=V.long()), OP + r"v must be a floating tensor"),
    "cache_positions wrong shape": (lambda: call(cache_positions=torch.arange(4)),
                                    OP + r"cache_positions has shape \[4\] but needs \[S\] or \[B, S\]"),
    "cache_positions floating": (lambda: call(cache_positions=torch.arange(3.0)),
                                 OP + r"cache_positions must be an int64 or int32 tensor, got Float"),
    "cache_positions on meta": (lambda: call(cache_positions=torch.arange(3, device="meta")),
                                OP + r"cache_positions is on meta"),
    "floating positions without cache_positions": (
        lambda: call(positions=torch.arange(3.0, dtype=F64)),
        OP + r"positions are Double coordinates, not cache slots; pass cache_positions"),
    "half positions with cache_positions": (
        lambda: call(positions=torch.arange(3.0).half(), cache_positions=torch.arange(3)),
        OP + r"positions must be an int64, int32, float32 or float64 tensor, got Half"),
    "pair_axis without cache_positions": (
        lambda: call(positions=torch.zeros(2, 3, dtype=torch.long), inv_freq=FQ.axial(8, 2)[0],
                     pair_axis=FQ.axial(8, 2)[1]),
        OP + r"with pair_axis a token has several positions; pass cache_positions"),
    "unknown cache_format": (lambda: call(cache_format="bhds"),
                             OP + r'cache_format must be "bhsd", "bshd" or "shd", got "bhds"'),
    "cache_format thd": (lambda: call(cache_format="thd"), OP + r'cache_format must be .* got "thd"'),
    "q and k_cache share memory": (
        lambda: (lambda buffer: call(buffer.view(2, 3, 4, 8), k_cache=buffer.view(2, 2, 6, 8)))(torch.randn(192)),
        OP + r"k_cache and q may share elements"),
    "k_cache and v_cache share memory": (lambda: (lambda c: call(k_cache=c, v_cache=c))(torch.zeros(2, 2, 6, 8)),
                                         OP + r"k_cache and v_cache may share elements"),
    "k_cache is k's memory": (
        lambda: (lambda c: call(k=c[:, :, :3].transpose(1, 2), k_cache=c))(torch.zeros(2, 2, 6, 8)),
        OP + r"k_cache and k may share elements"),
    "v_cache is v's memory": (
        lambda: (lambda c: call(v=c[:, :, 2:5].transpose(1, 2), v_cache=c))(torch.zeros(2, 2, 6, 8)),
        OP + r"v_cache and v may share elements"),
    "k_cache overlapping itself": (lambda: call(k_cache=torch.zeros(2, 2, 1, 8).expand(2, 2, 6, 8)),
                                   OP + r"k_cache has elements that share memory"),
    "q overlapping itself": (lambda: call(q=torch.zeros(2, 3, 1, 8).expand(2, 3, 4, 8)),
                             OP + r"q has elements that share memory"),
    "k other seq": (lambda: call(k=torch.randn(2, 4, 2, 8)), OP + r"k has shape"),
    "rotary_dim past head_dim": (lambda: call(inv_freq=FQ.rope(10)[0]), OP + r"rotary_dim 10 exceeds"),
    "position beyond the domain": (
        lambda: call(positions=torch.tensor([0, 1, LIMIT + 1]), cache_positions=torch.arange(3)),
        OP + r"position"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_messages(name):
    """Each refusal names the op and the argument (and the value)."""
    build, message = BAD_CALLS[name]
    with pytest.raises(RuntimeError, match=message):
        build()


# A cache that is its input itself (equal strides): run in a subprocess, since a wrong check could corrupt memory.
ALIASED_CACHES = {
    "k_cache is k": "PF.rope_qk_cache_(q, k, v, k, torch.zeros(1, 2, 2, 4), None, inv_freq)",
    "v_cache is v": "PF.rope_qk_cache_(q, k, v, torch.zeros(1, 2, 2, 4), v, None, inv_freq)",
    "k_cache is k, bshd": "PF.rope_qk_cache_(q, k, v, k, torch.zeros(1, 2, 2, 4), None, inv_freq, None, 'bshd')",
}


@pytest.mark.parametrize("name", list(ALIASED_CACHES))
def test_a_cache_that_is_its_input_is_refused(name):
    """k [1, 2, 2, 4] (bshd) and a bhsd cache [1, 2, 2, 4] have the same strides: the call that passes k as its
    own cache must be refused, naming the op and both arguments, and the process must live on."""
    import subprocess
    import sys
    code = f"""
import torch
from posenc import functional as PF, frequencies as FQ
q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
inv_freq = FQ.rope(4)[0]
try:
    {ALIASED_CACHES[name]}
    print("no error")
except RuntimeError as error:
    print(str(error).splitlines()[0])
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"the process died (exit {run.returncode}): {run.stderr[-2000:]}"
    cache = name.split()[0]
    assert re.search(rf"posenc\.rope_qk_cache_: {cache} and {cache[0]} may share elements", run.stdout), run.stdout


@pytest.mark.parametrize("bad", [dict(cache_positions=torch.tensor([[0, 1, 2], [3, 4, 3]])), dict(offset=4),
                                 dict(positions=torch.tensor([0, 6, 1])), dict(layout="half")])
def test_a_refused_call_writes_nothing(bad):
    """Every check (the slots' values included) runs before the first write: q and the caches stay as they were."""
    q, (k_cache, v_cache) = Q.clone(), caches()
    k_cache.normal_(), v_cache.normal_()
    before = q.clone(), k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match=OP):
        call(q, k_cache=k_cache, v_cache=v_cache, **bad)
    assert all(same_bits(a, b) for a, b in zip((q, k_cache, v_cache), before))


@pytest.mark.parametrize("name", ["q", "k", "v", "k_cache", "v_cache"])
def test_requires_grad_is_refused_under_grad_mode_only(name):
    tensors = dict(q=Q.clone(), k=K.clone(), v=V.clone(), k_cache=caches()[0], v_cache=caches()[1])
    tensors[name].requires_grad_()
    with pytest.raises(RuntimeError, match=OP + r"a tensor requires grad, but the op has no backward; "
                                                r"call it under torch.no_grad\(\)"):
        PF.rope_qk_cache_(tensors["q"], tensors["k"], tensors["v"], tensors["k_cache"], tensors["v_cache"], None, INV)
    for mode in (torch.no_grad, torch.inference_mode):
        fresh = {n: t.detach().clone().requires_grad_(n == name) for n, t in tensors.items()}
        with mode():
            PF.rope_qk_cache_(fresh["q"], fresh["k"], fresh["v"], fresh["k_cache"], fresh["v_cache"], None, INV)
        assert fresh["k_cache"].abs().sum() > 0


def test_bad_input_meta_matches_cpu():
    """The Meta kernel runs the same checks (all but the slot values, which it cannot read)."""
    meta = [t.to("meta") for t in (Q, K, V, *caches())]
    PF.rope_qk_cache_(*meta, None, INV.to("meta"))
    with pytest.raises(RuntimeError, match=OP + r"k_cache has shape \[2, 4, 6, 8\]"):
        PF.rope_qk_cache_(*meta[:3], torch.empty(2, 4, 6, 8, device="meta"), meta[4], None, INV.to("meta"))
    with pytest.raises(RuntimeError, match=OP + r'cache_format must be "bhsd", "bshd" or "shd", got "x"'):
        PF.rope_qk_cache_(*meta, None, INV.to("meta"), cache_format="x")


# ---------------------------------------------------------------- opcheck, compile, export, TorchScript

def opcheck_samples():
    inv_freq = FQ.rope(6)[0]
    q, k, v = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8), torch.randn(2, 5, 1, 4)
    yield "bhsd", (q, k, v, torch.randn(2, 1, 9, 8), torch.randn(2, 1, 9, 4), torch.tensor([3, 0, 8, 1, 2]),
                   inv_freq)
    yield "bshd per row", (q, k, v, torch.randn(2, 9, 1, 8), torch.randn(2, 9, 1, 4), None, inv_freq,
                           torch.tensor([[0, 1, 2, 3, 4], [8, 7, 6, 5, 4]]), "bshd", 0.5, "gptj", "bshd", 2)
    yield "shd thd", (q[0], k[0], v[0], torch.randn(9, 1, 8), torch.randn(9, 1, 4), None, inv_freq,
                      torch.tensor([4, 5, 6, 0, 1]), "shd", 1.0, "neox", "thd", 0, torch.tensor([0, 3, 5]))


@pytest.mark.parametrize("sample_args", list(opcheck_samples()), ids=lambda s: s[0])
def test_opcheck(sample_args):
    _, args = sample_args
    torch.library.opcheck(torch.ops.posenc.rope_qk_cache_.default, args)


class Decoder(torch.nn.Module):
    """One attention layer's cache and rotary prologue: caches and frequencies held as buffers."""

    def __init__(self, batch=2, kv_heads=2, slots=16, head_dim=8):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, slots, head_dim))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, slots, head_dim))
        self.register_buffer("inv_freq", FQ.rope(head_dim)[0])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = q * 1.0  # a fresh q to rotate in place
        PF.rope_qk_cache_(q, k, v, self.k_cache, self.v_cache, positions, self.inv_freq, None, "bhsd", 1.0, "neox",
                          "bhsd")
        scores = torch.matmul(q, self.k_cache.repeat_interleave(2, 1).transpose(-1, -2))
        return torch.matmul(scores.softmax(-1), self.v_cache.repeat_interleave(2, 1))


def decoder_inputs(seed, start, length):
    g = torch.Generator().manual_seed(seed)
    return (randn(2, 4, length, 8, generator=g), randn(2, 2, length, 8, generator=g),
            randn(2, 2, length, 8, generator=g), torch.arange(start, start + length)[None].expand(2, length))


def run_steps(model, steps=((0, 3), (3, 1), (4, 1))):
    outs = [model(*decoder_inputs(20 + i, start, length)) for i, (start, length) in enumerate(steps)]
    return outs, model.k_cache.clone(), model.v_cache.clone()


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    inv_freq = FQ.rope(8)[0]

    def step(q, k, v, k_cache, v_cache, positions):
        q = q * 2
        PF.rope_qk_cache_(q, k, v, k_cache, v_cache, positions, inv_freq)
        return q + 1

    inputs = decoder_inputs(1, 2, 3)
    q, k, v = (t.transpose(1, 2) for t in inputs[:3])
    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        k_cache, v_cache = torch.zeros(2, 2, 8, 8), torch.zeros(2, 2, 8, 8)
        results.append((fn(q, k, v, k_cache, v_cache, inputs[3]), k_cache, v_cache))
    for a, b in zip(*results):
        assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert results[0][1].abs().sum() > 0


def test_compile_module_decoding_steps():
    torch._dynamo.reset()
    eager, compiled_model = Decoder(), Decoder()
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    for a, b in zip(run_steps(eager)[0], run_steps(compiled)[0]):
        assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert same_bits(eager.k_cache, compiled_model.k_cache) and same_bits(eager.v_cache, compiled_model.v_cache)


def test_export_with_caches_as_buffers_equals_eager():
    model, reference = Decoder(), Decoder()
    inputs = decoder_inputs(30, 0, 3)
    exported = torch.export.export(model, inputs)
    assert "posenc.rope_qk_cache_" in str(exported.graph)
    module = exported.module()
    got = module(*inputs)
    want = reference(*inputs)
    assert same_bits(got, want)
    assert same_bits(module.k_cache, reference.k_cache) and same_bits(module.v_cache, reference.v_cache)
    step = decoder_inputs(31, 3, 3)  # a second call with the same shapes: the caches keep the first call's slots
    assert same_bits(module(*step), reference(*step))
    assert same_bits(module.k_cache, reference.k_cache)
    assert (reference.k_cache[:, :, :6].abs().sum(-1) > 0).all() and (reference.k_cache[:, :, 6:] == 0).all()


def test_torchscript_module():
    model, reference = torch.jit.script(Decoder()), Decoder()
    for a, b in zip(run_steps(model)[0], run_steps(reference)[0]):
        assert same_bits(a, b)
    assert same_bits(model.k_cache, reference.k_cache) and same_bits(model.v_cache, reference.v_cache)


# ---------------------------------------------------------------- coverage: sample call, property, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (determinism, concurrency, no_grad,
# CUDA and CPU-capability tests run the sample; test_properties.py the property; bad_input_fuzzer.py the cases).

def distinct_slots(rows, per_row, slots, seed):
    """[rows, per_row] slots, distinct within each row: the first per_row of a permutation of range(slots) per row
    (one row for a pool)."""
    assert per_row <= slots, (per_row, slots)
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(slots, generator=g)[:per_row] for _ in range(rows)]) if rows else \
        torch.empty(0, per_row, dtype=torch.long)


@sample("rope_qk_cache_")
def _build_rope_qk_cache_(m):
    """Not differentiable (no inputs). Large: bshd q [2, 512, 8, 128], GQA (2 kv heads), Llama 3 frequencies,
    positions [B, S] up to 1e5, HF's bhsd caches of 1024 slots at cache_positions [B, S] (distinct per row). Small:
    packed sequences (thd, cu_seqlens with an empty one, positions absent, offset 1) into one pool of slots ("shd",
    cache_positions [T]), partial rotary (65 pairs of 134 channels), gptj, scale 0.9, v of 67 channels as a
    channel-strided view."""
    if m.large:
        q, k, v = m.floats(2, 512, 8, 128, seed=140), m.floats(2, 512, 2, 128, seed=141), m.floats(2, 512, 2, 128,
                                                                                                  seed=142)
        k_cache, v_cache = m.floats(2, 2, 1024, 128, seed=143), m.floats(2, 2, 1024, 128, seed=144)
        inv_freq = FQ.rope(128, 500000.0, {"rope_type": "llama3", "factor": 8.0})[0]
        return call_args(q, k, v, k_cache, v_cache, m.ints(100000, 2, 512, seed=145), m.fixed(inv_freq),
                         distinct_slots(2, 512, 1024, 146).to(m.device))
    q, k = m.floats(16, 4, 134, seed=140), m.floats(16, 2, 134, seed=141)
    v = m.floats(16, 2, 134, seed=142)[..., ::2]
    k_cache, v_cache = m.floats(24, 2, 134, seed=143), m.floats(24, 2, 67, seed=144)
    inv_freq = FQ.rope(130, 500.0)[0]
    cache_positions = distinct_slots(1, 16, 24, 145)[0].to(m.device)
    return call_args(q, k, v, k_cache, v_cache, None, m.fixed(inv_freq), cache_positions, "shd", 0.9, "gptj", "thd", 1,
                     torch.tensor([0, 5, 5, 16]))


# ---- property: random valid inputs against the float64 formula (test_properties.py)

def cache_case(draw):
    """A random valid call: rope_qk's draws for q and k (format, sizes 0 and 1 among the others, dtype, layout,
    positions anywhere in the domain, packed sequences, multi-axis), v of its own head_dim, a cache format, and the
    slots: cache_positions (int64 or int32, [S] or [B, S], distinct per cache row) or, half of the time when the
    call allows it, the rotary positions themselves (absent with an offset, [S] or [B, S], made to be distinct
    slots). Caches and q laid out at random in NaN-filled memory; k and v may be broadcast views."""
    gen = generator(draw)
    fmt = draw(st.sampled_from(FORMATS))
    cache_format = draw(st.sampled_from(CACHE_FORMATS))
    batch = 1 if fmt == "thd" else draw(st.integers(0, 3))
    seq, pairs = draw(st.integers(0, 5)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    inv_freq = frequencies(draw, pairs)
    heads, kv_heads = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    head_dim = 2 * pairs + draw(st.integers(0, 3))
    q, q_bshd = rope_input(draw, gen, fmt, batch, seq, heads, head_dim, dtype, expand=False)
    k, k_bshd = rope_input(draw, gen, fmt, batch, seq, kv_heads, head_dim, dtype)
    v, v_bshd = rope_input(draw, gen, fmt, batch, seq, kv_heads, draw(st.integers(0, 4)), dtype)
    pooled = cache_format == "shd"
    # Tokens per cache row: every token for the pool, a batch row's otherwise.
    slots_count = max(batch * seq if pooled else seq, seq) + draw(st.integers(0, 3))
    seed = draw(st.integers(0, 99))
    index_dtype = draw(st.sampled_from([torch.long, torch.int]))

    def slot_values(shared):
        if shared:
            return distinct_slots(1, seq, slots_count, seed)[0]
        if pooled:
            return distinct_slots(1, batch * seq, slots_count, seed).view(batch, seq)
        return distinct_slots(batch, seq, slots_count, seed)

    if draw(st.booleans()):  # the rotary positions are the slots
        cu_seqlens, pair_axis, cache_positions = None, None, None
        kind = draw(st.sampled_from(["absent", "shared", "per_row"] if not pooled or batch <= 1 else ["per_row"]))
        if kind == "absent":
            positions, offset = None, draw(st.integers(0, 3))
            slots_count += offset
            slots = (torch.arange(seq) + offset)[None].expand(batch, seq)
        else:
            values = slot_values(kind == "shared" or fmt == "thd")
            offset = draw(st.integers(-3, 3))
            base = (values - offset).to(index_dtype)
            positions = drawn_tensor(draw, list(base.shape), lambda s: base.clone(), expand=False)
            slots = values.expand(batch, seq)
        absolute = slots.double()[..., None].expand(batch, seq, pairs)
    else:
        positions, offset, cu_seqlens, pair_axis, absolute = rope_positions(draw, gen, fmt, batch, seq, pairs)
        values = slot_values(fmt == "thd" or ((not pooled or batch <= 1) and draw(st.booleans())))
        cache_positions = arrange(draw, values.to(index_dtype), expand=False)
        slots = values.expand(batch, seq)
    cache_batch = 1 if fmt == "thd" else batch
    caches = []
    for x_bshd in (k_bshd, v_bshd):
        shape = cache_shape(cache_format, cache_batch, kv_heads, slots_count, x_bshd.shape[-1])
        caches.append(arrange(draw, normal(gen, shape, dtype), expand=False))
    q_scale = None
    if pair_axis is None and head_dim == 2 * pairs and draw(st.integers(0, 3)) == 0:
        q_scale = (draw(st.sampled_from([0.1, 0.5])), draw(st.integers(1, 4)), draw(st.integers(0, 2)))
    scale = draw(st.sampled_from([1.0, 0.5, 1.25]))
    layout = draw(st.sampled_from(["neox", "gptj"]))
    note(f"{fmt} {dtype} q {list(q.shape)} stride {q.stride()}, k {list(k.shape)}, v {list(v.shape)}, "
         f"{cache_format} caches {list(caches[0].shape)} stride {caches[0].stride()} / {list(caches[1].shape)}, "
         f"positions {None if positions is None else (positions.dtype, positions.tolist())}, offset {offset}, "
         f"cache_positions {None if cache_positions is None else cache_positions.tolist()}, cu_seqlens {cu_seqlens}, "
         f"pair_axis {None if pair_axis is None else pair_axis.tolist()}, q_scale {q_scale}")
    return dict(fmt=fmt, cache_format=cache_format, dtype=dtype, layout=layout, scale=scale, q=q, k=k, v=v,
                q_bshd=q_bshd.clone(), k_bshd=k_bshd, v_bshd=v_bshd, k_cache=caches[0], v_cache=caches[1],
                k_cache_before=caches[0].clone(), v_cache_before=caches[1].clone(), positions=positions,
                offset=offset, cu_seqlens=cu_seqlens, pair_axis=pair_axis, cache_positions=cache_positions,
                inv_freq=inv_freq, absolute=absolute, slots=slots, q_scale=q_scale)


@property_check("rope_qk_cache_")
@given(st.data())
def check_rope_qk_cache(data):
    """The float64 formula (q, the written rows), v's bits, unwritten slots and memory outside the views unchanged,
    rope_qk's bits; the Meta kernel accepts the call."""
    case = cache_case(data.draw)
    before_q = case["q"].clone()
    written = [case["q"], case["k_cache"], case["v_cache"]]
    storages = [buffer_of(t) for t in written]
    before = [s.clone() for s in storages]
    meta = {name: value.to("meta") if isinstance(value, torch.Tensor) else value for name, value in case.items()}
    run_case(meta)
    assert run_case(case) is None
    check_case(case, before_q)
    for view, storage, old in zip(written, storages, before):
        outside = torch.ones(storage.numel(), dtype=torch.bool)
        outside[covered_offsets(view)] = False
        assert same_bits(storage[outside], old[outside], any_nan=True), "wrote outside the view"


# ---- bad inputs: a small valid call, and the mutations that each make one argument wrong

def rope_qk_cache_base(draw):
    pairs, batch, seq = small(draw), small(draw), small(draw, 2, 3)
    heads, kv_heads = small(draw), small(draw)
    head_dim = 2 * pairs + small(draw, 0, 2)
    slots = seq + small(draw, 0, 2)
    return dict(q=randn(batch, seq, heads, head_dim), k=randn(batch, seq, kv_heads, head_dim, seed=1),
                v=randn(batch, seq, kv_heads, head_dim, seed=2), k_cache=torch.zeros(batch, kv_heads, slots, head_dim),
                v_cache=torch.zeros(batch, kv_heads, slots, head_dim), positions=None,
                inv_freq=torch.rand(pairs, dtype=F64), cache_positions=None, cache_format="bhsd", attention_scale=1.0,
                layout="neox", format="bshd", offset=0, cu_seqlens=None)


def seq_of(kw):
    return kw["q"].shape[1]


def slots_of(kw):
    return kw["k_cache"].shape[2]


def with_cache_positions(mutate):
    """mutate after giving the call cache_positions (the slots 0 ... S - 1), so that a multi-axis call (which needs
    them) is valid up to the mutation."""
    def build(draw, kw):
        kw["cache_positions"] = torch.arange(seq_of(kw))
        mutate(draw, kw)
    return build


def share_memory(written, other):
    """`written` (a cache or q) made a view of the memory of `other`, overlapping it."""
    def mutate(draw, kw):
        target = kw[written]
        buffer = torch.zeros(max(target.numel(), kw[other].numel()) + 4, dtype=target.dtype)
        start = draw(st.integers(0, 2))
        kw[other] = buffer[start:start + kw[other].numel()].view(kw[other].shape).copy_(kw[other])
        kw[written] = buffer[:target.numel()].view(target.shape)
    return mutate


def slot_out_of_range(draw, kw):
    seq, slots = seq_of(kw), slots_of(kw)
    how = draw(st.sampled_from(["cache_positions", "positions", "offset"]))
    bad = [slots, slots + 5, -1, 2 ** 63 - 1, -2 ** 63]
    if how == "cache_positions":
        kw["cache_positions"] = torch.arange(seq)
        put("cache_positions", bad)(draw, kw)
    elif how == "positions":
        kw["positions"] = torch.arange(seq)
        put("positions", [slots, slots + 5, -1])(draw, kw)
    else:
        kw["offset"] = draw(st.sampled_from([slots - seq + 1, slots, -1, -seq]))


def slots_shared(draw, kw):
    """Two tokens of one cache row at one slot: cache_positions with a repeat ([S] or [B, S]), positions with one."""
    seq = seq_of(kw)
    values = torch.arange(seq)
    i, j = draw(st.permutations(range(seq)))[:2]
    values[i] = values[j]
    if draw(st.booleans()):
        kw["cache_positions"] = values if draw(st.booleans()) else values.expand(kw["q"].shape[0], seq).clone()
    else:
        kw["positions"] = values


def pooled_shared_slots(draw, kw):
    """One pool ("shd") for two batch rows that take the same slots (positions shared, or absent)."""
    for name in ("q", "k", "v"):
        kw[name] = torch.cat([kw[name], kw[name]], 0)
    for name in ("k_cache", "v_cache"):
        kw[name] = kw[name][0].transpose(0, 1).contiguous()
    kw["cache_format"] = "shd"
    if draw(st.booleans()):
        kw["cache_positions"] = torch.arange(seq_of(kw))


def other_cache_format(draw, kw):
    """The caches, [B, Hkv, S_max, D], read as another format; where S_max equals Hkv they would fit "bshd" too
    (the fuzzer's long profile drew such a call), so S_max grows by one."""
    if kw["k_cache"].shape[1] == kw["k_cache"].shape[2]:
        for name in ("k_cache", "v_cache"):
            kw[name] = torch.cat([kw[name], kw[name][:, :, :1]], 2)
    kw["cache_format"] = draw(st.sampled_from(["bshd", "shd"]))


def requires_grad(draw, kw):
    name = draw(st.sampled_from(["q", "k", "v", "k_cache", "v_cache"]))
    kw[name] = kw[name].clone().requires_grad_()


def cache_mutations():
    out = rope_mutations(["q", "k"], inplace=True)
    for name in [n for n in out if n.startswith("pair_axis")]:
        out[name] = with_cache_positions(out[name])
    out.update({
        "v_not_floating": not_floating("v"),
        "v_other_dtype": to_dtype("v", torch.float64, torch.bfloat16),
        "v_other_heads": grow("v", 2),
        "v_other_seq": grow("v", 1),
        "k_cache_wrong_rank": wrong_rank("k_cache", [0, 1, 3, 5]),
        "v_cache_wrong_rank": wrong_rank("v_cache", [3, 5]),
        "k_cache_other_dtype": to_dtype("k_cache", torch.float64, torch.bfloat16, torch.float16),
        "v_cache_not_floating": not_floating("v_cache"),
        "k_cache_other_batch": grow("k_cache", 0),
        "k_cache_other_heads": grow("k_cache", 1),
        "v_cache_other_head_dim": grow("v_cache", 3),
        "caches_other_slots": grow("v_cache", 2, by=1),
        "k_cache_on_meta": on_meta("k_cache"),
        "v_cache_on_meta": on_meta("v_cache"),
        "cache_format_unknown": unknown_string("cache_format", {"bhsd", "bshd", "shd"}),
        "cache_format_other": other_cache_format,
        "slot_out_of_range": slot_out_of_range,
        "slots_shared": slots_shared,
        "pooled_shared_slots": pooled_shared_slots,
        "cache_positions_not_index": with_cache_positions(not_index("cache_positions")),
        "cache_positions_wrong_shape": with_cache_positions(lambda draw, kw: kw.update(cache_positions=draw(
            st.sampled_from([torch.arange(seq_of(kw) + 1), torch.zeros(kw["q"].shape[0] + 1, seq_of(kw),
                                                                        dtype=torch.long),
                             torch.zeros(1, 1, seq_of(kw), dtype=torch.long), torch.tensor(0)])))),
        "cache_positions_on_meta": with_cache_positions(on_meta("cache_positions")),
        "pair_axis_without_cache_positions": lambda draw, kw: kw.update(
            positions=torch.zeros(2, seq_of(kw), dtype=torch.long),
            pair_axis=torch.zeros(kw["inv_freq"].numel(), dtype=torch.long)),
        "requires_grad": requires_grad,
        "k_cache_overlapping": overlapping("k_cache"),
        "v_cache_overlapping": overlapping("v_cache"),
        "q_shares_k_cache": share_memory("k_cache", "q"),
        "v_cache_shares_k_cache": share_memory("v_cache", "k_cache"),
        "k_cache_shares_k": share_memory("k_cache", "k"),
        "v_cache_shares_v": share_memory("v_cache", "v"),
    })
    return out


bad_inputs("rope_qk_cache_", base=rope_qk_cache_base, mutations=cache_mutations())


# ---------------------------------------------------------------- the example of docs/decoding.md

DOC = Path(__file__).resolve().parents[2] / "docs" / "decoding.md"


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", DOC.read_text())) if DOC.exists() else 0))
def test_docs_examples_run(index):
    """Every Python block of the page runs as pasted (its asserts compare with rope_qk and a cache written by hand)."""
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[index]
    exec(compile(block, f"{DOC.name}[{index}]", "exec"), {})
