"""Every signature of an op agrees with the op's schema, so that a schema change that misses one of its wrappers (or
a wrapper edited on its own) fails here, not in a user's call that passes an argument by the wrong name or leans on
a default the op does not have.

- Written from the schemas: the C++ API's inline functions, the Python wrappers and the ONNX translations' parameters
  are what scripts/write_signatures.py writes (run it after a schema change). The checks below read the files
  independently of that script.

- Python: each op with a wrapper of the same name in posenc.functional takes the schema's parameters, by name and
  in order, with the same keyword-only split and the same defaults (None, numbers, strings, booleans, lists; a
  ScalarType default against a torch.dtype). Ops with no such wrapper are listed in NO_FUNCTIONAL_WRAPPER with
  what wraps them instead (posenc.frequencies' builders keep names of their own and are not compared).
- ONNX: each translation of posenc.onnx takes the schema's parameters by name and in order (the exporter binds
  them by name), with the same defaults.
- C++: each function of namespace posenc (not posenc::nn, posenc::frequencies, posenc::detail, nor a class
  member) declared or defined inline in the public headers csrc/include/posenc/*.h and named after an op, or after
  an op plus "_symint", takes the schema's parameters by name and in order, with the same defaults
  (std::nullopt for None, "neox" for "neox", 1.0 for 1., true for True, at::kFloat for float32). The headers are
  read by a small text parser (comments, string literals and nesting aware), tested on its own below, and it must
  find most ops so that a broken parser cannot pass by finding nothing.

Differences by design, and known mismatches (reason "MISMATCH: ..."), are listed with their reason below; each
must still be a difference, so that an entry fails once the difference is gone and has to be removed."""
import ast
import importlib.util
import inspect
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch

import posenc
from op_registry import all_ops

ROOT = Path(__file__).resolve().parents[2]
HEADERS = sorted((ROOT / "csrc" / "include" / "posenc").glob("*.h"))
# Fewer C++ functions named after an op than this means the parser, not the headers, lost them (33 today).
MIN_CPP_OPS = 25


def _load_writer():
    spec = importlib.util.spec_from_file_location("write_signatures", ROOT / "scripts" / "write_signatures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WRITER = _load_writer()
# Parameters that every wrapper, Python and C++, names differently from the schema:
# (op, schema argument) -> (the wrappers' name, why).
RENAMED = WRITER.RENAMED

# Python defaults that differ from the schema's: (op, argument) -> why.
PYTHON_DEFAULTS = {
    ("alibi_slopes", "dtype"): (
        "the schema's None means float32 (an optional, because AOTInductor cannot replay a ScalarType default); "
        "the wrapper spells float32 out"),
}

# C++ defaults that differ from the schema's, a missing one included: (C++ function, argument) -> why.
CPP_DEFAULTS = {
}

# C++ functions named after an op whose parameters are not the op's by design: C++ function -> why.
CPP_SKIP = {
    "alibi_slopes": (
        "the implementation the op calls, not a wrapper of it: a plain ScalarType dtype = at::kFloat and no device "
        "(the result is on the CPU)"),
    "image_positions": "the implementation the op calls: at::TensorOptions options in place of Device? device",
    "grid_positions": "the implementation the op calls: at::TensorOptions options in place of Device? device",
    "patch_center_positions": "the implementation the op calls: at::TensorOptions options in place of Device? device",
    "video_positions": "the implementation the op calls: at::TensorOptions options in place of Device? device",
    "zigzag_positions": "the implementation the op calls: at::TensorOptions options in place of Device? device",
}

# Ops with no same-name wrapper in posenc.functional: op -> (what wraps it, why).
NO_FUNCTIONAL_WRAPPER = {
    "axial_inv_freq": ("posenc.frequencies.axial", "a frequency builder, named by its scheme"),
    "cpu_capability": ("posenc.cpu_capability", "a property of the library, not an encoding"),
    "grid_sinusoidal_inv_freq": ("posenc.frequencies.grid_sinusoidal", "a frequency builder, named by its scheme"),
    "mrope_inv_freq": ("posenc.frequencies.mrope", "a frequency builder, named by its scheme"),
    "mrope_pair_axis": ("posenc.frequencies.mrope_pair_axis", "a frequency builder's pair axes"),
    "multiaxis_inv_freq": ("posenc.frequencies.multiaxis", "a frequency builder, named by its scheme"),
    "rope_inv_freq": ("posenc.frequencies.rope", "takes a Hugging Face scaling dict in place of the keywords"),
    "rope_inv_freq_for_length": ("posenc.nn.RotaryEmbedding",
                                 "called by the rotary modules, so compile traces one graph for every length"),
    "sinusoidal_inv_freq": ("posenc.frequencies.sinusoidal", "a frequency builder, named by its scheme"),
}


def test_the_wrappers_are_written_from_the_schemas():
    """The C++ API, the Python wrappers and the ONNX translations' parameters are what scripts/write_signatures.py
    writes from the schemas: a schema changed without rerunning it fails here, with the diff."""
    diffs = WRITER.stale()
    assert not diffs, "run python scripts/write_signatures.py:\n" + "".join(diffs)


def test_the_wrappers_pass_on_what_the_caller_gave():
    """A wrapper leaves out the trailing arguments that are its parameters' own default objects (torch.ops takes them
    from the schema, whose defaults they are); any value given, even one equal to its default, is passed on, and so
    is everything before it."""
    from posenc.functional import _given
    required = ("q", "k", None, "inv_freq")
    defaults = posenc.functional.rope_qk.__defaults__  # attention_scale, layout, format, offset, ...
    assert _given(required + defaults, defaults) == required
    offset = required + defaults[:3] + (3,)
    assert _given(offset + defaults[4:], defaults) == offset
    neox = "".join(["ne", "ox"])  # equal to the default layout, another object
    assert neox == defaults[1] and neox is not defaults[1]
    layout = required + defaults[:1] + (neox,)
    assert _given(layout + defaults[2:], defaults) == layout
    assert _given(("x",), ()) == ("x",)


def test_the_writer_fills_in_a_new_ops_stubs():
    """A new op starts from stubs: the writer completes each from the op's schema (add_learned's here)."""
    ops = WRITER.schemas()
    header = "namespace posenc {\n// doc\ninline void add_learned();\n}\n"
    assert WRITER.write_header(header, ops) == (
        "namespace posenc {\n// doc\n"
        "inline at::Tensor add_learned(const at::Tensor& x, const at::Tensor& weight,\n"
        "                              const std::optional<at::Tensor>& positions = std::nullopt, int64_t offset = 0,\n"
        "                              std::optional<int64_t> padding_idx = std::nullopt) {\n"
        '  static const auto op = detail::find_op<decltype(add_learned)>("posenc::add_learned");\n'
        "  return op.call(x, weight, positions, offset, padding_idx);\n}\n}\n")
    python = 'def add_learned():\n    """doc"""\n    return torch.ops.posenc.add_learned()\n'
    assert WRITER.write_functional(python, ops) == (
        "def add_learned(x: Tensor, weight: Tensor, positions: Optional[Tensor] = None, offset: int = 0,\n"
        "                padding_idx: Optional[int] = None) -> Tensor:\n"
        '    """doc"""\n'
        "    if torch.jit.is_scripting():\n"
        "        return torch.ops.posenc.add_learned(x, weight, positions, offset, padding_idx)\n"
        "    else:\n"
        "        return torch.ops.posenc.add_learned(*_given((x, weight, positions, offset, padding_idx),\n"
        "                                                     add_learned.__defaults__))\n")
    onnx = "def add_learned():\n    # fairseq\n    return x\n"
    assert WRITER.write_onnx(onnx, ops) == (
        "def add_learned(x, weight, positions=None, offset: int = 0, padding_idx: Optional[int] = None):\n"
        "    # fairseq\n    return x\n")
    # A pair for an op with SymInt arguments, from either function of it.
    pair = WRITER.write_header("inline void t5_bias_backward();\n", ops)
    assert "t5_bias_backward_symint(const at::Tensor& grad" in pair and "c10::SymInt(q_offset)" in pair
    assert WRITER.write_header(pair, ops) == pair


# ---------------------------------------------------------------- schemas and default values

class _NoDefault:
    def __repr__(self):
        return "<no default>"


NO_DEFAULT = _NoDefault()


@dataclass(frozen=True)
class Unread:
    """A C++ default the parser cannot read: equal to nothing, so that it needs an exception or a better parser."""
    text: str


def schema_of(name):
    return getattr(torch.ops.posenc, name).default._schema


def schema_default(argument):
    """The schema argument's default as a Python value; a ScalarType code as its torch.dtype."""
    if not argument.has_default_value():
        return NO_DEFAULT
    value = argument.default_value
    if "ScalarType" in str(argument.real_type) and isinstance(value, int) and not isinstance(value, bool):
        return torch.ops.aten.empty.memory_format([0], dtype=value).dtype
    return value


def wrapper_names(name):
    """The parameter names the op's wrappers must have: the schema's, renamed as RENAMED says."""
    return [RENAMED.get((name, a.name), (a.name,))[0] for a in schema_of(name).arguments]


def same_value(a, b):
    """Defaults compared across languages: None, bools, dtypes and strings exactly, numbers numerically, lists
    element by element; NO_DEFAULT only equals itself."""
    if a is NO_DEFAULT or b is NO_DEFAULT or a is None or b is None:
        return a is b
    if isinstance(a, (bool, torch.dtype, str)) or isinstance(b, (bool, torch.dtype, str)):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return False


def default_differences(function, schema, defaults):
    """{(function, schema argument): (schema default, wrapper default)} where they differ; defaults in order."""
    return {(function, a.name): (schema_default(a), d) for a, d in zip(schema.arguments, defaults)
            if not same_value(schema_default(a), d)}


def check_exceptions(differences, exceptions, function):
    """The differences are exactly the function's listed exceptions: none unlisted, none stale."""
    unlisted = {key: value for key, value in differences.items() if key not in exceptions}
    stale = [key for key in exceptions if key[0] == function and key not in differences]
    assert not unlisted, f"defaults differ from the schema's (schema, wrapper): {unlisted}"
    assert not stale, f"listed as different, but they agree now: remove {stale}"


def resolve(dotted):
    module, _, attribute = dotted.partition(".")
    assert module == "posenc", dotted
    return operator.attrgetter(attribute)(posenc)


# ---------------------------------------------------------------- Python

PYTHON_WRAPPED = [op.name for op in all_ops() if hasattr(posenc.functional, op.name)]


def python_parameters(name):
    return list(inspect.signature(getattr(posenc.functional, name)).parameters.values())


@pytest.mark.parametrize("name", PYTHON_WRAPPED)
def test_python_wrapper_matches_the_schema(name):
    schema, parameters = schema_of(name), python_parameters(name)
    assert [p.name for p in parameters] == wrapper_names(name)
    assert [p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters] == [a.kwarg_only for a in schema.arguments]
    defaults = [NO_DEFAULT if p.default is inspect.Parameter.empty else p.default for p in parameters]
    check_exceptions(default_differences(name, schema, defaults), PYTHON_DEFAULTS, name)


def test_every_op_without_a_functional_wrapper_is_listed():
    unwrapped = sorted(op.name for op in all_ops() if not hasattr(posenc.functional, op.name))
    assert unwrapped == sorted(NO_FUNCTIONAL_WRAPPER)
    for name, (where, _) in NO_FUNCTIONAL_WRAPPER.items():
        assert callable(resolve(where)), (name, where)


def test_python_exceptions_name_real_arguments():
    for name, argument in PYTHON_DEFAULTS:
        assert name in PYTHON_WRAPPED and argument in [a.name for a in schema_of(name).arguments], (name, argument)
    for name, argument in RENAMED:
        assert argument in [a.name for a in schema_of(name).arguments], (name, argument)


# ---------------------------------------------------------------- ONNX translations

def onnx_translations():
    """(op, translation) for every translation posenc.onnx registers, the ones below opset 23 included. The
    exporter binds the op's arguments to a translation's parameters by name. Translations that bind them from the
    schema themselves (*args: the configuration constants) have no list to compare."""
    import posenc.onnx as onnx
    pairs = [(target._schema.name.split("::")[1], fn) for target, fn in onnx.translation_table().items()]
    pairs += [(f"{fn.__name__}-below-opset-{onnx.OPSET}", fn) for fn in onnx._rope_for_opset(onnx.OPSET - 1)]
    return [(name, fn) for name, fn in pairs
            if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values())]


ONNX_TRANSLATIONS = onnx_translations()


def test_the_rotations_have_translations_at_every_opset():
    """The ops with a translation below opset 23 too (without RotaryEmbedding and RMSNormalization) are compared
    above in both forms."""
    cases = {case for case, _ in ONNX_TRANSLATIONS}
    assert {"rope", "rope_qk", "qk_norm_rope"} <= cases
    assert {"rope-below-opset-23", "rope_qk-below-opset-23", "qk_norm_rope-below-opset-23"} <= cases


@pytest.mark.parametrize("case,translation", ONNX_TRANSLATIONS, ids=[case for case, _ in ONNX_TRANSLATIONS])
def test_onnx_translation_matches_the_schema(case, translation):
    """Names in order and defaults; a translation may take the scaling keywords as **kwargs."""
    name = case.split("-")[0]
    schema = schema_of(name)
    parameters = [p for p in inspect.signature(translation).parameters.values()
                  if p.kind is not inspect.Parameter.VAR_KEYWORD]
    arguments = schema.arguments[:len(parameters)]
    assert [p.name for p in parameters] == [a.name for a in arguments]
    rest = schema.arguments[len(parameters):]
    assert not rest or any(p.kind is inspect.Parameter.VAR_KEYWORD
                           for p in inspect.signature(translation).parameters.values()), [a.name for a in rest]
    defaults = [NO_DEFAULT if p.default is inspect.Parameter.empty else p.default for p in parameters]
    assert default_differences(name, schema, defaults) == {}


# ---------------------------------------------------------------- C++ header parser

_LITERAL_START = re.compile(r'(?:u8|[uUL])?R"([^(\s]{0,16})\(')  # a raw string's opening: R"delim(
_OPEN, _CLOSE = "([{", ")]}"
# An unnamed parameter's last word: a built-in type's word (unsigned long), or a type after const alone (const T).
_BUILTIN_TYPE_WORDS = {"bool", "char", "short", "int", "long", "float", "double", "void", "signed", "unsigned", "auto"}
_CV_ONLY = re.compile(r"(?:(?:const|volatile)\s*)+")
_NOT_FUNCTIONS = re.compile(r"^(?:using|typedef|static_assert|class|struct|enum|union|namespace|friend|return)\b")


def _skip_literal(text, i):
    """The index past the string or character literal that starts at text[i] (a quote, or a raw string prefix)."""
    raw = _LITERAL_START.match(text, i)
    if raw:
        end = text.index(f'){raw.group(1)}"', raw.end())
        return end + len(raw.group(1)) + 2
    quote, i = text[i], i + 1
    while text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _is_literal_start(text, i):
    """A quote that opens a literal: not a digit separator (1'000); or the R of a raw string literal."""
    if text[i] == '"':
        return True
    if text[i] == "'":
        return i == 0 or not text[i - 1].isalnum()
    return text[i] in "uULR" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")) \
        and bool(_LITERAL_START.match(text, i))


def strip_comments(text):
    """The text with // and /* */ comments and preprocessor lines blanked (newlines kept), literals untouched."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.index("*/", i + 2) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif _is_literal_start(text, i):
            end = _skip_literal(text, i)
            out.append(text[i:end])
            i = end
        else:
            out.append(text[i])
            i += 1
    lines, continued = [], False
    for line in "".join(out).split("\n"):
        directive = continued or line.lstrip().startswith("#")
        continued = directive and line.rstrip().endswith("\\")
        lines.append("" if directive else line)
    return "\n".join(lines)


def _opens_template(text, i):
    """Whether the < at text[i] opens template arguments: it follows a name (std::optional<), not a number."""
    before = text[max(0, i - 200):i]
    return bool(re.search(r"(?:^|[^\w])[A-Za-z_]\w*\s*$", before)) and not text.startswith("<<", i) \
        and not re.search(r"\boperator\s*$", before)


def _scan(text):
    """(index, character, depth) of every character of text outside literals; depth counts the (), [], {} and
    template <> that enclose it. Literals are yielded as one item with their first index."""
    depth, angles, i, n = 0, [], 0, len(text)
    while i < n:
        c = text[i]
        if _is_literal_start(text, i):
            yield i, c, depth
            i = _skip_literal(text, i)
            continue
        if c in _OPEN or (c == "<" and _opens_template(text, i)):
            yield i, c, depth
            depth += 1
            if c == "<":
                angles.append(depth)
        elif c in _CLOSE or (c == ">" and angles and angles[-1] == depth and text[i - 1] != "-"):
            if c != ">":
                while angles and angles[-1] >= depth:  # a ) or } closes any < left open inside it (a < b)
                    angles.pop()
            else:
                angles.pop()
            depth -= 1
            yield i, c, depth
        else:
            yield i, c, depth
        i += 1


def _matching(text, i):
    """The index of the bracket that closes the one at text[i] (read in its context: a < after a name)."""
    opened = None
    for j, c, depth in _scan(text):
        if j == i:
            opened = depth
        elif opened is not None and depth == opened and c in _CLOSE + ">":
            return j
    raise ValueError(f"unbalanced {text[i]!r} in {text[i:i + 80]!r}")


def split_top_level(text, separator=","):
    """text split at the separators outside brackets, template arguments and literals."""
    parts, start = [], 0
    for i, c, depth in _scan(text):
        if c == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


@dataclass(frozen=True)
class CppParameter:
    name: Optional[str]
    type: str
    default: Optional[str]  # the default's text, None without one


@dataclass(frozen=True)
class CppFunction:
    name: str
    parameters: tuple
    where: str


def parse_parameter(text):
    """A parameter's name (None if unnamed), type and default text, from `const at::Tensor& x = {}`."""
    declaration, default = text, None
    for i, c, depth in _scan(text):
        if c == "=" and depth == 0 and text[i - 1] not in "=!<>" and text[i + 1:i + 2] != "=":
            declaration, default = text[:i], text[i + 1:].strip()
            break
    declaration = declaration.strip()
    pointer = re.search(r"\(\s*[*&]+\s*(?:const\s+)?([A-Za-z_]\w*)\s*\)\s*\(", declaration)  # void (*fn)(int)
    if pointer:
        return CppParameter(pointer.group(1), declaration, default)
    named = re.fullmatch(r"(.*?[\w>*&\s])\s*\b([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*", declaration, re.DOTALL)
    if named and named.group(1).strip() and not _CV_ONLY.fullmatch(named.group(1).strip()) \
            and named.group(2) not in _BUILTIN_TYPE_WORDS | {"const", "volatile"}:
        return CppParameter(named.group(2), named.group(1).strip(), default)
    return CppParameter(None, declaration, default)  # unnamed: int, const at::Tensor&, unsigned long


def parse_parameters(text):
    """The parameters of a parameter list's text (between its parentheses)."""
    parts = [p.strip() for p in split_top_level(text)]
    if parts in ([""], ["void"]):
        return ()
    return tuple(parse_parameter(p) for p in parts)


def parse_function(statement, terminator):
    """(name, parameters) of `<return type> <name>(<parameters>) [qualifiers]`, or None for anything else."""
    statement = statement.strip()
    while True:  # template <...> and [[attribute]] prefixes
        prefix = re.match(r"^template\s*<", statement) or re.match(r"^\[\[", statement)
        if not prefix:
            break
        statement = statement[(_matching(statement, prefix.end() - 1) if statement[0] == "t"
                               else statement.index("]]") + 1) + 1:].strip()
    if not statement or _NOT_FUNCTIONS.match(statement) or statement.startswith('extern "'):
        return None
    opening = next((i for i, c, depth in _scan(statement) if c == "(" and depth == 0), None)
    if opening is None:
        return None
    head = re.match(r"^(.*?)\b(~?[A-Za-z_]\w*)\s*$", statement[:opening], re.DOTALL)
    if not head or not head.group(1).strip() or head.group(1).rstrip().endswith(("::", ".", "->")) \
            or head.group(2).startswith("__") or head.group(2) == "operator" \
            or any(c == "=" and d == 0 for _, c, d in _scan(head.group(1))):
        return None
    closing = _matching(statement, opening)
    qualifiers = statement[closing + 1:].strip()
    if not re.fullmatch(r"(?:const|noexcept(?:\s*\(.*\))?|override|final|&&?|->\s*[^;{]+|\s)*"
                        r"(?:=\s*(?:0|default|delete))?", qualifiers, re.DOTALL):
        return None
    if terminator == "{" and "=" in qualifiers:
        return None
    return head.group(2), parse_parameters(statement[opening + 1:closing])


def _namespace(statement):
    """The names a `namespace a::b {` opens ([""] for an anonymous one), or None for another statement."""
    match = re.fullmatch(r"\s*(inline\s+)?namespace\s*([\w:\s]*?)\s*(?:\[\[.*\]\]\s*)?", statement, re.DOTALL)
    if not match:
        return None
    names = [name.strip() for name in match.group(2).split("::")] if match.group(2) else [""]
    return [] if match.group(1) else names  # an inline namespace is transparent


def functions(text, where="<text>", namespace=("posenc",)):
    """Every function declared (`...;`) or defined (`... { ... }`) directly in `namespace`, outside classes and
    nested namespaces, in C++ source text."""
    text = strip_comments(text)
    found, scopes, start, skipping = [], [], 0, None  # skipping: a body, class or initializer; is it a function's
    for i, c, depth in _scan(text):
        if skipping is not None:  # until the } at the depth of its {
            if c == "}" and depth == len(scopes):
                start, skipping = (i + 1 if skipping else start), None
            continue
        if c not in ";{}" or depth != len(scopes) - (c == "}"):
            continue
        if c == "}":
            scopes.pop()
            start = i + 1
            continue
        statement = text[start:i]
        here = tuple(name for scope in scopes for name in scope)
        parsed = parse_function(statement, c) if here == tuple(namespace) else None
        if parsed:
            line = text.count("\n", 0, i - len(statement.lstrip())) + 1
            found.append(CppFunction(parsed[0], parsed[1], f"{where}:{line}"))
        if c == ";":
            start = i + 1
        elif (names := _namespace(statement)) is not None:
            scopes.append(names)
            start = i + 1
        else:  # skipped whole; a class's or an initializer's statement goes on to its ;
            skipping = bool(parsed)
    assert not scopes and skipping is None, f"{where}: unclosed {scopes or 'body'}"
    return found


_DTYPES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
           "Long": torch.int64, "Int": torch.int32, "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
           "Bool": torch.bool, "ComplexFloat": torch.complex64, "ComplexDouble": torch.complex128}
_NUMBER = re.compile(r"[-+]?(?:\d[\d']*\.?[\d']*|\.\d[\d']*)(?:[eE][-+]?\d+)?([fFlLuU]*)")


def cpp_value(text, type_=""):
    """A C++ default as a Python value: std::nullopt -> None, "neox" -> 'neox', 1.0 -> 1.0, true -> True,
    at::kFloat -> torch.float32, {1.0, 2.0} -> [1.0, 2.0], c10::SymInt(0) -> 0; Unread(text) otherwise."""
    text = text.strip()
    if re.fullmatch(r"(?:(?:std|c10)::)?nullopt|nullptr", text) or (text == "{}" and "optional" in type_):
        return None
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r'(?:u8|[uUL])?"(?:[^"\\]|\\.)*"', text):
        return ast.literal_eval(text[text.index('"'):])
    if re.fullmatch(r"[-+]?0[xX][\da-fA-F']+[uUlL]*", text):
        return int(text.rstrip("uUlL").replace("'", ""), 16)
    number = _NUMBER.fullmatch(text)
    if number:
        digits = text[:len(text) - len(number.group(1))].replace("'", "")
        return float(digits) if re.search(r"[.eE]", digits) or "f" in number.group(1).lower() else int(digits)
    dtype = re.fullmatch(r"(?:at|c10|torch)::(?:k|ScalarType::)(\w+)", text)
    if dtype and dtype.group(1) in _DTYPES:
        return _DTYPES[dtype.group(1)]
    if text.startswith("{") and _matching(text, 0) == len(text) - 1:
        items = [item for item in split_top_level(text[1:-1]) if item.strip()]
        return [cpp_value(item) for item in items]
    wrapped = re.fullmatch(r"([A-Za-z_][\w:]*(?:<.*>)?)\s*([({])(.*)[)}]", text, re.DOTALL)
    if wrapped and _matching(text, wrapped.start(2)) == len(text) - 1:  # c10::SymInt(0), std::string("x")
        items = [item for item in split_top_level(wrapped.group(3)) if item.strip()]
        if re.search(r"vector|Array|list", wrapped.group(1)):
            return [cpp_value(item) for item in items]
        value = cpp_value(items[0]) if len(items) == 1 else None
        if len(items) == 1 and not isinstance(value, Unread):
            return value
    return Unread(text)


def header_functions():
    """{name: [CppFunction, ...]} of namespace posenc in the public headers (a declaration and its later
    definition, or overloads, are each kept)."""
    by_name = {}
    for header in HEADERS:
        for function in functions(header.read_text(), header.relative_to(ROOT).as_posix()):
            by_name.setdefault(function.name, []).append(function)
    return by_name


CPP_FUNCTIONS = header_functions()
OP_NAMES = {op.name for op in all_ops()}


def op_of(function_name):
    """The op a C++ function wraps: its own name, or its name without _symint; None if neither is an op."""
    for name in (function_name, function_name.removesuffix("_symint")):
        if name in OP_NAMES:
            return name
    return None


CPP_OPS = sorted({op_of(name) for name in CPP_FUNCTIONS} - {None})


# ---------------------------------------------------------------- C++

@pytest.mark.parametrize("name", CPP_OPS)
def test_cpp_functions_match_the_schema(name):
    schema = schema_of(name)
    for function_name in (name, name + "_symint"):
        for function in CPP_FUNCTIONS.get(function_name, []):
            names = [p.name for p in function.parameters]
            if function_name in CPP_SKIP:
                assert names != wrapper_names(name), \
                    f"{function.where}: {function_name} takes the schema's parameters now: remove it from CPP_SKIP"
                continue
            assert names == wrapper_names(name), function.where
            defaults = [NO_DEFAULT if p.default is None else cpp_value(p.default, p.type) for p in function.parameters]
            check_exceptions(default_differences(function_name, schema, defaults), CPP_DEFAULTS, function_name)


def test_the_parser_finds_the_ops_in_the_headers():
    assert len(CPP_OPS) >= MIN_CPP_OPS, CPP_OPS
    assert {"rope", "rope_qk", "qk_norm_rope", "qk_norm_rope_backward", "qk_norm_rope_", "add_alibi_", "learned",
            "sinusoidal", "t5_bias", "mrope_positions"} <= set(CPP_OPS)
    assert "t5_bias_symint" in CPP_FUNCTIONS and "embedding_backward_symint" in CPP_FUNCTIONS
    # Functions of posenc::frequencies, posenc::detail and class members are not posenc's own.
    assert not {"rope_for_length", "multiaxis", "find_op", "forward", "reset_parameters"} & set(CPP_FUNCTIONS)


def test_cpp_exceptions_name_real_functions():
    for function_name, argument in CPP_DEFAULTS:
        assert any(p.name == argument for f in CPP_FUNCTIONS.get(function_name, []) for p in f.parameters), \
            (function_name, argument)
    for function_name in CPP_SKIP:
        assert function_name in CPP_FUNCTIONS and op_of(function_name), function_name


# ---------------------------------------------------------------- the parser itself

PARSER_SAMPLE = r'''
#include <map>  // int not_a_function(int a);
#define DECLARE(name) \
  int name(int a);
// at::Tensor commented(int a);
/* at::Tensor also_commented(int a); */
namespace posenc {
namespace detail { inline int hidden(int a) { return a; } }
template <typename T>
std::map<std::string, std::vector<T>> declared(const std::map<int, std::pair<int, T>>& table,
    std::string_view layout = "a, (b) {c}; // not a comment", std::optional<int64_t> n = std::nullopt,
    std::vector<double> bases = {1.0, 2.5}, const char* s = "quote \" , ;", int64_t big = 1'000);
inline at::Tensor defined(const at::Tensor& x, double scale = 1.0, int64_t offset = -3, bool flag = true,
                          at::ScalarType dtype = at::kFloat, c10::SymInt q = c10::SymInt(0),
                          const Options& options = {}) {
  if (x.defined()) { return helper(x, '}', "{"); }
  return x;
}
struct Options { int a = 0; int method(int b); };
class Module { public: at::Tensor forward(const at::Tensor& x) { return x; } };
namespace nn { at::Tensor in_nn(int a); }
void unnamed(int, const at::Tensor&, const int64_t, unsigned long n);
TORCH_MODULE(Something);
constexpr int kValue = (1 < 2) ? 3 : 4;
}  // namespace posenc
namespace posenc::frequencies { at::Tensor elsewhere(int a); }
namespace other { at::Tensor outside(int a); }
'''


def test_the_parser_reads_declarations_and_inline_definitions():
    found = {f.name: f for f in functions(PARSER_SAMPLE)}
    assert list(found) == ["declared", "defined", "unnamed"]
    declared = found["declared"].parameters
    assert [p.name for p in declared] == ["table", "layout", "n", "bases", "s", "big"]
    assert declared[0] == CppParameter("table", "const std::map<int, std::pair<int, T>>&", None)
    assert [cpp_value(p.default, p.type) for p in declared[1:]] == \
        ["a, (b) {c}; // not a comment", None, [1.0, 2.5], 'quote " , ;', 1000]
    defined = found["defined"].parameters
    assert [p.name for p in defined] == ["x", "scale", "offset", "flag", "dtype", "q", "options"]
    assert [cpp_value(p.default, p.type) for p in defined[1:]] == [1.0, -3, True, torch.float32, 0, []]
    assert [p.name for p in found["unnamed"].parameters] == [None, None, None, "n"]
    assert found["defined"].where == "<text>:13"


def test_cpp_values():
    assert cpp_value("std::nullopt") is None and cpp_value("{}", "std::optional<int64_t>") is None
    assert cpp_value('"neox"') == "neox" and cpp_value("std::string_view(\"gptj\")") == "gptj"
    assert [cpp_value(v) for v in ("1.0", "1.", "0", "128", "10000.0f", "1e-5", "0x10", "-2")] == \
        [1.0, 1.0, 0, 128, 10000.0, 1e-5, 16, -2]
    assert cpp_value("at::kBFloat16") is torch.bfloat16 and cpp_value("c10::ScalarType::Long") is torch.int64
    assert cpp_value("some_function()") == Unread("some_function()")
    assert not same_value(cpp_value("1"), True) and same_value(cpp_value("1"), 1.0)
    assert not same_value(None, NO_DEFAULT) and same_value(NO_DEFAULT, NO_DEFAULT)
