import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

import posenc  # loads libposenc.so: torch.ops.posenc.*
from helpers import same_bits

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


def _flatten(result):
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in _flatten(item)]
    return [result]


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread than on two (the suite's cost stays small)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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


# ---------------------------------------------------------------- devices
# Every test runs on the CPU. Where a GPU is present, the suite also runs on CUDA in two ways:
# - tests that take the `device` fixture (tests/python/test_cuda.py) run once per device;
# - every other test runs as written on the CPU while each posenc op call it makes (forward and backward ops,
#   TorchScript too) is re-run on a copy of its inputs on the GPU (same sizes, strides and storage offsets) and
#   must give the same results, or raise the same error: the CPU's results are what the test sees and checks.
#   POSENC_SHADOW=cuda (the default where a GPU is present), cpu (a second CPU run: the mechanism itself, without
#   a GPU) or off. Tests of torch.compile, torch.export, ONNX, AOTInductor, DTensor, opcheck, Meta kernels and
#   CPU capabilities are not re-run this way (they trace or check the dispatcher itself, or run other processes;
#   test_cuda.py runs opcheck, compile and export on CUDA), nor TorchScript tests (an error raised through a
#   Python dispatch mode reaches TorchScript without its message).
import os  # noqa: E402
import re  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHADOW = os.environ.get("POSENC_SHADOW", "cuda" if torch.cuda.is_available() else "off")
_SHADOW_SKIPS = re.compile(r"compile|export|opcheck|meta|capabilit|emulated|script")
# Files whose tests trace, export or run other processes (ONNX, AOTInductor, DTensor, subprocesses).
_SHADOW_SKIP_FILES = {"test_capabilities.py", "test_export.py", "test_onnx.py", "test_distributed.py", "test_study.py",
                      "test_readme.py", "test_version.py"}

@pytest.fixture(params=DEVICES)
def device(request):
    """Each device the suite runs on: "cpu", and "cuda" where a GPU is present."""
    return request.param


def _copy_to(t, device):
    """t on `device` with its sizes, strides and storage offset: the whole storage is copied, then viewed alike."""
    t = t.detach()
    storage = t.untyped_storage()
    if t.numel() == 0 or storage.nbytes() % t.element_size() != 0:
        return t.to(device, copy=True)
    base = torch.empty(0, dtype=t.dtype).set_(storage)
    return base.to(device, copy=True).as_strided(t.size(), t.stride(), t.storage_offset())


def _plain_cpu(values):
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return (all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" for t in tensors)
            and not any(isinstance(v, torch.SymInt) for v in values))


def _first_line(error):
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


class ShadowDevice(TorchDispatchMode):
    """Re-runs each posenc op call made on CPU tensors on `device` and checks that the results (returned and
    mutated tensors) and errors agree; the CPU's results are returned."""

    def __init__(self, device):
        super().__init__()
        self.device = device
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        values, _ = tree_flatten((args, kwargs))
        # An op without a tensor argument has nothing to move (test_cuda.py runs those given a device on CUDA).
        if func.namespace != "posenc" or not any(isinstance(v, torch.Tensor) for v in values) \
                or not _plain_cpu(values):
            return func(*args, **kwargs)
        shadow_args, shadow_kwargs = tree_map(
            lambda v: _copy_to(v, self.device) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        try:
            expected = func(*args, **kwargs)
        except Exception as error:
            # The CPU raises at the call; the CUDA ops do in synchronous mode (by default, at a later check).
            asynchronous = not posenc.cuda.sync_checks()
            posenc.cuda.set_sync_checks(True)
            try:
                with pytest.raises(type(error)) as raised:
                    func(*shadow_args, **shadow_kwargs)
            finally:
                posenc.cuda.set_sync_checks(not asynchronous)
            assert _first_line(raised.value) == _first_line(error), f"{func}: the {self.device} error differs"
            raise
        actual = func(*shadow_args, **shadow_kwargs)
        name = func._schema.name.split("::")[-1]
        outputs = tree_flatten(expected)[0] + values
        shadows = tree_flatten(actual)[0] + tree_flatten((shadow_args, shadow_kwargs))[0]
        for cpu_value, other in zip(outputs, shadows):
            if isinstance(cpu_value, torch.Tensor):
                self._compare(name, cpu_value, other)
            else:
                assert cpu_value == other, f"{name}: {cpu_value!r} on the CPU, {other!r} on {self.device}"
        self.calls += 1
        return expected

    def _compare(self, name, expected, actual):
        assert actual.device.type == self.device, f"{name}: an output on {actual.device}"
        assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype), name
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{name} (expected the same bits): {m}")


_shadow_calls = {"count": 0}


@pytest.fixture(autouse=True)
def _shadow_device(request):
    if SHADOW == "off" or "device" in request.fixturenames or _SHADOW_SKIPS.search(request.node.name) \
            or request.node.path.name in _SHADOW_SKIP_FILES:
        yield
        return
    mode = ShadowDevice(SHADOW)
    with mode:
        yield
    _shadow_calls["count"] += mode.calls


def pytest_terminal_summary(terminalreporter):
    if SHADOW != "off":
        terminalreporter.write_line(f"posenc: {_shadow_calls['count']} op calls re-run on {SHADOW} and compared")
