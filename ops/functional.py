"""Typed wrappers of torch.ops.posenc.*: same arguments, same order, same defaults as the schemas."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["sinusoidal", "add_sinusoidal", "embed_sinusoidal", "embedding_backward"]


def _given(args: tuple, defaults: tuple) -> tuple:
    """``args`` without its trailing run of arguments that are their parameters' own default objects (left out by the
    caller, as a rule): ``torch.ops`` parses and boxes every argument it is handed, about 1.3k instructions each, and
    takes a missing one from the op's schema, whose defaults these are. Identity, not equality: a value passed
    explicitly, or a SymInt while tracing, is passed on as given. TorchScript, which has no ``*args``, compiles each
    wrapper's ``torch.jit.is_scripting()`` branch alone: the op with every argument."""
    n = len(args)
    first = n - len(defaults)
    while n > first and args[n - 1] is defaults[n - 1 - first]:
        n -= 1
    return args[:n]


def sinusoidal(positions: Tensor, inv_freq: Tensor, layout: str = "interleaved", dtype: Optional[torch.dtype] = None,
               offset: int = 0, pair_axis: Optional[Tensor] = None) -> Tensor:
    """The encoding of ``positions + offset``: shape ``positions.shape + [2F]``, F = len(inv_freq).

    ``layout="interleaved"`` gives [sin t0, cos t0, sin t1, cos t1, ...]; ``"half"`` gives
    [sin t0 .. sin t(F-1), cos t0 .. cos t(F-1)]; ``"half_cos_first"`` gives [cos .. || sin ..] (diffusers'
    ``flip_sin_to_cos``); ``"half_per_axis"`` gives "half" within each run of pairs on one axis. Positions may be
    integer or floating (diffusion timesteps, scaled grids); ``dtype`` defaults to that of floating positions,
    else float32. With ``pair_axis`` [F] (images, video: :func:`posenc.frequencies.grid_sinusoidal`), positions
    are ``[n_axes, ...]``, pair i encoding the position of axis ``pair_axis[i]``, and the output is
    ``positions.shape[1:] + [2F]``. Not differentiable.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.sinusoidal(positions, inv_freq, layout, dtype, offset, pair_axis)
    else:
        return torch.ops.posenc.sinusoidal(*_given((positions, inv_freq, layout, dtype, offset, pair_axis),
                                                    sinusoidal.__defaults__))


def add_sinusoidal(x: Tensor, positions: Optional[Tensor], inv_freq: Tensor, x_scale: float = 1.0,
                   layout: str = "interleaved", offset: int = 0, pair_axis: Optional[Tensor] = None,
                   num_prefix_tokens: int = 0) -> Tensor:
    """``x * x_scale + PE`` for x ``[..., S, D]``, D = 2F or 2F + 1 (the last channel then gets no encoding).

    ``positions``: None (``offset + arange(S')``), ``[S']`` or x's leading shape with S' last; ``offset`` is added
    to explicit positions too. S' = S - num_prefix_tokens: the first ``num_prefix_tokens`` tokens (cls,
    registers) get no encoding (``x * x_scale`` exactly). With ``pair_axis``, positions ``[n_axes, S']`` or
    ``[n_axes, ..., S']`` (the patch grid: :func:`grid_positions`). Differentiable w.r.t. x.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.add_sinusoidal(x, positions, inv_freq, x_scale, layout, offset, pair_axis,
                                               num_prefix_tokens)
    else:
        return torch.ops.posenc.add_sinusoidal(*_given((x, positions, inv_freq, x_scale, layout, offset, pair_axis,
                                                        num_prefix_tokens), add_sinusoidal.__defaults__))


def embed_sinusoidal(tokens: Tensor, token_weight: Tensor, positions: Optional[Tensor], inv_freq: Tensor,
                     token_scale: float = 1.0, padding_idx: Optional[int] = None, layout: str = "interleaved",
                     offset: int = 0) -> Tensor:
    """``token_weight[tokens] * token_scale + PE`` in one pass (token ids in ``[0, vocab)``).

    Differentiable w.r.t. token_weight; the ``padding_idx`` row receives no gradient, as with
    ``torch.nn.functional.embedding``.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.embed_sinusoidal(tokens, token_weight, positions, inv_freq, token_scale, padding_idx,
                                                 layout, offset)
    else:
        return torch.ops.posenc.embed_sinusoidal(*_given((tokens, token_weight, positions, inv_freq, token_scale,
                                                          padding_idx, layout, offset), embed_sinusoidal.__defaults__))


def embedding_backward(grad: Tensor, indices: Tensor, num_rows: int, scale: float = 1.0,
                       padding_idx: Optional[int] = None) -> Tensor:
    """Sum of the rows of ``grad [..., D]`` into a ``[num_rows, D]`` table at ``indices`` (grad's leading
    shape or a suffix of it), times ``scale``. Deterministic: the same bits for any thread count."""
    if torch.jit.is_scripting():
        return torch.ops.posenc.embedding_backward(grad, indices, num_rows, scale, padding_idx)
    else:
        return torch.ops.posenc.embedding_backward(*_given((grad, indices, num_rows, scale, padding_idx),
                                                            embedding_backward.__defaults__))


# Learned absolute. A position p reads row p + offset of its table; every row must lie in
# [0, L_max), L_max = the table's row count, or the op raises an error naming the position and L_max.

def learned(weight: Tensor, positions: Tensor, offset: int = 0, padding_idx: Optional[int] = None) -> Tensor:
    """``weight[positions + offset]``: shape ``positions.shape + [D]`` for integer positions.

    Differentiable w.r.t. weight (deterministically); the ``padding_idx`` row receives no gradient.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.learned(weight, positions, offset, padding_idx)
    else:
        return torch.ops.posenc.learned(*_given((weight, positions, offset, padding_idx), learned.__defaults__))


def add_learned(x: Tensor, weight: Tensor, positions: Optional[Tensor] = None, offset: int = 0,
                padding_idx: Optional[int] = None) -> Tensor:
    """``x + weight[positions + offset]`` for x ``[..., S, D]`` and a ``[L_max, D]`` table of x's dtype.

    ``positions``: None (``arange(S)``, so ``offset`` is the cache length), ``[S]`` or x's leading shape.
    Differentiable w.r.t. x and weight (not its ``padding_idx`` row).
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.add_learned(x, weight, positions, offset, padding_idx)
    else:
        return torch.ops.posenc.add_learned(*_given((x, weight, positions, offset, padding_idx),
                                                     add_learned.__defaults__))


def embed_learned(tokens: Tensor, token_weight: Tensor, pos_weight: Tensor, positions: Optional[Tensor] = None,
                  token_scale: float = 1.0, padding_idx: Optional[int] = None, offset: int = 0,
                  pos_padding_idx: Optional[int] = None) -> Tensor:
    """``token_weight[tokens] * token_scale + pos_weight[positions + offset]`` in one pass (GPT-2's wte + wpe).

    Differentiable w.r.t. both tables; ``padding_idx`` (a token row) and ``pos_padding_idx`` (a position
    row) receive no gradient. ``token_scale`` (e.g. ``sqrt(d_model)``) scales the token part only.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.embed_learned(tokens, token_weight, pos_weight, positions, token_scale, padding_idx,
                                              offset, pos_padding_idx)
    else:
        return torch.ops.posenc.embed_learned(*_given((tokens, token_weight, pos_weight, positions, token_scale,
                                                       padding_idx, offset, pos_padding_idx),
                                                       embed_learned.__defaults__))


def make_positions(tokens: Tensor, padding_idx: int) -> Tensor:
    """fairseq's ``make_positions`` along the last dimension (int64): padding keeps ``padding_idx``, real
    tokens are numbered ``padding_idx + 1, padding_idx + 2, ...`` (use a table of
    ``max_positions + padding_idx + 1`` rows with that ``padding_idx``)."""
    return torch.ops.posenc.make_positions(tokens, padding_idx)


def positions_from_mask(attention_mask: Tensor, pad_position: int = 0) -> Tensor:
    """Positions of a left-padded batch from its attention mask ``[..., S]`` (nonzero = real token), int64:
    real tokens count from 0 (``cumsum(mask) - 1``), masked ones get ``pad_position``.

    OPT: ``pad_position=-1`` with ``offset=2`` (padding reads row 1). With a cache of length P and a mask
    over P + S tokens, the new tokens' positions are ``positions_from_mask(mask)[..., P:]``.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.positions_from_mask(attention_mask, pad_position)
    else:
        return torch.ops.posenc.positions_from_mask(*_given((attention_mask, pad_position),
                                                             positions_from_mask.__defaults__))


def resample_learned(weight: Tensor, source_grid: List[int], grid: List[int], mode: str = "bicubic",
                     align_corners: bool = False, antialias: bool = False, scale_factor: Optional[List[float]] = None,
                     num_prefix_tokens: int = 0) -> Tensor:
    """A learned table of a ``source_grid`` (Hs, Ws) of patches resampled to ``grid`` (H, W), as vision
    transformers resize theirs to an image's grid (ViT, DINOv2, SigLIP; timm's ``resample_abs_pos_embed``).

    ``weight`` ``[P + Hs * Ws, D]``: ``P = num_prefix_tokens`` rows (cls, registers) kept as they are, then the grid
    rows, row-major. Returns ``[P + H * W, D]``: the grid rows are
    ``F.interpolate(table[None].permute(0, 3, 1, 2), size=grid, mode=mode, align_corners=align_corners,
    antialias=antialias)`` of ``table = weight[P:].view(Hs, Ws, D)``, back in rows. ``mode``: ``"bicubic"`` or
    ``"bilinear"``. ``scale_factor`` ``[sh, sw]``: the source coordinates of
    ``F.interpolate(scale_factor=..., recompute_scale_factor=False)`` (a step of ``1 / scale``: DINOv2's original
    ``+ 0.1``), the output still ``grid``. Weights and sums in float64, rounded once to weight's dtype.
    Differentiable w.r.t. weight (:func:`resample_learned_backward`), twice.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.resample_learned(weight, source_grid, grid, mode, align_corners, antialias,
                                                 scale_factor, num_prefix_tokens)
    else:
        return torch.ops.posenc.resample_learned(*_given((weight, source_grid, grid, mode, align_corners, antialias,
                                                          scale_factor, num_prefix_tokens),
                                                          resample_learned.__defaults__))


def add_resampled_learned(x: Tensor, weight: Tensor, source_grid: List[int], grid: List[int], mode: str = "bicubic",
                          align_corners: bool = False, antialias: bool = False,
                          scale_factor: Optional[List[float]] = None, num_prefix_tokens: int = 0) -> Tensor:
    """``x + resample_learned(weight, source_grid, grid, ...)`` for x ``[..., P + H * W, D]`` of weight's dtype, the
    table broadcast over x's leading dimensions: Hugging Face's ``x + pos.to(x.dtype)`` after an interpolation in
    float32, in one pass (float32 maths of x and the rounded table, rounded once; float64 for float64).
    Differentiable w.r.t. x (the identity) and weight (:func:`resample_learned_backward`).
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.add_resampled_learned(x, weight, source_grid, grid, mode, align_corners, antialias,
                                                      scale_factor, num_prefix_tokens)
    else:
        return torch.ops.posenc.add_resampled_learned(*_given((x, weight, source_grid, grid, mode, align_corners,
                                                               antialias, scale_factor, num_prefix_tokens),
                                                               add_resampled_learned.__defaults__))


def resample_learned_backward(grad: Tensor, source_grid: List[int], grid: List[int], mode: str = "bicubic",
                              align_corners: bool = False, antialias: bool = False,
                              scale_factor: Optional[List[float]] = None, num_prefix_tokens: int = 0) -> Tensor:
    """The adjoint of :func:`resample_learned`: ``grad [..., P + H * W, D]`` summed over its leading dimensions, then
    the transposed interpolation, to ``[P + Hs * Ws, D]`` (the prefix rows summed straight through). Float64 sums
    in a fixed order, rounded once: the same bits for any thread count. Differentiable (its derivative is
    :func:`resample_learned`).
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.resample_learned_backward(grad, source_grid, grid, mode, align_corners, antialias,
                                                          scale_factor, num_prefix_tokens)
    else:
        return torch.ops.posenc.resample_learned_backward(*_given((grad, source_grid, grid, mode, align_corners,
                                                                   antialias, scale_factor, num_prefix_tokens),
                                                                   resample_learned_backward.__defaults__))


__all__ += ["learned", "add_learned", "embed_learned", "make_positions", "positions_from_mask", "resample_learned",
            "add_resampled_learned", "resample_learned_backward"]


# ---------------------------------------------------------------- ALiBi

__all__ += ["alibi_slopes", "alibi_bias", "add_alibi", "add_alibi_", "alibi_backward"]


def alibi_slopes(num_heads: int, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> Tensor:
    """The ALiBi slopes ``[num_heads]`` of the paper and BLOOM, for any head count.

    With n = 2 ** floor(log2(num_heads)): m_k = 2 ** (-8k / n) for k = 1..n, then, past n heads,
    2 ** (-4(2j - 1) / n) for j = 1..num_heads - n (every other slope of the 2n-head series). Computed in
    float64 by the C++ implementation (``torch.ops.posenc.alibi_slopes``, C++ ``posenc::alibi_slopes``) and
    returned as ``dtype`` on ``device``. ``ValueError`` unless num_heads is positive and dtype floating.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.alibi_slopes(num_heads, dtype, device)
    else:
        return torch.ops.posenc.alibi_slopes(*_given((num_heads, dtype, device), alibi_slopes.__defaults__))


def alibi_bias(slopes: Tensor, q_len: int, k_len: int, mode: str = "causal", head_offset: int = 0,
               num_heads: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The ALiBi bias ``[B or 1, num_heads, q_len, k_len]`` of ``slopes`` ``[H]`` or ``[B, H]``.

    Bottom-right aligned (the last query sits on the last key): d = i + (k_len - q_len) - j;
    ``"symmetric"`` gives -m * |d|, ``"causal"`` gives -m * d, equal to it wherever j <= i + k_len - q_len
    (past that, the same line continues: mask those keys as usual). Head h uses
    ``slopes[..., head_offset + h]``, so a tensor-parallel shard passes the global slopes and its first head;
    ``num_heads`` defaults to every head from ``head_offset`` on, ``dtype`` to that of the slopes.
    Differentiable w.r.t. slopes.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.alibi_bias(slopes, q_len, k_len, mode, head_offset, num_heads, dtype)
    else:
        return torch.ops.posenc.alibi_bias(*_given((slopes, q_len, k_len, mode, head_offset, num_heads, dtype),
                                                    alibi_bias.__defaults__))


def add_alibi(scores: Tensor, slopes: Tensor, mode: str = "causal", head_offset: int = 0) -> Tensor:
    """``scores [B, H, Q, K]`` plus the ALiBi bias of heads ``head_offset .. head_offset + H - 1``, in one pass.

    Differentiable w.r.t. scores and slopes (learnable slopes); the slope gradient is only computed when the
    slopes require grad.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.add_alibi(scores, slopes, mode, head_offset)
    else:
        return torch.ops.posenc.add_alibi(*_given((scores, slopes, mode, head_offset), add_alibi.__defaults__))


def add_alibi_(scores: Tensor, slopes: Tensor, mode: str = "causal", head_offset: int = 0) -> None:
    """`add_alibi` in place, through the strides of ``scores``. For inference: raises if autograd would need it."""
    if torch.jit.is_scripting():
        torch.ops.posenc.add_alibi_(scores, slopes, mode, head_offset)
    else:
        torch.ops.posenc.add_alibi_(*_given((scores, slopes, mode, head_offset), add_alibi_.__defaults__))


def alibi_backward(grad: Tensor, slopes: Tensor, mode: str = "causal", head_offset: int = 0) -> Tensor:
    """The gradient w.r.t. ``slopes`` of an ALiBi bias whose output gradient is ``grad [B, H, Q, K]``.

    Shape and dtype of ``slopes``; zero for heads outside ``head_offset .. head_offset + H - 1``. Deterministic:
    the same bits for any thread count.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.alibi_backward(grad, slopes, mode, head_offset)
    else:
        return torch.ops.posenc.alibi_backward(*_given((grad, slopes, mode, head_offset), alibi_backward.__defaults__))


# ---------------------------------------------------------------- T5 relative bias

__all__ += ["relative_position_bucket", "t5_bias", "t5_bias_backward"]


def relative_position_bucket(relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32,
                             max_distance: int = 128) -> Tensor:
    """T5's bucket (int64, same shape) of integer relative positions ``key_pos - query_pos``.

    Identical to Hugging Face's ``T5Attention._relative_position_bucket``, float32 rounding at the bucket
    edges included. Bidirectional: half the buckets per direction; causal: positive positions share bucket 0.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance)
    else:
        return torch.ops.posenc.relative_position_bucket(*_given((relative_position, bidirectional, num_buckets,
                                                                  max_distance), relative_position_bucket.__defaults__))


def t5_bias(weight: Tensor, q_len: int, k_len: int, bidirectional: bool, num_buckets: int, max_distance: int,
            q_offset: int = 0) -> Tensor:
    """The T5 bias ``[1, H, q_len, k_len]``: ``weight[bucket(j - (i + q_offset)), h]`` for ``weight [num_buckets, H]``.

    Queries sit at positions ``q_offset .. q_offset + q_len - 1`` (``q_offset`` = cache length when decoding)
    and keys at ``0 .. k_len - 1``, as in Hugging Face's ``compute_bias``. Differentiable w.r.t. weight; the
    backward is deterministic.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.t5_bias(weight, q_len, k_len, bidirectional, num_buckets, max_distance, q_offset)
    else:
        return torch.ops.posenc.t5_bias(*_given((weight, q_len, k_len, bidirectional, num_buckets, max_distance,
                                                 q_offset), t5_bias.__defaults__))


def t5_bias_backward(grad: Tensor, bidirectional: bool, num_buckets: int, max_distance: int,
                     q_offset: int = 0) -> Tensor:
    """The gradient ``[num_buckets, H]`` w.r.t. the table of a T5 bias whose output gradient is ``grad [1, H, Q, K]``.

    Deterministic: the same bits for any thread count.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.t5_bias_backward(grad, bidirectional, num_buckets, max_distance, q_offset)
    else:
        return torch.ops.posenc.t5_bias_backward(*_given((grad, bidirectional, num_buckets, max_distance, q_offset),
                                                          t5_bias_backward.__defaults__))


# Rotary. inv_freq from posenc.frequencies.rope; the ops rotate channel pairs by p * inv_freq.

def rope(x: Tensor, positions: Optional[Tensor], inv_freq: Tensor, attention_scale: float = 1.0, layout: str = "neox",
         format: str = "bshd", offset: int = 0, cu_seqlens: Optional[Tensor] = None,
         pair_axis: Optional[Tensor] = None) -> Tensor:
    """x rotated by angle(p, i) = p * inv_freq[i], cos and sin scaled by ``attention_scale``.

    ``layout``: ``"neox"`` pairs (x_i, x_{i+r/2}) (Hugging Face ``rotate_half``), ``"gptj"`` pairs
    (x_{2i}, x_{2i+1}) (Meta's original weights). r = 2 * len(inv_freq) <= head_dim; the other channels pass
    through. ``format``: ``"bshd"`` [B,S,H,D], ``"bhsd"`` [B,H,S,D], ``"sbhd"`` [S,B,H,D] or ``"thd"`` [T,H,D]
    (packed; with ``cu_seqlens`` [N+1] the positions restart at each sequence). ``positions``: None
    (``offset + arange``), [S] (or [T]) or [B, S], int64 or int32; ``offset`` is added to given positions too.
    Any strides (e.g. a view of a fused qkv projection); the result is fresh and contiguous in x's format.
    Differentiable w.r.t. x: the gradient is the rotation by -angle.

    Multi-axis positions (images, video, multimodal text; see ``docs/multiaxis-rope.md``): ``pair_axis``
    [len(inv_freq)] (int64 or int32) names the axis whose position drives each frequency pair, and positions
    lead with an axis dimension, ``[n_axes, S]`` (shared by the batch), ``[n_axes, B, S]`` (Hugging Face
    Qwen2-VL's ``[3, batch, seq]``) or ``[n_axes, T]`` for thd: angle(i) = positions[pair_axis[i], ...] *
    inv_freq[i]. :mod:`posenc.frequencies` builds (inv_freq, pair_axis) for M-RoPE and axial schemes.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.rope(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                                     pair_axis)
    else:
        return torch.ops.posenc.rope(*_given((x, positions, inv_freq, attention_scale, layout, format, offset,
                                              cu_seqlens, pair_axis), rope.__defaults__))


def rope_backward(grad: Tensor, positions: Optional[Tensor], inv_freq: Tensor, attention_scale: float = 1.0,
                  layout: str = "neox", format: str = "bshd", offset: int = 0, cu_seqlens: Optional[Tensor] = None,
                  pair_axis: Optional[Tensor] = None) -> Tensor:
    """The gradient of :func:`rope`: ``grad`` rotated by -angle (times attention_scale)."""
    if torch.jit.is_scripting():
        return torch.ops.posenc.rope_backward(grad, positions, inv_freq, attention_scale, layout, format, offset,
                                              cu_seqlens, pair_axis)
    else:
        return torch.ops.posenc.rope_backward(*_given((grad, positions, inv_freq, attention_scale, layout, format,
                                                       offset, cu_seqlens, pair_axis), rope_backward.__defaults__))


def rope_qk(q: Tensor, k: Tensor, positions: Optional[Tensor], inv_freq: Tensor, attention_scale: float = 1.0,
            layout: str = "neox", format: str = "bshd", offset: int = 0, cu_seqlens: Optional[Tensor] = None,
            pair_axis: Optional[Tensor] = None, q_scale_beta: float = 0.0, q_scale_length: int = 1,
            q_scale_shift: int = 0) -> Tuple[Tensor, Tensor]:
    """:func:`rope` of q and k in one pass (each angle formed once for both). q and k share the format,
    batch and sequence sizes and dtype; their head counts (GQA/MQA) and head dims may differ.

    ``q_scale_beta`` (Llama 4's attention temperature, Ministral 3's ``llama_4_scaling_beta``): q, and only q, also
    times ``1 + q_scale_beta * log(1 + floor((p + q_scale_shift) / q_scale_length))`` at its position p (q fully
    rotated, one position per token)."""
    if torch.jit.is_scripting():
        return torch.ops.posenc.rope_qk(q, k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                                        pair_axis, q_scale_beta, q_scale_length, q_scale_shift)
    else:
        return torch.ops.posenc.rope_qk(*_given((q, k, positions, inv_freq, attention_scale, layout, format, offset,
                                                 cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift),
                                                 rope_qk.__defaults__))


def rope_qk_backward(grad_q: Tensor, grad_k: Tensor, positions: Optional[Tensor], inv_freq: Tensor,
                     attention_scale: float = 1.0, layout: str = "neox", format: str = "bshd", offset: int = 0,
                     cu_seqlens: Optional[Tensor] = None, pair_axis: Optional[Tensor] = None, q_scale_beta: float = 0.0,
                     q_scale_length: int = 1, q_scale_shift: int = 0) -> Tuple[Tensor, Tensor]:
    """The gradient of :func:`rope_qk`."""
    if torch.jit.is_scripting():
        return torch.ops.posenc.rope_qk_backward(grad_q, grad_k, positions, inv_freq, attention_scale, layout, format,
                                                 offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length,
                                                 q_scale_shift)
    else:
        return torch.ops.posenc.rope_qk_backward(*_given((grad_q, grad_k, positions, inv_freq, attention_scale, layout,
                                                          format, offset, cu_seqlens, pair_axis, q_scale_beta,
                                                          q_scale_length, q_scale_shift),
                                                          rope_qk_backward.__defaults__))


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Optional[Tensor],
                 inv_freq: Tensor, eps: float = 1e-06, norm: str = "llama", attention_scale: float = 1.0,
                 layout: str = "neox", format: str = "bshd", offset: int = 0, cu_seqlens: Optional[Tensor] = None,
                 pair_axis: Optional[Tensor] = None, q_scale_beta: float = 0.0, q_scale_length: int = 1,
                 q_scale_shift: int = 0) -> Tuple[Tensor, Tensor]:
    """q and k RMS-normalized, times their weights, then rotated as :func:`rope_qk` rotates them, in one pass.

    A weight of shape [head_dim] normalizes each head (Qwen3, Gemma 3); one of [heads * head_dim] all heads of a
    token together (OLMo 2). ``norm`` is the rounding convention: ``"llama"`` (Qwen3, Llama: x / rms(x) rounded to
    the input dtype, then times the weight), ``"gemma"`` (weight 1 + w, float32 until the norm's output),
    ``"olmo2"`` (float32 until the norm's output) or ``"fused"`` (float32 from load to store, one rounding).
    Differentiable in q, k and both weights. ``q_scale_*``: q's scale by position, as in :func:`rope_qk`."""
    if torch.jit.is_scripting():
        return torch.ops.posenc.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale,
                                             layout, format, offset, cu_seqlens, pair_axis, q_scale_beta,
                                             q_scale_length, q_scale_shift)
    else:
        return torch.ops.posenc.qk_norm_rope(*_given((q, k, q_weight, k_weight, positions, inv_freq, eps, norm,
                                                      attention_scale, layout, format, offset, cu_seqlens, pair_axis,
                                                      q_scale_beta, q_scale_length, q_scale_shift),
                                                      qk_norm_rope.__defaults__))


def qk_norm_rope_backward(grad_q: Tensor, grad_k: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                          positions: Optional[Tensor], inv_freq: Tensor, eps: float = 1e-06, norm: str = "llama",
                          attention_scale: float = 1.0, layout: str = "neox", format: str = "bshd", offset: int = 0,
                          cu_seqlens: Optional[Tensor] = None, pair_axis: Optional[Tensor] = None,
                          q_scale_beta: float = 0.0, q_scale_length: int = 1,
                          q_scale_shift: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`qk_norm_rope` for q, k, q_weight and k_weight (the norm recomputed from q and k)."""
    if torch.jit.is_scripting():
        return torch.ops.posenc.qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight, positions, inv_freq,
                                                      eps, norm, attention_scale, layout, format, offset, cu_seqlens,
                                                      pair_axis, q_scale_beta, q_scale_length, q_scale_shift)
    else:
        return torch.ops.posenc.qk_norm_rope_backward(*_given((grad_q, grad_k, q, k, q_weight, k_weight, positions,
                                                               inv_freq, eps, norm, attention_scale, layout, format,
                                                               offset, cu_seqlens, pair_axis, q_scale_beta,
                                                               q_scale_length, q_scale_shift),
                                                               qk_norm_rope_backward.__defaults__))


def qk_norm_rope_(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Optional[Tensor],
                  inv_freq: Tensor, eps: float = 1e-06, norm: str = "llama", attention_scale: float = 1.0,
                  layout: str = "neox", format: str = "bshd", offset: int = 0, cu_seqlens: Optional[Tensor] = None,
                  pair_axis: Optional[Tensor] = None, q_scale_beta: float = 0.0, q_scale_length: int = 1,
                  q_scale_shift: int = 0) -> Tuple[Tensor, Tensor]:
    """:func:`qk_norm_rope` in place (q and k keep their strides), for inference paths; returns (q, k)."""
    if torch.jit.is_scripting():
        torch.ops.posenc.qk_norm_rope_(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale,
                                       layout, format, offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length,
                                       q_scale_shift)
    else:
        torch.ops.posenc.qk_norm_rope_(*_given((q, k, q_weight, k_weight, positions, inv_freq, eps, norm,
                                                attention_scale, layout, format, offset, cu_seqlens, pair_axis,
                                                q_scale_beta, q_scale_length, q_scale_shift),
                                                qk_norm_rope_.__defaults__))
    return q, k


def qk_norm_rope_packed(qkv: Tensor, num_q_heads: int, num_kv_heads: int, q_weight: Tensor, k_weight: Tensor,
                        positions: Optional[Tensor], inv_freq: Tensor, eps: float = 1e-06, norm: str = "llama",
                        attention_scale: float = 1.0, layout: str = "neox", format: str = "bshd", offset: int = 0,
                        cu_seqlens: Optional[Tensor] = None, pair_axis: Optional[Tensor] = None,
                        q_scale_beta: float = 0.0, q_scale_length: int = 1, q_scale_shift: int = 0,
                        inplace: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`qk_norm_rope` of a fused QKV projection: ``qkv`` is ``[B, S, (Hq + 2 Hk) * D]`` (``"bshd"``),
    ``[S, B, ...]`` (``"sbhd"``) or ``[T, ...]`` (``"thd"``), its q heads, then k's, then v's. Returns
    ``(q, k, v)`` as ``[..., H, D]`` tensors in that format: q and k normalized and rotated (fresh tensors, or with
    ``inplace`` the views of qkv, rewritten), v a view of qkv, untouched. No copy is made of qkv."""
    if format not in ("bshd", "sbhd", "thd"):
        raise ValueError(f"posenc.qk_norm_rope_packed: format must be \"bshd\", \"sbhd\" or \"thd\" (a packed "
                         f"projection is token-major), got \"{format}\"")
    heads = num_q_heads + 2 * num_kv_heads
    width = qkv.shape[-1]
    if num_q_heads < 1 or num_kv_heads < 1 or width % heads != 0:
        raise ValueError(f"posenc.qk_norm_rope_packed: qkv's last size {width} must be (num_q_heads + 2 * "
                         f"num_kv_heads) * head_dim; got num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    split = qkv.unflatten(-1, (heads, width // heads))
    q, k, v = split.split([num_q_heads, num_kv_heads, num_kv_heads], dim=-2)
    if inplace:
        torch.ops.posenc.qk_norm_rope_(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale,
                                       layout, format, offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length,
                                       q_scale_shift)
        return q, k, v
    q, k = torch.ops.posenc.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale,
                                         layout, format, offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length,
                                         q_scale_shift)
    return q, k, v


def rope_(x: Tensor, positions: Optional[Tensor], inv_freq: Tensor, attention_scale: float = 1.0, layout: str = "neox",
          format: str = "bshd", offset: int = 0, cu_seqlens: Optional[Tensor] = None,
          pair_axis: Optional[Tensor] = None) -> Tensor:
    """:func:`rope` in place (x keeps its strides), for inference paths; returns x.

    Under autograd x must not be a leaf that requires grad; a non-leaf x is rebased onto the rotation."""
    if torch.jit.is_scripting():
        torch.ops.posenc.rope_(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis)
    else:
        torch.ops.posenc.rope_(*_given((x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                                        pair_axis), rope_.__defaults__))
    return x


def rope_qk_cache_(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Optional[Tensor],
                   inv_freq: Tensor, cache_positions: Optional[Tensor] = None, cache_format: str = "bhsd",
                   attention_scale: float = 1.0, layout: str = "neox", format: str = "bshd", offset: int = 0,
                   cu_seqlens: Optional[Tensor] = None, pair_axis: Optional[Tensor] = None, q_scale_beta: float = 0.0,
                   q_scale_length: int = 1, q_scale_shift: int = 0) -> Tensor:
    """One decoding step's attention prologue in one pass: q rotated in place as :func:`rope_qk` rotates it, k
    rotated and v copied into their caches; returns q. k and v are left as they are.

    ``cache_format``: ``"bhsd"`` (Hugging Face's ``StaticCache``, [B, H_kv, S_max, D]), ``"bshd"``
    ([B, S_max, H_kv, D], flash-attention's ``k_cache``) or ``"shd"`` ([S_max, H_kv, D]: one pool of slots that
    every token of the call writes into). Token (b, s) goes to slot ``cache_positions[b, s]`` (or ``[s]`` for every
    batch row; ``[T]`` for ``"thd"``); without ``cache_positions``, to its rotary position (``positions`` plus
    ``offset``; multi-axis positions need ``cache_positions``). Every slot is checked to lie in [0, S_max), and no two tokens may
    share a slot of one cache row. The caches have the dtype of k and v, and their heads and head dims.
    Inference only: a call that autograd would have to record raises an error."""
    if torch.jit.is_scripting():
        torch.ops.posenc.rope_qk_cache_(q, k, v, k_cache, v_cache, positions, inv_freq, cache_positions, cache_format,
                                        attention_scale, layout, format, offset, cu_seqlens, pair_axis, q_scale_beta,
                                        q_scale_length, q_scale_shift)
    else:
        torch.ops.posenc.rope_qk_cache_(*_given((q, k, v, k_cache, v_cache, positions, inv_freq, cache_positions,
                                                 cache_format, attention_scale, layout, format, offset, cu_seqlens,
                                                 pair_axis, q_scale_beta, q_scale_length, q_scale_shift),
                                                 rope_qk_cache_.__defaults__))
    return q


def rope_cos_sin(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "neox", format: str = "bshd") -> Tensor:
    """``x * cos + rotate(x) * sin`` with explicit tables, Hugging Face's ``apply_rotary_pos_emb`` for one tensor.

    ``cos``/``sin``: [S, r] or [B or 1, S, r] ([T, r] for ``"thd"``), r <= head_dim, any floating dtype, as
    Hugging Face builds them (``cat(freqs, freqs)`` for neox, ``repeat_interleave(freqs, 2)`` for gptj); the
    channels past r pass through. Differentiable w.r.t. x.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.rope_cos_sin(x, cos, sin, layout, format)
    else:
        return torch.ops.posenc.rope_cos_sin(*_given((x, cos, sin, layout, format), rope_cos_sin.__defaults__))


def rope_cos_sin_backward(grad: Tensor, cos: Tensor, sin: Tensor, layout: str = "neox", format: str = "bshd") -> Tensor:
    """The gradient of :func:`rope_cos_sin` (its transpose)."""
    if torch.jit.is_scripting():
        return torch.ops.posenc.rope_cos_sin_backward(grad, cos, sin, layout, format)
    else:
        return torch.ops.posenc.rope_cos_sin_backward(*_given((grad, cos, sin, layout, format),
                                                               rope_cos_sin_backward.__defaults__))


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None) -> Tensor:
    """Positions of this rank's tokens under the dual-chunk (zigzag) context-parallel split, int64.

    The sequence is cut into 2 * cp_size chunks; rank r holds chunks r and 2 * cp_size - 1 - r, which
    balances causal attention work. The positions are also the tokens' indices in the full sequence:
    ``rope(x.index_select(seq_dim, p), p)`` equals ``rope(x)`` at those tokens. ``seq_len`` must be a multiple
    of 2 * cp_size and ``0 <= cp_rank < cp_size`` (else ``ValueError``). C++: ``posenc::zigzag_positions``.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.zigzag_positions(seq_len, cp_size, cp_rank, device)
    else:
        return torch.ops.posenc.zigzag_positions(*_given((seq_len, cp_size, cp_rank, device),
                                                          zigzag_positions.__defaults__))


def zigzag_positions_varlen(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`zigzag_positions` per packed sequence: ``(positions, indices, local_cu_seqlens)``.

    ``positions`` are within each sequence (pass them to ``rope(..., format="thd")``), ``indices`` select this
    rank's tokens from the packed [T, H, D] input, ``local_cu_seqlens`` = cu_seqlens // cp_size. Every sequence
    length must be a multiple of 2 * cp_size (as in TransformerEngine's THD context parallelism); else
    ``ValueError``. C++: ``posenc::zigzag_positions_varlen``.
    """
    return torch.ops.posenc.zigzag_positions_varlen(cu_seqlens, cp_size, cp_rank)


__all__ += ["rope", "rope_backward", "rope_qk", "rope_qk_backward", "rope_", "rope_cos_sin", "rope_cos_sin_backward",
            "qk_norm_rope", "qk_norm_rope_backward", "qk_norm_rope_", "qk_norm_rope_packed", "rope_qk_cache_", "zigzag_positions",
            "zigzag_positions_varlen"]


# Multi-axis positions: the grids of images and videos, and Qwen2-VL's M-RoPE positions of text and vision.

def image_positions(height: int, width: int, device: Optional[torch.device] = None) -> Tensor:
    """Positions of an image's patches in row-major order, int64 ``[2, height * width]``: (row, column).

    Pass them to :func:`rope` / :func:`rope_qk` with the ``pair_axis`` of :func:`posenc.frequencies.axial`.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.image_positions(height, width, device)
    else:
        return torch.ops.posenc.image_positions(*_given((height, width, device), image_positions.__defaults__))


def video_positions(frames: int, height: int, width: int, time_interval: float = 1.0,
                    device: Optional[torch.device] = None) -> Tensor:
    """Positions of a video's patches, frame by frame in row-major order, int64 ``[3, frames * height * width]``:
    (time, row, column) with time = trunc(frame * time_interval) (Qwen2.5-VL: tokens_per_second times the
    seconds of a temporal patch)."""
    if torch.jit.is_scripting():
        return torch.ops.posenc.video_positions(frames, height, width, time_interval, device)
    else:
        return torch.ops.posenc.video_positions(*_given((frames, height, width, time_interval, device),
                                                         video_positions.__defaults__))


def mrope_positions(token_types: Tensor, image_grid_thw: Optional[Tensor] = None,
                    video_grid_thw: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                    spatial_merge_size: int = 2, tokens_per_second: Optional[float] = None,
                    second_per_grid_ts: Optional[Tensor] = None,
                    split_video_frames: bool = False) -> Tuple[Tensor, Tensor]:
    """Qwen2-VL's M-RoPE positions of a batch of text and vision tokens (transformers 5.24's ``get_rope_index``).

    ``token_types`` [B, S]: 0 text, 1 image, 2 video (the processor's ``mm_token_type_ids``). Text tokens take
    one running position on all three axes; each run of image (video) tokens is the next grid (t, h, w) of
    ``image_grid_thw`` (``video_grid_thw``) [N, 3], ``spatial_merge_size ** 2`` patches a token: its tokens
    take (start + trunc(frame * interval), start + row, start + column), and the text after it continues at
    start + max(h, w) // spatial_merge_size. A video's interval is ``tokens_per_second * second_per_grid_ts[v]``
    (Qwen2.5-VL; 1 when ``tokens_per_second`` is None: Qwen2-VL); ``split_video_frames`` makes each frame its
    own grid (Qwen3-VL). Tokens outside ``attention_mask`` get 0. Returns ``(positions [3, B, S] int64,
    rope_deltas [B, 1])``: decoding continues at ``cache_length + rope_deltas`` on every axis. A run whose
    length does not match its grid raises an error naming the row and the grid.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.mrope_positions(token_types, image_grid_thw, video_grid_thw, attention_mask,
                                                spatial_merge_size, tokens_per_second, second_per_grid_ts,
                                                split_video_frames)
    else:
        return torch.ops.posenc.mrope_positions(*_given((token_types, image_grid_thw, video_grid_thw, attention_mask,
                                                         spatial_merge_size, tokens_per_second, second_per_grid_ts,
                                                         split_video_frames), mrope_positions.__defaults__))


def grid_positions(grid: List[int], crop_from: Optional[List[int]] = None, scale: Optional[List[float]] = None,
                   interpolation_scale: float = 1.0, device: Optional[torch.device] = None) -> Tensor:
    """Real coordinates of a grid's tokens in row-major order, float32 ``[len(grid), prod(grid)]``: axis a at index
    i is ``(i + start_a) / scale[a] / interpolation_scale``, each division rounded to float32, with start_a =
    ``(crop_from[a] - grid[a]) // 2`` (a centre crop of a larger grid). These are diffusers' coordinates bit for bit:
    its 2-D table is ``grid_positions([h, w], scale=[h / base_size, w / base_size], interpolation_scale=s)``, SD3's
    cropped one ``crop_from=[M, M], scale=[M / base_size] * 2``, CogVideoX's 3-D one
    ``grid_positions([t, h, w], scale=[temporal_scale, spatial_scale, spatial_scale])``.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.grid_positions(grid, crop_from, scale, interpolation_scale, device)
    else:
        return torch.ops.posenc.grid_positions(*_given((grid, crop_from, scale, interpolation_scale, device),
                                                        grid_positions.__defaults__))


def patch_center_positions(height: int, width: int, num_prefix_tokens: int = 0, shift: Optional[float] = None,
                           jitter: Optional[float] = None, rescale: Optional[float] = None,
                           generator: Optional[torch.Generator] = None,
                           device: Optional[torch.device] = None) -> Tensor:
    """DINOv3's patch coordinates, float32 ``[2, num_prefix_tokens + height * width]``: (row, column) of each patch
    centre in [-1, 1], ``(i + 0.5) / n * 2 - 1`` in float32 as transformers computes it, and zeros for the prefix
    tokens (cls, registers), which a rotation by them leaves as they are. Pass them to :func:`rope_qk` with the
    frequencies of :func:`posenc.frequencies.axial` times 2 pi (DINOv3 rotates by 2 pi * coordinate * inv_freq).

    Training augmentations, drawn from ``generator`` (a CPU generator; the default one when None) in
    transformers' order: ``shift`` adds one uniform value in [-shift, shift] per axis, ``jitter`` multiplies each
    axis by exp(uniform in [-log jitter, log jitter]), ``rescale`` both axes by one exp(uniform in
    [-log rescale, log rescale]). With the same seed, the same coordinates as transformers'
    ``augment_patches_center_coordinates`` on the CPU.
    """
    if torch.jit.is_scripting():
        return torch.ops.posenc.patch_center_positions(height, width, num_prefix_tokens, shift, jitter, rescale,
                                                       generator, device)
    else:
        return torch.ops.posenc.patch_center_positions(*_given((height, width, num_prefix_tokens, shift, jitter,
                                                                rescale, generator, device),
                                                                patch_center_positions.__defaults__))


__all__ += ["image_positions", "video_positions", "grid_positions", "patch_center_positions", "mrope_positions"]
