"""Builds libposenc.so with CMake (the one list of sources in CMakeLists.txt) into the package `posenc`.

pip install --no-build-isolation .      (or -e . for an editable install)
Environment: POSENC_BUILD_DIR (default build/), POSENC_BUILD_TESTS=1 to also build the GoogleTest suite
and the C++ example in the same tree, so that the test command compiles every source once.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeLibrary(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def get_ext_filename(self, fullname):
        # The library is no Python module: it is loaded with torch.ops.load_library from the package folder.
        return os.path.join(*fullname.split(".")[:-1], "libposenc.so")

    def build_extension(self, ext):
        import torch

        build_dir = Path(os.environ.get("POSENC_BUILD_DIR", ROOT / "build")).resolve()
        with_tests = os.environ.get("POSENC_BUILD_TESTS", "0") == "1"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DPOSENC_BUILD_TESTS={'ON' if with_tests else 'OFF'}",
            f"-DPOSENC_BUILD_EXAMPLES={'ON' if with_tests else 'OFF'}",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"] if not (build_dir / "CMakeCache.txt").exists() else []
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build_dir), "--parallel", str(os.cpu_count() or 1)])
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "libposenc.so", target)


setup(
    name="posenc",
    version="0.1.0",
    description="Positional-encoding operators for PyTorch and LibTorch",
    packages=["posenc", "posenc.integrations"],
    package_dir={"posenc": "ops"},
    ext_modules=[CMakeLibrary("posenc._library")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["torch>=2.13"],
    python_requires=">=3.10",
    zip_safe=False,
)
