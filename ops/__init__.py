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

__all__ = ["frequencies", "functional", "nn", "library_path"]
