import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

import posenc  # noqa: F401  (loads libposenc.so: torch.ops.posenc.*)

# Outputs of more than 2^31 elements need up to 9 GiB of memory and minutes: collected on request only.
collect_ignore = [] if os.environ.get("POSENC_BIG_TESTS") == "1" else ["test_64bit_outputs.py"]

# Property-based tests (hypothesis). "ci", the default, is derandomized: every run draws the same examples, so
# CI is reproducible. "long" draws fresh random examples, many more of them. Pick one with the environment
# variable POSENC_HYPOTHESIS_PROFILE=long or with hypothesis' own pytest option --hypothesis-profile=long.
_HYPOTHESIS_COMMON = dict(deadline=None, database=None, print_blob=True,
                          phases=[Phase.explicit, Phase.generate, Phase.shrink],
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=25, derandomize=True, **_HYPOTHESIS_COMMON)
settings.register_profile("long", max_examples=1000, derandomize=False, **_HYPOTHESIS_COMMON)
settings.load_profile(os.environ.get("POSENC_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tensor_ops():
    """Every posenc op that takes a tensor: the ones the reliability tests (properties, bad input, determinism,
    concurrency) must each cover. Ops without a tensor argument (cpu_capability) answer configuration
    questions and have tests of their own."""
    names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("posenc::"))
    return [name for name in names
            if any("Tensor" in str(a.type) for a in getattr(torch.ops.posenc, name).default._schema.arguments)]


def _flatten(result):
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in _flatten(item)]
    return [result]


def same_bits(a, b):
    """Bitwise equality (NaN payloads included), which torch.equal is not: it calls NaN unequal to itself."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(as_int), b.contiguous().view(as_int)
    return torch.equal(a, b)


@pytest.fixture
def same_bits_for_any_thread_count():
    """Runs fn with 1, 2, 3, 1, 2 and 3 threads, asserts that every run gives the same bits (each tensor of a
    result, nested tuples and lists included), returns the first result. Shapes must be large enough that 2 and
    3 threads really split the work (at::parallel_for's grain is 32768 elements)."""

    def run(fn):
        previous = torch.get_num_threads()
        results = []
        try:
            for threads in (1, 2, 3, 1, 2, 3):
                torch.set_num_threads(threads)
                results.append(fn())
        finally:
            torch.set_num_threads(previous)
        first = _flatten(results[0])
        for threads, other in zip((2, 3, 1, 2, 3), results[1:]):
            other = _flatten(other)
            assert len(other) == len(first)
            for index, (a, b) in enumerate(zip(first, other)):
                assert same_bits(a, b), f"result {index} with {threads} threads differs from the 1-thread run"
        return results[0]

    return run


@pytest.fixture
def compiled_matches_eager():
    """Compiles fn with torch.compile(fullgraph=True, backend="aot_eager"): the forward graph, and the backward
    graph AOTAutograd derives from our autograd kernels. Asserts that the output and the gradients of `wrt`
    (a random output gradient) equal eager's."""

    def check(fn, inputs, wrt, dynamic=False):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        expected, actual = fn(*inputs), compiled(*inputs)
        torch.testing.assert_close(actual, expected)
        grad_out = torch.randn_like(expected)
        for a, e in zip(torch.autograd.grad(actual, wrt, grad_out), torch.autograd.grad(expected, wrt, grad_out)):
            torch.testing.assert_close(a, e)

    return check
