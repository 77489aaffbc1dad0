"""Frequencies (inv_freq, float64) of every family; twins of C++ posenc::frequencies.

They are formulas of the configuration, computed in float64 on the CPU; modules keep them out of reach of
``module.to(torch.bfloat16)`` and ``.half()``.
"""
import math

import torch
from torch import Tensor

__all__ = ["sinusoidal"]


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
