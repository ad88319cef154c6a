"""The docs' pointers into the code stay true: every file path in backticks in README.md and
docs/*.md (``dir/file.py``, ``.md``, ``.sh``, ``.toml``) exists, and every ``path.py::name`` (a
following ``::name`` means the same file; a bare ``test_x.py`` lives in tests/) names a file of the
repository that defines ``name`` as a function, class or assigned name."""

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REFERENCE = re.compile(r"`([\w/.]*\.py)?::(\w+)`")
PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|toml))(?:::\w+)?`")


@functools.cache
def _defined(path: Path) -> frozenset[str]:
    """Every function, class and assigned name in the file, at any depth."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def _resolve(path: str) -> Path:
    for candidate in (ROOT / path, ROOT / "tests" / path):
        if candidate.is_file():
            return candidate
    return ROOT / path


def _references(doc: Path) -> list[tuple[str, str]]:
    """``(file as written, name)`` for each reference of ``doc``, in order."""
    out, last = [], None
    for m in REFERENCE.finditer(doc.read_text()):
        last = m.group(1) or last
        if last is None:
            raise AssertionError(f"{doc.name}: `::{m.group(2)}` follows no file")
        out.append((last, m.group(2)))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_code_reference_names_something_defined(doc):
    missing = []
    for path, name in _references(doc):
        file = _resolve(path)
        if not file.is_file():
            missing.append(f"{path}::{name} (no such file)")
        elif name not in _defined(file):
            missing.append(f"{path}::{name}")
    assert not missing, f"{doc.name} points at what the code no longer has: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_path_exists(doc):
    missing = sorted({p for p in PATH.findall(doc.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{doc.name} names files the repository does not have: {missing}"


def test_the_check_finds_a_stale_name(tmp_path):
    """A reference to a name its file does not define is reported (the check can fail)."""
    doc = tmp_path / "doc.md"
    doc.write_text("`tests/test_docs_references.py::_defined`, `::no_such_function`")
    refs = _references(doc)
    assert refs == [("tests/test_docs_references.py", "_defined"),
                    ("tests/test_docs_references.py", "no_such_function")]
    assert [name in _defined(_resolve(p)) for p, name in refs] == [True, False]
