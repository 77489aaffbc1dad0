import ctypes
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posenc

VERSION_FILE = Path(__file__).resolve().parents[2] / "VERSION"


def test_python_and_cpp_versions_come_from_the_version_file():
    expected = VERSION_FILE.read_text().strip()
    library = ctypes.CDLL(posenc.library_path)
    library.posenc_version.restype = ctypes.c_char_p
    assert posenc.__version__ == expected
    assert library.posenc_version().decode() == expected
    assert importlib.metadata.version("posenc") == expected


def test_package_requires_the_torch_release_it_was_built_against():
    major, minor = posenc.built_torch_version.split(".")[:2]
    assert importlib.metadata.requires("posenc") == [f"torch=={major}.{minor}.*"]
    assert torch.__version__.startswith(f"{major}.{minor}.")


@pytest.mark.parametrize("built, running", [
    ("2.13.0+cpu", "2.13.0+cpu"), ("2.13.0+cpu", "2.13.1"), ("2.13.0", "2.13.0+cu130"), ("2.14.0a0+git1234", "2.14.1")])
def test_torch_check_accepts_the_same_release(built, running):
    posenc._check_torch(built, running)


@pytest.mark.parametrize("built, running", [("2.13.0+cpu", "2.14.1+cu130"), ("2.14.1", "2.13.0"), ("2.13.0", "3.13.0")])
def test_torch_check_refuses_another_release(built, running):
    with pytest.raises(ImportError, match=re.escape(f"built for torch {built}, but torch {running} is installed")) as error:
        posenc._check_torch(built, running)
    assert "--no-build-isolation" in str(error.value) and "torch==" in str(error.value)


def test_import_with_another_torch_fails_before_loading_the_library(tmp_path):
    # A copy of the installed package that says it was built for another torch release: importing it must
    # raise the clear error, not load libposenc.so.
    package = tmp_path / "posenc"
    shutil.copytree(Path(posenc.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_build_info.py").write_text(f"version = {posenc.__version__!r}\ntorch_version = '2.12.0'\n")
    env = {k: v for k, v in os.environ.items() if k != "POSENC_LIBRARY"}
    env["PYTHONPATH"] = str(tmp_path)
    script = ("try:\n    import posenc\nexcept ImportError as error:\n    print(error)\n"
              "print('libposenc loaded:', 'libposenc.so' in open('/proc/self/maps').read())")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert f"posenc {posenc.__version__} was built for torch 2.12.0, but torch {torch.__version__} is installed" \
        in result.stdout
    assert "libposenc loaded: False" in result.stdout
