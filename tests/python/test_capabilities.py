"""Runtime CPU dispatch: every capability this CPU runs computes the same bits as the others (NaNs are NaN), an emulated CPU
without AVX-512 (qemu-x86_64 -cpu max) picks AVX2 and computes those bits too, one without AVX picks the
baseline and computes them too, and no code outside the capability builds uses instructions beyond the x86-64
baseline. The outputs cover every op and every configuration formula (frequencies, slopes, position grids)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import op_registry
import posenc
from helpers import same_bits

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "capability_outputs.py"
CAPABILITIES = ["default", "avx2", "avx512"]
# OpenBLAS (numpy's, loaded with torch) reads OPENBLAS_CORETYPE, which some machines set for their own CPU: an
# emulated CPU without that CPU's instructions needs its own core type, or numpy's import dies of SIGILL.
OPENBLAS_CORE = {"max": "Haswell", "Nehalem": "Nehalem"}
# Not compared: the capability (it differs by design) and the list of ops the run called (checked on its own).
NOT_OUTPUTS = ("capability", "ops_called")


def run_outputs(tmp_path, name, capability=None, emulate=None, timeout=900, stream_bytes=None, avx512_bf16=None):
    out = tmp_path / f"{name}.pt"
    env = dict(os.environ, POSENC_LIBRARY=posenc.library_path)
    for knob in ("POSENC_CPU_CAPABILITY", "POSENC_STREAM_BYTES", "POSENC_AVX512_BF16", "POSENC_ENCODING_CACHE_MB"):
        env.pop(knob, None)
    if avx512_bf16 is not None:
        env["POSENC_AVX512_BF16"] = avx512_bf16
    if capability is not None:
        env["POSENC_CPU_CAPABILITY"] = capability
    if stream_bytes is not None:
        env["POSENC_STREAM_BYTES"] = str(stream_bytes)
    command = [sys.executable, str(RUNNER), str(out)]
    if emulate is not None:
        command = ["qemu-x86_64", "-cpu", emulate] + command
        env["OPENBLAS_CORETYPE"] = OPENBLAS_CORE[emulate]
    subprocess.run(command, env=env, check=True, timeout=timeout)
    return torch.load(out)


def assert_same_bits(actual, expected, what):
    assert actual.keys() == expected.keys()
    # A NaN may be any NaN: compilers order the operands of an operation on two NaNs as they please.
    different = [k for k in expected if k not in NOT_OUTPUTS and not same_bits(actual[k], expected[k], any_nan=True)]
    assert not different, f"{what}: outputs differ in {len(different)} of {len(expected)}: {different[:20]}"


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """Outputs under every capability this CPU supports, keyed by capability."""
    tmp_path = tmp_path_factory.mktemp("capabilities")
    results = {}
    for capability in CAPABILITIES:
        result = run_outputs(tmp_path, capability, capability)
        if result["capability"] == capability:  # else the CPU lacks it and a lower one ran
            results[capability] = result
    return results


def test_the_best_capability_is_chosen_by_default():
    expected = "default"
    for capability, flags in (("avx2", ["avx2", "fma", "f16c"]), ("avx512", ["avx512f", "avx512bw", "avx512vl",
                                                                               "avx512dq"])):
        cpu_flags = Path("/proc/cpuinfo").read_text().split()
        if all(flag in cpu_flags for flag in flags):
            expected = capability
    if "POSENC_CPU_CAPABILITY" not in os.environ:
        assert posenc.cpu_capability() == expected


def test_the_outputs_cover_every_op(native):
    """capability_outputs.py must call every registered op, so that a new op is compared across CPUs too: it runs
    every registry sample (op_registry.SAMPLES), which an op that takes a tensor must have."""
    registered = set(op_registry.ops()) - {"cpu_capability"}  # names the capability, which differs by design
    assert sorted(registered - set(native["default"]["ops_called"])) == []
    assert sorted(set(op_registry.tensor_ops()) - set(op_registry.SAMPLES)) == []


def test_every_capability_computes_the_same_bits(native):
    assert "default" in native
    for capability, result in native.items():
        assert_same_bits(result, native["default"], f"{capability} against default")


def test_outputs_stored_past_the_caches_have_the_same_bits(native, tmp_path):
    """POSENC_STREAM_BYTES=0 stores the output of every out-of-place float32 rotation and row addition with
    non-temporal stores (by default only outputs larger than the last-level cache): every capability's stores (the
    baseline's 16-byte ones, AVX2's and AVX-512's from registers) must write the bits that ordinary stores write."""
    for capability in sorted(native):
        result = run_outputs(tmp_path, f"{capability}-streamed", capability, stream_bytes=0)
        assert result["capability"] == capability
        assert_same_bits(result, native["default"], f"{capability} with every output streamed")


def test_avx512_without_avx512_bf16_computes_the_same_bits(native, tmp_path):
    """A CPU with AVX-512 but without AVX-512 BF16 (Skylake-X to Ice Lake) runs the AVX-512 kernels' other bf16 paths
    (the integer rounding, rows through a float chunk, no bf16 lines streamed from registers):
    POSENC_AVX512_BF16=0 runs them on a CPU that has the instructions, with outputs stored as usual and streamed. On
    a CPU without AVX-512 the switch must change nothing of what its best capability computes."""
    best = max(native, key=CAPABILITIES.index)
    for stream_bytes in (None, 0):
        result = run_outputs(tmp_path, f"{best}-no-bf16-{stream_bytes}", best, stream_bytes=stream_bytes,
                             avx512_bf16="0")
        assert result["capability"] == best
        assert_same_bits(result, native["default"], f"{best} without AVX-512 BF16, POSENC_STREAM_BYTES={stream_bytes}")


@pytest.mark.parametrize("switch, value, message", [
    ("POSENC_CPU_CAPABILITY", "sse9", 'POSENC_CPU_CAPABILITY must be "default", "avx2" or "avx512", got "sse9"'),
    ("POSENC_AVX512_BF16", "yes", 'POSENC_AVX512_BF16 must be "0" or "1", got "yes"'),
    ("POSENC_STREAM_BYTES", "lots", 'POSENC_STREAM_BYTES must be a byte count >= 0, got "lots"'),
    ("POSENC_ENCODING_CACHE_MB", "-1", 'POSENC_ENCODING_CACHE_MB must be a count of MiB >= 0, got "-1"'),
])
def test_an_invalid_switch_is_an_error(switch, value, message):
    env = dict(os.environ, POSENC_LIBRARY=posenc.library_path, **{switch: value})
    code = "import torch, posenc.functional as PF; PF.rope(torch.ones(1, 2, 1, 4), None, torch.ones(2))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert message in result.stderr


qemu = pytest.mark.skipif(shutil.which("qemu-x86_64") is None or os.uname().machine != "x86_64",
                          reason="qemu-x86_64 (Debian's qemu-user) is not installed")


@qemu
def test_an_emulated_cpu_without_avx512_runs_avx2_with_the_same_bits(native, tmp_path):
    result = run_outputs(tmp_path, "qemu-max", emulate="max")
    assert result["capability"] == "avx2"
    assert_same_bits(result, native["default"], "qemu -cpu max (AVX2, no AVX-512)")


@qemu
def test_an_emulated_cpu_without_avx_runs_the_baseline_with_the_same_bits(native, tmp_path):
    result = run_outputs(tmp_path, "qemu-nehalem", emulate="Nehalem")
    assert result["capability"] == "default"
    assert_same_bits(result, native["default"], "qemu -cpu Nehalem (no AVX)")


def disassembled_functions():
    """The library's functions as (name, body) from objdump; skips where there is no x86-64 objdump."""
    if os.uname().machine != "x86_64" or shutil.which("objdump") is None:
        pytest.skip("needs objdump on x86-64")
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", posenc.library_path], check=True,
                             capture_output=True, text=True).stdout
    for function in re.split(r"\n(?=[0-9a-f]+ <)", listing):
        header, _, body = function.partition("\n")
        yield header.partition("<")[2], body


def test_only_the_capability_builds_use_wide_instructions():
    """Functions outside posenc::cpu::AVX2 / AVX512 must be x86-64 baseline code: the library is loaded, and
    its registrations run, on every CPU, and the linker keeps one copy of each inline function for all callers."""
    offenders, wide_functions = [], 0
    for name, body in disassembled_functions():
        # ymm/zmm registers, AVX-512 masks, or any VEX/EVEX-encoded instruction (their mnemonics start with v)
        wide = re.search(r"%[yz]mm|\{%k[0-7]\}|^\s*[0-9a-f]+:\s+v[a-z0-9]+\s", body, re.MULTILINE)
        if not wide:
            continue
        wide_functions += 1
        if "::AVX512::" in name or ("::AVX2::" in name and "zmm" not in body):
            continue
        offenders.append(name[:200])
    assert wide_functions > 0, "no capability build found in the library"
    assert not offenders, f"baseline functions with wide instructions: {offenders[:10]}"


def test_the_capability_builds_convert_fp16_with_f16c():
    """The AVX2 and AVX-512 builds widen and narrow fp16 with F16C (vcvtph2ps / vcvtps2ph) rather than the integer
    form: their instruction sets come from a target pragma, which defines no __F16C__ for the preprocessor, and
    once no such instruction was compiled at all."""
    found = {"AVX2": set(), "AVX512": set()}
    for name, body in disassembled_functions():
        for capability in found:
            if f"::{capability}::" in name:
                found[capability] |= set(re.findall(r"\bvcvt(?:ph2ps|ps2ph)\b", body))
    assert found == {"AVX2": {"vcvtph2ps", "vcvtps2ph"}, "AVX512": {"vcvtph2ps", "vcvtps2ph"}}, found
