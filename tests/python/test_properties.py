"""Property-based tests (hypothesis) of every op in torch.ops.posenc.

Each test draws random valid inputs: shapes with sizes 0 and 1 among the others, every floating dtype, random
memory layouts (permuted, sliced out of a NaN-filled buffer, expanded along broadcast dimensions), the op's
layouts and formats, and positions and offsets anywhere in the supported domain, next to its edges included.
It compares the output with a float64 reference written from the formulas (no posenc call), and checks that the
Meta kernel predicts the output's shape, dtype and strides.

Each op's property lives in its family's test file (test_sinusoidal.py, test_learned.py, test_rope.py, ...),
registered with op_registry.property_check next to the family's value tests, and its bad-input cases there too
(op_registry.bad_inputs); the strategies and checks several families share are in strategies.py, their
mutations in mutations.py. This file runs them all (PROPERTIES, in op_registry's order), with one cross-op
property of its own ("in-place overlap"), and fails while an op of op_registry.tensor_ops() has no property or
no bad-input cases.

Both the properties (test_property) and random bad inputs (test_bad_inputs_raise_an_error_naming_the_op,
bad_input_fuzzer.py) run in subprocesses, so that a crash fails the test of the case that crashed instead of
ending the session; POSENC_PROPERTIES_IN_PROCESS=1 runs the properties in the pytest process instead.

Profiles (conftest.py): "ci" (default; derandomized, 25 examples per property, 12 per bad-input case) and
"long" (random, 1000 and 500): POSENC_HYPOTHESIS_PROFILE=long python -m pytest tests/python/test_properties.py
"""
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st


def _subprocess_arguments():
    """The subprocess side (main() below) reads its example count from the command line. @given reads the
    settings profile when it decorates, so the profile must be loaded before the decorators below run, and those
    of the family test files (which bad_input_fuzzer's import below imports, through op_registry)."""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=25)
    parser.add_argument("--derandomize", action="store_true")
    parser.add_argument("--after", default=None)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401  (registers the profiles)
    settings.register_profile("subprocess", settings.get_profile("ci"), max_examples=args.examples,
                              derandomize=args.derandomize)
    settings.load_profile("subprocess")
    return args


SUBPROCESS_ARGUMENTS = _subprocess_arguments() if __name__ == "__main__" else None

import bad_input_fuzzer  # noqa: E402
import op_registry  # noqa: E402
from strategies import OPS, covered_offsets, generator, normal, sizes  # noqa: E402


# ---------------------------------------------------------------- the cross-op property

def random_view(draw, gen, dims, last_min=1, max_size=3):
    """An as_strided view of a small buffer with random sizes and strides (0 and overlapping ones included),
    and whether two of its elements share memory (by enumeration)."""
    shape = sizes(draw, dims - 1, 1, max_size) + [draw(st.integers(last_min, max_size + 1))]
    strides = [draw(st.integers(0, 12)) for _ in range(dims)]
    offset = draw(st.integers(0, 3))
    extent = offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    buffer = normal(gen, [extent], torch.float32)
    view = buffer.as_strided(shape, strides, offset)
    offsets = covered_offsets(view)
    return buffer, view, offsets.unique().numel() != offsets.numel()


@given(st.data())
def check_inplace_ops_refuse_exactly_the_views_whose_elements_overlap(data):
    draw = data.draw
    gen = generator(draw)
    op = draw(st.sampled_from(["rope_", "add_alibi_"]))
    buffer, view, overlaps = random_view(draw, gen, 4, last_min=2 if op == "rope_" else 1)
    before = buffer.clone()
    note(f"{op} on shape {list(view.shape)} strides {view.stride()}, overlapping: {overlaps}")
    if op == "rope_":
        inv_freq = torch.tensor([1.0, 0.25], dtype=torch.float64)[:view.shape[-1] // 2]
        expected = OPS.rope(view, None, inv_freq, 1.0, "neox", "bshd", 3, None)
        run, arg = (lambda: OPS.rope_(view, None, inv_freq, 1.0, "neox", "bshd", 3, None)), "x"
    else:
        slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float32)
        expected = OPS.add_alibi(view, slopes, "symmetric", 0)
        run, arg = (lambda: OPS.add_alibi_(view, slopes, "symmetric", 0)), "scores"
    if overlaps:
        with pytest.raises(RuntimeError) as error:
            run()
        message = str(error.value)
        assert f"posenc.{op}:" in message and re.search(rf"\b{arg}\b", message), message
        assert torch.equal(buffer, before), "memory changed though the op refused"
    else:
        run()
        torch.testing.assert_close(view, expected, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- every op is covered; bad input fuzzing

# Every op's property, registered by its family's test file (op_registry.PROPERTIES): (function, the op it is
# given, if it serves several); then the cross-op one.
PROPERTIES = dict(op_registry.PROPERTIES)
PROPERTIES["in-place overlap"] = (check_inplace_ops_refuse_exactly_the_views_whose_elements_overlap,)


def run_property(name):
    function, *op = PROPERTIES[name]
    function(*op)


def test_every_op_has_a_property_and_bad_input_cases():
    from op_registry import tensor_ops
    assert sorted(set(PROPERTIES) - {"in-place overlap"}) == tensor_ops()
    assert sorted({op for op, *_ in bad_input_fuzzer.CASES.values()}) == tensor_ops()


# A case runner that prints nothing for this long is hung in its case (a case of the "long" profile takes seconds,
# the whole run of its bad inputs over 20 minutes on a 2-core machine).
CASE_STALL_SECONDS = 600


def _lines_into(stream, lines):
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_in_subprocesses(command):
    """Runs a case runner (this file's __main__, or bad_input_fuzzer.py) that prints a JSON line when each case
    starts and ends. When the process dies (segfault, abort), or prints nothing for CASE_STALL_SECONDS (then it is
    killed), the case it was running is recorded as failed and a new process resumes after it. Returns
    {case: record}."""
    results, after = {}, []
    while True:
        with tempfile.TemporaryFile("w+") as stderr:
            process = subprocess.Popen(command + after, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                       env=dict(os.environ))
            lines = queue.Queue()
            threading.Thread(target=_lines_into, args=(process.stdout, lines), daemon=True).start()
            running, hung = None, False
            while (line := _next_line(lines, process)) is not None:
                if line == "":
                    hung = True
                elif line.startswith("{"):
                    record = json.loads(line)
                    if record["status"] == "start":
                        running = record["case"]
                    else:
                        results[record["case"]] = record
                        running = None
            returncode = process.wait()
            stderr.seek(0)
            tail = stderr.read()[-4000:]
        if returncode == 0 or running is None:
            if returncode != 0:
                results["(runner)"] = {"status": "fail", "detail": f"exit {returncode}: {tail}"}
            return results
        cause = (f"the process printed nothing for {CASE_STALL_SECONDS} s on this case (killed)" if hung
                 else f"the process died (exit {returncode}) on this case")
        results[running] = {"status": "fail", "detail": f"{cause}; stderr (tail):\n{tail}"}
        after = ["--after", running]


def _next_line(lines, process):
    """The runner's next line of output; "" where it printed nothing for CASE_STALL_SECONDS (it is killed, and its
    remaining lines follow); None at the end of its output."""
    try:
        return lines.get(timeout=CASE_STALL_SECONDS)
    except queue.Empty:
        process.kill()
        return ""


def test_a_hung_or_dying_case_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
    """The runner of cases a, b, c, d: b prints nothing for longer than the stall limit, c kills its process. Each is
    recorded as failed, and a new process resumes after it."""
    runner = tmp_path / "runner.py"
    runner.write_text(
        "import json, os, sys, time\n"
        "cases = ['a', 'b', 'c', 'd']\n"
        "after = sys.argv[sys.argv.index('--after') + 1] if '--after' in sys.argv else None\n"
        "for case in cases[cases.index(after) + 1 if after else 0:]:\n"
        "    print(json.dumps({'case': case, 'status': 'start'}), flush=True)\n"
        "    if case == 'b': time.sleep(60)\n"
        "    if case == 'c': os.abort()\n"
        "    print(json.dumps({'case': case, 'status': 'ok', 'detail': ''}), flush=True)\n")
    monkeypatch.setattr(sys.modules[__name__], "CASE_STALL_SECONDS", 1)
    results = run_in_subprocesses([sys.executable, str(runner)])
    assert sorted(results) == ["a", "b", "c", "d"]
    assert results["a"]["status"] == results["d"]["status"] == "ok"
    assert results["b"]["status"] == "fail" and "printed nothing for 1 s" in results["b"]["detail"]
    assert results["c"]["status"] == "fail" and "died" in results["c"]["detail"]


def profile_arguments(examples_divisor=1):
    profile = settings.default
    return ["--examples", str(max(5, profile.max_examples // examples_divisor))] + \
        (["--derandomize"] if profile.derandomize else [])


def check_record(results, case):
    assert "(runner)" not in results, results.get("(runner)", {}).get("detail")
    assert case in results, f"{case} did not run"
    assert results[case]["status"] == "ok", results[case]["detail"]


IN_PROCESS = os.environ.get("POSENC_PROPERTIES_IN_PROCESS") == "1"


@pytest.fixture(scope="module")
def property_results():
    if IN_PROCESS:
        return None
    return run_in_subprocesses([sys.executable, __file__] + profile_arguments())


@pytest.mark.parametrize("name", list(PROPERTIES))
def test_property(name, property_results):
    """The property of one op over random valid inputs. It runs in a subprocess (a crash fails this test, not
    the session); POSENC_PROPERTIES_IN_PROCESS=1 runs it here instead, for a debugger or a profiler."""
    if IN_PROCESS:
        run_property(name)
    else:
        check_record(property_results, name)


@pytest.fixture(scope="module")
def fuzzer_results():
    return run_in_subprocesses([sys.executable, str(Path(bad_input_fuzzer.__file__))] + profile_arguments(2))


@pytest.mark.parametrize("case", sorted(bad_input_fuzzer.CASES))
def test_bad_inputs_raise_an_error_naming_the_op(case, fuzzer_results):
    check_record(fuzzer_results, case)


def main():
    """The subprocess side of test_property: runs every property with the given number of examples and prints
    a JSON line when each starts and ends."""
    import faulthandler
    import traceback

    args = SUBPROCESS_ARGUMENTS
    faulthandler.enable()
    names = list(PROPERTIES)
    for name in names[names.index(args.after) + 1 if args.after else 0:]:
        if args.only not in name:
            continue
        print(json.dumps({"case": name, "status": "start"}), flush=True)
        try:
            run_property(name)
            record = {"case": name, "status": "ok", "detail": ""}
        except (Exception, pytest.fail.Exception) as error:  # noqa: BLE001  (pytest.raises fails with the latter)
            notes = "\n".join(getattr(error, "__notes__", []))
            record = {"case": name, "status": "fail",
                      "detail": "".join(traceback.format_exception_only(type(error), error)) + notes}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
