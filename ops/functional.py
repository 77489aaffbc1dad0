"""Typed wrappers of torch.ops.posenc.*: same arguments, same order, same defaults as the schemas."""
from typing import Optional

import torch
from torch import Tensor

__all__ = ["sinusoidal", "add_sinusoidal", "embed_sinusoidal", "embedding_backward"]


def sinusoidal(positions: Tensor, inv_freq: Tensor, layout: str = "interleaved",
               dtype: Optional[torch.dtype] = None, offset: int = 0) -> Tensor:
    """The encoding of ``positions + offset``: shape ``positions.shape + [2F]``, F = len(inv_freq).

    ``layout="interleaved"`` gives [sin t0, cos t0, sin t1, cos t1, ...]; ``"half"`` gives
    [sin t0 .. sin t(F-1), cos t0 .. cos t(F-1)]; ``"half_cos_first"`` gives [cos .. || sin ..] (diffusers'
    ``flip_sin_to_cos``). Positions may be integer or floating (diffusion
    timesteps); ``dtype`` defaults to that of floating positions, else float32. Not differentiable.
    """
    return torch.ops.posenc.sinusoidal(positions, inv_freq, layout, dtype, offset)


def add_sinusoidal(x: Tensor, positions: Optional[Tensor], inv_freq: Tensor, x_scale: float = 1.0,
                   layout: str = "interleaved", offset: int = 0) -> Tensor:
    """``x * x_scale + PE`` for x ``[..., S, D]``, D = 2F or 2F + 1 (the last channel then gets no encoding).

    ``positions``: None (``offset + arange(S)``), ``[S]`` or x's leading shape; ``offset`` is added to
    explicit positions too. Differentiable w.r.t. x.
    """
    return torch.ops.posenc.add_sinusoidal(x, positions, inv_freq, x_scale, layout, offset)


def embed_sinusoidal(tokens: Tensor, token_weight: Tensor, positions: Optional[Tensor], inv_freq: Tensor,
                     token_scale: float = 1.0, padding_idx: Optional[int] = None, layout: str = "interleaved",
                     offset: int = 0) -> Tensor:
    """``token_weight[tokens] * token_scale + PE`` in one pass (token ids in ``[0, vocab)``).

    Differentiable w.r.t. token_weight; the ``padding_idx`` row receives no gradient, as with
    ``torch.nn.functional.embedding``.
    """
    return torch.ops.posenc.embed_sinusoidal(tokens, token_weight, positions, inv_freq, token_scale, padding_idx,
                                             layout, offset)


def embedding_backward(grad: Tensor, indices: Tensor, num_rows: int, scale: float = 1.0,
                       padding_idx: Optional[int] = None) -> Tensor:
    """Sum of the rows of ``grad [..., D]`` into a ``[num_rows, D]`` table at ``indices`` (grad's leading
    shape or a suffix of it), times ``scale``. Deterministic: the same bits for any thread count."""
    return torch.ops.posenc.embedding_backward(grad, indices, num_rows, scale, padding_idx)


# Learned absolute (SPEC 4.2). A position p reads row p + offset of its table; every row must lie in
# [0, L_max), L_max = the table's row count, or the op raises an error naming the position and L_max.

def learned(weight: Tensor, positions: Tensor, offset: int = 0, padding_idx: Optional[int] = None) -> Tensor:
    """``weight[positions + offset]``: shape ``positions.shape + [D]`` for integer positions.

    Differentiable w.r.t. weight (deterministically); the ``padding_idx`` row receives no gradient.
    """
    return torch.ops.posenc.learned(weight, positions, offset, padding_idx)


def add_learned(x: Tensor, weight: Tensor, positions: Optional[Tensor] = None, offset: int = 0,
                padding_idx: Optional[int] = None) -> Tensor:
    """``x + weight[positions + offset]`` for x ``[..., S, D]`` and a ``[L_max, D]`` table of x's dtype.

    ``positions``: None (``arange(S)``, so ``offset`` is the cache length), ``[S]`` or x's leading shape.
    Differentiable w.r.t. x and weight (not its ``padding_idx`` row).
    """
    return torch.ops.posenc.add_learned(x, weight, positions, offset, padding_idx)


def embed_learned(tokens: Tensor, token_weight: Tensor, pos_weight: Tensor, positions: Optional[Tensor] = None,
                  token_scale: float = 1.0, padding_idx: Optional[int] = None, offset: int = 0,
                  pos_padding_idx: Optional[int] = None) -> Tensor:
    """``token_weight[tokens] * token_scale + pos_weight[positions + offset]`` in one pass (GPT-2's wte + wpe).

    Differentiable w.r.t. both tables; ``padding_idx`` (a token row) and ``pos_padding_idx`` (a position
    row) receive no gradient. ``token_scale`` (e.g. ``sqrt(d_model)``) scales the token part only.
    """
    return torch.ops.posenc.embed_learned(tokens, token_weight, pos_weight, positions, token_scale, padding_idx,
                                          offset, pos_padding_idx)


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
    return torch.ops.posenc.positions_from_mask(attention_mask, pad_position)


__all__ += ["learned", "add_learned", "embed_learned", "make_positions", "positions_from_mask"]
