"""Scriptable modules built on the posenc ops."""
import math
from typing import Optional

import torch
from torch import Tensor

from . import frequencies

__all__ = ["SinusoidalPositionalEncoding", "SinusoidalEmbedding"]


class _ExactFrequencies(torch.nn.Module):
    """Keeps the float64 ``inv_freq`` buffer exact: ``.to(dtype)``, ``.half()`` and ``.bfloat16()`` would
    round it, so after any conversion it is recomputed from the configuration (on the buffer's device)."""

    def _make_inv_freq(self) -> Tensor:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._make_inv_freq().to(self.inv_freq.device)
        return self


class SinusoidalPositionalEncoding(_ExactFrequencies):
    """``x * x_scale + PE`` for x ``[..., S, dim]`` (SPEC 4.1); odd ``dim`` gets a zero last column.

    ``shift=1`` with ``layout="half"`` is the fairseq / Whisper convention; the defaults are the paper's.
    """

    def __init__(self, dim: int, base: float = 10000.0, shift: int = 0, layout: str = "interleaved",
                 x_scale: float = 1.0):
        super().__init__()
        self.dim, self.base, self.shift = dim, base, shift
        self.layout = layout
        self.x_scale = x_scale
        self.register_buffer("inv_freq", self._make_inv_freq(), persistent=False)

    def _make_inv_freq(self) -> Tensor:
        return frequencies.sinusoidal(self.dim, self.base, self.shift)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, offset: int = 0) -> Tensor:
        return torch.ops.posenc.add_sinusoidal(x, positions, self.inv_freq, self.x_scale, self.layout, offset)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, shift={self.shift}, layout={self.layout!r}, x_scale={self.x_scale}"


class SinusoidalEmbedding(_ExactFrequencies):
    """Token embedding plus sinusoidal encoding in one op: ``weight[tokens] * token_scale + PE``.

    ``token_scale`` defaults to ``sqrt(dim)`` (the paper's scaling of embeddings). The weight is
    initialised N(0, dim ** -0.5) with a zero ``padding_idx`` row, as in fairseq.
    """

    def __init__(self, num_embeddings: int, dim: int, padding_idx: Optional[int] = None,
                 token_scale: Optional[float] = None, base: float = 10000.0, shift: int = 0,
                 layout: str = "interleaved"):
        super().__init__()
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.dim, self.base, self.shift = dim, base, shift
        self.padding_idx = padding_idx
        self.token_scale = math.sqrt(dim) if token_scale is None else token_scale
        self.layout = layout
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, dim))
        self.register_buffer("inv_freq", self._make_inv_freq(), persistent=False)
        self.reset_parameters()

    def _make_inv_freq(self) -> Tensor:
        return frequencies.sinusoidal(self.dim, self.base, self.shift)

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.weight, std=self.dim ** -0.5)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None, offset: int = 0) -> Tensor:
        return torch.ops.posenc.embed_sinusoidal(tokens, self.weight, positions, self.inv_freq, self.token_scale,
                                                 self.padding_idx, self.layout, offset)
