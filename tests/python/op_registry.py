"""The one list of posenc's ops for the tests: every op the dispatcher knows in the posenc namespace, each with
one kind read from its schema. Coverage tests (properties, bad inputs, determinism, concurrency, CUDA, autocast,
DTensor, ONNX, CPU capabilities) select from here, so that a new op fails each of them until it is covered.

Kinds, decided in this order (the first rule that holds):
- "inplace": the schema mutates an argument (Tensor(a!)): rope_, add_alibi_.
- "backward": the name ends in _backward (rope_backward, embedding_backward, ...).
- "configuration": the op computes what a forward op is given, not an encoding: it takes no tensor (frequencies,
  slopes, position grids, cpu_capability), or its name says it builds positions or frequencies ("positions" or
  "inv_freq" in it: make_positions, positions_from_mask, mrope_positions, zigzag_positions_varlen,
  rope_inv_freq_for_length). A schema cannot tell index data from values to encode, so the name decides there.
- "forward": everything else (rope, add_alibi, t5_bias, relative_position_bucket, ...).
"""
import functools
from dataclasses import dataclass

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
    determinism, concurrency, CUDA kernels) must each cover."""
    return ops(takes_tensors=True)
