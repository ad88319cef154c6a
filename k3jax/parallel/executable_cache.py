"""Compiled programs, and the shapes they are traced from, kept on disk under a key known before
tracing, so a resumed run skips the trace and the lowering of its train step.

jax's persistent compilation cache is keyed by the lowered program: every start traces and lowers
the step before it can look it up (10.5 s for ``k3_small`` on an H200, most of it lowering the
Pallas kernels). Here the key is what the program is made from: the caller's description of it
(for the train step: the model and optimiser configs and the micro-batch count), its abstract
arguments with their shardings, the mesh's devices, the source of ``k3jax`` and
``pallas_kernels``, the versions of jax and the libraries the step calls, jax's configuration, the
``XLA_*`` / ``JAX_*`` environment and the devices' kind and runtime. A change in any of them is a
miss: the program is traced, lowered and compiled as without this cache, then stored. Plain values
made by tracing (the model's variable shapes, which take a trace of the whole initialiser) are kept
the same way by :func:`load_or_make`, under :func:`value_key`.

What the key cannot see is a library changed in place under an unchanged version (an editable
install of jax or flax): delete the cache directory after editing one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import re
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

import jax
from jax.experimental import serialize_executable

from k3jax.files import write_atomically

SOURCE_PACKAGES = ("k3jax", "pallas_kernels")
# Distributions whose code runs while the step is traced or compiled.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "chex", "numpy", "ml_dtypes")
ENV_PREFIXES = ("XLA_", "JAX_", "TF_", "NVIDIA_", "MOSAIC_", "CUDA_")
# jax options about caching, logging and jax's own tests, which do not change a program. The test
# options exist only once a module has imported jax's test utilities (the Mosaic GPU ragged dot
# does, when a trace first reaches it): kept in the key, a run that traced before computing it
# (the initialiser, for the variables' shapes) and one that did not (the shapes read back) had
# different keys for one program, and a resumed run compiled its step again.
IGNORED_OPTIONS = ("jax_compilation_cache", "jax_persistent_cache", "jax_log", "jax_explain",
                   "jax_debug_log", "jax_logging", "jax_test", "jax_num_generated_cases",
                   "jax_skip_slow_tests")
KEEP = 8  # programs kept per directory, the most recently used (k3_small's step: 29 MB)
KEEP_VALUES = 64  # values kept per directory (k3_small's variable shapes: 21 kB)
T = TypeVar("T")


def source_digest(roots: Iterable[Path]) -> str:
    """sha256 of every ``*.py`` file under ``roots`` (relative paths and bytes, in sorted order)."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _package_roots() -> list[Path]:
    roots = []
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(Path(p) for p in spec.submodule_search_locations)
    return roots


def _library_versions() -> dict[str, str]:
    versions = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and (name in LIBRARIES or name.startswith("jax")):
            versions[name] = dist.version
    return dict(sorted(versions.items()))


def environment() -> dict:
    """What the key takes from the process: sources, library versions, jax's options, the
    ``XLA_*`` / ``JAX_*`` environment and the backend's runtime."""
    backend = jax.devices()[0].client
    if jax.default_backend() == "gpu":
        _import_mosaic_gpu()
    return {
        "sources": source_digest(_package_roots()),
        "versions": _library_versions(),
        "options": {k: repr(v) for k, v in sorted(jax.config.values.items())
                    if k.startswith("jax_") and not k.startswith(IGNORED_OPTIONS)},
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(ENV_PREFIXES)},
        "runtime": (backend.platform, backend.platform_version),
    }


def _import_mosaic_gpu() -> None:
    """Import jax's Mosaic GPU module, which sets ``MOSAIC_GPU_*`` variables when imported (the
    CUDA and runtime library paths, and NVSHMEM's where that is installed). The kernels import it
    inside their first trace: a run that traced before computing its key (the initialiser, for
    the variables' shapes) and a resumed one that did not (the shapes read back) would otherwise
    see different environments, and the resumed run compiled its step again. Importing it first
    keeps whatever it sets, on any install, out of that difference. Only on GPUs: elsewhere no
    trace imports it, and the import costs a start-up 0.2 s."""
    with contextlib.suppress(ImportError):
        import jax.experimental.mosaic.gpu  # noqa: F401


def _abstract(x) -> tuple:
    return (tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None)))


def value_key(description: object) -> str:
    """The cache key of what ``description`` makes in this process: its ``repr`` (which must name
    everything the value is made from besides the source, e.g. frozen configs) and
    :func:`environment`."""
    return digest({"value": repr(description), **environment()})


def program_parts(description: object, args: tuple, mesh: jax.sharding.Mesh) -> dict:
    """What a program's key is made of, by name: ``description`` (as in :func:`value_key`), its
    (abstract) ``args`` with their shardings, ``mesh`` and :func:`environment`'s parts. Stored
    beside the program, so a miss can say which of them changed
    (:meth:`ExecutableCache.differences`)."""
    devices = [(d.id, d.device_kind) for d in mesh.devices.flat]
    return {"program": repr(description),
            "arguments": repr((str(jax.tree.structure(args)),
                               [_abstract(x) for x in jax.tree.leaves(args)])),
            "mesh": repr((mesh.axis_names, mesh.devices.shape, devices)),
            **environment()}


def digest(parts: dict) -> str:
    """A key from named parts (JSON values): 32 hex digits of their sha256."""
    return hashlib.sha256(_json(parts).encode()).hexdigest()[:32]


def _json(parts: dict) -> str:
    return json.dumps(parts, sort_keys=True, default=repr)


def _differing(stored, now, name: str = "") -> list[str]:
    """The dotted names of the leaves in which two JSON values differ."""
    if isinstance(stored, dict) and isinstance(now, dict):
        return [n for k in sorted(set(stored) | set(now))
                for n in _differing(stored.get(k), now.get(k), f"{name}.{k}" if name else k)]
    return [] if stored == now else [name]


def load_or_make(directory: str | Path, key: str, make: Callable[[], T]) -> T:
    """The value stored in ``directory`` under ``key``, else ``make()``'s, stored there atomically
    for the next process (a file that does not load is made again; the oldest files beyond
    :data:`KEEP_VALUES` are removed). Values are pickled: keep the directory your own."""
    path = Path(directory) / f"{key}.pickle"
    try:
        value = pickle.loads(path.read_bytes())
        os.utime(path)  # most recently used: kept longest
        return value
    except Exception:  # noqa: BLE001 - missing, truncated or from another version: make it again
        pass
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, pickle.dumps(value))
    _keep_newest(path.parent, "*.pickle", KEEP_VALUES)
    return value


def _by_last_use(directory: Path, pattern: str) -> list[Path]:
    """The files matching ``pattern``, the least recently used first (loads touch theirs)."""
    return sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime)


def _keep_newest(directory: Path, pattern: str, keep: int) -> list[Path]:
    """Remove all but the ``keep`` most recently used files matching ``pattern``; returns the
    removed paths."""
    files = _by_last_use(directory, pattern)
    for old in files[:-keep]:
        old.unlink(missing_ok=True)
    return files[:-keep]


class ExecutableCache:
    """Compiled programs in ``directory``, one file per key, each with its key's parts beside it:
    :meth:`load`, :meth:`store`, :meth:`differences`. Programs are named by the parts of their
    key (:func:`program_parts`), whose :func:`digest` names the files.

    For single-process runs only (the caller checks :func:`usable`): a multi-process program is
    compiled by every process for its own devices.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path(self, parts: dict) -> Path:
        return self.directory / f"{digest(parts)}.executable"

    def has(self, parts: dict) -> bool:
        return self.path(parts).is_file()

    def load(self, parts: dict) -> list[jax.stages.Compiled]:
        """The programs stored under ``parts`` (raises if there are none or they do not load)."""
        path = self.path(parts)
        entry = pickle.loads(path.read_bytes())
        os.utime(path)  # most recently used: kept longest
        register_handlers(entry["targets"])
        return [serialize_executable.deserialize_and_load(*p) for p in entry["programs"]]

    def store(self, parts: dict, programs: Sequence[jax.stages.Compiled]) -> Path:
        """``programs`` written under ``parts`` atomically (a crash leaves no partial file), the
        parts beside them (``KEY.json``); the oldest programs beyond :data:`KEEP` are removed with
        their parts."""
        targets = sorted({t for p in programs for t in custom_call_targets(p.as_text())})
        blob = pickle.dumps({"targets": targets,
                             "programs": [serialize_executable.serialize(p) for p in programs]})
        path = self.path(parts)
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(path.with_suffix(".json"), _json(parts))
        write_atomically(path, blob)
        for old in _keep_newest(self.directory, "*.executable", KEEP):
            old.with_suffix(".json").unlink(missing_ok=True)
        return path

    def differences(self, parts: dict) -> list[str]:
        """The names of the parts (``env.XLA_FLAGS``, ``options.jax_enable_x64``, ``program``,
        ...) in which the most recently used program's differ from ``parts``: why they missed.
        Empty when ``parts`` are stored (nothing missed: a stored file that did not load has
        nothing to explain) or nothing is."""
        if self.has(parts):
            return []
        try:
            newest = _by_last_use(self.directory, "*.executable")[-1]
            stored = json.loads(newest.with_suffix(".json").read_text())
        except (IndexError, OSError, ValueError):
            return []
        return _differing(stored, json.loads(_json(parts)))


def custom_call_targets(hlo_text: str) -> set[str]:
    """The custom-call targets a compiled module's HLO text calls."""
    return set(re.findall(r'custom_call_target="([^"]+)"', hlo_text))


def register_handlers(targets: Iterable[str]) -> None:
    """Registers the handlers of ``targets`` that jax registers only when it lowers a call to them.

    A program loaded in a process that lowered nothing would call an unregistered handler and
    crash (as ``jax.export`` knows: it registers the CPU's LAPACK handlers before it calls a
    deserialized program).
    """
    if any(t.startswith("mosaic_gpu") for t in targets):
        import jax.experimental.mosaic.gpu  # noqa: F401 - its extension registers the handler


def usable() -> bool:
    """Whether programs can be cached here: one process (see :class:`ExecutableCache`) on GPUs.

    Not on the CPU: XLA:CPU's deserialized programs failed there (a process that had compiled
    the same step for another sweep point loaded it and stopped at its first call with
    ``NOT_FOUND: Function wrapped_divide not found``), while jax's own cache, which never reloads
    a program the process compiled, works; a CPU step compiles in seconds anyway.
    """
    return jax.process_count() == 1 and jax.default_backend() == "gpu"


__all__ = ["ExecutableCache", "custom_call_targets", "digest", "environment", "load_or_make",
           "program_parts", "register_handlers", "source_digest", "usable", "value_key"]
