"""posenc: positional-encoding operators for PyTorch (torch.ops.posenc.*)."""
import importlib
import importlib.util
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Set

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

from . import cuda, frequencies, functional, nn  # noqa: E402


class _AfterImport:
    """A finder on ``sys.meta_path`` that finds no module itself: it lets the other finders find a module that
    callbacks wait for, and runs them once the module has been executed. posenc registers its DTensor sharding
    rules and its ONNX translations this way, when a program imports those parts of torch, without importing them
    itself (together they cost seconds)."""

    def __init__(self) -> None:
        self.waiting: Dict[str, List[Callable[[], None]]] = {}
        self.finding: Set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.waiting or name in self.finding:
            return None
        self.finding.add(name)
        try:
            spec = importlib.util.find_spec(name)  # by the other finders: this one passes while it asks
        finally:
            self.finding.discard(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRun(spec.loader, name, self.waiting.pop(name))
        return spec


class _ThenRun:
    """A module's loader that runs callbacks after executing the module; the module keeps its own loader."""

    def __init__(self, loader: Any, name: str, callbacks: List[Callable[[], None]]) -> None:
        self.loader, self.name, self.callbacks = loader, name, callbacks

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        try:
            self.loader.exec_module(module)
        except BaseException:
            _after_import.waiting.setdefault(self.name, []).extend(self.callbacks)  # for the next attempt
            raise
        for callback in self.callbacks:
            _run_registration(self.name, callback)


def _run_registration(module: str, callback: Callable[[], None]) -> None:
    # A failed registration must not fail the program's import of torch's module: the posenc calls it serves fail
    # later, with this warning to explain them.
    try:
        callback()
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"posenc: registering with {module} failed: {type(error).__name__}: {error}", RuntimeWarning,
                      stacklevel=2)


_after_import = _AfterImport()
sys.meta_path.insert(0, _after_import)


def _when_imported(module: str, callback: Callable[[], None]) -> None:
    """Runs callback now if module has been imported, else right after its import."""
    if module in sys.modules:
        _run_registration(module, callback)
    else:
        _after_import.waiting.setdefault(module, []).append(callback)


def _register_sharding_rules() -> None:
    importlib.import_module("posenc.distributed")


def _register_onnx_translations() -> None:
    importlib.import_module("posenc.onnx")._register_with_torch_onnx()


# DTensor: torch.distributed.tensor is imported by every program that makes DTensors (and by torch.compile).
_when_imported("torch.distributed.tensor", _register_sharding_rules)
# torch.onnx builds each export's table of translations from the ones its exporter loads with this module.
_when_imported("torch.onnx._internal.exporter._torchlib.ops", _register_onnx_translations)


def cpu_capability() -> str:
    """The CPU capability posenc's kernels run with: ``"default"`` (x86-64 baseline), ``"avx2"`` (AVX2, FMA,
    F16C) or ``"avx512"`` (AVX-512 F/BW/VL/DQ). The best the CPU supports is chosen when the library loads;
    the environment variable ``POSENC_CPU_CAPABILITY`` (set before the first op call) asks for a lower one.
    Every capability computes the same bits."""
    return torch.ops.posenc.cpu_capability()


__all__ = ["frequencies", "functional", "nn", "library_path", "built_torch_version", "cpu_capability"]
