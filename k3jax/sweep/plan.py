"""From a :class:`~k3jax.sweep.spec.Sweep` to its points: one ordinary experiment config each.

Order of a point's config: the base experiment, the variant's overrides, the ladder rule on the
model, then the point's learning rate, seed (``train.seed``: initialisation; the data order and
held-out split stay those of the base) and ``train.steps``. With WSD branching, the points of one
(variant, rung, lr, seed) share a stable phase (:class:`Group`): a constant-rate run with the same
warmup, checkpointed at each point's ``branch_step`` -- the first step at which the point's own WSD
rate leaves the peak -- from where the point decays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from k3jax.config.experiment import ExperimentConfig
from k3jax.sweep.ladder import Rung, build_rung
from k3jax.sweep.spec import Sweep, SweepError, lr_label


@dataclass(frozen=True)
class Point:
    name: str
    variant: str
    size: int
    lr: float
    seed: int
    n: int
    n_total: int
    flops_per_token: float
    budget: float  # the budget value this point came from (tokens, tokens/param or C)
    fraction: float
    steps: int
    tokens: int
    compute: float
    config: ExperimentConfig
    group: str | None = None
    branch_step: int | None = None

    def row(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "config"}


@dataclass(frozen=True)
class Group:
    """A shared stable phase: ``config`` at constant rate; ``points`` in branch-step order."""

    name: str
    config: ExperimentConfig
    points: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    sweep: Sweep
    points: tuple[Point, ...]
    groups: tuple[Group, ...]

    def point(self, name: str) -> Point:
        return next(p for p in self.points if p.name == name)

    def jobs(self) -> list[tuple[str, tuple[str, ...]]]:
        """(job id, its points in order): one job per ungrouped point, one per group; the
        largest compute first, so long jobs start early."""
        grouped = {n for g in self.groups for n in g.points}
        jobs = [(g.name, g.points) for g in self.groups]
        jobs += [(p.name, (p.name,)) for p in self.points if p.name not in grouped]
        cost = lambda job: max(self.point(n).compute for n in job[1])
        return sorted(jobs, key=cost, reverse=True)

    def trained_compute(self) -> float:
        """FLOPs actually trained: a group's stable phase counts once."""
        total = sum(p.compute for p in self.points if p.group is None)
        for g in self.groups:
            pts = [self.point(n) for n in g.points]
            stable = max(p.branch_step for p in pts)
            total += pts[0].flops_per_token * _tokens_per_step(g.config) * (
                stable + sum(p.steps - p.branch_step for p in pts))
        return total


def _tokens_per_step(cfg: ExperimentConfig) -> int:
    return cfg.data.batch_size * cfg.data.seq_len


def _budget_tokens(sweep: Sweep, rung: Rung) -> list[tuple[float, float]]:
    """(budget value, D) pairs for this rung (IsoFLOP budgets outside the D/N range dropped)."""
    b = sweep.budget
    if b.kind == "tokens":
        return [(v, float(v)) for v in b.values]
    if b.kind == "tokens_per_param":
        return [(v, v * rung.n) for v in b.values]
    lo, hi = b.tokens_per_param_range
    pairs = [(c, c / rung.flops_per_token) for c in b.values]
    return [(c, d) for c, d in pairs if lo <= d / rung.n <= hi]


def _lrs(sweep: Sweep, cfg: ExperimentConfig) -> tuple[float, ...]:
    if sweep.lr_rule is not None:
        return (sweep.lr_rule.at(cfg.model.d_model),)
    return sweep.lr_grid or (cfg.optim.lr,)


def _point_config(cfg: ExperimentConfig, lr: float, seed: int, steps: int) -> ExperimentConfig:
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr),
                               train=dataclasses.replace(cfg.train, seed=seed, steps=steps))


def branch_step(optim, steps: int) -> int:
    """The first step whose WSD rate differs from the constant rate: a checkpoint of the stable
    phase at this step continues exactly as a full WSD run of ``steps`` would."""
    from k3jax.train.optim import schedule

    t = np.arange(steps)
    wsd = np.asarray(schedule(optim, steps)(t))
    flat = np.asarray(schedule(dataclasses.replace(optim, schedule="constant"), steps)(t))
    differ = np.nonzero(wsd != flat)[0]
    return int(differ[0]) if len(differ) else steps


def plan_sweep(sweep: Sweep) -> Plan:
    """Every point of ``sweep``, validated (rungs built, budgets of at least one step)."""
    points, seen = [], set()
    for variant in sweep.variants:
        cfg = sweep.variant_config(variant)
        tps = _tokens_per_step(cfg)
        for size in sweep.ladder.sizes:
            rung = build_rung(cfg.model, sweep.ladder, size, cfg.data.seq_len)
            sized = dataclasses.replace(cfg, model=rung.model)
            pairs = _budget_tokens(sweep, rung)
            for lr in _lrs(sweep, sized):
                for seed in sweep.seeds:
                    for value, d in pairs:
                        for frac in sweep.budget.fractions:
                            steps = round(frac * d / tps)
                            if steps < 1:
                                raise SweepError(
                                    f"budget {sweep.budget.kind}={value:g} (x{frac:g}) gives "
                                    f"{frac * d:,.0f} tokens for {variant.name} at "
                                    f"{sweep.ladder.knob}={size}: below one step of {tps:,} "
                                    f"tokens (data.batch_size x data.seq_len)")
                            tokens = steps * tps
                            name = (f"{variant.name}.{sweep.ladder.knob[0]}{size}.lr{lr_label(lr)}"
                                    f".s{seed}.t{steps}")
                            # Names differ but for two budgets rounding to one step count
                            # (Sweep keeps variants, sizes, rates' labels and seeds distinct).
                            if name in seen:
                                continue
                            seen.add(name)
                            points.append(Point(
                                name, variant.name, size, lr, seed, rung.n, rung.n_total,
                                rung.flops_per_token, value, frac, steps, tokens,
                                tokens * rung.flops_per_token,
                                _point_config(sized, lr, seed, steps)))
    if not points:
        raise SweepError(f"sweep {sweep.name!r} has no points: no rung's D/N lies in "
                         f"Budget.tokens_per_param_range={sweep.budget.tokens_per_param_range}")
    if sweep.wsd_branching:
        return _branched(sweep, points)
    return Plan(sweep, tuple(points), ())


def _branched(sweep: Sweep, points: list[Point]) -> Plan:
    by_key: dict[tuple, list[Point]] = {}
    for p in points:
        by_key.setdefault((p.variant, p.size, p.lr, p.seed), []).append(p)
    out, groups = [], []
    for (variant, size, lr, seed), members in by_key.items():
        gname = f"{variant}.{sweep.ladder.knob[0]}{size}.lr{lr_label(lr)}.s{seed}.stable"
        branched = []
        for p in members:
            b = branch_step(p.config.optim, p.steps)
            warmup = p.config.optim.warmup_steps
            if b <= warmup:
                raise SweepError(f"WSD branching: {p.name} would branch at step {b}, inside the "
                                 f"warmup of {warmup} steps; lengthen the budget or shorten "
                                 f"optim.warmup_steps")
            branched.append(dataclasses.replace(p, group=gname, branch_step=b))
        branched.sort(key=lambda p: p.branch_step)
        base = branched[-1].config
        stable = dataclasses.replace(base, optim=dataclasses.replace(base.optim,
                                                                     schedule="constant"))
        groups.append(Group(gname, stable, tuple(p.name for p in branched)))
        out += branched
    return Plan(sweep, tuple(out), tuple(groups))


def format_plan(plan: Plan, tokens_per_s: dict[tuple[str, int], float] | None = None) -> str:
    """The plan as a text table; time from measured tokens/s per (variant, size) where given,
    else from the sweep's stated ``flops_per_s``."""
    tokens_per_s = tokens_per_s or {}
    head = f"{'name':44s} {'N':>11s} {'N_total':>11s} {'D':>12s} {'C':>10s} {'time':>8s}"
    lines = [head, "-" * len(head)]
    total = 0.0
    for p in plan.points:
        tps = tokens_per_s.get((p.variant, p.size))
        secs = (p.tokens / tps if tps else
                p.compute / plan.sweep.flops_per_s if plan.sweep.flops_per_s else None)
        total += secs or 0.0
        shown = f"{secs:7.0f}s" if secs is not None else "       -"
        lines.append(f"{p.name:44s} {p.n:11,d} {p.n_total:11,d} {p.tokens:12,d} "
                     f"{p.compute:10.3g} {shown}")
    as_points = sum(p.compute for p in plan.points)
    total *= plan.trained_compute() / as_points  # shared stable phases train once
    lines.append(f"{len(plan.points)} points in {len(plan.jobs())} jobs; compute "
                 f"{as_points:.3g} FLOPs as points, {plan.trained_compute():.3g} trained"
                 + (" (stable phases shared)" if plan.groups else "")
                 + (f"; about {total / 60:.1f} min if run in turn" if total else ""))
    return "\n".join(lines)
