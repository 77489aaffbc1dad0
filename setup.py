"""Builds libposenc.so with CMake (the one list of sources in CMakeLists.txt) into the package `posenc`.

pip install --no-build-isolation .      (or -e . for an editable install; pip wheel for a wheel)
Environment: POSENC_BUILD_DIR (default build/), POSENC_BUILD_TESTS=1 to also build the GoogleTest suite
and the C++ example in the same tree, so that the test command compiles every source once (=0: the library
only; unset: a build folder configured before keeps its choice, a new one builds the library only).

The library is compiled against the torch installed in this environment and works with that torch release
only: the package requires it (torch==MAJOR.MINOR.*) and records it in posenc/_build_info.py, which
`import posenc` checks. The version comes from the file VERSION, which CMake reads too.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = (ROOT / "VERSION").read_text().strip()

try:
    import torch
except ImportError:
    raise SystemExit(
        "posenc is built against the torch of the environment it is installed into, and none is installed here: "
        "install torch first, then build with pip's --no-build-isolation (see docs/install.md)")


def torch_release(version: str) -> str:
    """"2.13.0+cpu" -> "2.13": the release whose C++ ABI libposenc.so is compiled against."""
    return ".".join(version.split("+")[0].split(".")[:2])


def write_build_info(package_dir: Path) -> None:
    (package_dir / "_build_info.py").write_text(
        "# Written by setup.py when libposenc.so was built: the package's version and the torch it was compiled\n"
        "# against, which `import posenc` checks before loading the library.\n"
        f"version = {VERSION!r}\n"
        f"torch_version = {str(torch.__version__)!r}\n")


class CMakeLibrary(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def get_ext_filename(self, fullname):
        # The library is no Python module: it is loaded with torch.ops.load_library from the package folder.
        return os.path.join(*fullname.split(".")[:-1], "libposenc.so")

    def run(self):
        super().run()
        if self.inplace:  # an editable install: the library was copied into the source package folder, ops/
            write_build_info(Path(self.get_finalized_command("build_py").get_package_dir("posenc")))

    def build_extension(self, ext):
        build_dir = Path(os.environ.get("POSENC_BUILD_DIR", ROOT / "build")).resolve()
        with_tests = os.environ.get("POSENC_BUILD_TESTS")
        cache = build_dir / "CMakeCache.txt"
        torch_dir = Path(torch.utils.cmake_prefix_path) / "Torch"
        if cache.exists() and f"Torch_DIR:PATH={torch_dir}\n" not in cache.read_text():
            # Configured for another torch, whose paths CMake keeps in its cache: configure afresh.
            print(f"posenc: {build_dir} was configured for another torch; configuring it for {torch_dir}")
            cache.unlink()
            shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ]
        if with_tests is not None or not cache.exists():  # else the build folder keeps what it was configured with
            on = "ON" if with_tests == "1" else "OFF"
            configure += [f"-DPOSENC_BUILD_TESTS={on}", f"-DPOSENC_BUILD_EXAMPLES={on}"]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"] if not (build_dir / "CMakeCache.txt").exists() else []
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build_dir), "--parallel", str(os.cpu_count() or 1)])
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "libposenc.so", target)
        write_build_info(target.parent)


setup(
    name="posenc",
    version=VERSION,
    description="Positional-encoding operators for PyTorch and LibTorch",
    packages=["posenc", "posenc.integrations"],
    package_dir={"posenc": "ops"},
    ext_modules=[CMakeLibrary("posenc._library")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[f"torch=={torch_release(torch.__version__)}.*"],
    python_requires=">=3.10",
    zip_safe=False,
)
