"""Scaling fits recover known laws from noisy points, inside their bootstrap intervals, and the
intervals shrink with more points.

IsoFLOP points come from a law of exactly the fitted form: at compute C the loss is
``a C^-b + h (ln N - ln N_opt(C))^2`` with ``N_opt = k C^p``. Parametric points come from the
Chinchilla law with the published parameters (E 1.69, A 406.4, alpha 0.34, B 410.7, beta 0.28).
Both carry log-normal noise of 0.5% on the loss.
"""

import numpy as np

from k3jax.sweep.fits import (
    Chinchilla,
    PowerLaw,
    Runs,
    bootstrap,
    chinchilla_start,
    compute_multiplier,
    fit_chinchilla,
    fit_isoflop,
    interval,
)

NOISE = 0.005
LOSS = PowerLaw(40.0, -0.08)  # L_opt(C) = 40 C^-0.08
N_OPT = PowerLaw(0.1, 0.5)  # N_opt(C) = 0.1 C^0.5
CURVATURE = 0.03
BUDGETS = np.geomspace(1e16, 1e19, 4)
CHINCHILLA = Chinchilla(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)


def _isoflop_runs(sizes: int, seeds: int, rng, advantage: float = 1.0) -> Runs:
    """Sizes spanning N_opt / 6 .. 6 N_opt per budget; ``advantage`` m: the loss at C is the
    law's at m C (a variant worth m times the compute)."""
    rows = []
    for c in BUDGETS:
        n_opt = N_OPT(c * advantage)
        for n in np.geomspace(n_opt / 6, n_opt * 6, sizes):
            mean = LOSS(c * advantage) + CURVATURE * np.log(n / n_opt) ** 2
            for _ in range(seeds):
                rows.append({"n": n, "tokens": c / (6 * n), "flops_per_token": 6 * n,
                             "budget": c, "loss": mean * np.exp(rng.normal(0, NOISE))})
    return Runs.of(rows)


def _exponents(runs: Runs):
    fit = fit_isoflop(runs)

    def stat(r):
        f = fit_isoflop(r)
        return None if f is None else np.array([f.loss.exponent, f.n_opt.exponent])

    draws = bootstrap([runs], stat, 200)
    return [interval(v, draws[:, i]) for i, v in enumerate((fit.loss.exponent,
                                                           fit.n_opt.exponent))]


def test_isoflop_recovers_the_loss_and_size_exponents():
    rng = np.random.default_rng(0)
    few, many = _exponents(_isoflop_runs(7, 2, rng)), _exponents(_isoflop_runs(9, 6, rng))
    for est in (few, many):
        assert LOSS.exponent in est[0] and N_OPT.exponent in est[1], est
    assert all(m.width < f.width for f, m in zip(few, many))


def test_compute_multiplier_recovers_a_known_advantage():
    rng = np.random.default_rng(2)

    def mult(v, b):
        fv, fb = fit_isoflop(v), fit_isoflop(b)
        return None if fv is None or fb is None else compute_multiplier(fv.loss, fb.loss, 1e18)

    def estimate(sizes, seeds):
        base = _isoflop_runs(sizes, seeds, rng)
        variant = _isoflop_runs(sizes, seeds, rng, advantage=1.3)
        return interval(mult(variant, base), bootstrap([variant, base], mult, 200))

    few, many = estimate(5, 1), estimate(9, 3)
    assert 1.3 in few and 1.3 in many and many.low > 1.0, (few, many)
    assert many.width < few.width


def test_chinchilla_fit_recovers_the_law():
    rng = np.random.default_rng(1)

    def fitted(grid: int, starts=None):
        n, d = (x.ravel() for x in np.meshgrid(np.geomspace(1e7, 1e9, grid),
                                               np.geomspace(1e9, 1e11, grid)))
        loss = CHINCHILLA(n, d) * np.exp(rng.normal(0, NOISE, n.shape))
        runs = Runs(n, d, 6 * n, np.ones_like(n), loss)  # one budget: resample over all runs
        fit = fit_chinchilla(n, d, loss, starts)  # None: from the whole start grid
        start = [chinchilla_start(fit)]

        def stat(r):
            f = fit_chinchilla(r.n, r.tokens, r.loss, start)
            return np.array([f.alpha, f.beta, f.E])

        draws = bootstrap([runs], stat, 30)
        return fit, [interval(v, draws[:, i]) for i, v in enumerate((fit.alpha, fit.beta, fit.E))]

    truth = (CHINCHILLA.alpha, CHINCHILLA.beta, CHINCHILLA.E)
    first, small = fitted(4)
    _, large = fitted(8, [chinchilla_start(first)])  # the grid of starts ran once, above
    for est in (small, large):
        assert all(t in e for t, e in zip(truth, est)), (est, truth)
    assert all(b.width < a.width for a, b in zip(small, large))
