"""Checkpoints with orbax: asynchronous saves, keep the newest N, exact resume, damage tolerance.

A checkpoint holds two items: ``state`` (the whole training state of :mod:`k3jax.train.step`:
parameters, optimiser state, MoE ``balance`` biases, step, RNG, non-finite counters) and ``meta``
(JSON: the resolved config, the step and the data position). Resuming re-runs the same command: the
newest checkpoint that restores is used; one that does not (truncated or corrupted files) is
reported by path and the next older one is tried. A config whose model or optimiser differs from
the checkpoint's is an error naming the differing fields; a shape that differs names the parameter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from k3jax.config.base import ConfigError

# Sections of the config that must match to resume (the rest, e.g. train.steps, may change).
MUST_MATCH = ("model", "optim.name", "train.micro_batches", "data.task", "data.tokenizer",
              "data.seed", "data.seq_len", "data.batch_size")


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int, async_save: bool = True,
                 log: Callable[[str], Any] = print):
        self.directory = Path(directory).resolve()
        self.log = log
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
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def last_good_step(self) -> int | None:
        steps = self.manager.all_steps()
        return max(steps) if steps else None

    def restore_latest(self, abstract_state: dict, config: dict,
                       move_aside: bool = True) -> tuple[dict, dict] | None:
        """The newest restorable ``(state, meta)``, or None when there is no checkpoint.

        ``abstract_state`` gives shapes, dtypes and tree structure; ``config`` is the resolved
        config dict of this run, compared with the checkpoint's (:data:`MUST_MATCH`).
        """
        for step in sorted(self.manager.all_steps(), reverse=True):
            path = self.step_path(step)
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))["meta"]
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                self._report(path, e, move_aside)
                continue
            check_config(meta.get("config", {}), config, path)
            try:
                check_shapes(self.manager.item_metadata(step)["state"], abstract_state, path)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001
                self._report(path, e, move_aside)
                continue
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state)))["state"]
                jax.block_until_ready(restored)
            except Exception as e:  # noqa: BLE001
                self._report(path, e, move_aside)
                continue
            return restored, meta
        return None

    def _report(self, path: Path, error: Exception, move_aside: bool) -> None:
        """Log the unusable checkpoint and move it aside (a later save may need its step)."""
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        if not move_aside:
            self.log(f"[checkpoint] cannot restore {path} ({type(error).__name__}: {first}); "
                     "trying the next older checkpoint")
            return
        if jax.process_index() != 0:  # one process moves it; the others only skip it
            return
        aside = self.directory.parent / "checkpoints_unrestorable" / path.name
        aside.parent.mkdir(exist_ok=True)
        if aside.exists():
            shutil.rmtree(aside)
        shutil.move(str(path), str(aside))
        self.manager.reload()
        self.log(f"[checkpoint] cannot restore {path} ({type(error).__name__}: {first}); "
                 f"moved it to {aside}; trying the next older checkpoint")


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
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _diff(a, b, key: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{key}.{k}")
        return out
    norm = lambda v: json.loads(json.dumps(v))  # noqa: E731 - tuples vs lists after JSON
    return [] if norm(a) == norm(b) else [f"{key}: checkpoint {a!r} vs config {b!r}"]


def abstract_like(state: dict) -> dict:
    """Shapes, dtypes and shardings of a (possibly multi-process, sharded) state, for restoring."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
