"""The one list of posenc's ops for the tests, and the per-op entries the coverage tests run: every op the
dispatcher knows in the posenc namespace, each with one kind read from its schema; and, for each op that takes a
tensor, one sample call (SAMPLES), its hypothesis property (PROPERTIES) and its bad-input cases (BAD_INPUTS).
Coverage tests (properties, bad inputs, determinism, concurrency, no_grad, CUDA, autocast, DTensor, ONNX, CPU
capabilities) select from here, so that a new op fails each of them until it is covered.

Kinds, decided in this order (the first rule that holds):
- "inplace": the schema mutates an argument (Tensor(a!)): rope_, add_alibi_.
- "backward": the name ends in _backward (rope_backward, embedding_backward, ...).
- "configuration": the op computes what a forward op is given, not an encoding: it takes no tensor (frequencies,
  slopes, position grids, cpu_capability), or its name says it builds positions or frequencies ("positions" or
  "inv_freq" in it: make_positions, positions_from_mask, mrope_positions, zigzag_positions_varlen,
  rope_inv_freq_for_length). A schema cannot tell index data from values to encode, so the name decides there.
- "forward": everything else (rope, add_alibi, t5_bias, relative_position_bucket, ...).

Per-op entries: an op's family test file (test_<family>.py, the families of csrc/families.h: test_sinusoidal.py,
test_learned.py (with embedding_backward), test_rope.py, test_alibi.py, test_t5.py, test_multiaxis.py,
test_frequencies.py (the configuration ops that take tensors)) holds them next to its value tests, registered
with three calls of this module:

    @sample("add_learned")                    # SAMPLES["add_learned"]: see Samples below
    def _build_add_learned(m): ...

    @property_check("add_learned")            # PROPERTIES["add_learned"] = (check_add_learned,)
    @given(st.data())
    def check_add_learned(data): ...

    @property_check("rope", "rope_backward")  # one check of several ops, given the op:
    @given(data=st.data())                    # PROPERTIES["rope"] = (check_rope_and_its_backward, "rope")
    def check_rope_and_its_backward(op, data): ...

    bad_inputs("add_learned", base=add_learned, mutations={"x_not_floating": not_floating("x"), ...})

test_properties.py runs PROPERTIES (and its own cross-op property, "in-place overlap"); bad_input_fuzzer.py runs
BAD_INPUTS: base(draw), the keyword arguments of a small valid call, made wrong by each mutation(draw, kw) (case
"<op>/<mutation>"), and "<op>/anything", drawn from the schema. The properties of several families share
strategies.py (strategies, float64 checks), and their bad inputs mutations.py. An op added to a family needs an
edit of that family's test file only: test_properties.py's test_every_op_has_a_property_and_bad_input_cases and
every test that runs SAMPLES fail while an op of tensor_ops() has no entry.

The registries (SAMPLES, PROPERTIES, BAD_INPUTS) are filled on first access: load_families() imports every
tests/python/test_*.py with a line that starts with a registration (@sample(, @property_check( or bad_inputs(),
so that a new family file is found too. It imports them under their bare module names, as pytest does (its
default "prepend" import mode puts tests/python on sys.path), so that none is imported twice; the scripts that
run cases in subprocesses (test_properties.py, bad_input_fuzzer.py, capability_outputs.py) have tests/python on
sys.path as their own directory. Family files import this module, never the reverse at import time: no cycle.

Samples: SAMPLES[name], one entry for each op of tensor_ops(), is what the tests that run every op run:
test_determinism.py (size "large", 1, 2 and 3 threads, against the float64 reference), test_concurrency.py (both
sizes from 8 threads), capability_outputs.py (size "small", every dtype, across CPU capabilities), test_no_grad.py
and test_cuda.py. Each of those fails while an op of tensor_ops() has no entry; an op added to SAMPLES is run by
all of them with no other edit. Adding one: a builder decorated with @sample("name") (in the op's family test
file) that draws its inputs from `m` and returns call_args(*args, **kwargs) of torch.ops.posenc.<name>.

    SAMPLES[name](dtype=torch.float32, size="small", device="cpu", requires_grad=False, reference=False) -> Sample

- size: "small", a few thousand elements, taking the paths that the large call does not: odd widths (65
  frequency pairs in 130 or 134 channels, 67 keys), views (transposed, channel-strided), positions absent and
  offsets, padding_idx, every rotary layout and format among the rope ops, packed sequences (cu_seqlens),
  multi-axis positions, video grids; "large", 0.5-2 M elements, so that at::parallel_for (grain 32768) splits the
  work over 2 and 3 threads: model-sized shapes, positions given (up to 1e5), Llama 3 frequencies, GQA.
- dtype: the dtype of the op's floating data, and of its result where the op is given one (sinusoidal,
  alibi_bias). Frequencies, slopes and cos/sin tables keep their own dtype. The values are exact_values (integers
  times 2^-20 rounded to dtype, seeded per tensor): the same bits on every CPU and device.
- device: the inputs are made on the CPU and moved (leaves are made on the device): every device sees the same
  values.
- requires_grad: the data gradients flow to are leaves requiring grad (Sample.inputs); none for ops that are not
  differentiable (sinusoidal, embedding_backward, add_alibi_, the index and position ops).
- reference: the same values (rounded to dtype) held in float64 (the fixed-dtype tensors too), with float64
  results: the exact computation the sample approximates, for value checks.
Sample.run() calls the op and returns its output tensors (a tuple); an in-place op (rope_, add_alibi_) writes a
copy of its tensor made at each run and returns it. outputs_and_grads(sample) adds the gradients of Sample.inputs
for a fixed output gradient; sample_outputs(name, **kw) builds and runs in one call.
"""
import functools
import importlib
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

import posenc  # noqa: F401  (loads libposenc.so: torch.ops.posenc.*)

KINDS = ("forward", "backward", "inplace", "configuration")


@dataclass(frozen=True)
class Op:
    name: str
    kind: str
    takes_tensors: bool
    returns_tensors: bool


def _has_tensor(values):
    return any("Tensor" in str(value.type) for value in values)


def describe(name):
    """The registry's entry for torch.ops.posenc.<name>, read from its schema."""
    schema = getattr(torch.ops.posenc, name).default._schema
    takes_tensors = _has_tensor(schema.arguments)
    if schema.is_mutable:
        kind = "inplace"
    elif name.endswith("_backward"):
        kind = "backward"
    elif not takes_tensors or "positions" in name or "inv_freq" in name:
        kind = "configuration"
    else:
        kind = "forward"
    return Op(name, kind, takes_tensors, _has_tensor(schema.returns))


@functools.cache
def all_ops():
    """Every registered posenc op, sorted by name (the library's ops are all registered once it is loaded)."""
    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("posenc::"))
    return tuple(describe(name) for name in names)


def ops(*kinds, takes_tensors=None, returns_tensors=None):
    """Sorted names of the ops of any of `kinds` (all kinds when none is given), filtered by the two flags."""
    assert set(kinds) <= set(KINDS), kinds
    return [op.name for op in all_ops()
            if (not kinds or op.kind in kinds)
            and takes_tensors in (None, op.takes_tensors) and returns_tensors in (None, op.returns_tensors)]


def tensor_ops():
    """Every op that takes a tensor, of any kind: those the reliability tests (properties, bad inputs,
    determinism, concurrency, CUDA kernels) must each cover, and SAMPLES holds a call of."""
    return ops(takes_tensors=True)


# ---------------------------------------------------------------- samples (see the module's docstring)

SIZES = ("small", "large")


@dataclass(frozen=True, eq=False)
class Sample:
    """One call of torch.ops.posenc.<name> on freshly built inputs. `run()` calls it and returns its output tensors
    (a tuple); an in-place op works on a private copy of the tensor it writes (same sizes and strides: the sample
    stays reusable and threads never share what they write) and returns that copy. `inputs`: the leaves gradients
    flow to (empty when the op is not differentiable or requires_grad was False). `data`: the contiguous tensors
    the floating data of the sample's dtype was made in (arguments or the bases of argument views), for a caller
    that writes values of its own into them. `uses_dtype`: False when no input or result of the call depends on
    `dtype` (index and position ops): one dtype is enough."""
    name: str
    op: object
    args: tuple
    kwargs: dict
    inputs: tuple
    data: tuple
    dtype: torch.dtype
    uses_dtype: bool
    output_gradients: dict = field(default_factory=dict, repr=False)  # outputs_and_grads' made once

    def run(self):
        args = list(self.args)
        written = _written_arguments(self.name)
        for index in written:
            args[index] = args[index].clone()  # keeps the strides of a dense view; differentiable (rope_)
        out = self.op(*args, **self.kwargs)
        if written:
            return tuple(args[index] for index in written)
        return out if isinstance(out, tuple) else (out,)


@functools.cache
def _written_arguments(name):
    schema = getattr(torch.ops.posenc, name).default._schema
    return tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def exact_values(shape, seed, dtype=torch.float32):
    """Values in [-4, 4) made by integer arithmetic and then rounded to `dtype`: the same bits on every CPU
    (torch.randn's vectorized kernels differ between CPU capabilities, and capability_outputs.py compares bits)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 22, 2 ** 22, tuple(shape), generator=g, dtype=torch.float32).mul_(2.0 ** -20).to(dtype)


class _Inputs:
    """What a sample builder draws its inputs from (see SAMPLES)."""

    def __init__(self, dtype, size, device, requires_grad, reference):
        assert size in SIZES, size
        self.large = size == "large"
        self.nominal = dtype
        self.data_dtype = torch.float64 if reference else dtype
        self.reference = reference
        self.device = device
        self.requires_grad = requires_grad
        self.inputs = []
        self.data = []
        self.uses_dtype = False

    def size(self, small, large):
        return large if self.large else small

    @property
    def dtype(self):
        """The dtype a call asks its result in (sinusoidal, alibi_bias): the sample's (float64 for a reference)."""
        self.uses_dtype = True
        return self.data_dtype

    def floats(self, *shape, seed, dtype=None):
        """Data of the sample's dtype, or of a fixed `dtype` (float64 for a reference), on the device."""
        if dtype is not None:
            return exact_values(shape, seed, dtype).to(self.device, torch.float64 if self.reference else dtype)
        self.uses_dtype = True
        x = exact_values(shape, seed, self.nominal).to(self.device, self.data_dtype)
        self.data.append(x)
        return x

    def fixed(self, t):
        """A floating tensor made elsewhere (slopes, frequencies), float64 for a reference, on the device."""
        return t.to(self.device, torch.float64 if self.reference else t.dtype)

    def ints(self, high, *shape, seed, low=0):
        return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed)).to(self.device)

    def grad(self, t):
        """t as an input gradients flow to (a leaf, possibly a view of data that does not require grad)."""
        if self.requires_grad:
            t.requires_grad_(True)
            self.inputs.append(t)
        return t


# ---------------------------------------------------------------- the registries (see the module's docstring)

HERE = Path(__file__).resolve().parent
# The order the families' entries are listed and run in: csrc/families.h's, the embedding backward (registered
# first in test_learned.py) after the sinusoidal ops. A family file not named here follows these, by name.
FAMILY_ORDER = ("test_sinusoidal", "test_learned", "test_rope", "test_alibi", "test_t5", "test_multiaxis",
                "test_frequencies")
# A family file: one with a line that starts with a registration.
_REGISTERS = re.compile(r"^(?:@sample|@property_check|bad_inputs)\(", re.MULTILINE)
_families = None  # None, "loading" or "loaded"


@functools.cache
def family_modules():
    """The module names of the family test files: every tests/python/test_*.py that registers an entry, those of
    FAMILY_ORDER first, in that order."""
    found = sorted(path.stem for path in HERE.glob("test_*.py") if _REGISTERS.search(path.read_text()))
    return sorted(found, key=lambda name: FAMILY_ORDER.index(name) if name in FAMILY_ORDER else len(FAMILY_ORDER))


def load_families():
    """Imports the family test files (the first time), which fills the registries. Torch function modes are off
    while they import: a mode that records the posenc ops called (capability_outputs.py's) sees only its caller's
    calls, not those a family file makes when it is imported (frequencies for its constants)."""
    global _families
    if _families == "loaded":
        return
    if _families == "loading":
        raise RuntimeError("a family test file read a registry of op_registry while the family files were imported")
    _families = "loading"
    try:
        with torch._C.DisableTorchFunction():
            for name in family_modules():
                importlib.import_module(name)
    except BaseException:
        _families = None  # the next read imports the file that failed again (and raises its error again)
        raise
    _families = "loaded"


class Registry(Mapping):
    """Per-op entries, op name -> entry: a read-only mapping that imports the family test files on first access
    (load_families). Its order is the family files' (family_modules()), each file's entries in the order it
    registers them, whichever file was imported first (pytest imports some before the registry does)."""

    _sequence = itertools.count()

    def __init__(self, what):
        self.what = what
        self._entries = {}
        self._origins = {}
        self._registered = {}

    def register(self, name, entry, origin):
        """Adds `entry` for op `name`, registered by the function `origin`. An op registered twice is an error, unless
        by the same function (a family file imported again)."""
        where = (origin.__module__, origin.__name__)
        if name in self._entries and self._origins[name] != where:
            raise ValueError(f"two {self.what} entries of {name}: {'.'.join(self._origins[name])} and "
                             f"{'.'.join(where)}")
        self._entries[name] = entry
        self._origins[name] = where
        self._registered[name] = next(self._sequence)

    def __getitem__(self, name):
        load_families()
        return self._entries[name]

    def __iter__(self):
        load_families()
        rank = {module: i for i, module in enumerate(family_modules())}
        return iter(sorted(self._entries, key=lambda name: (rank.get(self._origins[name][0], len(rank)),
                                                            self._registered[name])))

    def __len__(self):
        load_families()
        return len(self._entries)

    def __repr__(self):
        return f"Registry({self.what}: {', '.join(self)})"


SAMPLES = Registry("sample")
PROPERTIES = Registry("property")
BAD_INPUTS = Registry("bad-input")


def sample(name):
    """Registers the builder it decorates as SAMPLES[name] (see Samples in the module's docstring)."""
    def register(build):
        def sample(dtype=torch.float32, size="small", device="cpu", requires_grad=False, reference=False):
            inputs = _Inputs(dtype, size, device, requires_grad, reference)
            args, kwargs = build(inputs)
            args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
            return Sample(name, getattr(torch.ops.posenc, name), args, kwargs, tuple(inputs.inputs),
                          tuple(inputs.data), dtype, inputs.uses_dtype)

        sample.__doc__ = build.__doc__
        SAMPLES.register(name, sample, build)
        return build

    return register


def call_args(*args, **kwargs):
    """What a sample builder returns: the arguments of its call."""
    return args, kwargs


def property_check(*names):
    """Registers the hypothesis property it decorates (a function under @given) as the property of each op of
    `names`: PROPERTIES[name] is (check,), run as check(), for a check of one op; (check, name), run as check(name),
    for a check of several ops (check_rope_and_its_backward(op, data))."""
    def register(check):
        for name in names:
            PROPERTIES.register(name, (check, name) if len(names) > 1 else (check,), check)
        return check

    return register


class BadInputs(NamedTuple):
    base: Callable  # base(draw): the keyword arguments of a small valid call
    mutations: dict  # {mutation name: mutate(draw, kw)}, each making one argument of kw wrong


def bad_inputs(name, base, mutations):
    """Registers the bad-input cases of op `name` (bad_input_fuzzer.py): BAD_INPUTS[name] = BadInputs(base,
    mutations), the cases "<name>/<mutation name>" (and "<name>/anything", drawn from the schema)."""
    BAD_INPUTS.register(name, BadInputs(base, mutations), base)


def outputs_and_grads(sample, seed=1):
    """sample.run()'s outputs, then (when the sample has inputs) the gradients of its inputs for a fixed output
    gradient (exact values rounded to the sample's dtype, seeded from `seed`)."""
    outs = sample.run()
    if not sample.inputs:
        return outs
    differentiable = [o for o in outs if o.requires_grad]
    grads = []
    for i, o in enumerate(differentiable):
        key = (seed + i, tuple(o.shape), o.dtype)
        if key not in sample.output_gradients:  # made once for repeated runs (and only read)
            sample.output_gradients[key] = exact_values(o.shape, seed + i, sample.dtype).to(o.device, o.dtype)
        grads.append(sample.output_gradients[key])
    return (*outs, *torch.autograd.grad(differentiable, sample.inputs, grads))


def sample_outputs(name, seed=1, **kw):
    """The outputs of SAMPLES[name](**kw), and the gradients of its inputs when requires_grad=True."""
    return outputs_and_grads(SAMPLES[name](**kw), seed)


@functools.cache
def uses_dtype(name):
    """Whether the sample of `name` depends on its dtype (False for index and position ops)."""
    return SAMPLES[name]().uses_dtype
