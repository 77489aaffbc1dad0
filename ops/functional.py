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
