"""DTensor support: sharding rules that let posenc ops take ``torch.distributed.tensor.DTensor`` inputs.

Importing this module registers them for every posenc op. ``import posenc`` does not import it, since the
torch.distributed.tensor machinery costs about 0.5 s to import: it imports this module once the program imports
torch.distributed.tensor (or at once, if that happened first). A DTensor call is written as the unsharded call
on global tensors; each rule lists the placements under which every rank's local call computes its part of that
result, and DTensor redistributes inputs that arrive otherwise (e.g. gathers a tensor sharded along a dimension
the op cannot split). docs/distributed.md has the table; in short, per mesh dimension:

- Rotary ops: the rotated tensors sharded over heads, over batch (``[B, S]`` positions with them), or over the
  sequence when the positions are explicit and sharded alongside (without positions a shard would count its
  tokens from 0). ``rope_cos_sin``'s tables are explicit, so its sequence sharding always applies.
- ALiBi: scores sharded over batch or heads, the slopes then sharded over their last dimension alongside.
  Every rank receives the same non-tensor arguments, so no rank can be handed its own ``head_offset``;
  instead each rank's slopes are its heads' slopes, and its local call
  ``add_alibi(local_scores, local_slopes, mode, 0)`` equals the manual tensor-parallel call
  ``add_alibi(local_scores, global_slopes, mode, head_offset=first_global_head)``. Head sharding therefore
  applies when the global call has ``head_offset=0`` and slopes for exactly the scores' heads (and, for
  ``alibi_bias``, ``num_heads=None``); other calls run replicated.
- QK-norm + rotary (``qk_norm_rope``): as the rotary ops, each token's rows being normalized alone, with the
  weights replicated; over heads only with per-head ``[head_dim]`` weights: ``[heads * head_dim]`` weights (OLMo 2)
  normalize all heads of a token together, so head-sharded q and k are gathered (or moved to another placement of
  the rule). The backward's weight gradients are partial sums (``Partial()``) over sharded rows.
- Decoding through a KV cache (``rope_qk_cache_``): q, k, v over heads with the caches over theirs, or over batch
  with the caches' batch rows (positions and cache_positions ``[B, S]`` alongside); a pool (``"shd"``) and the
  sequence are never split. q and the caches are written in place, so they must arrive in a placement of the rule.
- Multi-axis rotary (``pair_axis``): the same, with positions ``[n_axes, S]`` shared by the batch and
  ``[n_axes, B, S]`` sharded over their batch dimension (1) alongside; ``pair_axis`` is replicated.
- ``mrope_positions`` and ``rope_inv_freq_for_length`` run replicated: each result depends on the whole input
  (grids handed to the rows in order, a 0-d length). ``zigzag_positions_varlen`` takes plain tensors only (its
  output length follows the values of cu_seqlens, which DTensor cannot predict).
- Sinusoidal and learned: data sharded over batch, or over the sequence with explicit positions; learned
  tables also over channels. T5: the table over heads. Gradients of tables from batch-sharded rows (and
  ``alibi_backward`` of ``[H]`` slopes) are partial sums (``Partial()``), reduced when read.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor.experimental import register_sharding

__all__ = ["SUPPORTED_OPS"]

# Rules give, for one mesh dimension, the acceptable pairs (placement of every output, or a list with each output's,
# placements of the tensor arguments by name; a tensor not named is replicated).
_Strategy = Tuple[Union[Placement, List[Placement]], Dict[str, Placement]]

# Dimensions of batch, sequence (tokens) and heads in each rotary format.
_ROPE_DIMS = {"bshd": (0, 1, 2), "bhsd": (0, 2, 1), "sbhd": (1, 0, 2), "thd": (None, 0, 1)}


def _arguments(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The op's arguments by name with the schema's defaults filled in (a rule receives only what was passed)."""
    values = {}
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args):
            values[argument.name] = args[i]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def _rope_rule(rotated: Sequence[str], a: Dict[str, Any]) -> List[_Strategy]:
    """Rotations act on every (batch, token, head) row alone, with the angle of the row's position."""
    if a["format"] not in _ROPE_DIMS:
        return [(Replicate(), {})]  # the replicated call reports the bad format
    batch, seq, head = _ROPE_DIMS[a["format"]]
    positions, cu_seqlens = a["positions"], a["cu_seqlens"]
    # Multi-axis positions lead with their axis dimension ([n_axes, S] or [n_axes, B, S]); pair_axis is replicated.
    axes = 0 if a.get("pair_axis") is None else 1

    def strategy(x: Placement, positions: Placement = Replicate()) -> _Strategy:
        return x, {**{name: x for name in rotated}, "positions": positions}

    strategies = [strategy(Replicate()), strategy(Shard(head))]
    if batch is not None:
        per_row = positions is not None and positions.ndim == 2 + axes
        strategies.append(strategy(Shard(batch), Shard(axes) if per_row else Replicate()))
    # A shard without explicit positions would count from 0; cu_seqlens index the whole token dimension.
    if positions is not None and cu_seqlens is None:
        strategies.append(strategy(Shard(seq), Shard(positions.ndim - 1)))
    return strategies


def _qk_norm_rope_rule(a: Dict[str, Any], backward: bool = False) -> List[_Strategy]:
    """qk_norm_rope, its backward and qk_norm_rope_: rope's placements, since each token's rows are normalized and
    rotated alone, the weights replicated; but over heads only when both weights are per head ([head_dim]). A
    [heads * head_dim] weight (OLMo 2) normalizes all heads of a token together, which a shard of the heads cannot:
    the rule leaves head sharding out, and DTensor redistributes head-sharded q and k to a placement it keeps (it
    gathers the heads). The backward's weight gradients sum over every row: partial sums on sharded rows."""
    per_head = all(a[weight].ndim == 1 and a[x].ndim > 0 and a[weight].shape[0] == a[x].shape[-1]
                   for weight, x in (("q_weight", "q"), ("k_weight", "k")))
    head = _ROPE_DIMS.get(a["format"], (None, None, None))[2]
    data = ["grad_q", "grad_k", "q", "k"] if backward else ["q", "k"]
    strategies = []
    for output, inputs in _rope_rule(data, a):
        if not per_head and isinstance(output, Shard) and output.dim == head:
            continue
        if backward:  # grad_q and grad_k sharded as q and k, the weights' gradients summed over the ranks' rows
            weights = Replicate() if output == Replicate() else Partial()
            output = [output, output, weights, weights]
        strategies.append((output, inputs))
    return strategies


# Dimensions of batch and heads of each cache format of rope_qk_cache_ ("shd": one pool of slots, no batch).
_CACHE_DIMS = {"bhsd": (0, 1), "bshd": (0, 2), "shd": (None, 1)}


def _rope_qk_cache_rule(a: Dict[str, Any]) -> List[_Strategy]:
    """rope_qk_cache_: q, k and v sharded over their heads with the caches over theirs (each head is rotated and
    stored alone; with GQA each rank's q heads need not be its kv heads' group, as nothing mixes heads), or over the
    batch with the caches' batch rows ([B, S] positions and cache_positions with them). A pool ("shd") holds every
    batch row's slots, so it is never split by batch; nor is the sequence, whose tokens share one cache row (and
    their slots are checked against each other).

    q and the caches are written in place, and DTensor checks only the first argument of an in-place op: it would
    redistribute a cache that arrives in another placement into a copy and write there, silently. So the rule
    offers only the strategies of the placements the three written tensors arrive in, and refuses (naming the op)
    a call where they arrive in no placement of the rule."""
    if a["format"] not in _ROPE_DIMS or a["cache_format"] not in _CACHE_DIMS:
        return [(Replicate(), {})]  # the replicated call reports the bad format
    batch, _, head = _ROPE_DIMS[a["format"]]
    cache_batch, cache_head = _CACHE_DIMS[a["cache_format"]]

    def strategy(x: Placement, cache: Placement, positions: Placement = Replicate(),
                 cache_positions: Placement = Replicate()) -> _Strategy:
        return x, {"q": x, "k": x, "v": x, "k_cache": cache, "v_cache": cache, "positions": positions,
                   "cache_positions": cache_positions}

    strategies = [strategy(Replicate(), Replicate()), strategy(Shard(head), Shard(cache_head))]
    if batch is not None and cache_batch is not None:
        axes = 0 if a.get("pair_axis") is None else 1
        positions, cache_positions = a["positions"], a["cache_positions"]
        per_row = positions is not None and positions.ndim == 2 + axes
        slots_per_row = cache_positions is not None and cache_positions.ndim == 2
        strategies.append(strategy(Shard(batch), Shard(cache_batch), Shard(axes) if per_row else Replicate(),
                                   Shard(0) if slots_per_row else Replicate()))
    return _kept_in_place("rope_qk_cache_", ("q", "k_cache", "v_cache"), strategies, a,
                          f"for cache_format \"{a['cache_format']}\"")


def _kept_in_place(op: str, written: Sequence[str], strategies: List[_Strategy], a: Dict[str, Any],
                   context: str = "") -> List[_Strategy]:
    """The strategies of an in-place op that writes several tensors, kept to the placements those arrive in.
    DTensor checks only the first argument of an in-place op: it would redistribute another written tensor that
    arrives in a placement no strategy keeps into a copy, and write there, silently. So a call whose written tensors
    arrive in no strategy's placements is refused, naming the op."""
    if not all(isinstance(a[name], DTensorSpec) for name in written):
        return strategies
    offered = {tuple(inputs[name] for name in written): (output, inputs) for output, inputs in strategies}
    arrived = list(zip(*(a[name].placements for name in written)))  # per mesh dimension
    for dim, placements in enumerate(arrived):
        if placements not in offered:
            choices = "; ".join(", ".join(f"{name} {p!r}" for name, p in zip(written, key)) for key in offered)
            raise RuntimeError(
                f"posenc.{op}: {', '.join(written[:-1])} and {written[-1]} are written in place, so they must arrive in placements the op "
                f"keeps, but on mesh dimension {dim} they are "
                f"{', '.join(f'{name} {p!r}' for name, p in zip(written, placements))}; the op keeps ({choices})"
                f"{' ' + context if context else ''}: redistribute them before the call")
    return [offered[placements] for placements in dict.fromkeys(arrived)]


def _rope_cos_sin_rule(a: Dict[str, Any]) -> List[_Strategy]:
    """Explicit tables: [S, r] or [1, S, r] are shared by the batch, [B, S, r] are per row."""
    if a["format"] not in _ROPE_DIMS:
        return [(Replicate(), {})]
    batch, seq, head = _ROPE_DIMS[a["format"]]
    tables = ("cos", "sin")

    def strategy(x: Placement, table: Placement = Replicate()) -> _Strategy:
        return x, {"x": x, "grad": x, **{name: table for name in tables}}

    strategies = [strategy(Replicate()), strategy(Shard(head))]
    if batch is not None:
        per_row = a["cos"].ndim == 3 and a["cos"].shape[0] != 1
        strategies.append(strategy(Shard(batch), Shard(0) if per_row else Replicate()))
    strategies.append(strategy(Shard(seq), Shard(a["cos"].ndim - 2)))
    return strategies


def _heads_match(slopes: Any, heads: int, head_offset: int) -> bool:
    # Sharding the slopes like the heads hands each rank its heads' slopes only when the call's heads are
    # exactly the slopes' heads (see the module's docstring).
    return head_offset == 0 and slopes.shape[-1] == heads


def _alibi_rule(scores: str, a: Dict[str, Any]) -> List[_Strategy]:
    """add_alibi, add_alibi_ and alibi_backward: scores [B, H, Q, K] with slopes [H] or [B, H]."""
    slopes = a["slopes"]
    per_batch = slopes.ndim == 2
    strategies = [(Replicate(), {scores: Replicate(), "slopes": Replicate()})]
    batch_slopes = Shard(0) if per_batch else Replicate()
    # alibi_backward's output has the slopes' shape: per-batch slopes keep their rows, shared slopes sum them.
    batch_output = batch_slopes if scores == "grad" and per_batch else Partial() if scores == "grad" else Shard(0)
    strategies.append((batch_output, {scores: Shard(0), "slopes": batch_slopes}))
    if _heads_match(slopes, a[scores].shape[1], a["head_offset"]):
        head_slopes = Shard(slopes.ndim - 1)
        strategies.append((head_slopes if scores == "grad" else Shard(1), {scores: Shard(1), "slopes": head_slopes}))
    return strategies


def _alibi_bias_rule(a: Dict[str, Any]) -> List[_Strategy]:
    """alibi_bias: slopes [H] or [B, H] -> [1 or B, num_heads, Q, K]."""
    slopes = a["slopes"]
    strategies = [(Replicate(), {"slopes": Replicate()})]
    if slopes.ndim == 2:
        strategies.append((Shard(0), {"slopes": Shard(0)}))
    if a["num_heads"] is None and a["head_offset"] == 0:
        strategies.append((Shard(1), {"slopes": Shard(slopes.ndim - 1)}))
    return strategies


def _per_token_rule(data: str, lead: int, a: Dict[str, Any], tables: Sequence[str] = ()) -> List[_Strategy]:
    """Ops that add a position's encoding or table row to every token: data's dims before ``lead`` are batch
    dims, dim ``lead`` the sequence. ``tables`` ([rows, D] tables whose channels follow the output's) may be
    sharded over channels with the data, when the op's channels are independent (learned rows)."""
    positions = a["positions"]
    # Multi-axis positions (pair_axis) carry a leading axis dimension, never sharded.
    axes = 1 if a.get("pair_axis") is not None else 0
    strategies = [(Replicate(), {data: Replicate()})]
    for dim in range(lead):
        # Positions [S] are shared by the batch; positions with the data's leading shape go with their rows.
        shared = positions is None or positions.ndim == 1 + axes
        strategies.append((Shard(dim), {data: Shard(dim), "positions": Replicate() if shared else Shard(dim + axes)}))
    # Prefix tokens sit at the start of every sequence only: the sequence is not split then.
    if positions is not None and not a.get("num_prefix_tokens"):
        strategies.append((Shard(lead), {data: Shard(lead), "positions": Shard(positions.ndim - 1)}))
    if tables:
        channels = lead + 1
        strategies.append((Shard(channels), {**({data: Shard(channels)} if data == "x" else {}),
                                             **{table: Shard(1) for table in tables}}))
    return strategies


def _elementwise_rule(data: str, a: Dict[str, Any], skip_last: bool = False) -> List[_Strategy]:
    """Ops computed per element (or per row of the last dimension: ``skip_last``)."""
    dims = a[data].ndim - (1 if skip_last else 0)
    return [(Replicate(), {data: Replicate()})] + [(Shard(d), {data: Shard(d)}) for d in range(dims)]


def _sinusoidal_rule(a: Dict[str, Any]) -> List[_Strategy]:
    """sinusoidal: positions [...] -> [..., 2F], or with pair_axis positions [n_axes, ...] -> [..., 2F] (the axis
    dimension never sharded)."""
    if a.get("pair_axis") is None:
        return _elementwise_rule("positions", a)
    dims = a["positions"].ndim - 1
    return [(Replicate(), {"positions": Replicate()})] + [(Shard(d), {"positions": Shard(d + 1)}) for d in range(dims)]


def _learned_rule(a: Dict[str, Any]) -> List[_Strategy]:
    """learned: positions [...] -> [..., D]; the table's channels may be sharded."""
    strategies = _elementwise_rule("positions", a)
    strategies.append((Shard(a["positions"].ndim), {"positions": Replicate(), "weight": Shard(1)}))
    return strategies


def _embedding_backward_rule(a: Dict[str, Any]) -> List[_Strategy]:
    """embedding_backward: grad [..., D] into [num_rows, D] at indices (grad's leading shape or a suffix of
    it). Rows sharded over the batch give each rank a partial sum; channels sharded give the table's."""
    grad, indices = a["grad"], a["indices"]
    missing = grad.ndim - 1 - indices.ndim  # leading dims of grad that indices leave out
    strategies = [(Replicate(), {"grad": Replicate(), "indices": Replicate()}),
                  (Shard(1), {"grad": Shard(grad.ndim - 1), "indices": Replicate()})]
    for dim in range(grad.ndim - 1):
        strategies.append((Partial(), {"grad": Shard(dim),
                                       "indices": Shard(dim - missing) if dim >= missing else Replicate()}))
    return strategies


def _resampled_rule(data: str, a: Dict[str, Any]) -> List[_Strategy]:
    """resample_learned (weight [P + Hs * Ws, D] -> [P + H * W, D]), add_resampled_learned (x [..., P + H * W, D])
    and resample_learned_backward (grad [..., P + H * W, D] -> [P + Hs * Ws, D]): every output token reads tokens
    of the whole grid, so the token dimension is never sharded and the table is replicated; the batch dims of x go
    with the output's (grad's give each rank a partial sum), and the channels, independent, may be sharded."""
    if data == "weight":
        return [(Replicate(), {"weight": Replicate()}), (Shard(1), {"weight": Shard(1)})]
    tensor = a[data]
    lead = tensor.ndim - 2
    table = {"weight": Replicate()} if data == "x" else {}
    strategies = [(Replicate(), {data: Replicate(), **table})]
    for dim in range(lead):
        strategies.append((Shard(dim) if data == "x" else Partial(), {data: Shard(dim), **table}))
    strategies.append((Shard(tensor.ndim - 1) if data == "x" else Shard(1),
                       {data: Shard(tensor.ndim - 1), **({"weight": Shard(1)} if data == "x" else {})}))
    return strategies


def _replicated_rule(a: Dict[str, Any]) -> List[_Strategy]:
    """Builders of positions and frequencies whose result depends on the whole input: mrope_positions hands the
    grids to the rows in order and numbers each row along its sequence, zigzag_positions_varlen reads every
    sequence boundary, rope_inv_freq_for_length a 0-d length. They run replicated (a sharded input is gathered).
    DTensor cannot predict zigzag_positions_varlen's output length (it follows cu_seqlens' values) and refuses a
    DTensor call of it, naming the op: it takes cu_seqlens as a plain tensor."""
    return [(Replicate(), {})]


def _t5_rule(data: str) -> List[_Strategy]:
    """t5_bias (weight [N, H] -> [1, H, Q, K]) and t5_bias_backward ([1, H, Q, K] -> [N, H]): each head reads
    its own column of the table."""
    return [(Replicate(), {data: Replicate()}), (Shard(1), {data: Shard(1)})]


_RULES = {
    "sinusoidal": lambda a: _sinusoidal_rule(a),
    "add_sinusoidal": lambda a: _per_token_rule("x", a["x"].ndim - 2, a),
    "embed_sinusoidal": lambda a: _per_token_rule("tokens", a["tokens"].ndim - 1, a),
    "embedding_backward": _embedding_backward_rule,
    "learned": _learned_rule,
    "add_learned": lambda a: _per_token_rule("x", a["x"].ndim - 2, a, ["weight"]),
    "embed_learned": lambda a: _per_token_rule("tokens", a["tokens"].ndim - 1, a, ["token_weight", "pos_weight"]),
    "resample_learned": lambda a: _resampled_rule("weight", a),
    "add_resampled_learned": lambda a: _resampled_rule("x", a),
    "resample_learned_backward": lambda a: _resampled_rule("grad", a),
    "make_positions": lambda a: _elementwise_rule("tokens", a, skip_last=True),
    "positions_from_mask": lambda a: _elementwise_rule("attention_mask", a, skip_last=True),
    "relative_position_bucket": lambda a: _elementwise_rule("relative_position", a),
    "t5_bias": lambda a: _t5_rule("weight"),
    "t5_bias_backward": lambda a: _t5_rule("grad"),
    "rope": lambda a: _rope_rule(["x"], a),
    "rope_backward": lambda a: _rope_rule(["grad"], a),
    "rope_": lambda a: _rope_rule(["x"], a),
    "rope_qk": lambda a: _rope_rule(["q", "k"], a),
    "rope_qk_backward": lambda a: _rope_rule(["grad_q", "grad_k"], a),
    "qk_norm_rope": _qk_norm_rope_rule,
    "qk_norm_rope_backward": lambda a: _qk_norm_rope_rule(a, backward=True),
    "qk_norm_rope_": lambda a: _kept_in_place("qk_norm_rope_", ("q", "k"), _qk_norm_rope_rule(a), a),
    "rope_qk_cache_": _rope_qk_cache_rule,
    "rope_cos_sin": _rope_cos_sin_rule,
    "rope_cos_sin_backward": _rope_cos_sin_rule,
    "add_alibi": lambda a: _alibi_rule("scores", a),
    "add_alibi_": lambda a: _alibi_rule("scores", a),
    "alibi_backward": lambda a: _alibi_rule("grad", a),
    "alibi_bias": _alibi_bias_rule,
    "mrope_positions": _replicated_rule,
    "rope_inv_freq_for_length": _replicated_rule,
    "zigzag_positions_varlen": _replicated_rule,
}

SUPPORTED_OPS = tuple(_RULES)


def _register(name: str) -> None:
    op = getattr(torch.ops.posenc, name).default
    schema = op._schema
    rule = _RULES[name]

    def sharding(*args: Any, **kwargs: Any) -> List[Tuple[List[Optional[Placement]], List[Optional[Placement]]]]:
        a = _arguments(op, args, kwargs)
        passed = [a_.name for a_ in schema.arguments[:len(args)]] + list(kwargs)
        acceptable = []
        for output, inputs in rule(a):
            # One entry per argument passed, in the order DTensor lists them; None for non-tensors.
            placements = [inputs.get(n, Replicate()) if isinstance(a[n], DTensorSpec) else None for n in passed]
            outputs = output if isinstance(output, list) else [output] * len(schema.returns)
            acceptable.append((outputs, placements))
        return acceptable

    register_sharding(op)(sharding)
    # register_sharding keys its cache of sharding decisions on the non-tensor arguments from the first int
    # on; rope's format (before offset) decides which dimension is which, so key on every non-tensor argument.
    first_scalar = next(i for i, a_ in enumerate(schema.arguments) if not _is_tensor(a_.type))
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_to_schema_info[op] = RuntimeSchemaInfo(static_argnum=first_scalar, needs_pytree=True)


def _is_tensor(t: Any) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.TensorType)


for _name in _RULES:
    _register(_name)
