"""Thread safety: every op (forward, backward, autograd) called from 8 Python threads at once on shared inputs
gives the serial results bit for bit, and posenc.nn modules (eager and scripted) shared by 8 threads for
inference do too. The ops release the GIL while they run, so the threads really overlap, each also running
the kernels' own intra-op threads."""
import functools
import random
import threading

import pytest
import torch

import helpers
import posenc
from helpers import same_bits
from op_registry import tensor_ops
from posenc import functional as PF

THREADS = 8
ROUNDS = 3
F64 = torch.float64


def grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def shared_inputs():
    """One set of inputs, large enough that every kernel splits its work (32768-element grain), built once
    and only read by the threads."""
    g = torch.Generator().manual_seed(0)
    randn = functools.partial(helpers.randn, generator=g)

    def randint(high, *shape):
        return torch.randint(0, high, shape, generator=g)

    return dict(
        x=randn(4, 256, 128), x_grad=randn(4, 256, 128, requires_grad=True), positions=randint(5000, 4, 256),
        inv_freq=posenc.frequencies.sinusoidal(128), tokens=randint(500, 4, 256), table=randn(500, 128),
        table_grad=randn(500, 128, requires_grad=True), pos_table=randn(300, 128, requires_grad=True),
        q=randn(2, 128, 8, 64, dtype=torch.bfloat16), k=randn(2, 128, 2, 64, dtype=torch.bfloat16),
        q_grad=randn(2, 128, 8, 64, requires_grad=True), rope_positions=randint(100000, 2, 128),
        rope_freq=posenc.frequencies.rope(64)[0], cos=randn(128, 64), sin=randn(128, 64),
        scores=randn(2, 8, 64, 128), scores_grad=randn(2, 8, 64, 128, requires_grad=True),
        slopes=PF.alibi_slopes(8).requires_grad_(True), t5_table=randn(32, 8, requires_grad=True),
        relative=randint(2000, 64, 512) - 1000, mask=randint(2, 8, 4096),
        grad_bshd=randn(2, 128, 8, 64), grad_scores=randn(2, 8, 64, 128), grad_x=randn(4, 256, 128),
        mrope_freq=posenc.frequencies.mrope(64, [8, 12, 12]), mrope_positions=randint(100000, 3, 2, 128),
        # 64 rows of text, an image (grid 1 x 8 x 8, merge 2: 16 tokens) and text; the last 8 tokens padding.
        token_types=torch.tensor([[0] * 20 + [1] * 16 + [0] * 92] * 64), vision_mask=(torch.arange(128) < 120)
        .expand(64, 128), image_grids=torch.tensor([[1, 8, 8]] * 64), seq_len=torch.tensor(5000),
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), (randint(100, 2048) * 8).cumsum(0)]),
    )


def op_calls(t):
    """Every op, each as a function of the shared inputs returning tensors; in-place ops work on a private
    copy (writing into a shared input would be a race by design); backward through autograd as well."""
    return {
        "sinusoidal": lambda: PF.sinusoidal(t["positions"], t["inv_freq"], "half", None, 3),
        "add_sinusoidal": lambda: PF.add_sinusoidal(t["x"], t["positions"], t["inv_freq"], 2.0),
        "add_sinusoidal autograd": lambda: grads(PF.add_sinusoidal(t["x_grad"], None, t["inv_freq"], 0.5),
                                                 t["x_grad"], t["grad_x"]),
        "embed_sinusoidal": lambda: PF.embed_sinusoidal(t["tokens"], t["table"], None, t["inv_freq"], 1.5, 0),
        "embed_sinusoidal autograd": lambda: grads(PF.embed_sinusoidal(t["tokens"], t["table_grad"], None,
                                                                       t["inv_freq"], 1.5, 0), t["table_grad"],
                                                   t["grad_x"]),
        "embedding_backward": lambda: PF.embedding_backward(t["grad_x"], t["tokens"], 500, 0.5, 3),
        "learned": lambda: PF.learned(t["table"], t["tokens"], 0),
        "add_learned": lambda: PF.add_learned(t["x"], t["pos_table"].detach(), None, 7),
        "add_learned autograd": lambda: grads(PF.add_learned(t["x_grad"], t["pos_table"], t["tokens"] % 290, 3),
                                              (t["x_grad"], t["pos_table"]), t["grad_x"]),
        "embed_learned autograd": lambda: grads(PF.embed_learned(t["tokens"], t["table_grad"], t["pos_table"], None,
                                                                 2.0, 1, 10, 0), (t["table_grad"], t["pos_table"]),
                                                t["grad_x"]),
        "make_positions": lambda: PF.make_positions(t["tokens"] % 7, 1),
        "positions_from_mask": lambda: PF.positions_from_mask(t["mask"], -1),
        "rope": lambda: PF.rope(t["q"], t["rope_positions"], t["rope_freq"], 1.0, "gptj", "bshd", 5),
        "rope_backward": lambda: PF.rope_backward(t["grad_bshd"], None, t["rope_freq"], 0.5, "neox", "bshd", 2),
        "rope autograd": lambda: grads(PF.rope(t["q_grad"].transpose(1, 2), None, t["rope_freq"], 1.0, "neox",
                                               "bhsd"), t["q_grad"], t["grad_bshd"].transpose(1, 2)),
        "rope_qk": lambda: PF.rope_qk(t["q"], t["k"], None, t["rope_freq"], 1.0, "neox", "bshd", 11),
        "rope_qk_backward": lambda: PF.rope_qk_backward(t["q"].float(), t["k"].float(), t["rope_positions"],
                                                        t["rope_freq"]),
        "rope_": lambda: _inplace_rope(t),
        "rope_cos_sin": lambda: PF.rope_cos_sin(t["q"], t["cos"], t["sin"], "gptj"),
        "rope_cos_sin_backward": lambda: PF.rope_cos_sin_backward(t["grad_bshd"], t["cos"], t["sin"]),
        "alibi_bias": lambda: PF.alibi_bias(t["slopes"].detach(), 300, 500, "symmetric"),
        "add_alibi": lambda: PF.add_alibi(t["scores"], t["slopes"].detach(), "causal", 0),
        "add_alibi autograd": lambda: grads(PF.add_alibi(t["scores_grad"], t["slopes"], "symmetric"),
                                            (t["scores_grad"], t["slopes"]), t["grad_scores"]),
        "add_alibi_": lambda: _inplace_alibi(t),
        "alibi_backward": lambda: PF.alibi_backward(t["grad_scores"], t["slopes"].detach(), "causal"),
        "relative_position_bucket": lambda: PF.relative_position_bucket(t["relative"], False, 32, 128),
        "t5_bias": lambda: PF.t5_bias(t["t5_table"].detach(), 64, 512, True, 32, 128, 100),
        "t5_bias autograd": lambda: grads(PF.t5_bias(t["t5_table"], 64, 128, False, 32, 128, 3), t["t5_table"],
                                          t["grad_scores"][:1]),
        "t5_bias_backward": lambda: PF.t5_bias_backward(t["grad_scores"][:1], True, 32, 128, 7),
        "rope_qk multiaxis": lambda: PF.rope_qk(t["q"], t["k"], t["mrope_positions"], t["mrope_freq"][0], 1.0, "neox",
                                                "bshd", 3, None, t["mrope_freq"][1]),
        "mrope_positions": lambda: PF.mrope_positions(t["token_types"], t["image_grids"], None, t["vision_mask"]),
        "rope_inv_freq_for_length": lambda: torch.ops.posenc.rope_inv_freq_for_length(
            t["seq_len"], 64, 1e4, "dynamic", factor=2.0, max_position_embeddings=4096.0),
        "zigzag_positions_varlen": lambda: PF.zigzag_positions_varlen(t["cu_seqlens"], 4, 2),
    }


def _inplace_rope(t):
    x = t["q"].clone()
    PF.rope_(x, t["rope_positions"], t["rope_freq"], 1.0, "neox", "bshd", 1)
    return x


def _inplace_alibi(t):
    scores = t["scores"].clone()
    PF.add_alibi_(scores, t["slopes"].detach(), "symmetric", 0)
    return scores


def flatten(result):
    if isinstance(result, (tuple, list)):
        return [x for item in result for x in flatten(item)]
    return [result]


def run_concurrently(calls, expected, context=None):
    """Every thread runs every call ROUNDS times, in its own shuffled order, all threads released at once.
    Returns a list of problems (mismatches, exceptions)."""
    problems = []
    barrier = threading.Barrier(THREADS)

    def worker(index):
        order = [name for name in calls for _ in range(ROUNDS)]
        random.Random(index).shuffle(order)
        barrier.wait()
        try:
            with context() if context else _nothing():
                for name in order:
                    got = flatten(calls[name]())
                    if len(got) != len(expected[name]) or not all(map(same_bits, got, expected[name])):
                        problems.append(f"thread {index}: {name} differs from the serial result")
        except Exception as error:  # noqa: BLE001  (reported below, with the thread that raised it)
            problems.append(f"thread {index}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return problems


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_every_op_from_8_threads_equals_the_serial_results():
    calls = op_calls(shared_inputs())
    covered = {name.split(" ")[0] for name in calls}
    assert set(tensor_ops()) <= covered, set(tensor_ops()) - covered
    expected = {name: flatten(call()) for name, call in calls.items()}
    assert run_concurrently(calls, expected) == []


def modules():
    torch.manual_seed(1)
    built = {
        "SinusoidalPositionalEncoding": posenc.nn.SinusoidalPositionalEncoding(128, shift=1, layout="half"),
        "SinusoidalEmbedding": posenc.nn.SinusoidalEmbedding(500, 128, padding_idx=0),
        "LearnedPositionalEmbedding": posenc.nn.LearnedPositionalEmbedding(300, 128, offset=2),
        "LearnedEmbedding": posenc.nn.LearnedEmbedding(500, 300, 128, padding_idx=0),
        "RotaryEmbedding": posenc.nn.RotaryEmbedding(64),
        "RotaryEmbedding dynamic": posenc.nn.RotaryEmbedding(
            64, scaling={"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}),
        "RotaryEmbedding longrope": posenc.nn.RotaryEmbedding(64, scaling={
            "rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [4.0] * 32,
            "original_max_position_embeddings": 64, "max_position_embeddings": 256}),
        "ALiBi": posenc.nn.ALiBi(8, "symmetric"),
        "T5RelativeBias": posenc.nn.T5RelativeBias(8, 32, 128, False),
    }
    return {name: module.eval() for name, module in built.items()}


def module_calls(built, t):
    """Calls that change sequence lengths from call to call, so that per-call frequencies (dynamic NTK,
    LongRoPE) differ between threads running at once."""
    def rotary(module, length):
        return lambda: module(t["q"][:, :length], t["k"][:, :length], None, 5)

    calls = {}
    for prefix, get in (("", lambda name: built[name]), ("scripted ", lambda name: torch.jit.script(built[name]))):
        calls[prefix + "SinusoidalPositionalEncoding"] = (lambda m: lambda: m(t["x"], None, 4))(
            get("SinusoidalPositionalEncoding"))
        calls[prefix + "SinusoidalEmbedding"] = (lambda m: lambda: m(t["tokens"]))(get("SinusoidalEmbedding"))
        calls[prefix + "LearnedPositionalEmbedding"] = (lambda m: lambda: m(t["x"], t["tokens"] % 290))(
            get("LearnedPositionalEmbedding"))
        calls[prefix + "LearnedEmbedding"] = (lambda m: lambda: m(t["tokens"], None, 10))(get("LearnedEmbedding"))
        for name in ("RotaryEmbedding", "RotaryEmbedding dynamic", "RotaryEmbedding longrope"):
            module = get(name)
            for length in (16, 60, 128):
                calls[f"{prefix}{name} S={length}"] = rotary(module, length)
        calls[prefix + "ALiBi"] = (lambda m: lambda: m(t["scores"]))(get("ALiBi"))
        calls[prefix + "ALiBi bias"] = (lambda m: lambda: m.bias(100, 300))(get("ALiBi"))
        calls[prefix + "T5RelativeBias"] = (lambda m: lambda: m(64, 300, 17))(get("T5RelativeBias"))
    return calls


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_modules_shared_by_8_threads_for_inference_equal_the_serial_results(mode):
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    calls = module_calls(modules(), shared_inputs())
    with context():
        expected = {name: flatten(call()) for name, call in calls.items()}
    assert run_concurrently(calls, expected, context) == []


def test_inplace_ops_on_disjoint_views_of_one_tensor_from_8_threads():
    """8 threads rotate (rope_) and bias (add_alibi_) their own strided slices of one shared buffer at once, as
    workers filling one KV cache would: the buffer ends equal to the serial result, so no kernel writes outside
    its view."""
    t = shared_inputs()
    cache = torch.randn(THREADS * 2, 128, 8, 64, generator=torch.Generator().manual_seed(3))
    scores = torch.randn(THREADS, 8, 64, 128, generator=torch.Generator().manual_seed(4))

    def work(buffer_q, buffer_s, index):
        PF.rope_(buffer_q[index::THREADS], t["rope_positions"], t["rope_freq"], 1.0, "gptj", "bshd", index)
        PF.add_alibi_(buffer_s[index].unsqueeze(0).transpose(2, 3), t["slopes"].detach(), "symmetric")

    serial_q, serial_s = cache.clone(), scores.clone()
    for index in range(THREADS):
        work(serial_q, serial_s, index)
    barrier = threading.Barrier(THREADS)
    errors = []

    def worker(index):
        barrier.wait()
        try:
            for _ in range(ROUNDS):
                work(cache, scores, index)
        except Exception as error:  # noqa: BLE001
            errors.append(f"thread {index}: {error}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Each thread applied its work ROUNDS times; serially, apply it ROUNDS - 1 more times to compare.
    for _ in range(ROUNDS - 1):
        for index in range(THREADS):
            work(serial_q, serial_s, index)
    assert errors == []
    assert same_bits(cache, serial_q) and same_bits(scores, serial_s)
