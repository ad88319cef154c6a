"""Scaling-law fits with scipy, and bootstrap intervals.

* IsoFLOP (Chinchilla approach 2): per compute budget C, a parabola of the final loss in log N; its
  vertex gives N_opt(C) and L_opt(C); across budgets, power laws ``L_opt = a C^-b``,
  ``N_opt = k C^p`` and ``D_opt = m C^q`` (D_opt = C / training FLOPs per token at N_opt).
* Parametric (Chinchilla approach 3): ``L(N, D) = E + A / N^alpha + B / D^beta``, fitted as
  ``log L = LSE(a - alpha log N, b - beta log D, e)`` with the Huber loss (delta 1e-3) on the log
  residuals, by L-BFGS from a grid of starts (the best kept).
* Intervals: percentile bootstrap over runs (each run is one point and seed), resampled within
  each compute budget so every IsoFLOP profile keeps its sizes.
* Compute multiplier of a variant against a baseline at compute C: the compute the baseline needs to
  reach the variant's ``L_opt(C)``, divided by C (above 1: the variant is more compute-efficient).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

HUBER_DELTA = 1e-3


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    def __contains__(self, x: float) -> bool:
        return self.low <= x <= self.high

    @property
    def width(self) -> float:
        return self.high - self.low


@dataclass(frozen=True)
class PowerLaw:
    """``y = coef * x ** exponent``."""

    coef: float
    exponent: float

    def __call__(self, x):
        return self.coef * np.asarray(x, float) ** self.exponent

    def inverse(self, y):
        return (np.asarray(y, float) / self.coef) ** (1.0 / self.exponent)


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> PowerLaw:
    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    return PowerLaw(float(np.exp(intercept)), float(slope))


@dataclass(frozen=True)
class Runs:
    """Finished runs of one variant, as arrays: ``n`` (active non-embedding parameters),
    ``tokens``, ``flops_per_token``, ``budget`` (the IsoFLOP budget C each came from), ``loss``."""

    n: np.ndarray
    tokens: np.ndarray
    flops_per_token: np.ndarray
    budget: np.ndarray
    loss: np.ndarray

    @classmethod
    def of(cls, rows: list[dict]) -> Runs:
        return cls(*(np.asarray([r[k] for r in rows], float)
                     for k in ("n", "tokens", "flops_per_token", "budget", "loss")))

    def take(self, idx: np.ndarray) -> Runs:
        return Runs(self.n[idx], self.tokens[idx], self.flops_per_token[idx], self.budget[idx],
                    self.loss[idx])


@dataclass(frozen=True)
class Profile:
    """One IsoFLOP profile: ``loss = c2 x^2 + c1 x + c0`` in ``x = log N``."""

    compute: float
    coeffs: tuple[float, float, float]
    n_opt: float
    loss_opt: float
    d_opt: float


@dataclass(frozen=True)
class IsoFLOPFit:
    profiles: tuple[Profile, ...]
    loss: PowerLaw  # L_opt(C): exponent is -b
    n_opt: PowerLaw
    d_opt: PowerLaw


def isoflop_profiles(runs: Runs) -> list[Profile]:
    """A parabola per budget with at least three distinct sizes and an upward curvature."""
    flops_law = fit_power_law(runs.n, runs.flops_per_token) if len(set(runs.n)) > 1 else None
    out = []
    for c in sorted(set(runs.budget)):
        sel = runs.budget == c
        sizes = np.unique(runs.n[sel])
        if len(sizes) < 3:
            continue
        mean = np.array([runs.loss[sel][runs.n[sel] == s].mean() for s in sizes])
        c2, c1, c0 = np.polyfit(np.log(sizes), mean, 2)
        if c2 <= 0:
            continue  # no minimum: the budget's sizes do not bracket N_opt
        x = -c1 / (2 * c2)
        n_opt = float(np.exp(x))
        fpt = float(flops_law(n_opt)) if flops_law else float(runs.flops_per_token[sel][0])
        out.append(Profile(float(c), (float(c2), float(c1), float(c0)), n_opt,
                           float(c0 - c1 * c1 / (4 * c2)), float(c) / fpt))
    return out


def fit_isoflop(runs: Runs) -> IsoFLOPFit | None:
    """None when fewer than two budgets give a profile with a minimum."""
    profiles = isoflop_profiles(runs)
    if len(profiles) < 2:
        return None
    c = [p.compute for p in profiles]
    return IsoFLOPFit(tuple(profiles), fit_power_law(c, [p.loss_opt for p in profiles]),
                      fit_power_law(c, [p.n_opt for p in profiles]),
                      fit_power_law(c, [p.d_opt for p in profiles]))


@dataclass(frozen=True)
class Chinchilla:
    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def __call__(self, n, d):
        n, d = np.asarray(n, float), np.asarray(d, float)
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta


def _huber_objective(theta: np.ndarray, log_n, log_d, log_l):
    """Huber loss of log-space residuals and its gradient in (e, a, b, alpha, beta)."""
    e, a, b, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    # log-sum-exp written out: scipy's is ~5x slower on these 3 x n arrays, and a fit evaluates
    # this thousands of times.
    top = terms.max(axis=0)
    pred = top + np.log(np.exp(terms - top).sum(axis=0))
    r = pred - log_l
    small = np.abs(r) <= HUBER_DELTA
    loss = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum()
    dr = np.where(small, r, HUBER_DELTA * np.sign(r))
    w = np.exp(terms - pred) * dr  # softmax weights times dL/dpred
    grad = np.array([w[2].sum(), w[0].sum(), w[1].sum(), -(w[0] * log_n).sum(),
                     -(w[1] * log_d).sum()])
    return loss, grad


# The Huber loss at delta 1e-3 is nearly L1 on log residuals of a few 1e-3: with L-BFGS's default
# tolerances a refit stops at its start, and bootstrap intervals come out far too narrow.
LBFGS_OPTIONS = {"ftol": 1e-11, "gtol": 1e-8, "maxiter": 300}
# 32 starts: L-BFGS from each converges in tens of steps; bootstrap refits start from the best.
START_GRID = {"e": (0.0, 1.0), "a": (2.0, 8.0), "b": (2.0, 8.0), "alpha": (0.2, 0.6),
              "beta": (0.2, 0.6)}


def fit_chinchilla(n, d, loss, starts: Sequence[Sequence[float]] | None = None) -> Chinchilla:
    """L-BFGS from every start (default: :data:`START_GRID`); the lowest objective wins."""
    args = (np.log(np.asarray(n, float)), np.log(np.asarray(d, float)),
            np.log(np.asarray(loss, float)))
    starts = starts if starts is not None else list(itertools.product(*START_GRID.values()))
    best = None
    for x0 in starts:
        res = minimize(_huber_objective, np.asarray(x0, float), args=args, jac=True,
                       method="L-BFGS-B", options=LBFGS_OPTIONS)
        if best is None or res.fun < best.fun:
            best = res
    e, a, b, alpha, beta = best.x
    return Chinchilla(float(np.exp(e)), float(np.exp(a)), float(alpha), float(np.exp(b)),
                      float(beta))


def chinchilla_start(fit: Chinchilla) -> list[float]:
    return [np.log(fit.E), np.log(fit.A), np.log(fit.B), fit.alpha, fit.beta]


def compute_multiplier(variant: PowerLaw, baseline: PowerLaw, compute: float) -> float:
    """Baseline compute to reach the variant's L_opt(compute), over compute."""
    return float(baseline.inverse(variant(compute))) / compute


def bootstrap(runs: Sequence[Runs], statistic: Callable[..., float | None], resamples: int,
              seed: int = 0) -> np.ndarray:
    """``statistic(*resampled)`` over ``resamples`` draws; each ``Runs`` is resampled with
    replacement within each of its budgets. Draws where the statistic is None (a degenerate
    resample) are left out."""
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        drawn = [r.take(_resample_index(r, rng)) for r in runs]
        try:
            v = statistic(*drawn)
        except (np.linalg.LinAlgError, ValueError, FloatingPointError):
            v = None
        if v is not None and np.all(np.isfinite(v)):
            values.append(v)
    return np.asarray(values, float)


def _resample_index(runs: Runs, rng) -> np.ndarray:
    idx = [rng.choice(np.nonzero(runs.budget == c)[0], size=int((runs.budget == c).sum()))
           for c in np.unique(runs.budget)]
    return np.concatenate(idx)


def interval(value: float, draws: np.ndarray, level: float = 0.95) -> Interval:
    """Percentile interval of the bootstrap draws around the full-data ``value``."""
    if len(draws) == 0:
        return Interval(value, float("nan"), float("nan"))
    lo, hi = np.percentile(draws, [50 * (1 - level), 50 * (1 + level)], axis=0)
    return Interval(float(value), float(lo), float(hi))
