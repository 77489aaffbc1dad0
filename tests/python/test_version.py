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


def test_package_needs_neither_the_study_nor_its_dependencies():
    # The study (scripts/study.py) is a program beside the library, not part of it: the package must import
    # without matplotlib and tqdm, which only the study uses. torch.hub imports tqdm itself when it is installed
    # (with a fallback when it is not), so tqdm is made unimportable here and an import of it by posenc fails;
    # matplotlib, which torch does not import, must stay out of sys.modules.
    script = """
import importlib.util, sys
sys.modules["tqdm"] = None
import posenc, posenc.functional, posenc.nn, posenc.frequencies, posenc.onnx, posenc.integrations.transformers
print(sorted(m for m in sys.modules if m.split(".")[0] in ("matplotlib", "tqdm") and sys.modules[m]))
print(importlib.util.find_spec("posenc.study"))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr  # "import of tqdm halted": posenc imports tqdm
    loaded, study = result.stdout.splitlines()[-2:]
    assert loaded == "[]", f"posenc imported {loaded}"
    assert study == "None", f"posenc.study still exists: {study}"
