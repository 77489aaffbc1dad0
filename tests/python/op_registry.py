"""The one list of posenc's ops for the tests: every op the dispatcher knows in the posenc namespace, each with
one kind read from its schema, and one sample call of each op that takes a tensor. Coverage tests (properties,
bad inputs, determinism, concurrency, no_grad, CUDA, autocast, DTensor, ONNX, CPU capabilities) select from here,
so that a new op fails each of them until it is covered.

Kinds, decided in this order (the first rule that holds):
- "inplace": the schema mutates an argument (Tensor(a!)): rope_, add_alibi_.
- "backward": the name ends in _backward (rope_backward, embedding_backward, ...).
- "configuration": the op computes what a forward op is given, not an encoding: it takes no tensor (frequencies,
  slopes, position grids, cpu_capability), or its name says it builds positions or frequencies ("positions" or
  "inv_freq" in it: make_positions, positions_from_mask, mrope_positions, zigzag_positions_varlen,
  rope_inv_freq_for_length). A schema cannot tell index data from values to encode, so the name decides there.
- "forward": everything else (rope, add_alibi, t5_bias, relative_position_bucket, ...).

Samples: SAMPLES[name], one entry for each op of tensor_ops(), is what the tests that run every op run:
test_determinism.py (size "large", 1, 2 and 3 threads, against the float64 reference), test_concurrency.py (both
sizes from 8 threads), capability_outputs.py (size "small", every dtype, across CPU capabilities), test_no_grad.py
and test_cuda.py. Each of those fails while an op of tensor_ops() has no entry; an op added here is run by all of
them with no other edit. Adding one: a builder decorated with @_sample("name") (below, with its family) that
draws its inputs from `m` and returns _call(*args, **kwargs) of torch.ops.posenc.<name>.

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
from dataclasses import dataclass, field

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


SAMPLES = {}


def _sample(name):
    def register(build):
        def sample(dtype=torch.float32, size="small", device="cpu", requires_grad=False, reference=False):
            inputs = _Inputs(dtype, size, device, requires_grad, reference)
            args, kwargs = build(inputs)
            args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
            return Sample(name, getattr(torch.ops.posenc, name), args, kwargs, tuple(inputs.inputs),
                          tuple(inputs.data), dtype, inputs.uses_dtype)

        sample.__doc__ = build.__doc__
        SAMPLES[name] = sample
        return build

    return register


def _call(*args, **kwargs):
    return args, kwargs


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


def _rope_frequencies(m):
    """(large) Llama 3's 64 frequencies; (small) partial rotary: 65 pairs (odd) of 134-channel heads."""
    if m.large:
        return posenc.frequencies.rope(128, 500000.0, {"rope_type": "llama3", "factor": 8.0})[0]
    return posenc.frequencies.rope(130, 500.0)[0]


def _sinusoidal_frequencies(m):
    return posenc.frequencies.sinusoidal(m.size(130, 256))  # small: 65 pairs (odd)


# Sinusoidal and embeddings. Small: widths 130/131 (odd pairs, an unencoded last channel); large: [4, 1024, 256].

@_sample("sinusoidal")
def _build_sinusoidal(m):
    """Integer positions [4, S] (large: up to 1e5), output in the sample's dtype, an offset."""
    positions = m.ints(m.size(5000, 100000), 4, m.size(16, 1024), seed=10)
    return _call(positions, _sinusoidal_frequencies(m), m.size("half", "interleaved"), m.dtype, m.size(3, 5))


@_sample("add_sinusoidal")
def _build_add_sinusoidal(m):
    """Small: positions absent (arange + offset), half_cos_first; large: per-row positions [B, S]."""
    x = m.grad(m.floats(*m.size((3, 8, 131), (4, 1024, 256)), seed=11))
    positions = m.ints(100000, 4, 1024, seed=12) if m.large else None
    return _call(x, positions, _sinusoidal_frequencies(m), m.size(2.0, 0.5), m.size("half_cos_first", "interleaved"),
                 m.size(3, 0))


@_sample("embed_sinusoidal")
def _build_embed_sinusoidal(m):
    """Small: positions [S] given, padding_idx 0; large: positions absent, padding_idx 7."""
    vocab = m.size(50, 3000)
    tokens = m.ints(vocab, *m.size((3, 8), (4, 1024)), seed=13)
    table = m.grad(m.floats(vocab, m.size(130, 256), seed=14))
    positions = None if m.large else m.ints(5000, 8, seed=15)
    return _call(tokens, table, positions, _sinusoidal_frequencies(m), m.size(2.5, 2.0), m.size(0, 7),
                 m.size("half", "interleaved"), m.size(4, 0))


@_sample("embedding_backward")
def _build_embedding_backward(m):
    """Small: indices [S] shared by the batch, no padding_idx; large: indices [B, S], padding_idx 7."""
    vocab = m.size(50, 3000)
    grad = m.floats(*m.size((3, 8, 130), (4, 1024, 256)), seed=16)
    indices = m.ints(vocab, *m.size((8,), (4, 1024)), seed=17)
    return _call(grad, indices, vocab, m.size(1.5, 0.5), m.size(None, 7))


# Learned absolute.

@_sample("learned")
def _build_learned(m):
    table = m.grad(m.floats(m.size(70, 2048), m.size(130, 256), seed=20))
    positions = m.ints(m.size(68, 2000), *m.size((3, 8), (4, 1024)), seed=21)
    return _call(table, positions, m.size(2, 3), m.size(1, 0))


@_sample("add_learned")
def _build_add_learned(m):
    """Small: positions [B, S] given, padding_idx 0; large: positions absent, offset 1000 (a cache)."""
    x = m.grad(m.floats(*m.size((3, 8, 130), (4, 1024, 256)), seed=22))
    table = m.grad(m.floats(m.size(70, 2048), m.size(130, 256), seed=23))
    positions = None if m.large else m.ints(60, 3, 8, seed=24)
    return _call(x, table, positions, m.size(3, 1000), m.size(0, None))


@_sample("embed_learned")
def _build_embed_learned(m):
    """Small: positions absent, offset 10; large: positions [B, S] given. padding_idx 1, pos_padding_idx 0."""
    vocab = m.size(50, 3000)
    tokens = m.ints(vocab, *m.size((3, 8), (4, 1024)), seed=25)
    token_table = m.grad(m.floats(vocab, m.size(130, 256), seed=26))
    pos_table = m.grad(m.floats(m.size(70, 2048), m.size(130, 256), seed=27))
    positions = m.ints(2000, 4, 1024, seed=28) if m.large else None
    return _call(tokens, token_table, pos_table, positions, m.size(2.0, 0.5), 1, m.size(10, 2), 0)


@_sample("make_positions")
def _build_make_positions(m):
    return _call(m.ints(m.size(4, 5), *m.size((16, 128), (512, 1024)), seed=29), m.size(0, 1))


@_sample("positions_from_mask")
def _build_positions_from_mask(m):
    """Small: a bool mask, pad_position 0; large: an int64 mask, pad_position -1."""
    mask = m.ints(2, *m.size((8, 512), (256, 4096)), seed=30)
    return _call(mask if m.large else mask.bool(), m.size(0, -1))


# Rotary. Small: partial rotary (65 pairs in 134 channels; rope_qk: M-RoPE), the four formats and both layouts
# between the ops, views, varlen, multi-axis; large: [2, 512, H, 128] bshd with Llama 3 frequencies and per-row
# positions up to 1e5, GQA (8 and 2 heads).

def _rope_positions(m):
    return m.ints(100000, 2, 512, seed=40)


@_sample("rope")
def _build_rope(m):
    """Small: bhsd as a transposed view of bshd data, positions absent, offset 5, gptj, scale 0.9."""
    if m.large:
        return _call(m.grad(m.floats(2, 512, 8, 128, seed=41)), _rope_positions(m), _rope_frequencies(m))
    x = m.grad(m.floats(2, 8, 3, 134, seed=41).transpose(1, 2))
    return _call(x, None, _rope_frequencies(m), 0.9, "gptj", "bhsd", 5)


@_sample("rope_backward")
def _build_rope_backward(m):
    """Small: sbhd, a channel-strided view (the element-by-element path), positions absent, offset 2."""
    if m.large:
        return _call(m.grad(m.floats(2, 512, 8, 128, seed=42)), _rope_positions(m), _rope_frequencies(m))
    grad = m.grad(m.floats(8, 2, 3, 268, seed=42)[..., ::2])
    return _call(grad, None, _rope_frequencies(m), 0.5, "neox", "sbhd", 2)


@_sample("rope_qk")
def _build_rope_qk(m):
    """GQA. Small: multi-axis (M-RoPE sections [8, 12, 12], positions [3, B, S]), offset 3."""
    if m.large:
        q, k = m.floats(2, 512, 8, 128, seed=43), m.floats(2, 512, 2, 128, seed=44)
        return _call(m.grad(q), m.grad(k), _rope_positions(m), _rope_frequencies(m))
    q, k = m.grad(m.floats(2, 16, 4, 64, seed=43)), m.grad(m.floats(2, 16, 2, 64, seed=44))
    inv_freq, pair_axis = posenc.frequencies.mrope(64, [8, 12, 12])
    return _call(q, k, m.ints(100000, 3, 2, 16, seed=45), inv_freq, 1.0, "neox", "bshd", 3, None, pair_axis)


@_sample("rope_qk_backward")
def _build_rope_qk_backward(m):
    """GQA. Small: positions [S] shared by the batch, gptj, scale 0.5, offset 1."""
    if m.large:
        grad_q, grad_k = m.floats(2, 512, 8, 128, seed=46), m.floats(2, 512, 2, 128, seed=47)
        return _call(m.grad(grad_q), m.grad(grad_k), _rope_positions(m), _rope_frequencies(m))
    grad_q, grad_k = m.grad(m.floats(2, 8, 4, 134, seed=46)), m.grad(m.floats(2, 8, 2, 134, seed=47))
    return _call(grad_q, grad_k, m.ints(5000, 8, seed=48), _rope_frequencies(m), 0.5, "gptj", "bshd", 1)


@_sample("rope_")
def _build_rope_(m):
    """Small: thd, packed sequences (cu_seqlens, an empty one among them), positions absent, offset 1."""
    if m.large:
        return _call(m.grad(m.floats(2, 512, 8, 128, seed=49)), _rope_positions(m), _rope_frequencies(m))
    x = m.grad(m.floats(16, 3, 134, seed=49))
    return _call(x, None, _rope_frequencies(m), 1.0, "neox", "thd", 1, torch.tensor([0, 5, 5, 16]))


@_sample("rope_cos_sin")
def _build_rope_cos_sin(m):
    """float32 tables; small: per-batch tables [B, S, 130], gptj."""
    x = m.grad(m.floats(*m.size((2, 8, 3, 134), (2, 512, 8, 128)), seed=50))
    shape = m.size((2, 8, 130), (512, 128))
    cos, sin = m.floats(*shape, seed=51, dtype=torch.float32), m.floats(*shape, seed=52, dtype=torch.float32)
    return _call(x, cos, sin, m.size("gptj", "neox"), "bshd")


@_sample("rope_cos_sin_backward")
def _build_rope_cos_sin_backward(m):
    """Small: bhsd, a float64 cos and a float16 sin (tables need not share x's dtype)."""
    grad = m.grad(m.floats(*m.size((2, 3, 8, 134), (2, 512, 8, 128)), seed=53))
    shape = m.size((8, 130), (512, 128))
    cos = m.floats(*shape, seed=54, dtype=m.size(torch.float64, torch.float32))
    sin = m.floats(*shape, seed=55, dtype=m.size(torch.float16, torch.float32))
    return _call(grad, cos, sin, "neox", m.size("bhsd", "bshd"))


# ALiBi and T5. Small: 67 keys (no whole vector), head offsets; large: [2, 16, 128, 256] or [16, 128, 512].

def _slopes(m, differentiable=True):
    slopes = m.fixed(torch.ops.posenc.alibi_slopes(m.size(12, 16), torch.float32, None))
    return m.grad(slopes) if differentiable else slopes


@_sample("alibi_bias")
def _build_alibi_bias(m):
    """Small: symmetric, heads 2..5 of 12; large: causal, 512 keys for 128 queries."""
    return _call(_slopes(m), m.size(16, 128), m.size(67, 512), m.size("symmetric", "causal"), m.size(2, 0),
                 m.size(4, None), m.dtype)


@_sample("add_alibi")
def _build_add_alibi(m):
    scores = m.grad(m.floats(*m.size((2, 4, 16, 67), (2, 16, 128, 256)), seed=60))
    return _call(scores, _slopes(m), m.size("causal", "symmetric"), m.size(3, 0))


@_sample("add_alibi_")
def _build_add_alibi_(m):
    """Not differentiable (add_alibi is). Small: scores with a key stride (a transposed view), symmetric (add_alibi's
    small sample is causal), head offset 1."""
    if m.large:
        return _call(m.floats(2, 16, 128, 256, seed=61), _slopes(m, False), "symmetric", 0)
    return _call(m.floats(2, 4, 67, 16, seed=61).transpose(2, 3), _slopes(m, False), "symmetric", 1)


@_sample("alibi_backward")
def _build_alibi_backward(m):
    """Small: causal, head offset 3. Differentiable along grad only (the slopes' gradient does not depend on the
    slopes)."""
    grad = m.grad(m.floats(*m.size((2, 4, 16, 67), (2, 16, 128, 256)), seed=62))
    return _call(grad, _slopes(m, False), m.size("causal", "symmetric"), m.size(3, 0))


@_sample("relative_position_bucket")
def _build_relative_position_bucket(m):
    relative = m.ints(m.size(2000, 4000), *m.size((64, 64), (1024, 1024)), seed=63) - m.size(1000, 2000)
    return _call(relative, m.large, 32, 128)


@_sample("t5_bias")
def _build_t5_bias(m):
    """Small: unidirectional, max_distance 20; large: bidirectional, 512 keys for 128 queries, q_offset 3."""
    table = m.grad(m.floats(32, m.size(4, 16), seed=64))
    return _call(table, m.size(16, 128), m.size(70, 512), m.large, 32, m.size(20, 128), m.size(2, 3))


@_sample("t5_bias_backward")
def _build_t5_bias_backward(m):
    grad = m.grad(m.floats(*m.size((1, 4, 16, 70), (1, 16, 128, 512)), seed=65))
    return _call(grad, not m.large, 32, 128, m.size(7, 5))


# Positions and frequencies that take tensors.

@_sample("mrope_positions")
def _build_mrope_positions(m):
    """Rows of text and vision tokens, the last tokens padding. Small: 16 rows of text, an image (grid 1 x 8 x 8,
    merge 2: 16 tokens), text, a video (grid 2 x 4 x 8: 16 tokens, Qwen2.5-VL's time interval) and text; large:
    256 rows of 4096 tokens: 100 of text, an image (grid 1 x 16 x 16: 64 tokens) and text."""
    if m.large:
        row, rows = [0] * 100 + [1] * 64 + [0] * (4096 - 164), 256
    else:
        row, rows = [0] * 10 + [1] * 16 + [0] * 6 + [2] * 16 + [0] * 16, 16
    token_types = torch.tensor(row).expand(rows, -1).contiguous()
    mask = torch.ones_like(token_types)
    mask[:, -m.size(4, 40):] = 0
    images = torch.tensor([m.size([1, 8, 8], [1, 16, 16])] * rows)
    if m.large:
        return _call(token_types, images, None, mask)
    videos = torch.tensor([[2, 4, 8]] * rows)
    return _call(token_types, images, videos, mask, 2, 2.0, torch.full((rows,), 0.5))


@_sample("rope_inv_freq_for_length")
def _build_rope_inv_freq_for_length(m):
    """Small: dynamic NTK past its context; large: LongRoPE past its original context (the size changes nothing:
    the result has rotary_dim / 2 values)."""
    if m.large:
        rope_type, keywords = posenc.frequencies.rope_arguments({
            "rope_type": "longrope", "original_max_position_embeddings": 2048.0, "max_position_embeddings": 8192.0,
            "short_factor": [1.0 + i / 64 for i in range(64)], "long_factor": [4.0 + i for i in range(64)]})
        return _call(torch.tensor(3000), 128, 1e4, rope_type, **keywords)
    return _call(torch.tensor(5000), 64, 1e4, "dynamic", factor=2.0, max_position_embeddings=4096.0)


@_sample("zigzag_positions_varlen")
def _build_zigzag_positions_varlen(m):
    """Packed sequences of multiples of 8 tokens (some empty): small 16 of them, large 4096 (about 800 k tokens)."""
    lengths = m.ints(50, m.size(16, 4096), seed=66) * 8
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long, device=lengths.device), lengths.cumsum(0)])
    return _call(cu_seqlens, 4, m.size(2, 1))
