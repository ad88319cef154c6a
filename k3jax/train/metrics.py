"""Metrics to ``metrics.jsonl`` (one JSON object per line) and TensorBoard event files.

Records are flat dicts ``{"step": int, "kind": "train" | "eval" | ..., name: value}``; a value is a
number or a (nested) list for per-layer arrays (MaxVio per MoE layer, AttnRes depth weights). On
resume, records after the restored step are dropped first, so the file never holds a step twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from k3jax.files import write_atomically

METRICS_FILE = "metrics.jsonl"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts/tuples of arrays -> ``{"a/b/c": value}`` (scalars as floats, arrays as
    lists)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = prefix + jax.tree_util.keystr(path, simple=True, separator="/")
        arr = np.asarray(leaf)
        out[name] = float(arr) if arr.ndim == 0 else arr.astype(np.float64).tolist()
    return out


def read_metrics(workdir: str | Path) -> list[dict]:
    path = Path(workdir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write
    return records


class MetricsWriter:
    def __init__(self, workdir: str | Path, resume_step: int = 0, tensorboard: bool = True,
                 enabled: bool = True):
        """``enabled=False`` (every process but the first of a multi-process run) writes nothing."""
        self.path = Path(workdir) / METRICS_FILE
        self._file, self._tb = None, None
        if not enabled:
            return
        kept = [r for r in read_metrics(workdir) if r.get("step", 0) <= resume_step]
        if resume_step == 0:
            kept = []
        write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # e.g. a GPU image without it: JSONL alone still has everything
                print("[metrics] tensorboardX is not installed: writing metrics.jsonl only")
                return
            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"), purge_step=resume_step + 1
                                     if resume_step else None)

    def write(self, step: int, kind: str, values: dict[str, Any]) -> dict:
        record = {"step": int(step), "kind": kind, **{k: _clean(v) for k, v in values.items()}}
        if self._file is None:
            return record
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in record.items():
                if name in ("step", "kind"):
                    continue
                self._tb_add(f"{kind}/{name}", value, step)
        return record

    def _tb_add(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, (int, float)) and value is not None and math.isfinite(value):
            self._tb.add_scalar(tag, value, step)
        elif isinstance(value, list):
            arr = np.asarray(value, dtype=np.float64)
            if arr.size <= 64:
                for i, v in enumerate(arr.ravel()):
                    if math.isfinite(v):
                        self._tb.add_scalar(f"{tag}/{i}", float(v), step)
            elif np.isfinite(arr).all():
                self._tb.add_histogram(tag, arr, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _clean(value: Any) -> Any:
    """JSON-safe: numpy scalars to floats, non-finite to None."""
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (str, bool)):
        return value
    v = float(value)
    return v if math.isfinite(v) else None
