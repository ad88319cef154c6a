"""The whole experiment as one typed, frozen, validated config, plus ``--set a.b=c`` overrides.

``ExperimentConfig`` groups the model with data, optimiser, training, checkpoint and evaluation
settings. A preset file (``configs/k3_tiny.py``) defines ``get_config()``; :func:`load_config` runs
it and :func:`apply_overrides` applies dotted overrides typed by the dataclass field annotations, so
``--set train.steps=500`` parses ``500`` as an int and ``--set model.dtype=fp32`` fails naming the
key, the value and what is allowed. Every changed dataclass is rebuilt, so its validation reruns.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from k3jax.config.base import (
    ConfigError,
    check_literals,
    fail,
    non_negative,
    positive,
    require,
    to_dict,
)
from k3jax.config.mesh import MeshConfig
from k3jax.config.model import ModelConfig

# "corpus": a built text corpus; the others: synthetic sequences (k3jax.data.synthetic).
Task = Literal["corpus", "mqar", "palindrome", "stack", "parity"]
TASKS = typing.get_args(Task)


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how batches are cut.

    ``task="corpus"`` trains on a built corpus: ``data_dir`` if given, else one built from
    ``sources`` (empty: the Python standard library of the running interpreter) and cached. Other
    tasks draw synthetic sequences (``k3jax.data.synthetic``). ``batch_size`` is global per
    optimiser step.
    """

    task: Task = "corpus"
    sources: tuple[str, ...] = ()
    data_dir: str | None = None
    cache_dir: str | None = None
    tokenizer: Literal["byte", "bpe"] = "byte"
    seq_len: int = 256
    batch_size: int = 16
    heldout_fraction: float = 0.02
    max_doc_bytes: int = 65536
    seed: int = 0

    def __post_init__(self):
        check_literals(self)
        positive(self, "seq_len", "batch_size", "max_doc_bytes")
        require(0.0 < self.heldout_fraction < 0.5, self, "heldout_fraction",
                "expected a fraction in (0, 0.5)")
        non_negative(self, "seed")


Schedule = Literal["wsd", "cosine", "constant"]


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, or Muon for matrix weights with AdamW for the rest (``name="muon"``).

    Schedules: ``wsd`` (linear warmup, stable, linear decay over the last ``decay_fraction`` of the
    steps to ``min_lr_ratio * lr``), ``cosine`` (warmup then cosine to ``min_lr_ratio * lr``) or
    ``constant`` (warmup then flat).

    ``muon_ns_dtype``: the dtype of Muon's Newton-Schulz iterations, bf16 as in Muon's and
    Moonlight's reference code, or fp32 as in ``optax.contrib.muon``.
    """

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-3
    schedule: Schedule = "wsd"
    warmup_steps: int = 100
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    muon_consistent_rms: float = 0.2
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"

    def __post_init__(self):
        check_literals(self)
        require(0 < self.lr < math.inf, self, "lr", "expected a finite number > 0")
        require(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, self,
                "warmup_steps", "expected an integer >= 0")
        require(0.0 <= self.decay_fraction <= 1.0, self, "decay_fraction", "expected in [0, 1]")
        require(0.0 <= self.min_lr_ratio <= 1.0, self, "min_lr_ratio", "expected in [0, 1]")
        require(0 <= self.weight_decay < math.inf, self, "weight_decay",
                "expected a finite number >= 0")
        require(0.0 <= self.b1 < 1.0, self, "b1", "expected in [0, 1)")
        require(0.0 <= self.b2 < 1.0, self, "b2", "expected in [0, 1)")
        require(0 < self.eps < math.inf, self, "eps", "expected a finite number > 0")
        require(self.clip_norm is None or 0 < self.clip_norm < math.inf, self, "clip_norm",
                "expected None (no clipping) or a finite number > 0")
        require(0 < self.muon_consistent_rms < math.inf, self, "muon_consistent_rms",
                "expected a finite number > 0")


# The fields that make OptimConfig's learning-rate schedule (with train.steps).
SCHEDULE_FIELDS = ("lr", "schedule", "warmup_steps", "decay_fraction", "min_lr_ratio")


@dataclass(frozen=True)
class TrainConfig:
    """Length of the run and its bookkeeping. ``micro_batches`` splits each step's batch for
    gradient accumulation; ``max_bad_steps`` consecutive non-finite steps stop the run.

    ``schedule_change`` decides a resume whose ``steps`` (or learning-rate settings) differ from
    the checkpoint's: ``continue`` goes on under the re-planned schedule (a WSD run's stable phase
    extended and its decay planned at the new end) and logs how; when that plan gives the steps
    already trained other learning rates than they had (more steps after the decay began), the
    log line is a warning naming the jump. ``refuse`` stops such a resume instead, naming the
    choice.
    """

    steps: int = 1000
    micro_batches: int = 1
    seed: int = 0
    log_every: int = 10
    max_bad_steps: int = 5
    schedule_change: Literal["continue", "refuse"] = "continue"

    def __post_init__(self):
        positive(self, "steps", "micro_batches", "log_every", "max_bad_steps")
        non_negative(self, "seed")
        check_literals(self)


@dataclass(frozen=True)
class CheckpointConfig:
    """Save every ``every`` steps (and at the end), keep the newest ``keep``. A save that fails
    (disk full, permissions) stops the run (``on_save_error="stop"``) or is logged while training
    goes on (``"continue"``); either way the older checkpoints stay."""

    every: int = 200
    keep: int = 3
    async_save: bool = True
    on_save_error: Literal["stop", "continue"] = "stop"

    def __post_init__(self):
        positive(self, "every", "keep")
        check_literals(self)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out loss and bits per byte every ``every`` steps and at the end, over ``batches``
    batches; ``tasks`` are synthetic tasks evaluated alongside (accuracy on answer tokens)."""

    every: int = 200
    batches: int = 8
    tasks: tuple[str, ...] = ()

    def __post_init__(self):
        positive(self, "every", "batches")
        bad = [t for t in self.tasks if t not in TASKS[1:]]
        if bad:
            fail(self, "tasks", self.tasks, f"unknown task(s) {bad}; expected from {TASKS[1:]}")


@dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)

    def __post_init__(self):
        if self.data.batch_size % self.train.micro_batches:
            fail(self, "train.micro_batches", self.train.micro_batches,
                 f"must divide data.batch_size={self.data.batch_size}")
        moe = self.model.moe
        if moe is not None and self.mesh.expert > 0 and moe.num_experts % self.mesh.expert:
            fail(self, "mesh.expert", self.mesh.expert,
                 f"must divide model.moe.num_experts={moe.num_experts}")
        if self.data.task != "corpus" or self.data.data_dir is not None:
            return  # synthetic tokens have their own layout; a built corpus brings its tokenizer
        if self.data.tokenizer == "byte" and self.model.vocab_size < 256:
            fail(self, "model.vocab_size", self.model.vocab_size,
                 "the byte tokenizer needs a vocabulary of at least 256")
        if self.data.tokenizer == "bpe" and self.model.vocab_size <= 256:
            fail(self, "model.vocab_size", self.model.vocab_size,
                 "a byte-level BPE needs more than the 256 byte tokens")

    def to_dict(self) -> dict:
        return to_dict(self)


# -- loading ------------------------------------------------------------------------------------

PRESETS = Path(__file__).resolve().parents[2] / "configs"


def _preset_path(preset: str | Path) -> Path:
    """A preset file as given, else a shipped preset by its name (``k3_small``), file name
    (``k3_small.py``) or path from the repository root (``configs/k3_small.py``, what the README
    writes, also from another working directory)."""
    path = Path(preset)
    if path.is_file() or path.parent not in (Path("."), Path(PRESETS.name)):
        return path
    return PRESETS / (path.name if path.suffix else f"{path.name}.py")


def load_config(preset: str | Path) -> ExperimentConfig:
    """A preset by name (``k3_small``: ``configs/k3_small.py``) or file: a Python file is imported
    and its ``get_config()`` called; a ``.json`` file is a resolved config (a workdir's
    ``config.json``, e.g. one written by ``python -m k3jax.convert from-hf``)."""
    path = _preset_path(preset)
    if not path.is_file():
        raise ConfigError(f"--config {str(preset)!r}: no such file"
                          + ("" if path == Path(preset) else f" ({path})"))
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"--config {str(path)!r}: not valid JSON ({e})") from None
        return from_dict(ExperimentConfig, data, where=f"--config {str(path)!r}")
    spec = importlib.util.spec_from_file_location(f"_k3jax_preset_{path.stem}", path)
    if path.suffix != ".py" or spec is None or spec.loader is None:
        raise ConfigError(f"--config {str(path)!r}: not a Python preset file (expected a .py "
                          "file defining get_config(), e.g. configs/k3_tiny.py)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a preset is user code: any failure is its mistake
        raise ConfigError(f"--config {str(path)!r} failed to load ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"--config {str(path)!r} defines no get_config()")
    cfg = module.get_config()
    if not isinstance(cfg, ExperimentConfig):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, "
                          "expected an ExperimentConfig")
    return cfg


# What a run records beside its config in config.json and its checkpoints: the built corpus it
# trained on (its path and tokenizer), which a preset cannot set.
RECORDS = ("data.corpus",)


def from_dict(cls: type, data: dict, where: str = "config", prefix: str = "",
              extra: Sequence[str] = RECORDS) -> Any:
    """Rebuild a (nested) config dataclass from :func:`to_dict` output (JSON lists -> tuples).

    A key that is no field (a typo, or a field this version does not have) is a ConfigError
    naming it and ``where`` the dict came from; the dotted keys in ``extra`` are skipped.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names and prefix + k not in extra]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=3)
        hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
        raise ConfigError(f"{where}: unknown key {prefix + unknown[0]!r} in "
                          f"{cls.__name__}{hint}")
    return cls(**{name: _from_json(hints[name], data[name], where, f"{prefix}{name}.", extra)
                  for name in names if name in data})


def _from_json(tp: Any, value: Any, where: str, prefix: str, extra: Sequence[str]) -> Any:
    if value is None:
        return None
    inner = _dataclass_in(tp)
    if inner is not None:
        return from_dict(inner, value, where, prefix, extra)
    if isinstance(value, list):
        return tuple(value)
    return value


# -- dotted overrides ---------------------------------------------------------------------------

def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """Apply ``key=value`` overrides (dotted keys into nested dataclasses) and revalidate.

    All values are parsed first (an unknown key or unparsable value fails at once), then each
    changed dataclass is rebuilt once, so cross-field checks see every override together.
    """
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=500")
        key, raw = (s.strip() for s in item.split("=", 1))
        node, level = cfg, tree
        path = key.split(".")
        for depth, name in enumerate(path):
            tp = _field_type(node, name, key, cfg, "".join(f"{p}." for p in path[:depth]))
            if depth == len(path) - 1:
                if name in level:  # a later value would silently replace the earlier one(s)
                    earlier = "set twice" if not isinstance(level[name], dict) else \
                        "set field by field before; set it as a whole first"
                    raise ConfigError(f"--set {key}: {earlier}")
                level[name] = parse_value(tp, raw, key)
                break
            child = getattr(node, name)
            child = child if child is not None else _nested_default(tp, name, key)
            if not dataclasses.is_dataclass(child):
                raise ConfigError(f"--set {key}: {name!r} is a value, not a nested config")
            node, level = child, level.setdefault(name, {})
            if not isinstance(level, dict):
                raise ConfigError(f"--set {key}: {name!r} was already set as a whole")
    return _rebuild(cfg, tree, "")


def _field_type(node: Any, name: str, key: str, root: Any, prefix: str) -> Any:
    names = [f.name for f in dataclasses.fields(node)]
    if name not in names:
        close = difflib.get_close_matches(key, all_keys(root), n=3, cutoff=0.8)
        close = close or [prefix + k for k in difflib.get_close_matches(name, names, n=3)]
        hint = (f"; did you mean {', '.join(close)}?" if close
                else f"; known here: {', '.join(names)}")
        raise ConfigError(f"--set {key}: unknown key {name!r} in {type(node).__name__}{hint}")
    return typing.get_type_hints(type(node))[name]


def _nested_default(tp: Any, name: str, key: str) -> Any:
    cls = _dataclass_in(tp)
    if cls is None:
        raise ConfigError(f"--set {key}: {name!r} is not a nested config")
    return cls()  # setting a field of an absent optional section creates it


def _rebuild(node: Any, tree: dict, prefix: str) -> Any:
    changes = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            child = getattr(node, name)
            if child is None:
                child = _dataclass_in(typing.get_type_hints(type(node))[name])()
            value = _rebuild(child, value, f"{prefix}{name}.")
        changes[name] = value
    try:
        return dataclasses.replace(node, **changes)
    except ConfigError as e:
        if str(e).startswith("--set"):
            raise
        keys = ", ".join(_flat_keys(tree, prefix))
        raise ConfigError(f"--set {keys}: {e}") from None


def _flat_keys(tree: dict, prefix: str) -> list[str]:
    out = []
    for name, value in tree.items():
        if isinstance(value, dict):
            out += _flat_keys(value, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}={value!r}")
    return out


def all_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every settable dotted key of a config (nested dataclasses expanded)."""
    keys = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        name = prefix + f.name
        keys.append(name)
        value = getattr(cfg, f.name)
        sub = value if dataclasses.is_dataclass(value) else None
        if sub is None and _dataclass_in(hints[f.name]) is not None:
            sub = _dataclass_in(hints[f.name])()
        if sub is not None:
            keys.extend(all_keys(sub, name + "."))
    return keys


def parse_value(tp: Any, raw: str, key: str) -> Any:
    """Parse ``raw`` as the annotated type ``tp`` (int, float, bool, str, Literal, Optional,
    tuple[T, ...], or a nested dataclass given as ``default``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and raw.lower() in ("none", "null"):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return parse_value(arg, raw, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"--set {key}={raw!r}: expected {_type_name(tp)}")
    if origin is Literal:
        for choice in args:
            if str(choice) == raw:
                return choice
        raise ConfigError(f"--set {key}={raw!r}: expected one of {', '.join(map(repr, args))}")
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis or typing.get_origin(args[0]) is tuple:
            raise ConfigError(f"--set {key}: a table ({_type_name(tp)}), which a comma-separated "
                              "value cannot spell; set it in a preset file")
        items = [s.strip() for s in raw.strip("()[] ").split(",") if s.strip()]
        return tuple(parse_value(args[0], s, key) for s in items)
    if dataclasses.is_dataclass(tp):
        if raw.lower() == "default":
            return tp()
        raise ConfigError(f"--set {key}={raw!r}: a nested config; set its fields "
                          f"({key}.FIELD=...) or use {key}=default")
    if tp is bool:
        low = raw.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--set {key}={raw!r}: expected a boolean (true/false)")
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"--set {key}={raw!r}: expected an integer") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"--set {key}={raw!r}: expected a number") from None
    if tp is str:
        return raw
    raise ConfigError(f"--set {key}: cannot parse values of type {_type_name(tp)}")


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass in ``tp`` (``C`` or ``C | None``), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


__all__ = ["CheckpointConfig", "DataConfig", "EvalConfig", "ExperimentConfig", "OptimConfig",
           "SCHEDULE_FIELDS", "TASKS", "TrainConfig", "all_keys", "apply_overrides", "from_dict",
           "load_config", "parse_value"]
