#!/usr/bin/env python
"""Writes the argument lists of every op's wrappers from the op's schema (csrc/families.h, read through the C++
preprocessor), so that they are declared once: the C++ API's inline functions (csrc/include/posenc/*.h), the typed
Python wrappers (ops/functional.py) and the parameters of the ONNX translations (ops/onnx.py). Everything else in
those files (comments, docstrings, the translations' bodies) is written by hand and kept.

    python scripts/write_signatures.py           # rewrite the files
    python scripts/write_signatures.py --check   # exit 1 with a diff where a file is not what this would write

What is written:
- C++: every inline function of namespace posenc named after an op: its return type, parameters and defaults, and a
  body that calls the op through the dispatcher (detail::find_op). An op with SymInt arguments gets two functions,
  <op>_symint (c10::SymInt) and <op> (int64_t, calling <op>_symint), if the header holds a function of either name.
- Python: every function of ops/functional.py named after an op whose body calls torch.ops.posenc.<op>: its
  parameters, its return annotation (kept when statements follow the call: rope_ returns x) and the call's
  arguments; where the op has defaults (and no keyword-only arguments), a second call that leaves out the defaults
  the caller left out (`_given` in functional.py) for eager Python and tracing, the first kept for TorchScript.
- ONNX: the parameters of every function of ops/onnx.py named after an op and taking neither *args nor **kwargs:
  tensors unannotated, the attributes with their Python type (the exporter binds the op's arguments to them by name).

A new op starts from stubs that this script completes: `inline void <op>();` in its family's header,
`def <op>():` + docstring + `return torch.ops.posenc.<op>()` in functional.py, and `def <op>():` + body in onnx.py.
"""
import argparse
import ast
import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
HEADERS = ROOT / "csrc" / "include" / "posenc"
FUNCTIONAL = ROOT / "ops" / "functional.py"
ONNX = ROOT / "ops" / "onnx.py"
WIDTH = 120

# Parameters every wrapper names differently from the schema: (op, schema argument) -> (the wrappers' name, why).
RENAMED = {
    ("add_alibi_", "alibi_mode"): (
        "mode", "a mutable op cannot have an argument named mode (torch.compile's auto_functionalized passes its "
                "arguments as keywords beside a mode of its own); the wrappers keep the name add_alibi uses"),
}
# Python parameters whose annotation and default differ from the schema's: (op, argument) -> (annotation, default).
PYTHON_OVERRIDES = {
    # The schema's None means float32 (an optional: AOTInductor cannot replay a ScalarType default).
    ("alibi_slopes", "dtype"): ("torch.dtype", "torch.float32"),
}

NO_DEFAULT = object()


@dataclass(frozen=True)
class Argument:
    type: str  # the schema's spelling without alias annotations: "Tensor?", "SymInt", "float[]?"
    name: str
    default: object  # a Python value, or NO_DEFAULT
    kwarg_only: bool


@dataclass(frozen=True)
class Schema:
    name: str
    arguments: Tuple[Argument, ...]
    returns: Tuple[str, ...]  # the returns' types

    def wrapper_name(self, argument: Argument) -> str:
        return RENAMED.get((self.name, argument.name), (argument.name,))[0]

    @property
    def symint(self) -> bool:
        return any(a.type.startswith("SymInt") for a in self.arguments)


def schema_table() -> Dict[str, str]:
    """{op: "(arguments) -> returns"}: every list of csrc/families.h expanded by the C++ preprocessor, so that the
    script runs before the library is built (the library's own code calls the C++ API it writes)."""
    from torch.utils.cpp_extension import include_paths

    source = '#include "families.h"\nPOSENC_ALL_OPS(POSENC_WRITE_SIGNATURE, )\n'
    command = [os.environ.get("CXX", "c++"), "-E", "-P", "-x", "c++", "-std=c++17",
               "-DPOSENC_WRITE_SIGNATURE(A,op,schema)=POSENC_SCHEMA op schema", "-I", str(ROOT / "csrc"),
               "-I", str(ROOT / "csrc" / "include")] + [f"-I{path}" for path in include_paths()] + ["-"]
    expanded = subprocess.run(command, input=source, capture_output=True, text=True, check=True).stdout
    table = {}
    for name, literals in re.findall(r'POSENC_SCHEMA\s+(\w+)\s+((?:"(?:[^"\\]|\\.)*"\s*)+)', expanded):
        table[name] = "".join(ast.literal_eval(literal) for literal in re.findall(r'"(?:[^"\\]|\\.)*"', literals))
    if not table:
        raise RuntimeError("no schema found in csrc/families.h")
    return table


def schemas() -> Dict[str, Schema]:
    import torch

    found = {}
    for name, text in schema_table().items():
        schema = torch._C.parse_schema(f"posenc::{name}{text}")
        inside = text[text.index("(") + 1:text.rindex(") ->")]
        types = [re.sub(r"\([a-z]!?\)", "", part.split()[0]) for part in _split(inside) if part.strip() != "*"]
        arguments = tuple(
            Argument(t, a.name, a.default_value if a.has_default_value() else NO_DEFAULT, a.kwarg_only)
            for t, a in zip(types, schema.arguments, strict=True))
        found[name] = Schema(name, arguments, tuple(str(r.type) for r in schema.returns))
    return found


def _split(text: str) -> List[str]:
    """text split at the commas outside brackets and strings."""
    parts, depth, start, quoted = [], 0, 0, False
    for i, c in enumerate(text):
        if c == '"':
            quoted = not quoted
        elif not quoted and c in "([":
            depth += 1
        elif not quoted and c in ")]":
            depth -= 1
        elif not quoted and c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]] if text.strip() else []


def fill(head: str, items: List[str], tail: str, indent: Optional[int] = None) -> List[str]:
    """head + items joined by ", " + tail, wrapped at WIDTH: continuation lines start at the column after head
    (indent None), or, with an indent, every item goes on the lines after head."""
    lines, line = ([], head) if indent is None else ([head], " " * indent)
    margin = len(line)
    for i, item in enumerate(items):
        piece = item + ("," if i + 1 < len(items) else tail)
        joined = line + ("" if len(line) == margin else " ") + piece
        if len(joined) <= WIDTH or len(line) == margin:
            line = joined
        else:
            lines.append(line)
            line = " " * margin + piece
    if not items:
        line += tail
    return lines + [line]


# ---------------------------------------------------------------- C++

_CPP_TYPES = {
    "Tensor": "const at::Tensor&", "Tensor?": "const std::optional<at::Tensor>&", "int": "int64_t",
    "int?": "std::optional<int64_t>", "SymInt": "c10::SymInt", "SymInt?": "std::optional<c10::SymInt>",
    "float": "double", "float?": "std::optional<double>", "bool": "bool", "str": "std::string_view",
    "ScalarType?": "std::optional<at::ScalarType>", "int[]": "at::IntArrayRef", "int[]?": "at::OptionalIntArrayRef",
    "SymInt[]": "c10::SymIntArrayRef", "float[]": "at::ArrayRef<double>",
    "float[]?": "std::optional<at::ArrayRef<double>>",
}
_CPP_INT64 = {"SymInt": "int64_t", "SymInt?": "std::optional<int64_t>", "SymInt[]": "at::IntArrayRef"}


def cpp_value(value) -> str:
    if value is None:
        return "std::nullopt"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return f"{value:.1f}" if value.is_integer() else re.sub(r"e-0(\d)", r"e-\1", repr(value))
    if isinstance(value, int):
        return str(value)
    raise ValueError(f"no C++ spelling for the default {value!r}")


def cpp_returns(schema: Schema) -> str:
    if not schema.returns:
        return "void"
    if any(r != "Tensor" for r in schema.returns):
        raise ValueError(f"{schema.name}: a C++ wrapper returns tensors only, not {schema.returns}")
    return "at::Tensor" if len(schema.returns) == 1 else f"std::tuple<{', '.join(['at::Tensor'] * len(schema.returns))}>"


def cpp_function(schema: Schema, int64: bool) -> List[str]:
    """The inline function of schema's op: <op>_symint through the dispatcher, or (int64) <op> calling it."""
    name = schema.name if int64 or not schema.symint else schema.name + "_symint"
    parameters, arguments = [], []
    for a in schema.arguments:
        type_ = (_CPP_INT64.get(a.type) if int64 else None) or _CPP_TYPES.get(a.type)
        if type_ is None:
            raise ValueError(f"{schema.name}: no C++ wrapper type for the schema type {a.type}")
        wrapper = schema.wrapper_name(a)
        default = "" if a.default is NO_DEFAULT else f" = {cpp_value(a.default)}"
        parameters.append(f"{type_} {wrapper}{default}")
        if a.type == "SymInt":
            arguments.append(f"c10::SymInt({wrapper})" if int64 else f"std::move({wrapper})")
        elif a.type == "SymInt?":
            arguments.append(f"{wrapper} ? std::optional<c10::SymInt>(*{wrapper}) : std::nullopt" if int64
                             else f"std::move({wrapper})")
        elif a.type == "SymInt[]" and int64:
            arguments.append(f"c10::fromIntArrayRefSlow({wrapper})")
        else:
            arguments.append(wrapper)
    head = f"inline {cpp_returns(schema)} {name}("
    lines = fill(head, parameters, ") {", None if len(head) <= 50 else 4)
    call = "return " if schema.returns else ""
    if int64 and schema.symint:
        lines += fill(f"  {call}{schema.name}_symint(", arguments, ");")
    else:
        find = f'detail::find_op<decltype({name})>("posenc::{schema.name}");'
        lines += [f"  static const auto op = {find}"] if len(find) <= WIDTH - 25 else ["  static const auto op =",
                                                                                   f"      {find}"]
        lines += fill(f"  {call}op.call(", arguments, ");")
    return lines + ["}"]


_INLINE = re.compile(r"^inline [^;{(]*?\b(\w+)\(", re.MULTILINE)


def write_header(text: str, ops: Dict[str, Schema]) -> str:
    """text with every inline function named after an op (or <op>_symint) written from the op's schema; an op
    with SymInt arguments gets its pair of functions where the header had either."""
    out, position = [], 0
    for match in _INLINE.finditer(text):
        if match.start() < position:
            continue
        function = match.group(1)
        op = function if function in ops else function.removesuffix("_symint")
        if op not in ops or (function != op and not ops[op].symint):
            continue
        end = _function_end(text, match.end())
        schema = ops[op]
        written = "\n".join(cpp_function(schema, int64=False))
        if schema.symint:
            between = "\n\n"
            following = _INLINE.match(text, len(text) - len(text[end:].lstrip()))  # the pair's other function
            if following and following.group(1) in (op, op + "_symint") and following.group(1) != function:
                between, end = text[end:following.start()], _function_end(text, following.end())
            written += between + "\n".join(cpp_function(schema, int64=True))
        out += [text[position:match.start()], written]
        position = end
    return "".join(out) + text[position:]


def _function_end(text: str, start: int) -> int:
    """The index just past the function that begins before start: past its ';' (a declaration) or its closing
    '}' at the start of a line."""
    brace, semicolon = text.find("{", start), text.find(";", start)
    if semicolon >= 0 and (brace < 0 or semicolon < brace) and text[start:semicolon].count("(") \
            <= text[start:semicolon].count(")"):
        return semicolon + 1
    return text.index("\n}", brace) + 2


# ---------------------------------------------------------------- Python

_PYTHON_TYPES = {
    "Tensor": "Tensor", "Tensor?": "Optional[Tensor]", "int": "int", "SymInt": "int", "int?": "Optional[int]",
    "SymInt?": "Optional[int]", "float": "float", "float?": "Optional[float]", "bool": "bool", "str": "str",
    "ScalarType?": "Optional[torch.dtype]", "int[]": "List[int]", "SymInt[]": "List[int]", "int[]?": "Optional[List[int]]",
    "float[]": "List[float]", "float[]?": "Optional[List[float]]", "Device?": "Optional[torch.device]",
    "Generator?": "Optional[torch.Generator]",
}
# ONNX: tensors (and sizes, which may be symbolic) are inputs, unannotated; the rest are attributes.
_ONNX_TYPES = {
    "Tensor": None, "Tensor?": None, "SymInt": None, "int": "int", "int?": "Optional[int]",
    "SymInt?": "Optional[int]", "float": "float", "float?": "Optional[float]", "bool": "bool", "str": "str",
    "ScalarType?": "Optional[int]", "int[]": "Sequence[int]", "SymInt[]": "Sequence[int]",
    "int[]?": "Optional[Sequence[int]]",
    "float[]": "Sequence[float]", "float[]?": "Optional[Sequence[float]]",
}


def python_value(value) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(python_value(v) for v in value)}]"
    return repr(value)


def python_parameters(schema: Schema, types: Dict[str, Optional[str]], overrides=None) -> List[str]:
    parameters, keyword_only = [], False
    for a in schema.arguments:
        if a.kwarg_only and not keyword_only:
            parameters.append("*")
            keyword_only = True
        name = schema.wrapper_name(a)
        if a.type not in types:
            raise ValueError(f"{schema.name}: no Python type for the schema type {a.type}")
        annotation = types[a.type]
        default = NO_DEFAULT if a.default is NO_DEFAULT else python_value(a.default)
        if overrides and (schema.name, a.name) in overrides:
            annotation, default = overrides[(schema.name, a.name)]
        text = name if annotation is None else f"{name}: {annotation}"
        if default is not NO_DEFAULT:
            text += " = " if annotation else "="
            text += default
        parameters.append(text)
    return parameters


def python_returns(schema: Schema) -> str:
    types = {"Tensor": "Tensor", "float": "float", "str": "str"}
    if not schema.returns:
        return "None"
    named = [types[r] for r in schema.returns]
    return named[0] if len(named) == 1 else f"Tuple[{', '.join(named)}]"


def _header_lines(node: ast.FunctionDef, lines: List[str]) -> Tuple[int, int]:
    """The 0-based line range [first, last) of a def's header: from `def` to its line that ends with the colon
    closing the parameters (defaults hold no brackets inside strings)."""
    depth = 0
    for index in range(node.lineno - 1, node.body[0].lineno):
        for c in lines[index]:
            depth += (c in "([{") - (c in ")]}")
        if depth == 0 and lines[index].rstrip().endswith(":"):
            return node.lineno - 1, index + 1
    raise ValueError(f"line {node.lineno}: no end of the header of {node.name}")


_SCRIPTING = "torch.jit.is_scripting()"


def _op_call(statement: ast.stmt, name: str) -> Optional[ast.stmt]:
    """The statement (return or expression) of a wrapper's body that calls torch.ops.posenc.<name>, or, where the
    wrapper branches on torch.jit.is_scripting(), its first branch's."""
    if isinstance(statement, ast.If) and ast.unparse(statement.test) == _SCRIPTING:
        statement = statement.body[0]
    if isinstance(statement, (ast.Return, ast.Expr)) and isinstance(statement.value, ast.Call) and \
            ast.unparse(statement.value.func) == f"torch.ops.posenc.{name}":
        return statement
    return None


def write_functional(text: str, ops: Dict[str, Schema]) -> str:
    lines = text.split("\n")
    edits = []  # (first, last, new lines), applied from the bottom up
    for node in ast.parse(text).body:
        if not isinstance(node, ast.FunctionDef) or node.name not in ops:
            continue
        calls = [(i, s) for i, s in enumerate(node.body) if _op_call(s, node.name) is not None]
        if not calls:
            continue
        schema = ops[node.name]
        index, statement = calls[0]
        call = _op_call(statement, node.name)
        returns = python_returns(schema) if index + 1 == len(node.body) or node.returns is None \
            else ast.unparse(node.returns)
        first, last = _header_lines(node, lines)
        indent = " " * node.col_offset
        edits.append((first, last, fill(f"{indent}def {node.name}(",
                                        python_parameters(schema, _PYTHON_TYPES, PYTHON_OVERRIDES),
                                        f") -> {returns}:")))
        arguments = [(f"{schema.wrapper_name(a)}={schema.wrapper_name(a)}" if a.kwarg_only
                      else schema.wrapper_name(a)) for a in schema.arguments]
        keyword = "return " if isinstance(call, ast.Return) else ""
        at = " " * statement.col_offset
        head = f"{keyword}torch.ops.posenc.{node.name}("
        defaulted = any(a.default is not NO_DEFAULT for a in schema.arguments)
        if defaulted and not any(a.kwarg_only for a in schema.arguments):
            # The defaults left out are not passed on (_given); TorchScript, which has no *args, compiles the first
            # branch alone.
            given = arguments[:-1] + [arguments[-1] + ("," if len(arguments) == 1 else "") + ")",
                                      f"{node.name}.__defaults__"]
            written = ([f"{at}if {_SCRIPTING}:"] + fill(f"{at}    {head}", arguments, ")") + [f"{at}else:"] +
                       fill(f"{at}    {head}*_given((", given, "))"))
        else:
            written = fill(f"{at}{head}", arguments, ")")
        edits.append((statement.lineno - 1, statement.end_lineno, written))
    return _apply(lines, edits)


def write_onnx(text: str, ops: Dict[str, Schema]) -> str:
    lines = text.split("\n")
    edits = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.FunctionDef) or node.name not in ops or node.args.vararg or node.args.kwarg:
            continue
        first, last = _header_lines(node, lines)
        returns = "" if node.returns is None else f" -> {ast.unparse(node.returns)}"
        edits.append((first, last, fill(f"{' ' * node.col_offset}def {node.name}(",
                                        python_parameters(ops[node.name], _ONNX_TYPES), f"){returns}:")))
    return _apply(lines, edits)


def _apply(lines: List[str], edits) -> str:
    for first, last, new in sorted(edits, reverse=True):
        lines[first:last] = new
    return "\n".join(lines)


# ---------------------------------------------------------------- the files

def written() -> Dict[Path, Tuple[str, str]]:
    """{file: (its text now, the text this script writes)} for every file it writes."""
    ops = schemas()
    files = {header: write_header for header in sorted(HEADERS.glob("*.h"))}
    files.update({FUNCTIONAL: write_functional, ONNX: write_onnx})
    return {path: (path.read_text(), write(path.read_text(), ops)) for path, write in files.items()}


def stale() -> List[str]:
    """A unified diff per file that is not what this script writes (empty when every file is)."""
    return ["".join(difflib.unified_diff(now.splitlines(True), new.splitlines(True), str(path.relative_to(ROOT)),
                                         f"{path.relative_to(ROOT)} (written from the schemas)"))
            for path, (now, new) in written().items() if now != new]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if a file differs")
    args = parser.parse_args()
    if args.check:
        diffs = stale()
        sys.stdout.write("".join(diffs))
        return 1 if diffs else 0
    for path, (now, new) in written().items():
        if now != new:
            path.write_text(new)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
