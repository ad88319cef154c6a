"""Checkpoints with orbax: asynchronous saves, keep the newest N, exact resume, verified restores.

A checkpoint holds two items: ``state`` (the whole training state of :mod:`k3jax.train.step`:
parameters, optimiser state, MoE ``balance`` biases, step, RNG, non-finite counters) and ``meta``
(JSON: the resolved config, the step and the data position).

Orbax 0.12.4 checks no content on restore (its zarr3 layout checksums only the shard index; bytes
changed inside a data file restore silently), so the last act of every save is a manifest
(:data:`MANIFEST`: the size of every file of the step directory and the SHA-256 of each of its
pieces of :data:`HASH_PIECE_BYTES`, hashed on all cores), and a checkpoint is restored only after
its files match it. A checkpoint that does not (no manifest: the save never
finished; a file changed, missing or extra) is named in one line, moved to
``checkpoints_unrestorable/`` and the next older one is tried. A config whose model, optimiser or
data differs from the checkpoint's (:data:`MUST_MATCH`) is an error naming the differing fields;
a shape that differs names the parameter. A save that fails (disk full, permissions) is one line
naming the path and the reason; its temporary files are removed, older checkpoints stay, and the
run stops or goes on as ``checkpoint.on_save_error`` says.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from k3jax.config.base import ConfigError
from k3jax.config.experiment import SCHEDULE_FIELDS
from k3jax.files import write_atomically

# Sections of the config that must match to resume (the rest, e.g. train.steps, may change).
MUST_MATCH = ("model", "optim", "data", "train.micro_batches")
# Fields inside MUST_MATCH that may differ: how a result is computed or where a file is kept, not
# what it is (a run may resume with another value, and from checkpoints made before the field
# existed); the learning-rate schedule, which a resume re-plans (k3jax.train.resume); and the
# record of the built corpus, which the data fields compared here made.
MAY_DIFFER = ("model.mla.documents", "data.cache_dir", "data.corpus",
              *(f"optim.{name}" for name in SCHEDULE_FIELDS))
MANIFEST = "content_sha256.json"
# A file is hashed in pieces of this size, the pieces of all files at once on a thread each (the
# hash and the reads let go of the interpreter lock): one SHA-256 of a large state's one big file
# is a single core's work, seconds on every save and resume. A manifest without "piece_bytes"
# (written before) has one SHA-256 per whole file.
HASH_PIECE_BYTES = 64 << 20
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax names an unfinished save STEP.orbax-checkpoint-tmp-T
UNRESTORABLE = "checkpoints_unrestorable"


class CheckpointSaveError(RuntimeError):
    """A save failed and ``checkpoint.on_save_error`` is ``stop``."""


class CheckpointDamaged(Exception):
    """A step directory's files do not match its manifest (or it has none)."""


class Checkpointer:
    """``verified``: checks of step directories' files already started
    (:func:`verify_newest_ahead`), which :meth:`newest_usable` takes instead of hashing again."""

    def __init__(self, directory: str | Path, keep: int, async_save: bool = True,
                 log: Callable[[str], Any] = print, on_save_error: str = "stop",
                 verified: dict[int, Future] | None = None):
        self.directory = Path(directory).resolve()
        self.log, self.async_save, self.on_save_error = log, async_save, on_save_error
        self._verified = dict(verified or {})
        self._pending: int | None = None
        self._finished: set[int] = set()  # saves this process saw complete (before any manifest)
        options = ocp.CheckpointManagerOptions(
            # max_to_keep is deprecated in orbax 0.12.4: a preservation policy keeps the newest N.
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # a save killed half-way leaves a tmp dir: drop it
            create=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Start saving ``step`` (asynchronously when so configured); the previous save is finished
        and given its manifest first."""
        self.wait()
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - any failure of the write is reported the same way
            self._save_failed(step, e)
            return
        self._pending = step
        if not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight, if any, and write its manifest."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
            if jax.process_index() == 0:
                write_manifest(self.step_path(step))
        except Exception as e:  # noqa: BLE001
            self._save_failed(step, e)
            return
        self._finished.add(step)

    def poll(self) -> None:
        """Give a finished asynchronous save its manifest now (called every step), so a run
        killed later keeps it as a verified checkpoint."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()

    def last_good_step(self) -> int | None:
        steps = [s for s in self.manager.all_steps()
                 if s in self._finished or (self.step_path(s) / MANIFEST).is_file()]
        return max(steps) if steps else None

    def _save_failed(self, step: int, error: Exception) -> None:
        """Remove what the failed save left (orbax's temporary directory, a step directory without
        manifest), then stop or go on as configured."""
        if jax.process_index() == 0:
            for tmp in self.directory.glob(f"{step}{TMP_SUFFIX}*"):
                shutil.rmtree(tmp, ignore_errors=True)
            if not (self.step_path(step) / MANIFEST).is_file():
                shutil.rmtree(self.step_path(step), ignore_errors=True)
        self.manager.reload()
        good = self.last_good_step()
        newest = self.step_path(good) if good is not None else "none"
        what = (f"saving step {step} to {self.step_path(step)} failed ({_reason(error)}); "
                f"newest good checkpoint: {newest}")
        if self.on_save_error == "stop":
            raise CheckpointSaveError(f"{what}. Stopping (checkpoint.on_save_error=stop)")
        self.log(f"[checkpoint] error: {what}; "
                 "training goes on (checkpoint.on_save_error=continue)")

    # -- restoring ---------------------------------------------------------------------------

    def newest_usable(self, config: dict, abstract_state: Any,
                      move_aside: bool = True) -> tuple[int, dict] | None:
        """``(step, meta)`` of the newest checkpoint whose files match their manifest and whose
        metadata restores; None when there is none. Damaged ones are reported (and moved aside).

        ``config`` (the resolved config dict of this run) must agree with the checkpoint's on
        :data:`MUST_MATCH` and ``abstract_state`` (shapes) with its arrays, else ConfigError.
        Reads metadata only: nothing is compiled or restored.
        """
        for step in sorted(self.manager.all_steps(), reverse=True):
            path = self.step_path(step)
            try:
                checking = self._verified.pop(step, None)
                checking.result() if checking is not None else verify_manifest(path)
                meta = self.manager.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))["meta"]
                saved_tree = self.manager.item_metadata(step)["state"]
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                self._report(path, e, move_aside)
                continue
            check_config(meta.get("config", {}), config, path)
            check_shapes(saved_tree, abstract_state, path)
            return step, meta
        return None

    def restore(self, step: int, abstract_state: dict) -> dict:
        """The state of a checkpoint :meth:`newest_usable` chose, laid out as ``abstract_state``
        (shapes, dtypes and shardings: every process reads only its own shards).

        Read on a worker thread: orbax reads under ``asyncio.run``, which on the main thread sets
        a SIGINT handler holding its task, and Python 3.12.0 and 3.12.1 take that handler's repr
        when putting the old one back (CPython gh-112559): the repr of every restored array,
        fetched and formatted, 1.3 of 4 s restoring ``k3_small`` on a CPU."""
        def read() -> dict:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))["state"]
            return jax.block_until_ready(restored)

        with ThreadPoolExecutor(1, thread_name_prefix="restore") as reader:
            return reader.submit(read).result()

    def restore_latest(self, abstract_state: dict, config: dict,
                       move_aside: bool = True) -> tuple[dict, dict] | None:
        """The newest verified ``(state, meta)``, or None when there is no checkpoint."""
        while (found := self.newest_usable(config, abstract_state, move_aside)) is not None:
            step, meta = found
            try:
                return self.restore(step, abstract_state), meta
            except Exception as e:  # noqa: BLE001
                self._report(self.step_path(step), e, move_aside)
                if not move_aside:
                    return None
        return None

    def _report(self, path: Path, error: Exception, move_aside: bool) -> None:
        """Log the unusable checkpoint and move it aside (a later save may need its step)."""
        if not move_aside:
            self.log(f"[checkpoint] cannot restore {path} ({_reason(error)}); "
                     "trying the next older checkpoint")
            return
        aside = self.directory.parent / UNRESTORABLE / path.name
        if jax.process_index() == 0:  # one process moves it; the others only skip it
            aside.parent.mkdir(exist_ok=True)
            if aside.exists():
                shutil.rmtree(aside)
            shutil.move(str(path), str(aside))
        self.manager.reload()
        self.log(f"[checkpoint] cannot restore {path} ({_reason(error)}); "
                 f"moved it to {aside}; trying the next older checkpoint")


def verify_newest_ahead(directory: str | Path) -> dict[int, Future]:
    """``{step: check}``: the newest step directory under ``directory`` checked against its
    manifest on a worker thread (none when there is no step), for ``Checkpointer(verified=...)``.

    Hashing reads the whole state (seconds for a large one) and gives up the interpreter lock
    while it does, so a caller tracing its model meanwhile has the check for free.
    """
    directory = Path(directory)
    steps = [int(p.name) for p in directory.glob("*") if p.name.isdigit()]  # none if it is missing
    if not steps:
        return {}
    newest = max(steps)
    checker = ThreadPoolExecutor(1, thread_name_prefix="verify")
    try:
        return {newest: checker.submit(verify_manifest, directory / str(newest))}
    finally:
        checker.shutdown(wait=False)  # its worker ends once the check is done


def write_manifest(step_dir: Path) -> None:
    """Hash every file of a finished save; written last (atomically), so its presence says the
    save completed."""
    files = {str(f.relative_to(step_dir)): f for f in _files(step_dir)}
    sizes = [f.stat().st_size for f in files.values()]
    digests = _piece_digests(list(zip(files.values(), sizes)), HASH_PIECE_BYTES)
    entries = {name: {"size": size, "sha256": digest}
               for name, size, digest in zip(files, sizes, digests)}
    write_atomically(step_dir / MANIFEST, json.dumps(
        {"algorithm": "sha256", "piece_bytes": HASH_PIECE_BYTES, "files": entries}, indent=0))


def verify_manifest(step_dir: Path) -> None:
    """Raise CheckpointDamaged naming the first file that differs from the manifest."""
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        raise CheckpointDamaged(f"no {MANIFEST}: the save did not finish")
    try:
        recorded = json.loads(manifest.read_text())
        want, piece = recorded["files"], recorded.get("piece_bytes")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointDamaged(f"{MANIFEST} is unreadable ({e})") from None
    have = {str(f.relative_to(step_dir)) for f in _files(step_dir)}
    if missing := sorted(set(want) - have):
        raise CheckpointDamaged(f"file {missing[0]} is missing ({len(missing)} in all)")
    if extra := sorted(have - set(want)):
        raise CheckpointDamaged(f"file {extra[0]} was not part of the save")
    changed = "changed since it was saved (size or SHA-256)"
    for name, entry in want.items():
        if (step_dir / name).stat().st_size != entry["size"]:
            raise CheckpointDamaged(f"file {name} {changed}")
    digests = _piece_digests([(step_dir / name, entry["size"]) for name, entry in want.items()],
                             piece)
    for (name, entry), digest in zip(want.items(), digests):
        if digest != (entry["sha256"] if piece else [entry["sha256"]]):
            raise CheckpointDamaged(f"file {name} {changed}")


def _files(step_dir: Path) -> list[Path]:
    return sorted(f for f in step_dir.rglob("*") if f.is_file() and f.name != MANIFEST
                  and not f.name.startswith(f".{MANIFEST}"))


def _piece_digests(files: list[tuple[Path, int]], piece: int | None) -> list[list[str]]:
    """SHA-256 hex digests of each ``piece``-byte piece of every ``(path, size)`` (one piece, the
    whole file, when ``piece`` is None; an empty file is one empty piece), all pieces hashed in
    parallel."""
    pieces = []  # (which file, path, start, length)
    for i, (path, size) in enumerate(files):
        step = piece or max(size, 1)
        pieces += [(i, path, start, min(step, size - start))
                   for start in range(0, size, step) or [0]]
    digests: list[list[str]] = [[] for _ in files]
    with ThreadPoolExecutor(max(1, min(len(pieces), os.cpu_count() or 1)),
                            thread_name_prefix="hash") as pool:
        for (i, *_), digest in zip(pieces, pool.map(_piece_digest, [p[1:] for p in pieces])):
            digests[i].append(digest)
    return digests


def _piece_digest(piece: tuple[Path, int, int]) -> str:
    path, start, length = piece
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(start)
        while length > 0:
            block = f.read(min(length, 8 << 20))
            if not block:
                break  # shorter than recorded: the digest differs
            digest.update(block)
            length -= len(block)
    return digest.hexdigest()


def _reason(error: Exception) -> str:
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def check_config(saved: dict, current: dict, path: Path) -> None:
    """Raise ConfigError naming every field of :data:`MUST_MATCH` that differs."""
    diffs = []
    for key in MUST_MATCH:
        a, b = _get(saved, key), _get(current, key)
        diffs += _diff(a, b, key)
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; ... {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise ConfigError(f"the checkpoint at {path} was made with a different config: {shown}. "
                          "Use another --workdir, or the checkpoint's settings.")


def check_shapes(saved_tree: Any, abstract_state: dict, path: Path) -> None:
    """Compare the checkpoint's array metadata with this run's state, naming the first mismatch."""
    want = {_key(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    have = {_key(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(saved_tree)[0]
            if hasattr(x, "shape")}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise ConfigError(f"the checkpoint at {path} has a different state structure: "
                          f"missing {missing[:4]}, unexpected {extra[:4]}")
    bad = [f"{k}: checkpoint {have[k]} vs config {want[k]}" for k in want if have[k] != want[k]]
    if bad:
        raise ConfigError(f"the checkpoint at {path} does not match this config's shapes: "
                          + "; ".join(bad[:4]))


def _key(path) -> str:
    """``opt_state/1/0/mu/embedding``: named-tuple fields and dict keys spelled alike (orbax
    metadata stores named tuples as dicts)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _diff(a, b, key: str) -> list[str]:
    if key in MAY_DIFFER:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{key}.{k}")
        return out
    norm = lambda v: json.loads(json.dumps(v))
    return [] if norm(a) == norm(b) else [f"{key}: checkpoint {a!r} vs config {b!r}"]


def abstract_like(state: dict) -> dict:
    """Shapes, dtypes and shardings of a (possibly multi-process, sharded) state, for restoring."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
