"""Frequencies (inv_freq, float64) of every family.

The formulas live once, in C++ (``posenc::frequencies``): these functions turn their arguments (for RoPE, a
Hugging Face ``rope_scaling`` / ``rope_parameters`` dict) into the typed arguments of the ops
``torch.ops.posenc.sinusoidal_inv_freq``, ``rope_inv_freq`` and ``rope_inv_freq_for_length``, which compute in
float64 on the CPU. Invalid values raise ``ValueError`` naming the key and the value; a key's default applies only
where the key is absent (or None), never to a zero. Modules keep the results out of reach of
``module.to(torch.bfloat16)`` and ``.half()``: see ``docs/frequencies.md``.
"""
import functools
import numbers
import operator
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["sinusoidal", "rope", "rope_arguments", "ROPE_TYPES"]


def _fake_constants(*args, op, **kwargs):
    # The value computed for real (the arguments are configuration, never data), its tensors as the tracer's
    # fakes: torch.export's non-strict tracing then records the op, and its float outputs as the constants they are.
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        real = op(*args, **kwargs)
    return tuple(torch.empty(t.shape, dtype=t.dtype) if isinstance(t, Tensor) else t for t in real)


# The ops that return several values and take no tensor: torch.compile evaluates the functions below while
# tracing (_constant_under_compile), torch.export traces the ops through these fakes.
for _name in ("rope_inv_freq", "multiaxis_inv_freq", "axial_inv_freq", "mrope_inv_freq", "grid_sinusoidal_inv_freq"):
    _op = getattr(torch.ops.posenc, _name).default
    torch.library.register_fake(f"posenc::{_name}")(functools.partial(_fake_constants, op=_op))


def _constant_under_compile(fn):
    # torch.compiler.assume_constant_result's mark, set without importing torch._dynamo (1.4 s) at `import posenc`.
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def sinusoidal(dim: int, base: float = 10000.0, shift: int = 0) -> Tensor:
    """omega_i = base ** (-i / (dim // 2 - shift)) for i < dim // 2, float64 ``[dim // 2]``.

    An odd dim has dim // 2 whole pairs (its last channel is the zero column), as in fairseq and diffusers.

    ``shift=0`` is "Attention Is All You Need" (omega_i = base ** (-2i / dim)); ``shift=1`` is the
    fairseq / tensor2tensor / Whisper / diffusers convention (denominator dim/2 - 1). ``dim`` >= 2 (and
    dim // 2 > shift), ``base`` finite and positive, ``shift`` 0 or 1; otherwise ``ValueError``.
    """
    return torch.ops.posenc.sinusoidal_inv_freq(dim, float(base), shift)


ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "yarn", "llama3", "longrope", "proportional")
_ROPE = "posenc.frequencies.rope"


def _scaling_keywords(schema_type: str) -> Tuple[str, ...]:
    """The scaling keywords of ``rope_inv_freq`` whose schema type is ``schema_type``, in schema order: the keys of
    a scaling dict that the ops read (all others are ignored), read from the op itself rather than listed again."""
    arguments = torch.ops.posenc.rope_inv_freq.default._schema.arguments
    return tuple(a.name for a in arguments if a.kwarg_only and a.name != "seq_len" and str(a.type) == schema_type)


_NUMBER_KEYS = _scaling_keywords("Optional[float]")
_LIST_KEYS = _scaling_keywords("Optional[List[float]]")


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{_ROPE}: {key} must be a number, got {value!r}")
    return float(value)


def rope_arguments(scaling: Optional[Dict[str, Any]]) -> Tuple[str, Dict[str, Any]]:
    """``(rope_type, keywords)``: a Hugging Face scaling dict as the typed arguments of ``rope_inv_freq``.

    ``rope_type`` is the dict's ``rope_type`` (else its older ``type``, else ``"default"``); the keywords are the
    keys the ops read, converted to float (lists of floats for ``short_factor`` / ``long_factor``, a bool for
    ``truncate``). Absent and None keys are left out, so that the op applies its default; other keys are ignored.
    The values themselves are checked by the op.
    """
    params = dict(scaling or {})
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type is None:
        rope_type = "default"
    if not isinstance(rope_type, str):
        raise ValueError(f"{_ROPE}: rope_type must be a string, got {rope_type!r}")
    keywords: Dict[str, Any] = {}
    for key in _NUMBER_KEYS:
        if params.get(key) is not None:
            keywords[key] = _number(key, params[key])
    for key in _LIST_KEYS:
        values = params.get(key)
        if values is not None:
            if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
                raise ValueError(f"{_ROPE}: {key} must be a list of numbers, got {values!r}")
            keywords[key] = [_number(f"{key}[{i}]", v) for i, v in enumerate(values)]
    if params.get("truncate") is not None:
        keywords["truncate"] = bool(params["truncate"])
    return rope_type, keywords


@_constant_under_compile
def rope(rotary_dim: int, base: float = 10000.0, scaling: Optional[Dict[str, Any]] = None,
         seq_len: Optional[int] = None) -> Tuple[Tensor, float]:
    """RoPE frequencies: ``(inv_freq float64 [rotary_dim // 2], attention_scale)``.

    Without scaling, inv_freq_i = base ** (-2i / rotary_dim). ``scaling`` is a Hugging Face style dict
    (``config.rope_scaling`` / ``config.rope_parameters``): ``rope_type`` (or ``type``) is one of
    ``ROPE_TYPES``, with the keys of that type (defaults in brackets, used only where a key is absent):

    - ``linear``: ``factor`` (position interpolation: inv_freq / factor);
    - ``dynamic``: ``factor``, ``max_position_embeddings``; Hugging Face's runtime rule: the original
      frequencies up to max_position_embeddings, beyond it base * (factor * L / max - (factor - 1)) **
      (r / (r - 2)) with L = ``seq_len``;
    - ``ntk`` (fixed NTK): ``alpha`` (else ``factor``): base * alpha ** (r / (r - 2)). A ``dynamic`` dict with
      an ``alpha`` (HunYuan checkpoints) and the type ``ntk_alpha`` mean this too;
    - ``yarn``: ``factor`` [max_position_embeddings / original_max_position_embeddings],
      ``original_max_position_embeddings`` [max_position_embeddings], ``beta_fast`` [32] >= ``beta_slow`` [1],
      ``attention_factor`` [0.1 ln(factor) + 1, or DeepSeek's ratio when both ``mscale`` and ``mscale_all_dim``
      are given], ``truncate`` [True];
    - ``llama3``: ``factor`` [8], ``low_freq_factor`` [1] < ``high_freq_factor`` [4],
      ``original_max_position_embeddings`` [8192];
    - ``longrope``: ``short_factor``, ``long_factor`` (rotary_dim // 2 positive values each),
      ``original_max_position_embeddings`` [max_position_embeddings], ``factor`` (as yarn's),
      ``attention_factor`` [sqrt(1 + ln(factor) / ln(original))]; the long factors apply when ``seq_len`` >
      original_max_position_embeddings;
    - ``proportional`` (Gemma 4): ``partial_rotary_factor`` [1] <= 1, ``factor`` [1]: ``rotary_dim`` is the whole
      head, whose first int(partial_rotary_factor * rotary_dim // 2) pairs turn at inv_freq_i / factor and the
      others not at all (frequency 0).

    Every number the type reads must be finite and positive; anything else raises ``ValueError`` naming the key
    and the value (``posenc.frequencies.rope: llama3 factor must be positive, got 0.0``). A ``rope_theta`` key
    replaces ``base``; keys of no use to the type (``partial_rotary_factor`` but for proportional, ...) are
    ignored. ``seq_len`` is the current sequence length (max position + 1). Computed in float64 by the C++
    implementation (``torch.ops.posenc.rope_inv_freq``); the attention scale multiplies cos and sin (pass it to
    the ops).
    """
    rope_type, keywords = rope_arguments(scaling)
    if seq_len is not None:
        seq_len = operator.index(seq_len)  # an int, numpy integer or 0-d integer tensor
    inv_freq, attention_scale = torch.ops.posenc.rope_inv_freq(rotary_dim, float(base), rope_type, seq_len=seq_len,
                                                               **keywords)
    return inv_freq, attention_scale


# Multi-axis rotary: (inv_freq float64 [pairs], pair_axis int64 [pairs]) for rope / rope_qk's pair_axis, the axis
# whose position drives each frequency pair; computed by the C++ implementation like rope's.

@_constant_under_compile
def multiaxis(axes_dim: Sequence[int], base: Union[float, Sequence[float]] = 10000.0) -> Tuple[Tensor, Tensor]:
    """Per-axis widths with their own frequencies: axis a rotates ``axes_dim[a]`` channels, its
    ``axes_dim[a] // 2`` pairs following those of the axes before it, with ``rope(axes_dim[a], base_a)``'s
    frequencies base_a ** (-2i / axes_dim[a]). ``base``: one for all axes or one per axis.

    Flux: ``multiaxis([16, 56, 56], 10000.0)`` with layout ``"gptj"`` and positions ``img_ids.T`` (diffusers'
    ``FluxPosEmbed``).
    """
    bases = [float(base)] if isinstance(base, numbers.Real) else [float(b) for b in base]
    return torch.ops.posenc.multiaxis_inv_freq([operator.index(d) for d in axes_dim], bases)


@_constant_under_compile
def axial(rotary_dim: int, n_axes: int = 2, base: float = 10000.0) -> Tuple[Tensor, Tensor]:
    """The axial scheme of vision transformers: ``rotary_dim`` split evenly among ``n_axes`` axes (it must divide
    by 2 * n_axes), each with the frequencies base ** (-2 * n_axes * i / rotary_dim).

    With :func:`posenc.functional.image_positions` (row, column) the first rotary_dim // (2 * n_axes) pairs follow
    the rows: Qwen2-VL's vision tower (neox), EVA-02 (gptj); SAM 2 puts columns first (flip the positions).
    """
    return torch.ops.posenc.axial_inv_freq(rotary_dim, n_axes, float(base))


@_constant_under_compile
def mrope_pair_axis(mrope_section: Sequence[int], interleaved: bool = False) -> Tensor:
    """M-RoPE's axis of each frequency pair (int64 ``[sum(mrope_section)]``) from ``mrope_section``, the pairs of
    each axis (time, height, width).

    Consecutive sections (Qwen2-VL, Qwen2.5-VL): the first ``mrope_section[0]`` pairs follow axis 0, the next
    ``mrope_section[1]`` axis 1, ... Interleaved (Qwen3-VL): with n axes, pair i follows axis a = i % n when
    a > 0 and i < n * mrope_section[a], else axis 0.
    """
    return torch.ops.posenc.mrope_pair_axis([operator.index(s) for s in mrope_section], interleaved)


@_constant_under_compile
def mrope(rotary_dim: int, mrope_section: Sequence[int], base: float = 10000.0,
          interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """M-RoPE frequencies: ``rope(rotary_dim, base)`` with :func:`mrope_pair_axis` (``sum(mrope_section)`` must be
    rotary_dim // 2). Qwen2-VL / Qwen2.5-VL: ``mrope(128, [16, 24, 24], rope_theta)``; Qwen3-VL:
    ``mrope(128, [24, 20, 20], rope_theta, interleaved=True)``. With a scaling dict, take inv_freq and
    attention_scale from :func:`rope` instead."""
    return torch.ops.posenc.mrope_inv_freq(rotary_dim, [operator.index(s) for s in mrope_section], float(base),
                                           interleaved)


__all__ += ["multiaxis", "axial", "mrope_pair_axis", "mrope"]


GRID_CONVENTIONS = ("mae", "timm", "timm_interleaved", "cogvideox")


@_constant_under_compile
def grid_sinusoidal(dim: int, convention: str = "mae", base: float = 10000.0) -> Tuple[Tensor, Tensor, str]:
    """A multi-axis sincos table's convention: ``(inv_freq float64 [dim // 2], pair_axis int64 [dim // 2], layout)``
    for :func:`posenc.functional.add_sinusoidal` / :func:`posenc.functional.sinusoidal` with ``pair_axis``. Each
    axis block of n pairs has the frequencies ``1 / base ** (k / n)``, k < n. Positions are (row, column) for the
    2-D conventions and (time, row, column) for the 3-D one (:func:`posenc.functional.grid_positions`).

    - ``"mae"``: MAE, DiT, diffusers' 2-D table (PixArt, SD3): dim/4 pairs on the column, then dim/4 on the row,
      ``"half_per_axis"``: [sin col, cos col, sin row, cos row].
    - ``"timm"``: timm's ``build_sincos2d_pos_embed``: row, then column, ``"half"``: [sin row, sin col, cos row,
      cos col].
    - ``"timm_interleaved"``: the same with ``interleave_sin_cos=True``: [sin row, cos row, sin col, cos col].
    - ``"cogvideox"``: diffusers' 3-D table: dim/8 pairs on time, 3 dim/16 on the column, 3 dim/16 on the row,
      ``"half_per_axis"``.
    """
    inv_freq, pair_axis, layout = torch.ops.posenc.grid_sinusoidal_inv_freq(dim, convention, float(base))
    return inv_freq, pair_axis, layout


__all__ += ["grid_sinusoidal", "GRID_CONVENTIONS"]
