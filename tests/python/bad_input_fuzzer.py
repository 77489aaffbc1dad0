"""Random bad inputs for every posenc op, run in a subprocess by test_properties.py so that a crash (segfault,
abort) fails the test that started it instead of ending pytest.

Two kinds of case, each run with hypothesis:
- "<op>/<mutation>": a small valid call with one argument made wrong (dtype, rank, size, device, string,
  index or position out of range, overlapping memory, ...). It must raise a RuntimeError that names
  posenc.<op>.
- "<op>/anything": every argument drawn at random from its schema type (any dtype, rank, size, NaN/Inf, int64
  extremes, unknown strings). The call may succeed; if it fails, it must be a RuntimeError naming posenc.<op>.
Each op's small valid call (its base) and its mutations live in its family's test file (test_sinusoidal.py,
test_learned.py, ...), registered with op_registry.bad_inputs (op_registry.BAD_INPUTS); the mutations several
families share are in mutations.py. This file holds the runner: the cases, "anything"'s arguments, the check.

Usage: python bad_input_fuzzer.py --examples N [--derandomize] [--only SUBSTRING] [--after CASE]
Prints one JSON line per case when it starts and when it ends: {"case", "status": start|ok|fail, "detail"}.
--after resumes after a case (the one that crashed the previous run).
"""
import argparse
import faulthandler
import json
import re
import sys
import traceback

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import posenc  # noqa: F401  (loads libposenc.so, or POSENC_LIBRARY)
from op_registry import BAD_INPUTS
from strategies import INT64_MAX, INT64_MIN, LIMIT

OPS = torch.ops.posenc


# ---------------------------------------------------------------- "anything": arguments drawn from the schema

CHAOS_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
                torch.uint8, torch.bool, torch.complex64]
STRINGS = ["interleaved", "half", "half_cos_first", "half_per_axis", "mae", "cogvideox", "neox", "gptj", "bshd", "bhsd", "sbhd", "thd", "causal",
           "symmetric", "", "bad"]
SIZE_ARGS = {"q_len", "k_len", "num_rows", "num_heads", "rotary_dim"}
SPECIAL_INTS = [INT64_MIN, INT64_MAX, LIMIT, -LIMIT, LIMIT + 1, 2 ** 62, 2 ** 31, -1]


def chaos_tensor(draw):
    dtype = draw(st.sampled_from(CHAOS_DTYPES))
    shape = [draw(st.integers(0, 4)) for _ in range(draw(st.integers(0, 4)))]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    if dtype.is_floating_point or dtype.is_complex:
        values = torch.randn(shape, generator=gen, dtype=torch.float64) * 10
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, 0.0], dtype=torch.float64)
        pick = torch.randint(0, 8, shape, generator=gen)
        values = torch.where(pick < 5, specials[pick.clamp(max=4)], values) if draw(st.booleans()) else values
        t = values.to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(-3, 10, shape, generator=gen).clamp(info.min, info.max).to(dtype)
        if t.numel() and draw(st.booleans()):
            t.view(-1)[0] = draw(st.sampled_from([info.min, info.max]))
    how = draw(st.sampled_from(["plain", "transposed", "expanded", "sliced"]))
    if how == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    elif how == "expanded" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    elif how == "sliced" and t.dim() >= 1:
        t = torch.cat([t, t], 0)[::2]
    return t


def chaos_value(draw, name, type_name):
    optional = type_name.startswith("Optional")
    if optional and draw(st.integers(0, 2)) == 0:
        return None
    if "Tensor" in type_name:
        return chaos_tensor(draw)
    if name == "dtype":
        return draw(st.sampled_from(CHAOS_DTYPES))
    if "List[float]" in type_name:
        return [draw(st.sampled_from([1.0, 2.0, 0.0, -1.0, float("nan")])) for _ in range(draw(st.integers(0, 6)))]
    if "List[int]" in type_name:  # grids: small sizes, so that a drawn grid never asks for a huge table
        return [draw(st.integers(-2, 6)) for _ in range(draw(st.integers(0, 3)))]
    if "int" in type_name:
        if name in SIZE_ARGS:
            return draw(st.integers(-3, 12))
        return draw(st.one_of(st.integers(-5, 40), st.sampled_from(SPECIAL_INTS)))
    if "float" in type_name:
        return draw(st.sampled_from([1.0, 0.0, -1.5, float("nan"), float("inf"), 1e300]))
    if "str" in type_name:
        return draw(st.sampled_from(STRINGS))
    if "bool" in type_name:
        return draw(st.booleans())
    raise TypeError(f"no strategy for {name}: {type_name}")


def chaos(op):
    arguments = getattr(OPS, op).default._schema.arguments

    def build(draw):
        return {a.name: chaos_value(draw, a.name, str(a.type)) for a in arguments}
    return build


# ---------------------------------------------------------------- the cases

# Each op's small valid call and its mutations, registered by its family's test file (op_registry.BAD_INPUTS).
BASES = {op: entry.base for op, entry in BAD_INPUTS.items()}
MUTATIONS = {op: entry.mutations for op, entry in BAD_INPUTS.items()}


def mutated(op, mutate):
    def build(draw):
        kw = BASES[op](draw)
        mutate(draw, kw)
        return kw
    return build


CASES = {}
for _op, _mutations in MUTATIONS.items():
    for _name, _mutate in _mutations.items():
        CASES[f"{_op}/{_name}"] = (_op, mutated(_op, _mutate), False)
    CASES[f"{_op}/anything"] = (_op, chaos(_op), True)


def describe(kw):
    parts = []
    for name, value in kw.items():
        if isinstance(value, torch.Tensor):
            text = f"{name}={value.dtype} {list(value.shape)} stride {value.stride()} on {value.device}"
            if value.device.type == "cpu" and value.numel() <= 8:
                text += f" {value.tolist()}"
            parts.append(text)
        else:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


# The name an op's errors carry where it is not posenc.<op>: rope_inv_freq_for_length shares its checks, and their
# messages, with posenc.frequencies.rope.
ERROR_NAMES = {"rope_inv_freq_for_length": "frequencies.rope"}
# Ops whose invalid values raise ValueError (documented), their invalid tensors RuntimeError.
VALUE_ERROR_OPS = {"rope_inv_freq_for_length", "zigzag_positions_varlen"}


def names_op(message, op):
    name = ERROR_NAMES.get(op, op)
    return re.search(rf"posenc\.{re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def run_case(op, build, may_succeed, examples, derandomize):
    @settings(max_examples=examples, derandomize=derandomize, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(st.data())
    def check(data):
        kw = build(data.draw)
        expected = (RuntimeError, ValueError) if op in VALUE_ERROR_OPS else RuntimeError
        try:
            getattr(OPS, op)(**kw)
        except expected as error:
            if not names_op(str(error), op):
                raise AssertionError(f"a RuntimeError that does not name posenc.{op}: "
                                     f"{str(error).splitlines()[0][:400]}\ninputs: {describe(kw)}") from None
            return
        except Exception as error:  # noqa: BLE001  (the point: any other exception type is a failure)
            raise AssertionError(f"{type(error).__name__} instead of a RuntimeError: {str(error)[:400]}\n"
                                 f"inputs: {describe(kw)}") from None
        if not may_succeed:
            raise AssertionError(f"no error for bad input: {describe(kw)}")

    check()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--derandomize", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--after", default=None)
    args = parser.parse_args()
    faulthandler.enable()  # a crash prints the Python stack of the case that caused it to stderr
    names = list(CASES)
    start = names.index(args.after) + 1 if args.after else 0
    for name in names[start:]:
        op, build, may_succeed = CASES[name]
        if args.only not in name:
            continue
        print(json.dumps({"case": name, "status": "start"}), flush=True)
        try:
            run_case(op, build, may_succeed, args.examples, args.derandomize)
            record = {"case": name, "status": "ok", "detail": ""}
        except Exception as error:  # noqa: BLE001
            notes = "\n".join(getattr(error, "__notes__", []))
            record = {"case": name, "status": "fail",
                      "detail": "".join(traceback.format_exception_only(type(error), error)) + notes}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())
