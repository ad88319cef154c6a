"""Files that a kill cannot leave half-written."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all: a process killed mid-write leaves the old
    file (or none) in place, never a truncated one that the next reader fails on. The text goes to
    a temporary file beside ``path`` first, then :func:`os.replace` swaps it in."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
