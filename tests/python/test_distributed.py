"""DTensor inputs (posenc.distributed): two gloo processes on CPU run every check below on sharded tensors and
compare the results, forward and backward, with the unsharded ops on the full tensors. The output
placements are checked too, so a rule that silently gathered everything would fail.

One spawn serves the whole file (about 5 s of process start-up on an idle 2-core machine): the workers run
every check, record each outcome and write it to a file, and each test reads its check's outcome.
"""
import json
import multiprocessing
import re
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import op_registry
import posenc
from posenc import functional as PF

WORLD_SIZE = 2
CHECKS = {}
DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------- helpers run inside the workers

def _dt():
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    return Partial, Replicate, Shard, distribute_tensor


def _run_sharded(op, mesh, inputs, placements, grad_wrt=(), out_placements=None, exact=True):
    """op on the full inputs and on DTensors with the given placements (None: an argument passed as is);
    asserts equal outputs (bit for bit when ``exact``: each rank runs the same kernel on its rows) with the
    expected placements, and equal gradients of the inputs named by index."""
    _, Replicate, _, distribute_tensor = _dt()
    full = [t.detach().requires_grad_(i in grad_wrt) if isinstance(t, torch.Tensor) else t
            for i, t in enumerate(inputs)]
    sharded = [distribute_tensor(t.detach(), mesh, [p]).requires_grad_(i in grad_wrt) if p is not None else t
               for i, (t, p) in enumerate(zip(inputs, placements))]
    expected, actual = op(*full), op(*sharded)
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    for e, a, p in zip(expected, actual, out_placements or [None] * len(actual)):
        assert_close(a.full_tensor(), e, **(dict(rtol=0, atol=0) if exact else {}))
        if p is not None:
            assert a.placements == (p,), f"output placement {a.placements}, expected {p}"
    if grad_wrt:
        grads = [torch.randn_like(e) for e in expected]
        torch.autograd.backward(expected, grads)
        torch.autograd.backward(actual, [distribute_tensor(g, mesh, a.placements) for g, a in zip(grads, actual)])
        for i in grad_wrt:
            assert_close(sharded[i].grad.full_tensor(), full[i].grad)
    return actual


def _qk_norm_inputs(batch, seq, q_weight_size, k_weight_size):
    """inv_freq for head_dim 16; q [batch, seq, 4, 16] and k [batch, seq, 2, 16] (GQA); weights in [0.5, 1.5) of the
    given sizes; positions [batch, seq] below 500."""
    inv_freq = posenc.frequencies.rope(16)[0]
    q, k = torch.randn(batch, seq, 4, 16), torch.randn(batch, seq, 2, 16)
    q_weight, k_weight = torch.rand(q_weight_size) + 0.5, torch.rand(k_weight_size) + 0.5
    return inv_freq, q, k, q_weight, k_weight, torch.randint(0, 500, (batch, seq))


# ---------------------------------------------------------------- rotary

@check
def rope_sharded_over_heads_and_batch_in_every_format(mesh):
    _, Replicate, Shard, _ = _dt()
    inv_freq = posenc.frequencies.rope(16)[0]
    shapes = {"bshd": (4, 6, 4, 16), "bhsd": (4, 4, 6, 16), "sbhd": (6, 4, 4, 16), "thd": (6, 4, 16)}
    dims = {"bshd": (0, 2), "bhsd": (0, 1), "sbhd": (1, 2), "thd": (None, 1)}
    for fmt, shape in shapes.items():
        for layout in ("neox", "gptj"):
            for dim in dims[fmt]:
                if dim is None:
                    continue
                x = torch.randn(shape)
                rope = lambda x, f: PF.rope(x, None, f, 0.5, layout, fmt, 3)  # noqa: E731
                _run_sharded(rope, mesh, [x, inv_freq], [Shard(dim), Replicate()], grad_wrt=(0,),
                             out_placements=[Shard(dim)])


@check
def rope_sharded_over_the_sequence_with_positions_sharded_alongside(mesh):
    _, Replicate, Shard, _ = _dt()
    inv_freq = posenc.frequencies.rope(12)[0]  # partial rotary: 12 of 16 channels
    cases = [("bshd", (2, 8, 3, 16), 1), ("bhsd", (2, 3, 8, 16), 2), ("sbhd", (8, 2, 3, 16), 0),
             ("thd", (8, 3, 16), 0)]
    for fmt, shape, seq in cases:
        x = torch.randn(shape)
        shared = torch.randint(0, 1000, (8,))
        rope = lambda x, p, f: PF.rope(x, p, f, 1.0, "neox", fmt, 5)  # noqa: E731
        _run_sharded(rope, mesh, [x, shared, inv_freq], [Shard(seq), Shard(0), Replicate()], grad_wrt=(0,),
                     out_placements=[Shard(seq)])
        if fmt != "thd":
            per_row = torch.randint(0, 1000, (2, 8))
            _run_sharded(rope, mesh, [x, per_row, inv_freq], [Shard(seq), Shard(1), Replicate()], grad_wrt=(0,),
                         out_placements=[Shard(seq)])
            # batch sharding: [B, S] positions go with their rows, [S] positions are shared
            batch = 1 if fmt == "sbhd" else 0
            _run_sharded(rope, mesh, [x, per_row, inv_freq], [Shard(batch), Shard(0), Replicate()],
                         grad_wrt=(0,), out_placements=[Shard(batch)])
            _run_sharded(rope, mesh, [x, shared, inv_freq], [Shard(batch), Replicate(), Replicate()],
                         grad_wrt=(0,), out_placements=[Shard(batch)])


@check
def rope_without_positions_gathers_a_sequence_shard(mesh):
    # A shard would number its tokens from 0: DTensor must gather x first, and the result stays exact.
    _, Replicate, Shard, _ = _dt()
    inv_freq = posenc.frequencies.rope(16)[0]
    rope = lambda x, f: PF.rope(x, None, f, 1.0, "neox", "bshd", 2)  # noqa: E731
    _run_sharded(rope, mesh, [torch.randn(2, 8, 3, 16), inv_freq], [Shard(1), Replicate()], grad_wrt=(0,),
                 out_placements=[Replicate()])


@check
def rope_cache_key_includes_the_format(mesh):
    # The same input placement means heads in bshd but the sequence in bhsd: the second call must not reuse
    # the first call's sharding decision.
    _, Replicate, Shard, _ = _dt()
    inv_freq = posenc.frequencies.rope(16)[0]
    x = torch.randn(4, 4, 4, 16)
    for fmt, expected in (("bshd", Shard(2)), ("bhsd", Replicate()), ("bshd", Shard(2))):
        rope = lambda x, f: PF.rope(x, None, f, 1.0, "neox", fmt)  # noqa: E731
        _run_sharded(rope, mesh, [x, inv_freq], [Shard(2), Replicate()], out_placements=[expected])


@check
def rope_qk_with_grouped_heads(mesh):
    _, Replicate, Shard, _ = _dt()
    inv_freq, scale = posenc.frequencies.rope(16, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 64})
    q, k = torch.randn(2, 6, 8, 16), torch.randn(2, 6, 2, 16)  # 8 query heads, 2 key heads
    positions = torch.randint(0, 200, (2, 6))
    rope_qk = lambda q, k, p, f: PF.rope_qk(q, k, p, f, scale)  # noqa: E731
    for x_placement, p_placement in ((Shard(2), Replicate()), (Shard(0), Shard(0)), (Shard(1), Shard(1))):
        _run_sharded(rope_qk, mesh, [q, k, positions, inv_freq], [x_placement, x_placement, p_placement, Replicate()],
                     grad_wrt=(0, 1), out_placements=[x_placement, x_placement])


@check
def rope_backward_ops_directly(mesh):
    _, Replicate, Shard, _ = _dt()
    inv_freq = posenc.frequencies.rope(16)[0]
    g, h = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
    _run_sharded(lambda g, f: PF.rope_backward(g, None, f), mesh, [g, inv_freq], [Shard(2), Replicate()],
                 grad_wrt=(0,), out_placements=[Shard(2)])
    _run_sharded(lambda g, h, f: PF.rope_qk_backward(g, h, None, f), mesh, [g, h, inv_freq],
                 [Shard(2), Shard(2), Replicate()], grad_wrt=(0, 1), out_placements=[Shard(2), Shard(2)])


@check
def rope_in_place_keeps_the_sharding(mesh):
    _, Replicate, Shard, distribute_tensor = _dt()
    inv_freq = posenc.frequencies.rope(16)[0]
    x = torch.randn(2, 6, 4, 16)
    positions = torch.randint(0, 100, (6,))
    expected = PF.rope(x, positions, inv_freq)
    for placement, p_placement in ((Shard(2), Replicate()), (Shard(1), Shard(0))):
        sharded = distribute_tensor(x, mesh, [placement])
        local = sharded.to_local()
        PF.rope_(sharded, distribute_tensor(positions, mesh, [p_placement]),
                 distribute_tensor(inv_freq, mesh, [Replicate()]))
        assert sharded.placements == (placement,)
        assert sharded.to_local().data_ptr() == local.data_ptr()  # rotated where it lies
        assert_close(sharded.full_tensor(), expected, rtol=0, atol=0)


@check
def rope_cos_sin_sharded_with_its_tables(mesh):
    _, Replicate, Shard, _ = _dt()
    x = torch.randn(4, 6, 2, 16)
    angles = torch.randn(4, 6, 6)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [B, S, r = 12]
    op = lambda x, c, s: PF.rope_cos_sin(x, c, s, "neox", "bshd")  # noqa: E731
    for x_p, table_p, tables in ((Shard(1), Shard(1), (cos, sin)), (Shard(0), Shard(0), (cos, sin)),
                                 (Shard(2), Replicate(), (cos, sin)), (Shard(0), Replicate(), (cos[0], sin[0]))):
        _run_sharded(op, mesh, [x, *tables], [x_p, table_p, table_p], grad_wrt=(0,), out_placements=[x_p])


@check
def rope_multiaxis_sharded_over_heads_batch_and_sequence(mesh):
    # Positions [3, B, S] (Qwen2-VL) go with their batch (dim 1) or sequence (dim 2); [3, S] are shared by the batch.
    _, Replicate, Shard, _ = _dt()
    inv_freq, pair_axis = posenc.frequencies.mrope(16, [2, 3, 3])
    q, k = torch.randn(4, 6, 4, 16), torch.randn(4, 6, 2, 16)
    per_row, shared = torch.randint(0, 500, (3, 4, 6)), torch.randint(0, 500, (3, 6))
    rope_qk = lambda q, k, p, f, a: PF.rope_qk(q, k, p, f, 1.0, "neox", "bshd", 2, None, a)  # noqa: E731
    for x_p, p_p, positions in ((Shard(2), Replicate(), per_row), (Shard(0), Shard(1), per_row),
                                (Shard(0), Replicate(), shared), (Shard(1), Shard(2), per_row),
                                (Shard(1), Shard(1), shared)):
        _run_sharded(rope_qk, mesh, [q, k, positions, inv_freq, pair_axis], [x_p, x_p, p_p, Replicate(), Replicate()],
                     grad_wrt=(0, 1), out_placements=[x_p, x_p])
    # thd: [n_axes, T] positions sharded over the tokens with x.
    rope = lambda x, p, f, a: PF.rope(x, p, f, 1.0, "gptj", "thd", 0, None, a)  # noqa: E731
    _run_sharded(rope, mesh, [q[0], shared, inv_freq, pair_axis], [Shard(0), Shard(1), Replicate(), Replicate()],
                 grad_wrt=(0,), out_placements=[Shard(0)])


# ---------------------------------------------------------------- QK-norm + rotary

QK_NORMS = ("llama", "gemma", "olmo2", "fused")


@check
def qk_norm_rope_with_per_head_weights_over_heads_batch_and_sequence(mesh):
    # [head_dim] weights: every row normalized alone, so q and k shard as rope_qk's do, the weights replicated; the
    # weights' gradients come back from each rank's rows as partial sums.
    _, Replicate, Shard, _ = _dt()
    inv_freq, scale = posenc.frequencies.rope(12, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 64})
    q, k = torch.randn(4, 6, 4, 16), torch.randn(4, 6, 2, 16)  # GQA: 4 query heads, 2 key heads
    q_weight, k_weight = torch.rand(16) + 0.5, torch.rand(16) + 0.5
    per_row, shared = torch.randint(0, 500, (4, 6)), torch.randint(0, 500, (6,))
    for norm in QK_NORMS:
        def op(q, k, qw, kw, p, f):
            return PF.qk_norm_rope(q, k, qw, kw, p, f, 1e-5, norm, scale, "neox", "bshd", 2)

        for x_p, p_p, positions in ((Shard(2), Replicate(), per_row), (Shard(0), Shard(0), per_row),
                                    (Shard(0), Replicate(), shared), (Shard(1), Shard(1), per_row),
                                    (Shard(1), Shard(0), shared)):
            _run_sharded(op, mesh, [q, k, q_weight, k_weight, positions, inv_freq],
                         [x_p, x_p, Replicate(), Replicate(), p_p, Replicate()], grad_wrt=(0, 1, 2, 3),
                         out_placements=[x_p, x_p])
    # Every format over its heads, without positions; thd over its tokens with positions sharded alongside.
    for fmt, head in (("bhsd", 1), ("sbhd", 2), ("thd", 1)):
        def op(q, k, qw, kw, f):
            return PF.qk_norm_rope(q, k, qw, kw, None, f, 1e-6, "llama", 1.0, "gptj", fmt)

        x_q, x_k = (t.permute(0, 2, 1, 3) if fmt == "bhsd" else t.transpose(0, 1) if fmt == "sbhd" else t[0]
                    for t in (q, k))
        _run_sharded(op, mesh, [x_q.contiguous(), x_k.contiguous(), q_weight, k_weight, inv_freq],
                     [Shard(head), Shard(head), Replicate(), Replicate(), Replicate()], grad_wrt=(0, 1, 2, 3),
                     out_placements=[Shard(head), Shard(head)])
    def thd(q, k, qw, kw, p, f):
        return PF.qk_norm_rope(q, k, qw, kw, p, f, 1e-6, "olmo2", 1.0, "neox", "thd")

    _run_sharded(thd, mesh, [q[0], k[0], q_weight, k_weight, shared, inv_freq],
                 [Shard(0), Shard(0), Replicate(), Replicate(), Shard(0), Replicate()], grad_wrt=(0, 1, 2, 3),
                 out_placements=[Shard(0), Shard(0)])


@check
def qk_norm_rope_with_weights_over_all_heads_gathers_a_head_shard(mesh):
    # OLMo 2's [heads * head_dim] weights normalize all heads of a token together: a rank holding half the heads
    # cannot, so the rule offers no head sharding and DTensor moves q and k to another placement of the rule first
    # (the result stays exact). Batch and sequence shards hold whole tokens and keep their placement.
    _, Replicate, Shard, _ = _dt()
    inv_freq, q, k, q_weight, k_weight, positions = _qk_norm_inputs(4, 6, 64, 32)
    for norm in QK_NORMS:
        op = lambda q, k, qw, kw, p, f: PF.qk_norm_rope(q, k, qw, kw, p, f, 1e-6, norm)  # noqa: E731
        q_out, k_out = _run_sharded(op, mesh, [q, k, q_weight, k_weight, positions, inv_freq],
                                    [Shard(2), Shard(2), Replicate(), Replicate(), Replicate(), Replicate()],
                                    grad_wrt=(0, 1, 2, 3))
        assert Shard(2) not in q_out.placements + k_out.placements, (q_out.placements, k_out.placements)
        for x_p, p_p in ((Shard(0), Shard(0)), (Shard(1), Shard(1))):
            _run_sharded(op, mesh, [q, k, q_weight, k_weight, positions, inv_freq],
                         [x_p, x_p, Replicate(), Replicate(), p_p, Replicate()], grad_wrt=(0, 1, 2, 3),
                         out_placements=[x_p, x_p])
    # One weight per head and one over all heads: q and k share their placement, so neither shards its heads.
    op = lambda q, k, qw, kw, f: PF.qk_norm_rope(q, k, qw, kw, None, f)  # noqa: E731
    q_out, _ = _run_sharded(op, mesh, [q, k, q_weight[:16], k_weight, inv_freq],
                            [Shard(2), Shard(2), Replicate(), Replicate(), Replicate()], grad_wrt=(0, 1, 2, 3))
    assert q_out.placements != (Shard(2),)


@check
def qk_norm_rope_backward_directly(mesh):
    # The gradients of q and k keep the placement of their rows; the weights' gradients are partial sums.
    Partial, Replicate, Shard, _ = _dt()
    inv_freq = posenc.frequencies.rope(16)[0]
    g, h, q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16), torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
    for norm in QK_NORMS:
        def op(g, h, q, k, qw, kw, f):
            return PF.qk_norm_rope_backward(g, h, q, k, qw, kw, None, f, 1e-6, norm)

        for x_p in (Shard(2), Shard(0)):
            _run_sharded(op, mesh, [g, h, q, k, torch.rand(16), torch.rand(16), inv_freq],
                         [x_p, x_p, x_p, x_p, Replicate(), Replicate(), Replicate()],
                         out_placements=[x_p, x_p, Partial(), Partial()], exact=False)
    # Replicated rows: every output replicated.
    op = lambda g, h, q, k, qw, kw, f: PF.qk_norm_rope_backward(g, h, q, k, qw, kw, None, f)  # noqa: E731
    _run_sharded(op, mesh, [g, h, q, k, torch.rand(64), torch.rand(32), inv_freq], [Replicate()] * 7,
                 out_placements=[Replicate()] * 4)


@check
def qk_norm_rope_in_place_keeps_the_sharding(mesh):
    _, Replicate, Shard, distribute_tensor = _dt()
    inv_freq = posenc.frequencies.rope(16)[0]
    q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
    positions = torch.randint(0, 100, (6,))
    for q_weight, k_weight, placement, p_placement in ((torch.rand(16), torch.rand(16), Shard(2), Replicate()),
                                                       (torch.rand(64), torch.rand(32), Shard(1), Shard(0))):
        expected = PF.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, 1e-6, "gemma")
        sharded = [distribute_tensor(t, mesh, [placement]) for t in (q, k)]
        local = [t.to_local().data_ptr() for t in sharded]
        replicated = [distribute_tensor(t, mesh, [Replicate()]) for t in (q_weight, k_weight)]
        PF.qk_norm_rope_(*sharded, *replicated, distribute_tensor(positions, mesh, [p_placement]),
                         distribute_tensor(inv_freq, mesh, [Replicate()]), 1e-6, "gemma")
        for t, pointer, e in zip(sharded, local, expected):
            assert t.placements == (placement,)
            assert t.to_local().data_ptr() == pointer  # normalized and rotated where it lies
            assert_close(t.full_tensor(), e, rtol=0, atol=0)
    # Over all heads, a head shard cannot be normalized where it lies, and an in-place op cannot be redistributed.
    sharded = [distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k)]
    replicated = [distribute_tensor(t, mesh, [Replicate()]) for t in (torch.rand(64), torch.rand(32), inv_freq)]
    with pytest.raises(RuntimeError, match=r"posenc\.qk_norm_rope_: q and k are written in place"):
        PF.qk_norm_rope_(*sharded, replicated[0], replicated[1], None, replicated[2])
    # Nor can k alone, which DTensor would copy into q's placement and write there, leaving k as it was.
    mixed = [distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Replicate()])]
    before = mixed[1].full_tensor().clone()
    per_head = [distribute_tensor(t, mesh, [Replicate()]) for t in (torch.rand(16), torch.rand(16))]
    with pytest.raises(RuntimeError, match=r"posenc\.qk_norm_rope_: q and k are written in place.*k Replicate\(\)"):
        PF.qk_norm_rope_(*mixed, *per_head, None, replicated[2])
    assert torch.equal(mixed[1].full_tensor(), before)


@check
def rope_qk_cache_in_place_over_heads_and_batch(mesh):
    # q, k, v over heads with the caches over theirs, or over batch with the caches' rows (positions and
    # cache_positions [B, S] alongside), for each cache format (the pool "shd" over heads only): q and the caches
    # written where they lie, the unsharded bits. A written cache in a placement the rule lacks is refused.
    _, Replicate, Shard, distribute_tensor = _dt()
    inv_freq = posenc.frequencies.rope(12)[0]  # partial rotary: 12 of 16 channels
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
    positions = torch.tensor([[5, 6, 7], [1, 2, 3]])
    cache_positions = torch.tensor([[0, 1, 2], [5, 3, 4]])
    shapes = {"bhsd": (2, 2, 8, 16), "bshd": (2, 8, 2, 16), "shd": (8, 2, 16)}
    heads = {"bhsd": 1, "bshd": 2, "shd": 1}
    for cache_format, shape in shapes.items():
        slots = torch.tensor([[0, 1, 2], [5, 6, 7]]) if cache_format == "shd" else cache_positions
        placements = [(Shard(2), Shard(heads[cache_format]), Replicate())]
        if cache_format != "shd":
            placements.append((Shard(0), Shard(0), Shard(0)))
        for x_p, cache_p, rows_p in placements:
            k_cache, v_cache = torch.randn(shape), torch.randn(shape)
            expected = [q.clone(), k_cache.clone(), v_cache.clone()]
            PF.rope_qk_cache_(expected[0], k, v, expected[1], expected[2], positions, inv_freq, slots, cache_format,
                              0.5, "gptj")
            written = [distribute_tensor(q, mesh, [x_p]), distribute_tensor(k_cache, mesh, [cache_p]),
                       distribute_tensor(v_cache, mesh, [cache_p])]
            pointers = [t.to_local().data_ptr() for t in written]
            PF.rope_qk_cache_(written[0], distribute_tensor(k, mesh, [x_p]), distribute_tensor(v, mesh, [x_p]),
                              written[1], written[2], distribute_tensor(positions, mesh, [rows_p]),
                              distribute_tensor(inv_freq, mesh, [Replicate()]),
                              distribute_tensor(slots, mesh, [rows_p]), cache_format, 0.5, "gptj")
            for t, pointer, e, p in zip(written, pointers, expected, (x_p, cache_p, cache_p)):
                assert t.placements == (p,), (cache_format, t.placements, p)
                assert t.to_local().data_ptr() == pointer  # written where it lies
                assert_close(t.full_tensor(), e, rtol=0, atol=0)
    # q over heads but the caches replicated or over batch: DTensor would write into redistributed copies of the
    # caches (it checks only an in-place op's first argument), so the rule refuses, naming the op; nothing written.
    for cache_p in (Replicate(), Shard(0)):
        k_cache = distribute_tensor(torch.zeros(2, 2, 8, 16), mesh, [cache_p])
        v_cache = distribute_tensor(torch.zeros(2, 2, 8, 16), mesh, [cache_p])
        with pytest.raises(RuntimeError, match=r"posenc\.rope_qk_cache_: q, k_cache and v_cache are written in place"):
            PF.rope_qk_cache_(distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)]),
                              distribute_tensor(v, mesh, [Shard(2)]), k_cache, v_cache, None,
                              distribute_tensor(inv_freq, mesh, [Replicate()]))
        assert k_cache.full_tensor().abs().sum() == 0


@check
def query_scale_shards_with_the_positions(mesh):
    # rope_qk / qk_norm_rope with Llama 4's query scale (beta, length, shift) = (0.3, 2, 1): q's scale is read at
    # each row's own position, so heads, batch and sequence shards (positions sharded alongside) give the unsharded
    # bits; without positions a sequence shard would count its tokens from 0 and is gathered. The backward ops and
    # the in-place form too.
    Partial, Replicate, Shard, distribute_tensor = _dt()
    inv_freq, q, k, q_weight, k_weight, positions = _qk_norm_inputs(2, 8, 16, 16)
    scaled = (0.3, 2, 1)

    def rope_qk(q, k, p, f):
        return PF.rope_qk(q, k, p, f, 0.5, "neox", "bshd", 3, None, None, *scaled)

    def qk_norm(q, k, qw, kw, p, f):
        return PF.qk_norm_rope(q, k, qw, kw, p, f, 1e-6, "llama", 1.0, "gptj", "bshd", 3, None, None, *scaled)

    assert not torch.allclose(rope_qk(q, k, positions, inv_freq)[0], PF.rope_qk(q, k, positions, inv_freq, 0.5,
                                                                                   "neox", "bshd", 3)[0])
    for x_p, p_p in ((Shard(2), Replicate()), (Shard(0), Shard(0)), (Shard(1), Shard(1))):
        _run_sharded(rope_qk, mesh, [q, k, positions, inv_freq], [x_p, x_p, p_p, Replicate()], grad_wrt=(0, 1),
                     out_placements=[x_p, x_p])
        _run_sharded(qk_norm, mesh, [q, k, q_weight, k_weight, positions, inv_freq],
                     [x_p, x_p, Replicate(), Replicate(), p_p, Replicate()], grad_wrt=(0, 1, 2, 3),
                     out_placements=[x_p, x_p])
    _run_sharded(rope_qk, mesh, [q, k, None, inv_freq], [Shard(1), Shard(1), None, Replicate()], grad_wrt=(0, 1),
                 out_placements=[Replicate(), Replicate()])
    _run_sharded(lambda g, h, f: PF.rope_qk_backward(g, h, None, f, 1.0, "neox", "bshd", 5, None, None, *scaled),
                 mesh, [q, k, inv_freq], [Shard(0), Shard(0), Replicate()], out_placements=[Shard(0), Shard(0)])
    _run_sharded(lambda g, h, q, k, qw, kw, f: PF.qk_norm_rope_backward(g, h, q, k, qw, kw, None, f, 1e-6, "olmo2",
                                                                        1.0, "neox", "bshd", 0, None, None, *scaled),
                 mesh, [q, k, q, k, q_weight, k_weight, inv_freq], [Shard(2)] * 4 + [Replicate()] * 3,
                 out_placements=[Shard(2), Shard(2), Partial(), Partial()], exact=False)
    expected = qk_norm(q, k, q_weight, k_weight, positions, inv_freq)
    sharded = [distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k)]
    replicated = [distribute_tensor(t, mesh, [Replicate()]) for t in (q_weight, k_weight)]
    PF.qk_norm_rope_(*sharded, *replicated, distribute_tensor(positions, mesh, [Shard(1)]),
                     distribute_tensor(inv_freq, mesh, [Replicate()]), 1e-6, "llama", 1.0, "gptj", "bshd", 3, None,
                     None, *scaled)
    for t, e in zip(sharded, expected):
        assert t.placements == (Shard(1),)
        assert_close(t.full_tensor(), e, rtol=0, atol=0)


@check
def position_and_frequency_builders_run_replicated(mesh):
    # Each result depends on the whole input (grids handed to the rows in order, every sequence boundary): a
    # sharded input is gathered and the result replicated.
    _, Replicate, Shard, _ = _dt()
    row = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0]
    token_types, grids = torch.tensor([row, row[::-1]]), torch.tensor([[1, 4, 4], [1, 4, 4]])
    mrope = lambda t, i, v: PF.mrope_positions(t, i, v)  # noqa: E731
    for placement in (Shard(0), Shard(1), Replicate()):
        _run_sharded(mrope, mesh, [token_types, grids, grids], [placement, Replicate(), Replicate()],
                     out_placements=[Replicate(), Replicate()])
    # zigzag_positions_varlen's output length follows cu_seqlens' values, which DTensor's shape propagation cannot
    # see: a DTensor call is refused naming the op; cu_seqlens are small, the op takes them as a plain tensor.
    cu_seqlens = torch.tensor([0, 8, 8, 24, 32])
    with pytest.raises(RuntimeError, match=r"posenc.zigzag_positions_varlen"):
        _run_sharded(lambda c: PF.zigzag_positions_varlen(c, 2, 1), mesh, [cu_seqlens], [Replicate()])
    _run_sharded(lambda n: torch.ops.posenc.rope_inv_freq_for_length(n, 16, 1e4, "dynamic", factor=2.0,
                                                                      max_position_embeddings=64.0),
                 mesh, [torch.tensor(300)], [Replicate()], out_placements=[Replicate()])


# ---------------------------------------------------------------- ALiBi

@check
def add_alibi_sharded_over_heads_equals_the_manual_head_offset_call(mesh):
    _, Replicate, Shard, _ = _dt()
    scores = torch.randn(2, 8, 5, 7)
    slopes = PF.alibi_slopes(8)
    for mode in ("causal", "symmetric"):
        op = lambda s, m: PF.add_alibi(s, m, mode)  # noqa: E731
        out, = _run_sharded(op, mesh, [scores, slopes], [Shard(1), Replicate()], grad_wrt=(0, 1),
                            out_placements=[Shard(1)])
        # What each rank computed is what a hand-written tensor-parallel layer passes: the global slopes and
        # the rank's first head as head_offset.
        rank = mesh.get_local_rank()
        local_heads = 8 // WORLD_SIZE
        manual = PF.add_alibi(scores[:, rank * local_heads:(rank + 1) * local_heads], slopes, mode,
                              head_offset=rank * local_heads)
        assert_close(out.to_local(), manual, rtol=0, atol=0)


@check
def add_alibi_sharded_over_batch_with_shared_or_per_batch_slopes(mesh):
    _, Replicate, Shard, _ = _dt()
    scores = torch.randn(4, 3, 6, 6)
    per_batch = torch.rand(4, 3)
    _run_sharded(PF.add_alibi, mesh, [scores, PF.alibi_slopes(3)], [Shard(0), Replicate()], grad_wrt=(0, 1),
                 out_placements=[Shard(0)])
    _run_sharded(PF.add_alibi, mesh, [scores, per_batch], [Shard(0), Shard(0)], grad_wrt=(0, 1),
                 out_placements=[Shard(0)])
    _run_sharded(PF.add_alibi, mesh, [torch.randn(4, 4, 6, 6), torch.rand(4, 4)], [Shard(1), Replicate()],
                 grad_wrt=(0, 1), out_placements=[Shard(1)])


@check
def add_alibi_with_a_global_head_offset_runs_replicated(mesh):
    # Slopes for 8 heads, scores for heads 2..5: a shard's slopes cannot be cut to match, so the call gathers.
    _, Replicate, Shard, _ = _dt()
    op = lambda s, m: PF.add_alibi(s, m, "causal", 2)  # noqa: E731
    _run_sharded(op, mesh, [torch.randn(2, 4, 5, 5), PF.alibi_slopes(8)], [Shard(1), Replicate()], grad_wrt=(0, 1),
                 out_placements=[Replicate()])


@check
def add_alibi_in_place_over_heads(mesh):
    _, Replicate, Shard, distribute_tensor = _dt()
    scores, slopes = torch.randn(2, 4, 5, 7), PF.alibi_slopes(4)
    sharded = distribute_tensor(scores, mesh, [Shard(1)])
    PF.add_alibi_(sharded, distribute_tensor(slopes, mesh, [Replicate()]), "symmetric")
    assert sharded.placements == (Shard(1),)
    assert_close(sharded.full_tensor(), PF.add_alibi(scores, slopes, "symmetric"), rtol=0, atol=0)


@check
def alibi_backward_over_batch_is_a_partial_sum(mesh):
    # Each rank sums its batch rows; the sum over ranks happens when the result is read.
    Partial, Replicate, Shard, _ = _dt()
    grad, slopes = torch.randn(4, 3, 5, 6), PF.alibi_slopes(3)
    _run_sharded(PF.alibi_backward, mesh, [grad, slopes], [Shard(0), Replicate()], grad_wrt=(0,),
                 out_placements=[Partial()], exact=False)
    _run_sharded(PF.alibi_backward, mesh, [grad, slopes], [Shard(1), Shard(0)], grad_wrt=(0,),
                 out_placements=[Shard(0)])


@check
def alibi_bias_sharded_over_heads_or_batch(mesh):
    _, Replicate, Shard, _ = _dt()
    bias = lambda m: PF.alibi_bias(m, 5, 9, "symmetric")  # noqa: E731
    _run_sharded(bias, mesh, [PF.alibi_slopes(6)], [Shard(0)], grad_wrt=(0,), out_placements=[Shard(1)])
    _run_sharded(bias, mesh, [torch.rand(4, 6)], [Shard(0)], grad_wrt=(0,), out_placements=[Shard(0)])
    _run_sharded(bias, mesh, [torch.rand(4, 6)], [Shard(1)], grad_wrt=(0,), out_placements=[Shard(1)])
    # num_heads names a global count a shard cannot take: replicated.
    _run_sharded(lambda m: PF.alibi_bias(m, 5, 9, "causal", 0, 6), mesh, [PF.alibi_slopes(6)], [Shard(0)],
                 grad_wrt=(0,), out_placements=[Replicate()])


# ---------------------------------------------------------------- sinusoidal, learned, T5

@check
def sinusoidal_family_sharded_over_batch_sequence_and_positions(mesh):
    _, Replicate, Shard, _ = _dt()
    inv_freq = posenc.frequencies.sinusoidal(16, shift=1)
    odd = posenc.frequencies.sinusoidal(17)
    x, per_row, shared = torch.randn(4, 6, 16), torch.randint(0, 500, (4, 6)), torch.randint(0, 500, (6,))
    add = lambda x, p, f: PF.add_sinusoidal(x, p, f, 2.0, "half", 3)  # noqa: E731
    for x_p, p_p, positions in ((Shard(0), Shard(0), per_row), (Shard(0), Replicate(), shared),
                                (Shard(1), Shard(1), per_row), (Shard(1), Shard(0), shared)):
        _run_sharded(add, mesh, [x, positions, inv_freq], [x_p, p_p, Replicate()], grad_wrt=(0,),
                     out_placements=[x_p])
    _run_sharded(lambda x, f: PF.add_sinusoidal(x, None, f), mesh, [torch.randn(4, 6, 17), odd],
                 [Shard(0), Replicate()], grad_wrt=(0,), out_placements=[Shard(0)])
    _run_sharded(lambda p, f: PF.sinusoidal(p.float() / 7, f, "interleaved", None, 1), mesh, [per_row, inv_freq],
                 [Shard(1), Replicate()], out_placements=[Shard(1)])
    table = torch.randn(11, 16)
    embed = lambda t, w, p, f: PF.embed_sinusoidal(t, w, p, f, 4.0, 1, "half")  # noqa: E731
    tokens = torch.randint(0, 11, (4, 6))
    # The token table's gradient comes back from each rank's rows as a partial sum.
    _run_sharded(embed, mesh, [tokens, table, per_row, inv_freq], [Shard(0), Replicate(), Shard(0), Replicate()],
                 grad_wrt=(1,), out_placements=[Shard(0)])
    _run_sharded(embed, mesh, [tokens, table, shared, inv_freq], [Shard(1), Replicate(), Shard(0), Replicate()],
                 grad_wrt=(1,), out_placements=[Shard(1)])


@check
def learned_family_sharded_over_batch_sequence_and_channels(mesh):
    _, Replicate, Shard, _ = _dt()
    wpe, wte = torch.randn(40, 8), torch.randn(11, 8)
    x, tokens = torch.randn(4, 6, 8), torch.randint(0, 11, (4, 6))
    per_row, shared = torch.randint(0, 30, (4, 6)), torch.randint(0, 30, (6,))
    add = lambda x, w, p: PF.add_learned(x, w, p, 2)  # noqa: E731
    for x_p, w_p, p_p, positions in ((Shard(0), Replicate(), Shard(0), per_row),
                                     (Shard(1), Replicate(), Shard(0), shared),
                                     (Shard(2), Shard(1), Replicate(), per_row)):  # channels: x with the table's
        _run_sharded(add, mesh, [x, wpe, positions], [x_p, w_p, p_p], grad_wrt=(0, 1), out_placements=[x_p])
    embed = lambda t, a, b, p: PF.embed_learned(t, a, b, p, 2.0, 1, 1)  # noqa: E731
    for t_p, w_p, p_p, out_p in ((Shard(0), Replicate(), Shard(0), Shard(0)),
                                 (Shard(1), Replicate(), Shard(1), Shard(1)),
                                 (Replicate(), Shard(1), Replicate(), Shard(2))):
        _run_sharded(embed, mesh, [tokens, wte, wpe, per_row], [t_p, w_p, w_p, p_p], grad_wrt=(1, 2),
                     out_placements=[out_p])
    _run_sharded(lambda w, p: PF.learned(w, p, 3), mesh, [wpe, per_row], [Replicate(), Shard(1)], grad_wrt=(0,),
                 out_placements=[Shard(1)])
    # Without positions the backward builds the table rows as a plain tensor, which DTensor accepts only under
    # implicit replication (docs/distributed.md).
    from torch.distributed.tensor.experimental import implicit_replication
    with pytest.raises(RuntimeError, match=r"posenc.embedding_backward.default got mixed torch.Tensor and DTensor"):
        _run_sharded(lambda x, w: PF.add_learned(x, w, None, 2), mesh, [x, wpe], [Shard(0), Replicate()],
                     grad_wrt=(1,))
    with implicit_replication():
        _run_sharded(lambda x, w: PF.add_learned(x, w, None, 2), mesh, [x, wpe], [Shard(0), Replicate()],
                     grad_wrt=(0, 1), out_placements=[Shard(0)])
    mask = torch.randint(0, 2, (4, 6))
    _run_sharded(lambda t: PF.make_positions(t, 1), mesh, [tokens], [Shard(0)], out_placements=[Shard(0)])
    _run_sharded(lambda m: PF.positions_from_mask(m, -1), mesh, [mask], [Shard(0)], out_placements=[Shard(0)])
    # The numbering runs along the sequence: a sequence shard is gathered.
    _run_sharded(lambda m: PF.positions_from_mask(m, -1), mesh, [mask], [Shard(1)], out_placements=[Replicate()])


@check
def t5_sharded_over_heads(mesh):
    _, Replicate, Shard, _ = _dt()
    weight = torch.randn(32, 4)
    for bidirectional in (True, False):
        bias = lambda w: PF.t5_bias(w, 5, 9, bidirectional, 32, 128, 2)  # noqa: E731
        _run_sharded(bias, mesh, [weight], [Shard(1)], grad_wrt=(0,), out_placements=[Shard(1)])
    relative = torch.randint(-300, 300, (6, 8))
    _run_sharded(PF.relative_position_bucket, mesh, [relative], [Shard(1)], out_placements=[Shard(1)])


# ---------------------------------------------------------------- the documented example

@check
def the_example_in_docs_distributed_md(mesh):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    exec(compile(code, str(DOC), "exec"), {})


# ---------------------------------------------------------------- the two processes

def _worker(rank, init_file, results_dir):
    import torch.distributed as dist

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=60))
    import posenc.distributed  # noqa: F401  (registers the sharding rules)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    outcomes = {}
    for name, fn in CHECKS.items():
        torch.manual_seed(0)  # both ranks draw the same full tensors
        try:
            fn(mesh)
            outcomes[name] = "ok"
        except Exception:  # noqa: BLE001  (reported by the test of this check)
            outcomes[name] = traceback.format_exc()
    Path(results_dir, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


def _spawn(worker, directory):
    """Runs worker(rank, init_file, directory) in WORLD_SIZE processes; returns each rank's recorded outcomes."""
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=worker, args=(rank, directory / "init", directory))
               for rank in range(WORLD_SIZE)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    for w in workers:
        if w.is_alive():
            w.kill()
    return {rank: json.loads((directory / f"rank{rank}.json").read_text()) if (directory / f"rank{rank}.json").exists()
            else {} for rank in range(WORLD_SIZE)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return _spawn(_worker, tmp_path_factory.mktemp("distributed"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_sharded_equals_unsharded(outcomes, name):
    for rank in range(WORLD_SIZE):
        assert outcomes[rank].get(name) == "ok", f"rank {rank}:\n{outcomes[rank].get(name, 'no result (crashed?)')}"


def test_import_posenc_does_not_import_torch_distributed_tensor():
    import subprocess
    import sys

    code = "import sys, posenc; print('torch.distributed.tensor' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def _worker_without_posenc_distributed(rank, init_file, results_dir):
    """A program that makes DTensors and calls posenc ops on them without ``import posenc.distributed``: this test
    module imports posenc, then torch.distributed.tensor is imported, and posenc registers its rules then."""
    import sys

    import torch.distributed as dist

    outcome = "ok"
    try:
        assert "posenc.distributed" not in sys.modules
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                                timeout=timedelta(seconds=60))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        torch.manual_seed(0)
        q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
        inv_freq, scale = posenc.frequencies.rope(16, 10000.0, {"rope_type": "linear", "factor": 2.0})
        q_rot, k_rot = PF.rope_qk(distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)]),
                                  None, distribute_tensor(inv_freq, mesh, [Replicate()]), scale)
        assert q_rot.placements == k_rot.placements == (Shard(2),)
        expected = PF.rope_qk(q, k, None, inv_freq, scale)
        assert_close(q_rot.full_tensor(), expected[0], rtol=0, atol=0)
        assert_close(k_rot.full_tensor(), expected[1], rtol=0, atol=0)
    except Exception:  # noqa: BLE001  (reported by the test)
        outcome = traceback.format_exc()
    Path(results_dir, f"rank{rank}.json").write_text(json.dumps({"rope_qk": outcome}))
    dist.destroy_process_group()


def test_dtensor_calls_work_without_importing_posenc_distributed(tmp_path):
    results = _spawn(_worker_without_posenc_distributed, tmp_path)
    for rank in range(WORLD_SIZE):
        assert results[rank].get("rope_qk") == "ok", f"rank {rank}:\n{results[rank].get('rope_qk', 'no result')}"


def test_dtensor_calls_work_when_torch_distributed_tensor_was_imported_before_posenc(tmp_path):
    import subprocess
    import sys

    code = f"""
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import posenc
from posenc import functional as PF

dist.init_process_group("gloo", init_method="file://{tmp_path / 'init'}", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cpu", (1,))
x, inv_freq = torch.randn(2, 6, 4, 16), posenc.frequencies.rope(16)[0]
out = PF.rope(distribute_tensor(x, mesh, [Shard(2)]), None, distribute_tensor(inv_freq, mesh, [Replicate()]))
assert out.placements == (Shard(2),) and torch.equal(out.full_tensor(), PF.rope(x, None, inv_freq))
dist.destroy_process_group()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("ok"), result.stderr


def test_every_posenc_op_with_tensor_arguments_has_a_rule():
    import posenc.distributed

    assert set(op_registry.tensor_ops()) == set(posenc.distributed.SUPPORTED_OPS)
