"""jax's persistent compilation cache for runs, seeded with the XLA autotuning results k3jax ships.

On a GPU, XLA picks each matmul fusion's tiling by compiling and timing candidates: 19-31 s of
``k3_small``'s 50-75 s compile on an H200. With the persistent cache on, jax points XLA at a
per-fusion autotuning directory inside it (``xla_gpu_per_fusion_autotune_cache_dir``): one small
file per fusion, under a subdirectory named for the GPU model and XLA's autotuning version, named
for the fusion's HLO. XLA reads a fusion's result from there instead of tuning it, and writes the
ones it tunes.

``k3jax/parallel/autotune/`` holds such results for the presets as the training loop compiles
them (one JSON table per subdirectory, each file's bytes in base64). Before it compiles a train
step, the loop copies the ones tuned on its kind of GPU that the cache lacks into it
(:func:`seed_cache_in_use`), so a first run on that GPU with these library versions skips their
tuning. A fusion the tables do not have (another width, batch or library version, a changed
model) is tuned as before; on another device nothing is copied. The files are XLA's own format,
copied byte for byte: XLA checks them as it checks what it wrote itself.

Refresh the tables after a change to the presets' programs: run ``train.py`` on the GPU with an
empty cache directory (``JAX_COMPILATION_CACHE_DIR``), then
``python3 -m k3jax.parallel.compile_cache pack DIR`` (docs/runs.md).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import warnings
from pathlib import Path

from k3jax.files import write_atomically

# The directory jax names after XLA's flag, inside the compilation cache (jax._src.compiler).
AUTOTUNE_DIR = "xla_gpu_per_fusion_autotune_cache_dir"
SHIPPED = Path(__file__).with_name("autotune")
MIN_COMPILE_S = 1.0  # programs that compile faster are not worth a cache file


def use_compilation_cache(default: str | Path) -> Path:
    """Turn on jax's persistent compilation cache at ``$JAX_COMPILATION_CACHE_DIR`` or
    ``default``; returns the directory. Call it before anything compiles. Nothing is written
    yet: the directory may not be usable (a mistaken workdir), which the run reports itself."""
    import jax

    cache = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or default).resolve()
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    return cache


def seed_cache_in_use() -> int:
    """:func:`seed` jax's persistent compilation cache, when one is on, with the tables tuned on
    this process's kind of device (none on a CPU, where XLA tunes nothing); returns how many
    results were written. A cache that cannot be written to costs the run its speed-up, not the
    run: a warning says why."""
    import jax

    directory = jax.config.jax_compilation_cache_dir
    if not (jax.config.jax_enable_compilation_cache and directory):
        return 0
    try:
        return seed(directory, _device_kind())
    except OSError as e:
        warnings.warn(f"the shipped XLA autotuning results were not copied into {directory}: {e}")
        return 0


def seed(cache: str | Path, device: str | None = None, tables: str | Path = SHIPPED) -> int:
    """Write every autotuning result of ``tables`` (those tuned on ``device``, a
    ``device_kind``; None: all) that ``cache`` lacks; returns how many.

    Results already in ``cache`` are kept: they come from this machine. Each file is written
    atomically, so processes seeding one cache at once never leave a partial file.
    """
    written = 0
    for table in sorted(Path(tables).glob("*.json")):
        record = json.loads(table.read_text())
        if device is not None and record["device"] != device:
            continue
        folder = Path(cache) / AUTOTUNE_DIR / record["subdirectory"]
        missing = [name for name in record["results"] if not (folder / name).exists()]
        if missing:
            folder.mkdir(parents=True, exist_ok=True)
        for name in missing:
            write_atomically(folder / name, base64.b64decode(record["results"][name]))
        written += len(missing)
    return written


def pack(cache: str | Path, tables: str | Path = SHIPPED, device: str | None = None) -> list[Path]:
    """Add the autotuning results in ``cache`` to the tables in ``tables`` (one per
    subdirectory; a result of the same name is replaced); returns the tables written.
    ``device``: the GPU model the results were tuned on, recorded in the table."""
    root = Path(cache) / AUTOTUNE_DIR
    if not root.is_dir():
        raise FileNotFoundError(f"cache={str(cache)!r}: no {AUTOTUNE_DIR}/ in it; expected the "
                                "compilation cache of a run on a GPU")
    written = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        table = Path(tables) / f"{folder.name}.json"
        old = json.loads(table.read_text()) if table.exists() else {}
        results = {**old.get("results", {}),
                   **{p.name: base64.b64encode(p.read_bytes()).decode()
                      for p in folder.iterdir() if p.is_file()}}
        record = {"subdirectory": folder.name, "device": device or old.get("device"),
                  "versions": _jax_versions(), "results": dict(sorted(results.items()))}
        Path(tables).mkdir(parents=True, exist_ok=True)
        written.append(write_atomically(table, json.dumps(record, indent=0) + "\n"))
    return written


def _device_kind() -> str:
    """The ``device_kind`` of this process's first device (starts jax's backend: call it once
    ``jax.distributed`` is set up)."""
    import jax

    return jax.devices()[0].device_kind


def _jax_versions() -> dict[str, str]:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("jax", "jaxlib")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Add the autotuning results of a run's compilation "
                                 "cache to the tables k3jax ships.")
    ap.add_argument("command", choices=["pack"])
    ap.add_argument("cache", help="the run's compilation cache directory")
    ap.add_argument("--tables", default=str(SHIPPED), help="where the tables are")
    args = ap.parse_args(argv)
    try:
        tables = pack(args.cache, args.tables, _device_kind())
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    for table in tables:
        print(table)


if __name__ == "__main__":
    main()
