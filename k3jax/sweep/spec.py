"""A scaling sweep as one typed, frozen, validated object, and the loader of sweep files.

A sweep file (``configs/sweeps/*.py``) defines ``get_sweep()`` returning a :class:`Sweep`: a base
experiment and its axes -- the model-size :class:`Ladder`, the token :class:`Budget`, the
:class:`Variant` overrides, the learning rate (a grid or a :class:`WidthRule`) and the seeds -- plus
the :class:`Executor` that runs the points. Everything that can be checked without training is
checked when the objects are built, or by :func:`k3jax.sweep.plan.plan_sweep` (which builds every
rung's model shapes); a bad value raises :class:`SweepError` naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from k3jax.config.base import ConfigError
from k3jax.config.experiment import ExperimentConfig, apply_overrides


class SweepError(ConfigError):
    """An invalid sweep (names the axis, the value and what is allowed)."""


def _check(cond: bool, owner: str, name: str, value, allowed: str) -> None:
    if not cond:
        raise SweepError(f"{owner}.{name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class Ladder:
    """Model sizes from one knob. ``knob="width"``: ``sizes`` are ``d_model`` values; head counts
    and every derived width (FFN, latent ranks, gate ranks, experts, MoE latent) scale with
    ``d_model / base d_model``, rounded to ``multiple``; head dims stay fixed. ``knob="depth"``:
    ``sizes`` are layer counts; the hybrid schedule rule (``mla_every``) is kept."""

    sizes: tuple[int, ...]
    knob: Literal["width", "depth"] = "width"
    multiple: int = 8

    def __post_init__(self):
        _check(self.knob in ("width", "depth"), "Ladder", "knob", self.knob,
               "expected 'width' or 'depth'")
        _check(len(self.sizes) > 0 and all(isinstance(s, int) and s > 0 for s in self.sizes),
               "Ladder", "sizes", self.sizes, "expected one or more positive integers")
        _check(len(set(self.sizes)) == len(self.sizes), "Ladder", "sizes", self.sizes,
               "sizes repeat")
        _check(isinstance(self.multiple, int) and self.multiple > 0, "Ladder", "multiple",
               self.multiple, "expected a positive integer")


@dataclass(frozen=True)
class Budget:
    """Training tokens D of each run: exactly one of ``tokens`` (D itself), ``tokens_per_param``
    (D = k N) or ``compute`` (IsoFLOP: D = C / training FLOPs per token; a rung is kept for a budget
    when D / N lies in ``tokens_per_param_range``). Each D is also run at every ``fractions``
    multiple (with WSD branching, decays of one stable phase)."""

    tokens: tuple[int, ...] = ()
    tokens_per_param: tuple[float, ...] = ()
    compute: tuple[float, ...] = ()
    tokens_per_param_range: tuple[float, float] = (0.0, float("inf"))
    fractions: tuple[float, ...] = (1.0,)

    def __post_init__(self):
        given = [n for n in ("tokens", "tokens_per_param", "compute") if getattr(self, n)]
        if len(given) != 1:
            raise SweepError(f"Budget: give exactly one of tokens, tokens_per_param, compute "
                             f"(got {given or 'none'})")
        values = getattr(self, given[0])
        _check(all(v > 0 for v in values), "Budget", given[0], values, "expected values > 0")
        lo, hi = self.tokens_per_param_range
        _check(0 <= lo < hi, "Budget", "tokens_per_param_range", self.tokens_per_param_range,
               "expected (low, high) with 0 <= low < high")
        _check(len(self.fractions) > 0 and all(0 < f <= 1 for f in self.fractions), "Budget",
               "fractions", self.fractions, "expected fractions in (0, 1]")

    @property
    def kind(self) -> str:
        return next(n for n in ("tokens", "tokens_per_param", "compute") if getattr(self, n))

    @property
    def values(self) -> tuple[float, ...]:
        return getattr(self, self.kind)


@dataclass(frozen=True)
class Variant:
    """A named arm of the comparison: ``--set``-style overrides of the base experiment."""

    name: str
    overrides: tuple[str, ...] = ()

    def __post_init__(self):
        _check(bool(re.fullmatch(r"[A-Za-z0-9_\-]+", self.name)), "Variant", "name", self.name,
               "expected letters, digits, '_' or '-' (it names run directories)")


@dataclass(frozen=True)
class WidthRule:
    """Learning rate per rung: ``lr * (width / d_model) ** exponent``."""

    lr: float
    width: int
    exponent: float = 1.0

    def __post_init__(self):
        _check(self.lr > 0, "WidthRule", "lr", self.lr, "expected > 0")
        _check(self.width > 0, "WidthRule", "width", self.width, "expected > 0")

    def at(self, d_model: int) -> float:
        return self.lr * (self.width / d_model) ** self.exponent


def lr_label(lr: float) -> str:
    """A learning rate as point and stable-phase names show it: 3 significant digits."""
    return f"{lr:.3g}".replace("+", "")


EXECUTORS = ("inline", "local", "slurm", "submitit-local")


@dataclass(frozen=True)
class Executor:
    """How points run. ``inline``: in turn, in the calling process. ``local``: one process per
    slot; ``devices="gpu"``: ``per_device`` runs share each visible GPU (each capped at its share of
    the memory); ``devices="cpu"``: ``per_device`` CPU processes. ``slurm``: one SLURM job per
    point (or WSD branch group) through submitit, with ``parameters`` passed to its
    ``update_parameters`` (e.g. ``(("slurm_partition", "gpu"), ("gpus_per_node", 1))``).
    ``submitit-local``: submitit's local executor (same code path, no cluster)."""

    kind: str = "inline"
    devices: Literal["cpu", "gpu"] = "gpu"
    per_device: int = 1
    timeout_min: int = 60
    parameters: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        _check(self.kind in EXECUTORS, "Executor", "kind", self.kind,
               f"expected one of {', '.join(map(repr, EXECUTORS))}")
        _check(self.devices in ("cpu", "gpu"), "Executor", "devices", self.devices,
               "expected 'cpu' or 'gpu'")
        _check(isinstance(self.per_device, int) and self.per_device > 0, "Executor",
               "per_device", self.per_device, "expected a positive integer")
        _check(isinstance(self.timeout_min, int) and self.timeout_min > 0, "Executor",
               "timeout_min", self.timeout_min, "expected a positive integer")


@dataclass(frozen=True)
class Sweep:
    """The whole study. ``baseline`` names the variant multipliers are measured against (default:
    the first); ``reference_compute`` the C at which they are stated (default: the largest budget's
    compute). ``wsd_branching`` trains one stable phase per (variant, rung, lr, seed) and decays
    each point from its checkpoint. ``flops_per_s`` is a stated throughput for the plan's time
    estimates where no measured tokens/s exists yet."""

    name: str
    base: ExperimentConfig
    ladder: Ladder
    budget: Budget
    variants: tuple[Variant, ...] = (Variant("base"),)
    baseline: str | None = None
    lr_grid: tuple[float, ...] = ()
    lr_rule: WidthRule | None = None
    seeds: tuple[int, ...] = (0,)
    wsd_branching: bool = False
    executor: Executor = field(default_factory=Executor)
    reference_compute: float | None = None
    flops_per_s: float | None = None

    def __post_init__(self):
        _check(isinstance(self.base, ExperimentConfig), "Sweep", "base", type(self.base).__name__,
               "expected an ExperimentConfig")
        names = [v.name for v in self.variants]
        _check(len(names) > 0 and len(set(names)) == len(names), "Sweep", "variants", names,
               "expected one or more variants with distinct names")
        _check(self.baseline is None or self.baseline in names, "Sweep", "baseline",
               self.baseline, f"expected one of the variants {names}")
        _check(not (self.lr_grid and self.lr_rule), "Sweep", "lr_grid", self.lr_grid,
               "give a learning-rate grid or a width rule, not both")
        _check(all(lr > 0 for lr in self.lr_grid), "Sweep", "lr_grid", self.lr_grid,
               "expected learning rates > 0")
        labels = [lr_label(lr) for lr in self.lr_grid]
        _check(len(set(labels)) == len(labels), "Sweep", "lr_grid", self.lr_grid,
               "expected rates that differ in their first 3 significant digits, which name the "
               f"points and their run directories (their labels: {labels})")
        _check(len(self.seeds) > 0 and len(set(self.seeds)) == len(self.seeds), "Sweep", "seeds",
               self.seeds, "expected one or more distinct seeds")
        if self.wsd_branching:
            _check(self.base.optim.schedule == "wsd", "Sweep", "wsd_branching", True,
                   f"branching decays a warmup-stable-decay run; base optim.schedule is "
                   f"{self.base.optim.schedule!r}")
        for v in self.variants:  # unknown keys and bad values fail here, before any training
            try:
                apply_overrides(self.base, v.overrides)
            except ConfigError as e:
                raise SweepError(f"variant {v.name!r}: {e}") from None

    @property
    def baseline_name(self) -> str:
        return self.baseline or self.variants[0].name

    def variant_config(self, variant: Variant) -> ExperimentConfig:
        return apply_overrides(self.base, variant.overrides)

    def with_executor(self, **changes) -> Sweep:
        return dataclasses.replace(self, executor=dataclasses.replace(self.executor, **changes))


_SPEC_CLASSES = {c.__name__: c for c in (Sweep, Ladder, Budget, Variant, WidthRule, Executor)}
_UNKNOWN = re.compile(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'")


def load_sweep(path: str | Path) -> Sweep:
    """Import a sweep file and call its ``get_sweep()``; an unknown axis is named."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file {str(path)!r}: no such file")
    module_spec = importlib.util.spec_from_file_location(f"_k3jax_sweep_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        if not hasattr(module, "get_sweep"):
            raise SweepError(f"sweep file {str(path)!r} defines no get_sweep()")
        sweep = module.get_sweep()
    except TypeError as e:
        m = _UNKNOWN.search(str(e))
        if not m or m.group(1) not in _SPEC_CLASSES:
            raise
        cls, name = _SPEC_CLASSES[m.group(1)], m.group(2)
        known = [f.name for f in dataclasses.fields(cls)]
        close = difflib.get_close_matches(name, known, n=2)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
        raise SweepError(f"{path}: unknown axis {name!r} of {cls.__name__}; {hint}") from None
    if not isinstance(sweep, Sweep):
        raise SweepError(f"{path}: get_sweep() returned {type(sweep).__name__}, expected a Sweep")
    return sweep


__all__ = [
    "EXECUTORS",
    "Budget",
    "Executor",
    "Ladder",
    "Sweep",
    "SweepError",
    "Variant",
    "WidthRule",
    "load_sweep",
]
