"""posenc: positional-encoding operators for PyTorch (torch.ops.posenc.*)."""
import os
from pathlib import Path

import torch


def _library_path() -> str:
    # POSENC_LIBRARY points at a build tree's libposenc.so; by default, the copy installed in the package.
    return os.environ.get("POSENC_LIBRARY") or str(Path(__file__).resolve().parent / "libposenc.so")


library_path = _library_path()
torch.ops.load_library(library_path)

from . import frequencies, functional, nn  # noqa: E402


def cpu_capability() -> str:
    """The CPU capability posenc's kernels run with: ``"default"`` (x86-64 baseline), ``"avx2"`` (AVX2, FMA,
    F16C) or ``"avx512"`` (AVX-512 F/BW/VL/DQ). The best the CPU supports is chosen when the library loads;
    the environment variable ``POSENC_CPU_CAPABILITY`` (set before the first op call) asks for a lower one.
    Every capability computes the same bits."""
    return torch.ops.posenc.cpu_capability()


__all__ = ["frequencies", "functional", "nn", "library_path", "cpu_capability"]
