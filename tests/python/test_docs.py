"""Every promise the docs make has a test behind it: each row of a `| promise | held by |` table in docs/ names at
least one test, and every test it names exists (pytest functions as `file.py::test_name[params]`, `::test_name`
for the file named before it in the cell, GoogleTest cases as `Suite.Test`, scripts by path). The guarantees page
and each integration page must hold such a table, so that a new "works with" claim comes with its test."""
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PYTHON_TESTS = ROOT / "tests" / "python"
# The pages whose promises are integrations or guarantees: each must keep a promise table.
PAGES_WITH_PROMISES = ["guarantees.md", "integrations-transformers.md", "export.md", "distributed.md", "vision.md"]

_CELL_REFERENCE = re.compile(r"`([^`]+)`")
_GTEST = re.compile(r"^([A-Z]\w*)\.([A-Z]\w*\*?)$")


def promise_rows(page):
    """(line number, promise, held-by cell) of every row of every promise table on the page."""
    rows, in_table = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            in_table = False
        elif [c.lower() for c in cells] == ["promise", "held by"]:
            in_table = True
        elif in_table and not set(line) <= set("|- "):
            rows.append((number, cells[0], "|".join(cells[1:])))
    return rows


def python_test_names(path):
    return set(re.findall(r"^\s*(?:async\s+)?def (test\w+)\(", path.read_text(), re.MULTILINE))


def cpp_test_names():
    names = set()
    for path in (ROOT / "tests" / "cpp").glob("*.cpp"):
        names |= {f"{suite}.{name}" for suite, name in
                  re.findall(r"^TEST(?:_F|_P)?\((\w+),\s*(\w+)\)", path.read_text(), re.MULTILINE)}
    return names


def resolve(cell, cpp_names):
    """The references of a held-by cell: (resolved, unresolved) lists."""
    resolved, unresolved, current_file = [], [], None
    for token in _CELL_REFERENCE.findall(cell):
        token = token.strip()
        if "::" in token and (token.startswith("::") or token.split("::")[0].endswith(".py")):
            file_part, _, test_part = token.partition("::")
            if file_part:
                current_file = ROOT / file_part if "/" in file_part else PYTHON_TESTS / file_part
            name = re.sub(r"\[.*$", "", test_part)
            found = current_file is not None and current_file.exists() and \
                any(fnmatch.fnmatchcase(n, name) for n in python_test_names(current_file))
            (resolved if found else unresolved).append(token)
        elif _GTEST.match(token) and token not in ("Suite.Test",):
            found = any(fnmatch.fnmatchcase(n, token) for n in cpp_names)
            (resolved if found else unresolved).append(token)
        elif token.endswith((".py", ".sh", ".cpp")) and "/" in token:
            (resolved if (ROOT / token).exists() else unresolved).append(token)
        elif token.endswith(".py") and (PYTHON_TESTS / token).exists():
            current_file = PYTHON_TESTS / token
            resolved.append(token)
    return resolved, unresolved


@pytest.mark.parametrize("page", PAGES_WITH_PROMISES)
def test_every_promise_names_tests_that_exist(page):
    rows = promise_rows(DOCS / page)
    assert rows, f"docs/{page} has no `| promise | held by |` table"
    cpp_names = cpp_test_names()
    problems = []
    for number, promise, cell in rows:
        resolved, unresolved = resolve(cell, cpp_names)
        if unresolved:
            problems.append(f"docs/{page}:{number}: no such test {unresolved}")
        if not resolved:
            problems.append(f"docs/{page}:{number}: '{promise[:60]}' names no test")
    assert not problems, "\n".join(problems)


def test_every_docs_page_with_a_promise_table_is_checked():
    pages = sorted(p.name for p in DOCS.glob("*.md") if promise_rows(p))
    assert sorted(set(pages) - set(PAGES_WITH_PROMISES)) == []


def test_a_missing_test_is_found():
    """The checker itself: a row naming a test that does not exist, or none, is reported."""
    cpp_names = cpp_test_names()
    assert resolve("`test_domain.py::test_no_such_thing`", cpp_names) == ([], ["test_domain.py::test_no_such_thing"])
    assert resolve("`Domain.NoSuchCase`", cpp_names) == ([], ["Domain.NoSuchCase"])
    assert resolve("a sentence", cpp_names) == ([], [])
    assert resolve("`test_domain.py::test_positions_outside_the_domain_are_an_error`, `::test_nope`",
                   cpp_names)[1] == ["::test_nope"]
