"""Documents from paths: text files, directories, ``.jsonl`` and ``.xz`` / ``.tar.xz`` archives.

A document is ``(group, name, data)``: ``data`` is raw UTF-8 bytes, ``group`` the unit of the
held-out split. Files larger than ``max_doc_bytes`` are cut at paragraph breaks into several
documents, so a corpus of a few huge files (debtext) still has many documents to pack and split.
Their pieces are grouped into sections of ``SECTION_PIECES`` consecutive pieces: neighbouring pieces
land on the same side of the split, yet a corpus of a dozen large files can still hold out about the
asked fraction (with whole files as the unit, 1% of debtext's 12 files would be one whole file,
5-25%).
"""

from __future__ import annotations

import json
import lzma
import sysconfig
import tarfile
from pathlib import Path
from typing import Iterator, NamedTuple

STDLIB = "stdlib"  # the default source: the running interpreter's standard library (.py files)
SECTION_PIECES = 16  # ~1 MB sections at the default 64 KiB pieces
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", "idle_test"}


class Document(NamedTuple):
    group: str
    name: str
    data: bytes


def iter_documents(sources: list[str], max_doc_bytes: int) -> Iterator[Document]:
    """All documents of ``sources`` in a deterministic order."""
    for source in sources:
        if source == STDLIB:
            yield from _from_stdlib(max_doc_bytes)
            continue
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"--source {source!r}: no such file or directory")
        if path.is_dir():
            for f in directory_files(path):
                yield from _from_file(f, max_doc_bytes, skip_binary=True)
        else:
            yield from _from_file(path, max_doc_bytes, skip_binary=False)


def directory_files(root: Path) -> list[Path]:
    """The files a directory source reads, in order: every file below ``root`` but hidden ones
    and ``__pycache__``."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p, root))


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _from_stdlib(max_doc_bytes: int) -> Iterator[Document]:
    root = stdlib_dir()
    for f in sorted(root.rglob("*.py")):
        if not _SKIP_DIRS.intersection(f.relative_to(root).parts[:-1]):
            yield from split_document(str(f), f.read_bytes(), max_doc_bytes)


def _hidden(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).parts
    return any(p.startswith(".") or p == "__pycache__" for p in parts)


def _from_file(path: Path, max_doc_bytes: int, skip_binary: bool) -> Iterator[Document]:
    name = path.name
    if name.endswith((".tar.xz", ".tar.gz", ".tar", ".tgz", ".txz")):
        yield from _from_tar(path, max_doc_bytes)
    elif name.endswith(".jsonl"):
        yield from _from_jsonl(str(path), path.read_bytes())
    elif name.endswith(".xz"):
        yield from split_document(str(path), lzma.decompress(path.read_bytes()), max_doc_bytes)
    else:
        data = path.read_bytes()
        if skip_binary and b"\0" in data[:8192]:
            return  # a directory may hold images or compiled files; they are not text
        yield from split_document(str(path), data, max_doc_bytes)


def _from_tar(path: Path, max_doc_bytes: int) -> Iterator[Document]:
    with tarfile.open(path, "r:*") as tar:
        for member in sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name):
            data = tar.extractfile(member).read()
            group = f"{path}:{member.name}"
            if member.name.endswith(".jsonl"):
                yield from _from_jsonl(group, data)
            elif b"\0" not in data[:8192]:
                yield from split_document(group, data, max_doc_bytes)


def _from_jsonl(group: str, data: bytes) -> Iterator[Document]:
    """One document per line: the ``text`` field, else the first string field."""
    for i, line in enumerate(data.splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{group}: line {i + 1} is not JSON ({e.msg})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if text is None and isinstance(record, dict):
            text = next((v for v in record.values() if isinstance(v, str)), None)
        if text is None and isinstance(record, str):
            text = record
        if text:
            # Every record is its own group: a jsonl file is usually one corpus of many documents.
            yield Document(f"{group}#{i}", f"{group}#{i}", text.encode("utf-8"))


def split_document(group: str, data: bytes, max_doc_bytes: int) -> Iterator[Document]:
    """Cut ``data`` into pieces of at most ``max_doc_bytes``, preferring paragraph breaks."""
    if max_doc_bytes <= 0:  # a piece of no bytes never advances: the loop below would not end
        raise ValueError(f"max_doc_bytes={max_doc_bytes} is invalid: expected a positive number "
                         "of bytes")
    start, piece = 0, 0
    while start < len(data):
        end = min(start + max_doc_bytes, len(data))
        if end < len(data):
            cut = data.rfind(b"\n\n", start + 1, end)
            cut = cut if cut > start else data.rfind(b"\n", start + 1, end)
            end = cut + 1 if cut > start else end
        if data[start:end].strip():
            yield Document(f"{group}@{piece // SECTION_PIECES}", f"{group}#{piece}",
                           data[start:end])
        start, piece = end, piece + 1
