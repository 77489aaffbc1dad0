"""Frequencies (inv_freq, float64) of every family; twins of C++ posenc::frequencies.

They are formulas of the configuration, computed in float64 on the CPU; modules keep them out of reach of
``module.to(torch.bfloat16)`` and ``.half()``.
"""
import math
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["sinusoidal", "rope", "ROPE_TYPES"]


def sinusoidal(dim: int, base: float = 10000.0, shift: int = 0) -> Tensor:
    """omega_i = base ** (-i / (dim // 2 - shift)) for i < dim // 2, float64 ``[dim // 2]``.

    An odd dim has dim // 2 whole pairs (its last channel is the zero column), as in fairseq and diffusers.

    ``shift=0`` is "Attention Is All You Need" (omega_i = base ** (-2i / dim)); ``shift=1`` is the
    fairseq / tensor2tensor / Whisper / diffusers convention (denominator dim/2 - 1).
    """
    if dim < 2:
        raise ValueError(f"posenc.frequencies.sinusoidal: dim must be at least 2, got {dim}")
    if base <= 0:
        raise ValueError(f"posenc.frequencies.sinusoidal: base must be positive, got {base}")
    if shift not in (0, 1):
        raise ValueError(f"posenc.frequencies.sinusoidal: shift must be 0 or 1, got {shift}")
    pairs = dim // 2
    if pairs - shift <= 0:
        raise ValueError(
            f"posenc.frequencies.sinusoidal: dim {dim} has {pairs} frequency pairs, too few for shift {shift}")
    i = torch.arange(pairs, dtype=torch.float64)
    return torch.exp(i * (-math.log(base) / (pairs - shift)))


ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "yarn", "llama3", "longrope")
_ROPE = "posenc.frequencies.rope"


def _theta_powers(rotary_dim: int, theta: float) -> Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return torch.exp(exponent * -math.log(theta))


def _require(params: Dict[str, Any], key: str, rope_type: str, fallback: Optional[str] = None) -> float:
    value = params.get(key)
    if value is None and fallback is not None:
        value = params.get(fallback)
    if value is None:
        needs = key if fallback is None else f"{key} (or {fallback})"
        raise ValueError(f'{_ROPE}: rope_type "{rope_type}" needs {needs}')
    return float(value)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope(rotary_dim: int, base: float = 10000.0, scaling: Optional[Dict[str, Any]] = None,
         seq_len: Optional[int] = None) -> Tuple[Tensor, float]:
    """RoPE frequencies: ``(inv_freq float64 [rotary_dim // 2], attention_scale)``.

    Without scaling, inv_freq_i = base ** (-2i / rotary_dim). ``scaling`` is a Hugging Face style dict
    (``config.rope_scaling`` / ``config.rope_parameters``): ``rope_type`` (or ``type``) is one of
    ``ROPE_TYPES``, with the keys of that type:

    - ``linear``: ``factor`` (position interpolation: inv_freq / factor);
    - ``dynamic``: ``factor``, ``max_position_embeddings``; Hugging Face's runtime rule: the original
      frequencies up to max_position_embeddings, beyond it base * (factor * L / max - (factor - 1)) **
      (r / (r - 2)) with L = ``seq_len``;
    - ``ntk`` (fixed NTK): ``alpha`` (else ``factor``): base * alpha ** (r / (r - 2)). A ``dynamic`` dict with
      ``alpha`` (HunYuan checkpoints) and ``ntk_alpha`` mean this too;
    - ``yarn``: ``factor``, ``original_max_position_embeddings``, optional ``beta_fast`` (32), ``beta_slow`` (1),
      ``attention_factor``, ``mscale`` and ``mscale_all_dim`` (DeepSeek), ``truncate`` (True);
    - ``llama3``: ``factor`` (8), ``low_freq_factor`` (1), ``high_freq_factor`` (4),
      ``original_max_position_embeddings`` (8192);
    - ``longrope``: ``short_factor``, ``long_factor`` (rotary_dim // 2 values each),
      ``original_max_position_embeddings``, optional ``factor`` / ``attention_factor``; the long factors
      apply when ``seq_len`` > original_max_position_embeddings.

    ``factor`` of yarn and longrope defaults to max_position_embeddings / original_max_position_embeddings.
    A ``rope_theta`` key replaces ``base``; keys of no use to the type (``partial_rotary_factor``, ...) are
    ignored. ``seq_len`` is the current sequence length (max position + 1). Computed in float64; the attention
    scale multiplies cos and sin (pass it to the ops).
    """
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"{_ROPE}: rotary_dim must be even and at least 2, got {rotary_dim}")
    params: Dict[str, Any] = dict(scaling or {})
    theta = float(params.get("rope_theta") or base)
    if theta <= 0:
        raise ValueError(f"{_ROPE}: base (rope_theta) must be positive, got {theta}")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "ntk_alpha" or (rope_type == "dynamic" and params.get("alpha")):
        rope_type = "ntk"
    inv_freq = _theta_powers(rotary_dim, theta)
    pairs = rotary_dim // 2

    def ntk_exponent(what: str) -> float:
        if rotary_dim <= 2:
            raise ValueError(f'{_ROPE}: rope_type "{rope_type}" rescales the base by {what}^(r / (r - 2)), '
                             f"undefined for rotary_dim 2")
        return rotary_dim / (rotary_dim - 2)

    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / _require(params, "factor", rope_type), 1.0
    if rope_type == "dynamic":
        factor = _require(params, "factor", rope_type)
        limit = _require(params, "max_position_embeddings", rope_type)
        length = max(float(seq_len) if seq_len is not None else limit, limit)
        scale = factor * length / limit - (factor - 1)
        return _theta_powers(rotary_dim, theta * scale ** ntk_exponent("the scale")), 1.0
    if rope_type == "ntk":
        alpha = _require(params, "alpha", rope_type, fallback="factor")
        return _theta_powers(rotary_dim, theta * alpha ** ntk_exponent("alpha")), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, rotary_dim, theta, params)
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "longrope":
        original = _require(params, "original_max_position_embeddings", rope_type, fallback="max_position_embeddings")
        for key in ("short_factor", "long_factor"):
            if len(params.get(key) or ()) != pairs:
                raise ValueError(f'{_ROPE}: rope_type "longrope" needs {key} of rotary_dim / 2 = {pairs} values, '
                                 f"got {len(params.get(key) or ())}")
        factor = _context_factor(params, original, rope_type)
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = params["long_factor"] if seq_len is not None and seq_len > original else params["short_factor"]
        return inv_freq / torch.tensor(ext, dtype=torch.float64), float(attention)
    raise ValueError(f'{_ROPE}: unknown rope_type "{rope_type}"; expected one of {", ".join(ROPE_TYPES)}')


def _context_factor(params: Dict[str, Any], original: float, rope_type: str) -> float:
    if params.get("factor") is not None:
        return float(params["factor"])
    return _require(params, "max_position_embeddings", rope_type) / original


def _yarn(inv_freq: Tensor, rotary_dim: int, theta: float, params: Dict[str, Any]) -> Tuple[Tensor, float]:
    original = _require(params, "original_max_position_embeddings", "yarn", fallback="max_position_embeddings")
    factor = _context_factor(params, original, "yarn")
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:  # DeepSeek
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction(rotations: float) -> float:
        # The pair index whose wavelength fits `rotations` times into the original context.
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(beta_fast), correction(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: avoids a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


def _llama3(inv_freq: Tensor, params: Dict[str, Any]) -> Tensor:
    factor = float(params.get("factor") or 8.0)
    low = float(params.get("low_freq_factor") or 1.0)
    high = float(params.get("high_freq_factor") or 4.0)
    original = float(params.get("original_max_position_embeddings") or 8192)
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, smoothed, scaled)


# Multi-axis rotary: (inv_freq float64 [pairs], pair_axis int64 [pairs]) for rope / rope_qk's pair_axis, the axis
# whose position drives each frequency pair.

def multiaxis(axes_dim: Sequence[int], base: Union[float, Sequence[float]] = 10000.0) -> Tuple[Tensor, Tensor]:
    """Per-axis widths with their own frequencies: axis a rotates ``axes_dim[a]`` channels, its
    ``axes_dim[a] // 2`` pairs following those of the axes before it, with ``rope(axes_dim[a], base_a)``'s
    frequencies base_a ** (-2i / axes_dim[a]). ``base``: one for all axes or one per axis.

    Flux: ``multiaxis([16, 56, 56], 10000.0)`` with layout ``"gptj"`` and positions ``img_ids.T`` (diffusers'
    ``FluxPosEmbed``).
    """
    axes = [int(d) for d in axes_dim]
    bases = [float(base)] * len(axes) if isinstance(base, (int, float)) else [float(b) for b in base]
    if not axes:
        raise ValueError("posenc.frequencies.multiaxis: axes_dim is empty; at least one axis is needed")
    if len(bases) != len(axes):
        raise ValueError(f"posenc.frequencies.multiaxis: got {len(bases)} bases for {len(axes)} axes; give one base "
                         f"or one per axis")
    inv_freq, pair_axis = [], []
    for a, (dim, theta) in enumerate(zip(axes, bases)):
        if dim < 2 or dim % 2:
            raise ValueError(f"posenc.frequencies.multiaxis: axes_dim[{a}] must be even and at least 2, got {dim}")
        inv_freq.append(rope(dim, theta)[0])
        pair_axis.append(torch.full((dim // 2,), a, dtype=torch.int64))
    return torch.cat(inv_freq), torch.cat(pair_axis)


def axial(rotary_dim: int, n_axes: int = 2, base: float = 10000.0) -> Tuple[Tensor, Tensor]:
    """The axial scheme of vision transformers: ``rotary_dim`` split evenly among ``n_axes`` axes (it must divide
    by 2 * n_axes), each with the frequencies base ** (-2 * n_axes * i / rotary_dim).

    With :func:`posenc.functional.image_positions` (row, column) the first rotary_dim // (2 * n_axes) pairs follow
    the rows: Qwen2-VL's vision tower (neox), EVA-02 (gptj); SAM 2 puts columns first (flip the positions).
    """
    if n_axes < 1:
        raise ValueError(f"posenc.frequencies.axial: n_axes must be at least 1, got {n_axes}")
    if rotary_dim <= 0 or rotary_dim % (2 * n_axes):
        raise ValueError(f"posenc.frequencies.axial: rotary_dim {rotary_dim} must be a positive multiple of "
                         f"2 * n_axes = {2 * n_axes}")
    return multiaxis([rotary_dim // n_axes] * n_axes, base)


def mrope_pair_axis(mrope_section: Sequence[int], interleaved: bool = False) -> Tensor:
    """M-RoPE's axis of each frequency pair (int64 ``[sum(mrope_section)]``) from ``mrope_section``, the pairs of
    each axis (time, height, width).

    Consecutive sections (Qwen2-VL, Qwen2.5-VL): the first ``mrope_section[0]`` pairs follow axis 0, the next
    ``mrope_section[1]`` axis 1, ... Interleaved (Qwen3-VL): with n axes, pair i follows axis a = i % n when
    a > 0 and i < n * mrope_section[a], else axis 0.
    """
    sections = [int(s) for s in mrope_section]
    op = "posenc.frequencies.mrope_pair_axis"
    if not sections:
        raise ValueError(f"{op}: mrope_section is empty; at least one axis is needed")
    for a, size in enumerate(sections):
        if size < 0:
            raise ValueError(f"{op}: mrope_section[{a}] must not be negative, got {size}")
    pairs, n_axes = sum(sections), len(sections)
    if pairs == 0:
        raise ValueError(f"{op}: mrope_section {sections} holds no frequency pair")
    if not interleaved:
        return torch.repeat_interleave(torch.arange(n_axes), torch.tensor(sections))
    pair_axis = torch.zeros(pairs, dtype=torch.int64)
    for a in range(1, n_axes):
        pair_axis[a:min(pairs, n_axes * sections[a]):n_axes] = a
    return pair_axis


def mrope(rotary_dim: int, mrope_section: Sequence[int], base: float = 10000.0,
          interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """M-RoPE frequencies: ``rope(rotary_dim, base)`` with :func:`mrope_pair_axis` (``sum(mrope_section)`` must be
    rotary_dim // 2). Qwen2-VL / Qwen2.5-VL: ``mrope(128, [16, 24, 24], rope_theta)``; Qwen3-VL:
    ``mrope(128, [24, 20, 20], rope_theta, interleaved=True)``. With a scaling dict, take inv_freq and
    attention_scale from :func:`rope` instead."""
    pair_axis = mrope_pair_axis(mrope_section, interleaved)
    if 2 * pair_axis.numel() != rotary_dim:
        raise ValueError(f"posenc.frequencies.mrope: mrope_section {list(mrope_section)} holds {pair_axis.numel()} "
                         f"frequency pairs but rotary_dim {rotary_dim} has {rotary_dim // 2}")
    return rope(rotary_dim, base)[0], pair_axis


__all__ += ["multiaxis", "axial", "mrope_pair_axis", "mrope"]
