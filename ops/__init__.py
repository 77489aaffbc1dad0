"""posenc: positional-encoding operators for PyTorch (torch.ops.posenc.*)."""
import os
from pathlib import Path

import torch

from ._build_info import torch_version as built_torch_version
from ._build_info import version as __version__


def _library_path() -> str:
    # POSENC_LIBRARY points at a build tree's libposenc.so; by default, the copy installed in the package.
    return os.environ.get("POSENC_LIBRARY") or str(Path(__file__).resolve().parent / "libposenc.so")


def _release(version: str) -> str:
    """"2.13.0+cpu" -> "2.13"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _check_torch(built: str, running: str) -> None:
    # libposenc.so is compiled C++ against one torch release, whose C++ ABI changes between releases: loaded
    # into another, it fails on undefined symbols or misbehaves. Patch releases keep the ABI.
    if _release(built) != _release(running):
        raise ImportError(
            f"posenc {__version__} was built for torch {built}, but torch {running} is installed; its C++ library "
            f"works with torch {_release(built)}.x only. Install torch=={_release(built)}.* or rebuild posenc "
            "against this torch: `pip install --no-build-isolation .` in posenc's source folder "
            "(see docs/install.md).")


library_path = _library_path()
if "POSENC_LIBRARY" not in os.environ:  # a build tree's library is not described by this package's build info
    _check_torch(built_torch_version, torch.__version__)
torch.ops.load_library(library_path)

from . import frequencies, functional, nn  # noqa: E402


def cpu_capability() -> str:
    """The CPU capability posenc's kernels run with: ``"default"`` (x86-64 baseline), ``"avx2"`` (AVX2, FMA,
    F16C) or ``"avx512"`` (AVX-512 F/BW/VL/DQ). The best the CPU supports is chosen when the library loads;
    the environment variable ``POSENC_CPU_CAPABILITY`` (set before the first op call) asks for a lower one.
    Every capability computes the same bits."""
    return torch.ops.posenc.cpu_capability()


__all__ = ["frequencies", "functional", "nn", "library_path", "built_torch_version", "cpu_capability"]
