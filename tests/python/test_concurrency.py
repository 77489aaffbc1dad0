"""Thread safety: every op (forward, backward, autograd: each op's registry samples, op_registry.SAMPLES, with
their gradients) called from 8 Python threads at once on shared inputs gives the serial results bit for bit, and
posenc.nn modules (eager and scripted) shared by 8 threads for inference do too, as do in-place ops writing
disjoint views of one buffer. The ops release the GIL while they run, so the threads really overlap, each also
running the kernels' own intra-op threads."""
import functools
import random
import threading

import pytest
import torch

import helpers
import posenc
from helpers import same_bits
from op_registry import SAMPLES, outputs_and_grads, tensor_ops
from posenc import functional as PF

THREADS = 8
ROUNDS = 3


def shared_inputs():
    """Inputs of the module tests, built once and only read by the threads."""
    g = torch.Generator().manual_seed(0)
    randn = functools.partial(helpers.randn, generator=g)

    def randint(high, *shape):
        return torch.randint(0, high, shape, generator=g)

    return dict(x=randn(4, 256, 128), tokens=randint(500, 4, 256), q=randn(2, 128, 8, 64, dtype=torch.bfloat16),
                k=randn(2, 128, 2, 64, dtype=torch.bfloat16), scores=randn(2, 8, 64, 128),
                rope_positions=randint(100000, 2, 128), rope_freq=posenc.frequencies.rope(64)[0],
                slopes=PF.alibi_slopes(8))


# Each op's registry sample at both sizes: "large" (float32) splits every kernel's work over its intra-op threads,
# "small" (bfloat16) takes the other paths of the op (positions absent, offsets, views, varlen, multi-axis, ...).
# A large call runs once per thread (8 at once already; comparing millions of values costs), a small one ROUNDS times.
SIZE_DTYPES = {"large": torch.float32, "small": torch.bfloat16}
SIZE_ROUNDS = {"large": 1, "small": ROUNDS}


def op_calls():
    """Every op, each a function returning its outputs and the gradients of its inputs (through autograd, so the
    backward ops run too) on inputs shared by the threads; in-place ops write into a private copy (writing into a
    shared input would be a race by design)."""
    calls = {}
    for name in sorted(SAMPLES):
        for size, dtype in SIZE_DTYPES.items():
            calls[f"{name} {size}"] = functools.partial(outputs_and_grads, SAMPLES[name](dtype=dtype, size=size,
                                                                                         requires_grad=True))
    return calls


def flatten(result):
    if isinstance(result, (tuple, list)):
        return [x for item in result for x in flatten(item)]
    return [result]


def run_threads(worker):
    """Runs worker(index) for index 0 .. THREADS - 1, each in its own thread, and waits for all of them."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_concurrently(calls, expected, context=None, rounds=None):
    """Every thread runs every call ROUNDS times (or rounds[name]), in its own shuffled order, all threads released
    at once.
    Returns a list of problems (mismatches, exceptions)."""
    problems = []
    barrier = threading.Barrier(THREADS)

    def worker(index):
        order = [name for name in calls for _ in range((rounds or {}).get(name, ROUNDS))]
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

    run_threads(worker)
    return problems


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_every_op_from_8_threads_equals_the_serial_results():
    """Every thread runs every call (each op's samples, mixed in a shuffled order)."""
    calls = op_calls()
    covered = {name.split(" ")[0] for name in calls}
    assert set(tensor_ops()) <= covered, set(tensor_ops()) - covered
    expected = {name: flatten(call()) for name, call in calls.items()}
    rounds = {name: SIZE_ROUNDS[name.split(" ")[1]] for name in calls}
    assert run_concurrently(calls, expected, rounds=rounds) == []


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

    run_threads(worker)
    # Each thread applied its work ROUNDS times; serially, apply it ROUNDS - 1 more times to compare.
    for _ in range(ROUNDS - 1):
        for index in range(THREADS):
            work(serial_q, serial_s, index)
    assert errors == []
    assert same_bits(cache, serial_q) and same_bits(scores, serial_s)
