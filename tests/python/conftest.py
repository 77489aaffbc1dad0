import pytest
import torch

import posenc  # noqa: F401  (loads libposenc.so: torch.ops.posenc.*)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def same_bits_for_any_thread_count():
    """Runs fn with 1, 2, 1 and 2 threads, asserts every run gives the same bits, returns the first result."""

    def run(fn):
        previous = torch.get_num_threads()
        results = []
        try:
            for threads in (1, 2, 1, 2):
                torch.set_num_threads(threads)
                results.append(fn())
        finally:
            torch.set_num_threads(previous)
        first = results[0] if isinstance(results[0], (tuple, list)) else (results[0],)
        for other in results[1:]:
            other = other if isinstance(other, (tuple, list)) else (other,)
            assert all(torch.equal(a, b) for a, b in zip(first, other))
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
