"""Reading and writing Hugging Face safetensors directories, one shard at a time.

A directory holds ``model.safetensors`` or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file). Reading opens one shard at a time and copies out one
tensor at a time, so host memory holds at most one tensor beyond what the caller keeps.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFDirectory:
    """The tensors of a safetensors directory: names, shapes and dtypes from the headers only."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE).is_file():
            with safe_open(self.directory / SINGLE, "numpy") as f:
                weight_map = {k: SINGLE for k in f.keys()}  # noqa: SIM118 (a safe_open handle)
        else:
            raise FileNotFoundError(f"{self.directory}: neither {INDEX} nor {SINGLE}")
        self.shard_of: dict[str, str] = weight_map
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for shard in self.shards():
            with safe_open(self.directory / shard, "numpy") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle)
                    s = f.get_slice(name)
                    self.shapes[name], self.dtypes[name] = tuple(s.get_shape()), s.get_dtype()
        listed_missing = sorted(set(weight_map) - set(self.shapes))
        if listed_missing:
            raise FileNotFoundError(f"{index}: tensors listed but absent from their shards: "
                                    f"{listed_missing[:8]}")

    def shards(self) -> list[str]:
        return sorted(set(self.shard_of.values()))

    def names_by_shard(self) -> dict[str, list[str]]:
        out = defaultdict(list)
        for name, shard in self.shard_of.items():
            out[shard].append(name)
        return out

    def read(self, name: str) -> np.ndarray:
        """One tensor (opens its shard lazily; nothing else is read)."""
        with safe_open(self.directory / self.shard_of[name], "numpy") as f:
            return f.get_tensor(name)

    def iter_shard(self, shard: str, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        with safe_open(self.directory / shard, "numpy") as f:
            for name in names:
                yield name, f.get_tensor(name)


def write_sharded(directory: str | Path, tensors: Iterator[tuple[str, np.ndarray]],
                  sizes: dict[str, int], max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` (name, array; produced lazily, in order) into shards of at most
    ``max_shard_bytes`` (a larger tensor gets a shard of its own) with an index; one file
    ``model.safetensors`` without index when everything fits. ``sizes`` gives every tensor's byte
    size in advance, so the shard count is known before the first file is written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    groups, current, used = [], [], 0
    for name, n in sizes.items():
        if current and used + n > max_shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    groups.append(current)
    files = ([SINGLE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    shard_of = {name: files[g] for g, names in enumerate(groups) for name in names}
    pending: dict[str, np.ndarray] = {}
    remaining = {f: len(names) for f, names in zip(files, groups)}
    for name, array in tensors:
        pending[name] = array
        f = shard_of[name]
        remaining[f] -= 1
        if remaining[f] == 0:
            save_file({k: pending.pop(k) for k in list(pending) if shard_of[k] == f},
                      str(directory / f), metadata={"format": "pt"})
    if len(files) > 1:
        (directory / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": int(sum(sizes.values()))}, "weight_map": shard_of},
            indent=1))
    return files


__all__ = ["INDEX", "SINGLE", "HFDirectory", "write_sharded"]
