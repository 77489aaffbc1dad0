"""Learned absolute position embeddings: references, gradients, determinism, bad input,
opcheck, compile, export, TorchScript, and the Hugging Face GPT-2 and OPT conventions."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import posenc
from helpers import randn
from mutations import (grow, not_floating, not_index, on_meta, positions_length, put, set_value, small, to_dtype,
                       wrong_rank)
from op_registry import bad_inputs, call_args, property_check, sample
from posenc import functional as PF
from strategies import (FLOAT_DTYPES, INT64_MAX, INT64_MIN, assert_rounds_within, call, drawing, drawn_tensor,
                        integers, math_eps, normal, sizes)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
POSITIONS = ["default", "shared", "per_row", "int32"]


def table(rows, dim, dtype=torch.float32, contiguous=True, requires_grad=False, device="cpu"):
    """A [rows, dim] table; non-contiguous ones are the transpose of a [dim, rows] tensor."""
    t = torch.randn(rows, dim, dtype=dtype, device=device)
    t = t if contiguous else torch.randn(dim, rows, dtype=dtype, device=device).t()
    return t.requires_grad_(requires_grad)


def sample_positions(kind, leading, max_row, offset):
    """Positions of a [*leading] input whose rows (positions + offset) lie in [0, max_row)."""
    if kind == "default":
        return None
    shape = leading[-1:] if kind == "shared" else leading
    positions = torch.randint(0, max_row - offset, shape)
    return positions.int() if kind == "int32" else positions


def reference_rows(positions, seq_len, offset):
    return (torch.arange(seq_len) if positions is None else positions.long()) + offset


def grads(output, inputs, grad_output):
    return torch.autograd.grad(output, inputs, grad_output)


def assert_grads_close(actual, expected):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e.to(a.dtype))


# --- values and gradients against torch.nn.functional.embedding --------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", POSITIONS)
@pytest.mark.parametrize("contiguous", [True, False])
def test_add_learned_matches_embedding(dtype, kind, contiguous):
    batch, seq_len, dim, max_positions, offset = (2, 3), 5, 12, 11, 3
    x = torch.randn(*batch, dim, seq_len, dtype=dtype).transpose(-1, -2)  # [..., S, D], strided
    x = (x.contiguous() if contiguous else x).requires_grad_()
    weight = table(max_positions, dim, dtype, contiguous, requires_grad=True)
    positions = sample_positions(kind, (*batch, seq_len), max_positions, offset)

    out = PF.add_learned(x, weight, positions, offset, padding_idx=4)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    expected = x64 + F.embedding(reference_rows(positions, seq_len, offset), w64, padding_idx=4)
    torch.testing.assert_close(out, expected.to(dtype))
    assert out.is_contiguous() and out.dtype == dtype

    grad_out = torch.randn_like(out)
    assert_grads_close(grads(out, (x, weight), grad_out), grads(expected, (x64, w64), grad_out.double()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", POSITIONS)
def test_embed_learned_matches_embedding(dtype, kind):
    batch, seq_len, dim, vocab, max_positions, offset, scale = (3,), 6, 8, 9, 10, 2, math.sqrt(8)
    tokens = torch.randint(0, vocab, (*batch, seq_len))
    tokens[0, :2] = 1  # some padding
    token_weight = table(vocab, dim, dtype, requires_grad=True)
    pos_weight = table(max_positions, dim, dtype, contiguous=False, requires_grad=True)
    positions = sample_positions(kind, tokens.shape, max_positions, offset)

    out = PF.embed_learned(tokens, token_weight, pos_weight, positions, scale, padding_idx=1, offset=offset,
                           pos_padding_idx=offset)
    tw64, pw64 = (w.detach().double().requires_grad_() for w in (token_weight, pos_weight))
    rows = reference_rows(positions, seq_len, offset)
    expected = (F.embedding(tokens, tw64, padding_idx=1) * scale + F.embedding(rows, pw64, padding_idx=offset))
    torch.testing.assert_close(out, expected.to(dtype))

    grad_out = torch.randn_like(out)
    actual = grads(out, (token_weight, pos_weight), grad_out)
    assert_grads_close(actual, grads(expected, (tw64, pw64), grad_out.double()))
    assert actual[0][1].eq(0).all(), "the padding_idx row of token_weight got a gradient"


@pytest.mark.parametrize("dtype", DTYPES)
def test_learned_matches_embedding(dtype):
    weight = table(7, 5, dtype, requires_grad=True)
    positions = torch.randint(0, 5, (2, 3, 4))
    out = PF.learned(weight, positions, offset=2, padding_idx=6)
    w64 = weight.detach().double().requires_grad_()
    expected = F.embedding(positions + 2, w64, padding_idx=6)
    assert torch.equal(out, expected.to(dtype))  # a gather copies bits
    grad_out = torch.randn_like(out)
    assert_grads_close(grads(out, (weight,), grad_out), grads(expected, (w64,), grad_out.double()))
    assert torch.equal(PF.learned(weight, torch.tensor(3)), weight[3])  # 0-d positions give one row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_rounds_like_torch_for_every_bit_pattern(dtype):
    # Every 16-bit pattern (denormals, infinities, NaNs included) as x: one rounding of the float result,
    # the same bits as torch's own conversions.
    x = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
    for weight in (torch.zeros(256, 256, dtype=dtype), torch.randn(256, 256).to(dtype)):
        expected = (x.float() + weight.float()).to(dtype)
        torch.testing.assert_close(PF.add_learned(x, weight), expected, rtol=0, atol=0, equal_nan=True)
    tokens = torch.arange(256).expand(3, 256)
    token_weight = torch.randn(256, 256).to(dtype)
    expected = (token_weight.float()[tokens] * 0.25 + x.float()).to(dtype)  # an exact product, with or without FMA
    torch.testing.assert_close(PF.embed_learned(tokens, token_weight, x, None, 0.25), expected, rtol=0, atol=0,
                               equal_nan=True)


def test_token_scale_applies_to_tokens_only():
    token_weight, pos_weight = table(4, 6), table(5, 6)
    tokens = torch.tensor([[0, 3, 2]])
    out = PF.embed_learned(tokens, token_weight, pos_weight, None, token_scale=4.0)
    torch.testing.assert_close(out, token_weight[tokens] * 4.0 + pos_weight[:3])


def test_positions_and_offset_select_the_rows_they_name():
    # Explicit positions, the offset of a cache and per-row positions all select the rows they name.
    weight = torch.arange(20.0).reshape(10, 2)
    x = torch.zeros(2, 3, 2)
    assert PF.add_learned(x, weight, offset=4)[0, :, 0].tolist() == [8.0, 10.0, 12.0]
    per_row = torch.tensor([[0, 1, 2], [7, 8, 9]])
    assert PF.add_learned(x, weight, per_row)[:, :, 1].tolist() == [[1.0, 3.0, 5.0], [15.0, 17.0, 19.0]]


def test_empty_inputs_give_empty_results():
    weight = table(4, 3, requires_grad=True)
    assert PF.add_learned(torch.randn(2, 0, 3), weight).shape == (2, 0, 3)
    assert PF.learned(weight, torch.zeros(0, 5, dtype=torch.long)).shape == (0, 5, 3)
    out = PF.embed_learned(torch.zeros(0, 4, dtype=torch.long), table(2, 3), weight)
    assert out.shape == (0, 4, 3)
    out.sum().backward()
    assert weight.grad.eq(0).all()
    assert PF.make_positions(torch.zeros(3, 0, dtype=torch.long), 1).shape == (3, 0)


def test_nan_and_inf_propagate():
    weight = table(4, 2)
    weight[1, 0] = float("nan")
    x = torch.zeros(1, 3, 2)
    x[0, 2, 1] = float("inf")
    out = PF.add_learned(x, weight)
    assert out[0, 1, 0].isnan() and out[0, 2, 1].isinf() and out.isfinite().sum() == 4


def test_bf16_results_keep_denormals_and_quiet_every_nan_to_one_pattern():
    """bf16 rows of 64 channels (the vectorized loop's width): a denormal result among normal ones is kept, not
    flushed to zero, and a NaN becomes 0x7FC0 whatever its payload (c10's rounding, as everywhere in posenc)."""
    bits = torch.full((1, 3, 64), 0x3FC0, dtype=torch.int16)  # 1.5
    bits[0, 0, 5], bits[0, 1, 40], bits[0, 2, 63] = 0x0003, 0x7F81, -0x7FFF  # denormal, NaN, -denormal
    x = bits.view(torch.bfloat16)
    out = PF.add_learned(x, torch.zeros(3, 64, dtype=torch.bfloat16))  # x + 0 = x, exactly
    expected = bits.clone()
    expected[0, 1, 40] = 0x7FC0
    assert torch.equal(out.view(torch.int16), expected)


# --- determinism -----------------------------------------------------------------------------------------


def test_table_gradients_are_bitwise_identical_for_1_and_2_threads(same_bits_for_any_thread_count):
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (8, 512))  # many repeats per row: the order of sums matters
    positions = torch.randint(0, 600, (8, 512))
    token_weight = table(50, 256, requires_grad=True)
    pos_weight = table(600, 256, requires_grad=True)
    grad_out = torch.randn(8, 512, 256)

    def forward_and_grads():
        out = PF.embed_learned(tokens, token_weight, pos_weight, positions, 0.5)
        return (out, *grads(out, (token_weight, pos_weight), grad_out))

    first = same_bits_for_any_thread_count(forward_and_grads)
    expected = F.embedding(tokens, token_weight) * 0.5 + F.embedding(positions, pos_weight)
    assert_grads_close(first[1:], grads(expected, (token_weight, pos_weight), grad_out))


@pytest.mark.parametrize("shape", [(3, 100, 1024), (64, 1, 1024), (2, 3, 40, 512)])
@pytest.mark.parametrize("kind", ["default", "shared", "per_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_learned_blocks_and_threads(shape, kind, dtype):
    """Blocks of positions times leading indices (a decoding step: one position, many leading indices),
    split over threads: every row once, the same bits for 1 and 2 threads."""
    x = torch.randn(shape, dtype=dtype)
    weight = table(200, shape[-1], dtype)
    positions = sample_positions(kind, shape[:-1], 200, 1)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(PF.add_learned(x, weight, positions, 1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    expected = x.float() + F.embedding(reference_rows(positions, shape[-2], 1), weight).float()
    assert torch.equal(results[0], expected.to(dtype))  # one float32 add, rounded once


# --- positions: fairseq, attention masks, OPT -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_make_positions_matches_fairseq(dtype):
    tokens = torch.randint(0, 6, (3, 4, 9), dtype=dtype)
    padding_idx = 1
    mask = tokens.ne(padding_idx).int()
    expected = (torch.cumsum(mask, dim=-1).type_as(mask) * mask).long() + padding_idx  # fairseq.utils.make_positions
    out = PF.make_positions(tokens, padding_idx)
    assert out.dtype == torch.long and torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float32])
def test_positions_from_mask_left_padding(dtype):
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]).to(dtype)
    assert PF.positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    # OPT: (cumsum(mask) * mask - 1), so padding is -1 and reads row 1 of a table offset by 2.
    long_mask = mask.long()
    opt = torch.cumsum(long_mask, dim=1) * long_mask - 1
    assert torch.equal(PF.positions_from_mask(mask, pad_position=-1), opt)


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("call, position, limit", [
    (lambda w: PF.learned(w, torch.tensor([[0, 10]])), 10, 10),
    (lambda w: PF.learned(w, torch.tensor([-1]), padding_idx=0), -1, 10),
    (lambda w: PF.learned(w, torch.tensor([3], dtype=torch.int32), offset=7), 10, 10),
    (lambda w: PF.add_learned(torch.zeros(2, 4, 3), w, offset=7), 10, 10),
    (lambda w: PF.add_learned(torch.zeros(2, 11, 3), w), 10, 10),
    (lambda w: PF.add_learned(torch.zeros(2, 2, 3), w, torch.tensor([[0, 1], [1, 12]])), 12, 10),
    (lambda w: PF.embed_learned(torch.zeros(2, 3, dtype=torch.long), table(5, 3), w, torch.tensor([0, -2, 1])), -2, 10),
    (lambda w: PF.embed_learned(torch.zeros(1, 3, dtype=torch.long), table(5, 3), w, offset=-1), -1, 10),
])
def test_out_of_range_positions_name_the_op_position_and_l_max(call, position, limit):
    weight = table(10, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=rf"posenc\.\w+: position {position} is outside \[0, L_max\) with "
                                           rf"L_max = {limit}"):
        call(weight)


def test_offset_overflow_is_an_error_not_a_wraparound():
    with pytest.raises(RuntimeError, match=r"posenc\.learned: position \(overflow\)"):
        PF.learned(table(4, 2), torch.tensor([5]), offset=2**63 - 2)


@pytest.mark.parametrize("call, message", [
    (lambda: PF.learned(table(4, 2), torch.tensor([0.0])), r"learned: positions must be an int64 or int32"),
    (lambda: PF.learned(torch.zeros(4, 2, dtype=torch.long), torch.tensor([0])), r"learned: weight must be a floating"),
    (lambda: PF.learned(torch.zeros(4), torch.tensor([0])), r"learned: weight must be \[rows, D\]"),
    (lambda: PF.learned(table(4, 2), torch.tensor([0]), padding_idx=4), r"learned: padding_idx 4 is outside \[0, 4\)"),
    (lambda: PF.add_learned(torch.zeros(3, 2), table(4, 3)), r"add_learned: x has 2 channels but weight has 3"),
    (lambda: PF.add_learned(torch.zeros(3), table(4, 3)), r"add_learned: x must be \[\.\.\., S, D\]"),
    (lambda: PF.add_learned(torch.zeros(3, 2, dtype=torch.long), table(4, 2)), r"add_learned: x must be a floating"),
    (lambda: PF.add_learned(torch.zeros(3, 2), table(4, 2, torch.float64)),
     r"add_learned: weight is Double but x is Float"),
    (lambda: PF.add_learned(torch.zeros(2, 3, 2), table(4, 2), torch.zeros(2, 2, dtype=torch.long)),
     r"add_learned: positions has shape \[2, 2\] but x needs \[3\] or \[2, 3\]"),
    (lambda: PF.add_learned(torch.zeros(3, 2), table(4, 2, device="meta")), r"add_learned: weight is on meta"),
    (lambda: PF.embed_learned(torch.tensor([0, 5]), table(5, 2), table(4, 2)),
     r"embed_learned: tokens holds 5 at flat index 1, outside \[0, 5\)"),
    (lambda: PF.embed_learned(torch.tensor([0.0]), table(5, 2), table(4, 2)),
     r"embed_learned: tokens must be an int64"),
    (lambda: PF.embed_learned(torch.tensor(0), table(5, 2), table(4, 2)),
     r"embed_learned: tokens must be \[\.\.\., S\]"),
    (lambda: PF.embed_learned(torch.tensor([0]), table(5, 2), table(4, 3)),
     r"embed_learned: token_weight has 2 channels"),
    (lambda: PF.embed_learned(torch.tensor([0]), table(5, 2), table(4, 2, torch.float16)),
     r"embed_learned: pos_weight is Half but token_weight is Float"),
    (lambda: PF.embed_learned(torch.tensor([0]), table(5, 2), table(4, 2), pos_padding_idx=-1),
     r"embed_learned: padding_idx -1 is outside \[0, 4\)"),
    (lambda: PF.make_positions(torch.tensor(3), 1), r"make_positions: tokens must be \[\.\.\., S\]"),
    (lambda: PF.make_positions(torch.tensor([1.0]), 1), r"make_positions: tokens must be an int64"),
    (lambda: PF.make_positions(torch.tensor([1, 2]), 2**63 - 2), r"make_positions: padding_idx .* leaves no room"),
    (lambda: PF.positions_from_mask(torch.ones(3, dtype=torch.complex64)),
     r"positions_from_mask: attention_mask must be"),
    (lambda: PF.positions_from_mask(torch.tensor(1)), r"positions_from_mask: attention_mask must be \[\.\.\., S\]"),
])
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(RuntimeError, match=r"posenc\." + message):
        call()


def test_bad_input_meta_matches_cpu():
    # Meta kernels run the same metadata checks; position values need data, so only CPU checks their range.
    meta = dict(device="meta")
    with pytest.raises(RuntimeError, match=r"posenc\.add_learned: x has 2 channels but weight has 3"):
        PF.add_learned(torch.empty(3, 2, **meta), torch.empty(4, 3, **meta))
    with pytest.raises(RuntimeError, match=r"posenc\.embed_learned: pos_weight is Half but token_weight is Float"):
        PF.embed_learned(torch.empty(2, dtype=torch.long, **meta), torch.empty(4, 3, **meta),
                         torch.empty(4, 3, dtype=torch.half, **meta))
    with pytest.raises(RuntimeError, match=r"posenc\.learned: positions must be an int64 or int32"):
        PF.learned(torch.empty(4, 3, **meta), torch.empty(2, **meta))


# --- gradcheck, opcheck, compile, export ------------------------------------------------------------------


def test_gradcheck_float64():
    tokens = torch.tensor([[1, 0, 2, 1], [2, 2, 0, 1]])
    positions = torch.tensor([[0, 1, 2, 3], [3, 3, 1, 0]])
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    token_weight = table(3, 3, torch.float64, requires_grad=True)
    pos_weight = table(6, 3, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: PF.learned(w, positions, 1), (pos_weight,))
    assert torch.autograd.gradcheck(lambda a, w: PF.add_learned(a, w, None, 2), (x, pos_weight))
    assert torch.autograd.gradcheck(lambda a, w: PF.add_learned(a, w, positions[0], 1), (x, pos_weight))
    assert torch.autograd.gradcheck(
        lambda tw, pw: PF.embed_learned(tokens, tw, pw, positions, 1.5, offset=1),
        (token_weight, pos_weight))


def test_double_backward_is_a_clear_error():
    weight = table(4, 2, torch.float64, requires_grad=True)
    out = PF.learned(weight, torch.tensor([0, 1, 1]))
    with pytest.raises(RuntimeError, match=r"posenc\.embedding_backward: double backward"):
        torch.autograd.grad(out, weight, torch.ones_like(out, requires_grad=True), create_graph=True)


def opcheck_samples():
    tokens = torch.tensor([[1, 0, 2], [2, 2, 0]])
    weight = table(6, 4, requires_grad=True)
    yield torch.ops.posenc.learned.default, (weight, torch.tensor([[0, 5], [1, 1]])), {"offset": 0, "padding_idx": 1}
    yield torch.ops.posenc.add_learned.default, (torch.randn(2, 3, 4, requires_grad=True), weight, None), {"offset": 2}
    yield torch.ops.posenc.add_learned.default, (torch.randn(2, 3, 4), weight, tokens.int()), {"padding_idx": 0}
    yield (torch.ops.posenc.embed_learned.default, (tokens, table(3, 4, requires_grad=True), weight, None),
           {"token_scale": 2.0, "padding_idx": 0, "offset": 3, "pos_padding_idx": 3})
    yield torch.ops.posenc.embed_learned.default, (tokens, table(3, 4, requires_grad=True), weight, tokens[0]), {}
    yield torch.ops.posenc.make_positions.default, (tokens, 0), {}
    yield torch.ops.posenc.positions_from_mask.default, (torch.tensor([[0, 1, 1], [1, 1, 1]]), -1), {}


@pytest.mark.parametrize("op, args, kwargs", list(opcheck_samples()))
def test_opcheck(op, args, kwargs):
    torch.library.opcheck(op, args, kwargs)


def input_embeddings(tokens, attention_mask, token_weight, pos_weight, x):
    """Every learned op in one function: OPT positions from a mask, fairseq positions, a cache offset."""
    positions = PF.positions_from_mask(attention_mask, -1)
    fused = PF.embed_learned(tokens, token_weight, pos_weight, positions, 2.0, 0, 2)
    fairseq = PF.learned(pos_weight, PF.make_positions(tokens, 0))
    return fused + fairseq + PF.add_learned(x, pos_weight, None, 1)


def input_embeddings_sample():
    tokens = torch.tensor([[0, 0, 3, 4, 5], [1, 2, 3, 4, 5]])
    return tokens, tokens.ne(0).long(), table(6, 8, requires_grad=True), table(9, 8, requires_grad=True), \
        torch.randn(2, 5, 8, requires_grad=True)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    args = input_embeddings_sample()
    compiled_matches_eager(input_embeddings, args, args[2:], dynamic=True)


def test_export_with_a_dynamic_sequence_length():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = posenc.nn.LearnedEmbedding(6, 8, 4, padding_idx=0, offset=2)
            self.position = posenc.nn.LearnedPositionalEmbedding(8, 4)

        def forward(self, tokens, attention_mask):
            positions = PF.positions_from_mask(attention_mask, -1)
            return self.position(self.embed(tokens, positions))

    model = Model()
    tokens = torch.tensor([[0, 3, 4, 5], [1, 2, 3, 4]])
    seq = torch.export.Dim("seq", min=2, max=8)
    program = torch.export.export(model, (tokens, tokens.ne(0).long()), dynamic_shapes=({1: seq}, {1: seq}))
    for length in (4, 7):
        tokens = torch.randint(0, 6, (2, length))
        torch.testing.assert_close(program.module()(tokens, tokens.ne(0).long()), model(tokens, tokens.ne(0).long()))
    graph = str(program.graph)
    assert all(f"posenc.{op}" in graph for op in ("positions_from_mask", "embed_learned", "add_learned"))


def test_compile_inductor_dynamic():
    torch._dynamo.reset()
    module = posenc.nn.LearnedPositionalEmbedding(16, 8, offset=1)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    with torch.no_grad():  # the backward graph is covered by the aot_eager test; inductor compiles are slow
        for seq_len in (5, 9):
            x = torch.randn(2, seq_len, 8)
            torch.testing.assert_close(compiled(x, None, 2), module(x, None, 2))


# --- modules -----------------------------------------------------------------------------------------------


def test_positional_module_init_padding_and_offset():
    torch.manual_seed(0)
    module = posenc.nn.LearnedPositionalEmbedding(300, 64, padding_idx=-1, offset=2)
    assert module.weight.shape == (302, 64) and module.padding_idx == 301
    assert module.weight[301].eq(0).all()
    assert abs(module.weight.std().item() - 0.02) < 1e-3
    x = torch.randn(2, 5, 64)
    positions = torch.tensor([[3, 4, 5, 299, 299]])
    out = module(x, positions.expand(2, 5), offset=0)
    torch.testing.assert_close(out, x + module.weight[positions + 2])
    torch.testing.assert_close(module(x, offset=7), x + module.weight[9:14])
    with pytest.raises(RuntimeError, match=r"position 302 is outside \[0, L_max\) with L_max = 302"):
        module(x, torch.tensor([0, 0, 0, 0, 300]))


def test_modules_script_and_match_eager():
    torch.manual_seed(0)
    positional = posenc.nn.LearnedPositionalEmbedding(16, 6, padding_idx=0, offset=1)
    embedding = posenc.nn.LearnedEmbedding(10, 16, 6, padding_idx=3, token_scale=2.0)
    tokens = torch.tensor([[3, 3, 5, 9], [1, 2, 3, 4]])
    x = torch.randn(2, 4, 6)
    for module, args in ((positional, (x, None, 2)), (embedding, (tokens, None, 2))):
        scripted = torch.jit.script(module)
        assert torch.equal(scripted(*args), module(*args))
    scripted = torch.jit.script(embedding)
    scripted(tokens).sum().backward()
    assert embedding.token_weight.grad[3].eq(0).all() and embedding.token_weight.grad[5].ne(0).all()
    with pytest.raises(RuntimeError, match=r"posenc\.embed_learned: position 16 is outside"):
        scripted(tokens, None, 14)


# --- Hugging Face transformers ---------------------------------------------------------------------------


def test_equals_gpt2_input_embeddings():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=24, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2Model(config).eval()
    tokens = torch.randint(0, 40, (2, 7))
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    # Left padding as Hugging Face generate() numbers it: cumsum(mask) - 1, padding at position 1.
    position_ids = PF.positions_from_mask(attention_mask, pad_position=1)
    hf = model(tokens, attention_mask=attention_mask, position_ids=position_ids,
               output_hidden_states=True).hidden_states[0]
    wte, wpe = model.wte.weight, model.wpe.weight
    ours = PF.embed_learned(tokens, wte, wpe, position_ids)
    torch.testing.assert_close(ours, hf)
    grad_out = torch.randn_like(hf)
    assert_grads_close(grads(ours, (wte, wpe), grad_out), grads(hf, (wte, wpe), grad_out))
    # Default positions with a cache of 5 tokens: arange(5, 5 + S), GPT-2's past_length numbering.
    module = posenc.nn.LearnedEmbedding(40, 24, 16)
    module.load_state_dict({"token_weight": wte.detach(), "pos_weight": wpe.detach()})
    torch.testing.assert_close(module(tokens, offset=5), model.wte(tokens) + model.wpe(torch.arange(5, 12)))


def test_equals_opt_learned_positional_embedding():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=40, max_position_embeddings=20, hidden_size=16, ffn_dim=32,
                                    num_hidden_layers=1, num_attention_heads=2, word_embed_proj_dim=16)
    hf = transformers.OPTModel(config).decoder.embed_positions
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    module = posenc.nn.LearnedPositionalEmbedding(20, 16, offset=2)
    module.load_state_dict(hf.state_dict())
    for cache_length in (0, 2):
        expected = hf(attention_mask, cache_length)
        positions = PF.positions_from_mask(attention_mask, pad_position=-1)[:, cache_length:]
        torch.testing.assert_close(PF.learned(hf.weight, positions, offset=2), expected)
        torch.testing.assert_close(module(torch.zeros_like(expected), positions), expected)


# ---------------------------------------------------------------- coverage: sample calls, properties, bad inputs
# This family's entries in the coverage tests, registered with op_registry.py (which imports this file to find
# them): each op's sample call (op_registry.SAMPLES: determinism, concurrency, no_grad, CUDA and CPU-capability
# tests), its hypothesis property (test_properties.py) and its bad-input cases (bad_input_fuzzer.py).

# ---- sample calls
# embedding_backward (csrc/families.h's embedding family: the scatter-add backward shared by the sinusoidal and
# learned families) has its entries here, each registered first: the cases list it after the sinusoidal ops.
# Small: width 130; large: [4, 1024, 256].

@sample("embedding_backward")
def _build_embedding_backward(m):
    """Small: indices [S] shared by the batch, no padding_idx; large: indices [B, S], padding_idx 7."""
    vocab = m.size(50, 3000)
    grad = m.floats(*m.size((3, 8, 130), (4, 1024, 256)), seed=16)
    indices = m.ints(vocab, *m.size((8,), (4, 1024)), seed=17)
    return call_args(grad, indices, vocab, m.size(1.5, 0.5), m.size(None, 7))


@sample("learned")
def _build_learned(m):
    table = m.grad(m.floats(m.size(70, 2048), m.size(130, 256), seed=20))
    positions = m.ints(m.size(68, 2000), *m.size((3, 8), (4, 1024)), seed=21)
    return call_args(table, positions, m.size(2, 3), m.size(1, 0))


@sample("add_learned")
def _build_add_learned(m):
    """Small: positions [B, S] given, padding_idx 0; large: positions absent, offset 1000 (a cache)."""
    x = m.grad(m.floats(*m.size((3, 8, 130), (4, 1024, 256)), seed=22))
    table = m.grad(m.floats(m.size(70, 2048), m.size(130, 256), seed=23))
    positions = None if m.large else m.ints(60, 3, 8, seed=24)
    return call_args(x, table, positions, m.size(3, 1000), m.size(0, None))


@sample("embed_learned")
def _build_embed_learned(m):
    """Small: positions absent, offset 10; large: positions [B, S] given. padding_idx 1, pos_padding_idx 0."""
    vocab = m.size(50, 3000)
    tokens = m.ints(vocab, *m.size((3, 8), (4, 1024)), seed=25)
    token_table = m.grad(m.floats(vocab, m.size(130, 256), seed=26))
    pos_table = m.grad(m.floats(m.size(70, 2048), m.size(130, 256), seed=27))
    positions = m.ints(2000, 4, 1024, seed=28) if m.large else None
    return call_args(tokens, token_table, pos_table, positions, m.size(2.0, 0.5), 1, m.size(10, 2), 0)


@sample("make_positions")
def _build_make_positions(m):
    return call_args(m.ints(m.size(4, 5), *m.size((16, 128), (512, 1024)), seed=29), m.size(0, 1))


@sample("positions_from_mask")
def _build_positions_from_mask(m):
    """Small: a bool mask, pad_position 0; large: an int64 mask, pad_position -1."""
    mask = m.ints(2, *m.size((8, 512), (256, 4096)), seed=30)
    return call_args(mask if m.large else mask.bool(), m.size(0, -1))


# ---- properties: random valid inputs against float64 references (test_properties.py)

@property_check("embedding_backward")
@given(st.data())
def check_embedding_backward(data):
    draw, gen, dtype = drawing(data, FLOAT_DTYPES)
    leading = sizes(draw, draw(st.integers(0, 3)))
    width = draw(st.integers(1, 5))
    grad = drawn_tensor(draw, leading + [width], lambda s: normal(gen, s, dtype))
    suffix = leading[len(leading) - draw(st.integers(0, len(leading))):]
    num_rows = draw(st.integers(1, 6))
    indices = drawn_tensor(draw, suffix, lambda s: integers(gen, s, 0, num_rows,
                                                             draw(st.sampled_from([torch.long, torch.int]))))
    scale = draw(st.sampled_from([1.0, 0.5, -3.0]))
    padding_idx = draw(st.one_of(st.none(), st.integers(0, num_rows - 1)))
    out = call("embedding_backward", grad, indices, num_rows, scale, padding_idx)
    assert out.dtype == dtype and out.shape == (num_rows, width)
    rows = grad.double().reshape(-1, width)
    ids = indices.long().expand(leading).reshape(-1)
    reference = torch.zeros(num_rows, width, dtype=torch.float64).index_add_(0, ids, rows) * scale
    magnitude = torch.zeros(num_rows, width, dtype=torch.float64).index_add_(0, ids, rows.abs()) * abs(scale)
    count = torch.zeros(num_rows, dtype=torch.float64).index_add_(0, ids, torch.ones(ids.numel(),
                                                                                      dtype=torch.float64))
    if padding_idx is not None:
        reference[padding_idx] = 0
        magnitude[padding_idx] = 0
    assert_rounds_within(out, reference, (count[:, None] + 2) * math_eps(dtype) * magnitude)


def learned_rows(draw, gen, shape, table_rows, shared_ok=True):
    """Positions whose rows (position + offset) lie in [0, table_rows): absent (needs S <= table_rows),
    [S] or `shape`, int64 or int32, with an offset that may be large. Returns (positions, offset, rows)."""
    seq = shape[-1]
    kinds = (["absent"] if seq <= table_rows else []) + (["shared"] if shared_ok else []) + ["per_row"]
    kind = draw(st.sampled_from(kinds))
    if kind == "absent":
        offset = draw(st.integers(0, table_rows - seq))
        return None, offset, torch.arange(offset, offset + seq)
    pos_shape = [seq] if kind == "shared" else list(shape)
    dtype = draw(st.sampled_from([torch.long, torch.int]))
    limit = 2 ** 31 - table_rows if dtype == torch.int else 2 ** 62
    offset = draw(st.one_of(st.integers(-3, 3), st.integers(-limit, limit)))
    rows = integers(gen, pos_shape, 0, table_rows)
    positions = drawn_tensor(draw, pos_shape, lambda s: (rows[tuple(slice(0, n) for n in s)] - offset).to(dtype))
    return positions, offset, positions.long() + offset


@property_check("learned")
@given(st.data())
def check_learned(data):
    draw, gen, dtype = drawing(data, FLOAT_DTYPES)
    table_rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    weight = drawn_tensor(draw, [table_rows, width], lambda s: normal(gen, s, dtype))
    shape = sizes(draw, draw(st.integers(1, 3)))
    positions, offset, rows = learned_rows(draw, gen, shape, table_rows, shared_ok=False)
    if positions is None:
        positions, rows = torch.arange(shape[-1]).expand(shape) - offset, (torch.arange(shape[-1])).expand(shape)
    padding_idx = draw(st.one_of(st.none(), st.integers(0, table_rows - 1)))
    out = call("learned", weight, positions, offset, padding_idx)
    assert out.dtype == dtype
    assert_rounds_within(out, weight.double()[rows.expand(shape)], 0.0)


@property_check("add_learned")
@given(st.data())
def check_add_learned(data):
    draw, gen, dtype = drawing(data, FLOAT_DTYPES)
    rows_shape = sizes(draw, draw(st.integers(1, 3)))
    table_rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    weight = drawn_tensor(draw, [table_rows, width], lambda s: normal(gen, s, dtype))
    x = drawn_tensor(draw, rows_shape + [width], lambda s: normal(gen, s, dtype))
    positions, offset, rows = learned_rows(draw, gen, rows_shape, table_rows)
    padding_idx = draw(st.one_of(st.none(), st.integers(0, table_rows - 1)))
    out = call("add_learned", x, weight, positions, offset, padding_idx)
    assert out.dtype == dtype and out.is_contiguous()
    table = weight.double()[rows.expand(rows_shape)]
    assert_rounds_within(out, x.double() + table, 2 * math_eps(dtype) * (x.double().abs() + table.abs()))


@property_check("embed_learned")
@given(st.data())
def check_embed_learned(data):
    draw, gen, dtype = drawing(data, FLOAT_DTYPES)
    shape = sizes(draw, draw(st.integers(1, 3)))
    vocab, table_rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    token_weight = drawn_tensor(draw, [vocab, width], lambda s: normal(gen, s, dtype))
    pos_weight = drawn_tensor(draw, [table_rows, width], lambda s: normal(gen, s, dtype))
    tokens = drawn_tensor(draw, shape, lambda s: integers(gen, s, 0, vocab))
    positions, offset, rows = learned_rows(draw, gen, shape, table_rows)
    token_scale = draw(st.sampled_from([1.0, 0.5, 27.7]))
    padding_idx = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    pos_padding_idx = draw(st.one_of(st.none(), st.integers(0, table_rows - 1)))
    out = call("embed_learned", tokens, token_weight, pos_weight, positions, token_scale, padding_idx, offset,
               pos_padding_idx)
    assert out.dtype == dtype
    scaled = token_weight.double()[tokens] * token_scale
    table = pos_weight.double()[rows.expand(shape)]
    assert_rounds_within(out, scaled + table, 4 * math_eps(dtype) * (scaled.abs() + table.abs()))


@property_check("make_positions")
@given(st.data())
def check_make_positions(data):
    draw, gen = drawing(data)
    padding_idx = draw(st.one_of(st.integers(-3, 5), st.integers(INT64_MIN, INT64_MAX - 64)))
    shape = sizes(draw, draw(st.integers(1, 3)))
    dtype = draw(st.sampled_from([torch.long, torch.int]))
    values = [padding_idx, 0, 1, 2] if dtype == torch.long or abs(padding_idx) < 2 ** 31 else [0, 1, 2]
    tokens = drawn_tensor(draw, shape, lambda s: torch.tensor(values)[integers(gen, s, 0, len(values))].to(dtype))
    out = call("make_positions", tokens, padding_idx)
    assert out.dtype == torch.long
    real = tokens.long() != padding_idx
    rows = (math.prod(shape[:-1]), shape[-1])
    reference = [[padding_idx + count if keep else padding_idx for keep, count in zip(row, counts)]
                 for row, counts in zip(real.reshape(rows).tolist(), real.long().cumsum(-1).reshape(rows).tolist())]
    assert out.shape == tokens.shape and out.reshape(rows).tolist() == reference


@property_check("positions_from_mask")
@given(st.data())
def check_positions_from_mask(data):
    draw, gen = drawing(data)
    shape = sizes(draw, draw(st.integers(1, 3)))
    dtype = draw(st.sampled_from([torch.bool, torch.long, torch.int, torch.uint8, torch.float32, torch.float64,
                                  torch.bfloat16]))
    values = {torch.bool: [False, True]}.get(dtype, [0, 1, 2, -1] if dtype != torch.uint8 else [0, 1, 255])
    if dtype.is_floating_point:
        values = [0.0, 1.0, 0.5, float("nan"), -0.0]
    mask = drawn_tensor(draw, shape, lambda s: torch.tensor(values, dtype=dtype)[integers(gen, s, 0, len(values))])
    pad_position = draw(st.one_of(st.integers(-2, 2), st.sampled_from([INT64_MIN, INT64_MAX])))
    out = call("positions_from_mask", mask, pad_position)
    real = (mask != 0).long()
    reference = torch.where(real.bool(), real.cumsum(-1) - 1, torch.full_like(real, pad_position))
    assert out.dtype == torch.long and torch.equal(out, reference)


# ---- bad inputs: a small valid call of each op, and the mutations that each make one argument wrong

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


bad_inputs("embedding_backward", base=embedding_backward, mutations=dict(
    grad_not_floating=not_floating("grad"), grad_0d=wrong_rank("grad", [0]), indices_not_index=not_index("indices"),
    indices_not_a_suffix=grow("indices", -1),
    index_out_of_range=lambda draw, kw: put("indices", [kw["num_rows"], -1, INT64_MAX, INT64_MIN])(draw, kw),
    num_rows_negative=set_value("num_rows", st.integers(-10, -1)),
    padding_idx_out_of_range=lambda draw, kw: kw.update(padding_idx=draw(st.sampled_from(
        [-1, kw["num_rows"], INT64_MAX, INT64_MIN]))),
    indices_on_meta=on_meta("indices")))
bad_inputs("learned", base=learned, mutations=dict(
    weight_wrong_rank=wrong_rank("weight", [1, 3]), weight_not_floating=not_floating("weight"),
    positions_not_index=not_index("positions"), rows_outside_the_table=rows_outside_table("weight"),
    padding_idx_out_of_range=lambda draw, kw: kw.update(padding_idx=draw(st.sampled_from(
        [-1, kw["weight"].shape[0], INT64_MAX]))),
    positions_on_meta=on_meta("positions")))
bad_inputs("add_learned", base=add_learned, mutations=dict(
    x_not_floating=not_floating("x"), x_wrong_rank=wrong_rank("x", [0, 1]),
    weight_other_dtype=to_dtype("weight", torch.float64, torch.bfloat16),
    x_width_mismatch=grow("x", -1), rows_outside_the_table=rows_outside_table("weight"),
    positions_not_index=lambda draw, kw: kw.update(positions=torch.zeros(kw["x"].shape[-2])),
    positions_wrong_shape=lambda draw, kw: kw.update(
        positions=torch.zeros(kw["x"].shape[-2] + 1, dtype=torch.long)),
    weight_on_meta=on_meta("weight")))
bad_inputs("embed_learned", base=embed_learned, mutations=dict(
    tokens_not_index=not_index("tokens"), tokens_0d=wrong_rank("tokens", [0]),
    tokens_out_of_vocab=lambda draw, kw: put("tokens", [kw["token_weight"].shape[0], -1])(draw, kw),
    pos_weight_other_dtype=to_dtype("pos_weight", torch.float64, torch.float16),
    pos_weight_width_mismatch=grow("pos_weight", 1),
    rows_outside_the_table=rows_outside_table("pos_weight"),
    pos_padding_idx_out_of_range=lambda draw, kw: kw.update(
        pos_padding_idx=kw["pos_weight"].shape[0])))
bad_inputs("make_positions", base=make_positions, mutations=dict(
    tokens_not_index=not_index("tokens"), tokens_0d=wrong_rank("tokens", [0]),
    positions_overflow_int64=lambda draw, kw: kw.update(
        tokens=torch.zeros_like(kw["tokens"]), padding_idx=INT64_MAX)))
bad_inputs("positions_from_mask", base=positions_from_mask, mutations=dict(
    attention_mask_complex=to_dtype("attention_mask", torch.complex64),
    attention_mask_0d=wrong_rank("attention_mask", [0])))
