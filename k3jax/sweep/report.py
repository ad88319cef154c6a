"""The report of a sweep directory: results table, fits with intervals, plots, markdown summary.

Written to ``DIR/report/``: ``results.csv`` and ``results.jsonl`` (one row per point),
``fits.json``, ``loss_vs_compute.png``, ``isoflop.png``, ``n_opt.png``, ``multipliers.png`` (the
plots that have data) and ``summary.md``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from k3jax.sweep.fits import (
    Interval,
    Runs,
    bootstrap,
    chinchilla_start,
    compute_multiplier,
    fit_chinchilla,
    fit_isoflop,
    interval,
)
from k3jax.sweep.runner import FAILED_FILE, TIMING_FILE, point_status, read_plan, run_dir

COLUMNS = ("name", "variant", "seed", "size", "lr", "n", "n_total", "tokens", "compute", "budget",
           "steps", "loss", "bpb", "tokens_per_s", "mfu", "wall_s", "startup_s", "overhead",
           "status", "error")


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get("kind") == "train" and r.get(key)]
    return float(np.median(values)) if values else None


def _spans(d: Path) -> list[list[float]]:
    return json.loads((d / TIMING_FILE).read_text()) if (d / TIMING_FILE).is_file() else []


def _tokens_stepped(point: dict, spans: list[list[float]]) -> int:
    """Tokens a point's launches (``spans``, its timing file's) trained towards its result: a WSD
    branch's own steps from its branch step on, plus the stretch of the shared stable phase its
    launches trained first (the earlier stretches ran in earlier branches' launches)."""
    own = point["steps"] - (point.get("branch_step") or 0)
    stable = sum(span[2] for span in spans if len(span) > 2)
    return point["tokens"] // point["steps"] * (own + stable)


def collect(root: str | Path) -> list[dict]:
    """One row per planned point, from its run directory."""
    from k3jax.train.metrics import read_metrics

    root = Path(root)
    rows = []
    for p in read_plan(root)["points"]:
        d = run_dir(root, p["name"])
        row = {k: p.get(k) for k in COLUMNS}
        row["status"] = point_status(root, p)
        records = read_metrics(d) if (d / "metrics.jsonl").is_file() else []
        row["tokens_per_s"], row["mfu"] = _median(records, "tokens_per_s"), _median(records, "mfu")
        # From a launch's start to its first step done (compile included), summed over launches.
        row["startup_s"] = sum(r["start_to_first_step_s"] for r in records
                               if r.get("kind") == "compile") or None
        spans = _spans(d)
        if spans:
            row["wall_s"] = sum(span[1] - span[0] for span in spans)
        if row["status"] == "done":
            summary = json.loads((d / "summary.json").read_text())
            last = summary.get("heldout_last", {})
            row.update(loss=last.get("loss"), bpb=last.get("bpb"))
            if row["wall_s"] and row["tokens_per_s"]:
                # Start-up, compilation, evaluation and checkpoints: wall time not spent stepping.
                # The stable phase's steps are timed at the point's rate: same model and batch.
                stepping = _tokens_stepped(p, spans) / row["tokens_per_s"]
                row["overhead"] = max(0.0, 1 - stepping / row["wall_s"])
        if row["status"] == "failed":
            row["error"] = json.loads((d / FAILED_FILE).read_text())["error"].splitlines()[0]
        rows.append(row)
    return rows


def side_by_side(root: str | Path) -> tuple[float, float] | None:
    """``(busy, summed)`` seconds of the sweep's points from their timing files: the time during
    which at least one point ran (the union of every launch's span: the gaps between resumed
    launches left out), and the points' wall times added up, what running them in turn would
    take if each ran as fast alone as beside the others. None before any point has run."""
    root = Path(root)
    spans = sorted(span[:2] for p in read_plan(root)["points"]
                   for span in _spans(run_dir(root, p["name"])))
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > end:
            busy, start = busy + end - start, a
        end = max(end, b)
    return busy + end - start, sum(b - a for a, b in spans)


def measured_tokens_per_s(root: str | Path) -> dict[tuple[str, int], float]:
    """Median tokens/s of finished points per (variant, size)."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in collect(root):
        if r["tokens_per_s"]:
            out.setdefault((r["variant"], r["size"]), []).append(r["tokens_per_s"])
    return {k: float(np.median(v)) for k, v in out.items()}


def _write_tables(rows: list[dict], out: Path) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _runs_by_variant(rows: list[dict], plan: dict) -> dict[str, Runs]:
    done = [dict(r, flops_per_token=p["flops_per_token"])
            for r, p in zip(rows, plan["points"]) if r["status"] == "done" and r["loss"]]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    return {v: Runs.of([r for r in done if r["variant"] == v]) for v in variants
            if any(r["variant"] == v for r in done)}


def _iv(x: Interval) -> dict:
    return {"value": x.value, "low": x.low, "high": x.high}


def fit_all(runs: dict[str, Runs], baseline: str, compute: float, resamples: int,
            isoflop: bool = True) -> dict:
    """Every fit of the report, each statistic with its bootstrap interval; ``isoflop``: the
    budgets are compute budgets (IsoFLOP profiles make sense)."""
    out: dict = {"baseline": baseline, "compute": compute, "variants": {}, "multipliers": {}}
    iso = {v: fit_isoflop(r) if isoflop else None for v, r in runs.items()}
    for v, r in runs.items():
        entry: dict = {"runs": len(r.loss)}
        fit = iso[v]
        if fit is not None:
            stat = lambda key: (lambda x: None if (f := fit_isoflop(x)) is None
                                else getattr(f, key).exponent)
            draws = {k: bootstrap([r], stat(k), resamples) for k in ("loss", "n_opt", "d_opt")}
            entry["isoflop"] = {
                "profiles": [p.__dict__ for p in fit.profiles],
                "loss_law": {"a": fit.loss.coef, "b": _iv(interval(-fit.loss.exponent,
                                                                   -draws["loss"]))},
                "n_opt_law": {"k": fit.n_opt.coef, "p": _iv(interval(fit.n_opt.exponent,
                                                                     draws["n_opt"]))},
                "d_opt_law": {"m": fit.d_opt.coef, "q": _iv(interval(fit.d_opt.exponent,
                                                                     draws["d_opt"]))},
                "n_opt_at_compute": float(fit.n_opt(compute)),
                "d_opt_at_compute": float(fit.d_opt(compute)),
                "loss_at_compute": float(fit.loss(compute))}
        if len(set(r.n)) >= 2 and len(set(r.tokens)) >= 2 and len(r.loss) >= 5:
            entry["chinchilla"] = _chinchilla_with_intervals(r, resamples)
        out["variants"][v] = entry
    if iso.get(baseline) is not None:
        for v, fit in iso.items():
            if v == baseline or fit is None:
                continue
            value = compute_multiplier(fit.loss, iso[baseline].loss, compute)

            def stat(x, b):
                fx, fb = fit_isoflop(x), fit_isoflop(b)
                return None if fx is None or fb is None else compute_multiplier(fx.loss, fb.loss,
                                                                                compute)

            draws = bootstrap([runs[v], runs[baseline]], stat, resamples)
            out["multipliers"][v] = _iv(interval(value, draws))
    return out


def _chinchilla_with_intervals(r: Runs, resamples: int) -> dict:
    fit = fit_chinchilla(r.n, r.tokens, r.loss)
    start = [chinchilla_start(fit)]
    draws = bootstrap([r], lambda x: np.array(list(
        fit_chinchilla(x.n, x.tokens, x.loss, start).__dict__.values())), resamples)
    names = list(fit.__dict__)
    return {k: _iv(interval(getattr(fit, k), draws[:, i] if len(draws) else draws))
            for i, k in enumerate(names)}


# -- plots --------------------------------------------------------------------------------------

def _plots(runs: dict[str, Runs], fits: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    colors = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v, r in runs.items():
        ax.scatter(r.tokens * r.flops_per_token, r.loss, s=12, alpha=0.5,
                   color=colors[v], label=f"{v} runs")
        iso = fits["variants"][v].get("isoflop")
        if iso:
            c = np.array([p["compute"] for p in iso["profiles"]])
            ax.scatter(c, [p["loss_opt"] for p in iso["profiles"]], marker="*", s=80,
                       color=colors[v])
            grid = np.geomspace(c.min() / 2, c.max() * 2, 50)
            a, b = iso["loss_law"]["a"], iso["loss_law"]["b"]["value"]
            ax.plot(grid, a * grid ** -b, color=colors[v], label=f"{v}: L = {a:.3g} C^-{b:.3f}")
    _finish(ax, "training compute C (FLOPs)", "final held-out loss (nats/token)", True)
    made.append(_save(fig, out / "loss_vs_compute.png"))

    with_iso = [v for v in runs if fits["variants"][v].get("isoflop")]
    if with_iso:
        fig, axes = plt.subplots(1, len(with_iso), figsize=(5.5 * len(with_iso), 4.2),
                                 squeeze=False)
        for ax, v in zip(axes[0], with_iso):
            r = runs[v]
            for p in fits["variants"][v]["isoflop"]["profiles"]:
                sel = r.budget == p["compute"]
                ax.scatter(r.n[sel], r.loss[sel], s=12)
                x = np.linspace(np.log(r.n[sel].min()), np.log(r.n[sel].max()), 50)
                ax.plot(np.exp(x), np.polyval(p["coeffs"], x), label=f"C = {p['compute']:.2g}")
                ax.scatter([p["n_opt"]], [p["loss_opt"]], marker="*", s=80, color="k")
            ax.set_title(v)
            _finish(ax, "N (active non-embedding parameters)", "final held-out loss", False)
        made.append(_save(fig, out / "isoflop.png"))

        fig, ax = plt.subplots(figsize=(6, 4.2))
        for v in with_iso:
            iso = fits["variants"][v]["isoflop"]
            c = np.array([p["compute"] for p in iso["profiles"]])
            ax.scatter(c, [p["n_opt"] for p in iso["profiles"]], color=colors[v])
            k, p = iso["n_opt_law"]["k"], iso["n_opt_law"]["p"]["value"]
            ax.plot(c, k * c ** p, color=colors[v], label=f"{v}: N_opt ~ C^{p:.2f}")
        _finish(ax, "training compute C (FLOPs)", "N_opt", True, logy=True)
        made.append(_save(fig, out / "n_opt.png"))

    if fits["multipliers"]:
        fig, ax = plt.subplots(figsize=(5, 3.8))
        names = list(fits["multipliers"])
        m = [fits["multipliers"][n] for n in names]
        val = np.array([x["value"] for x in m])
        err = np.array([[x["value"] - x["low"] for x in m], [x["high"] - x["value"] for x in m]])
        ax.bar(names, val, yerr=np.nan_to_num(err), capsize=6, color="tab:blue", alpha=0.7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(f"compute multiplier vs {fits['baseline']} at C = {fits['compute']:.2g}")
        made.append(_save(fig, out / "multipliers.png"))
    return made


def _finish(ax, xlabel: str, ylabel: str, legend: bool, logy: bool = False) -> None:
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


# -- summary ------------------------------------------------------------------------------------

def _fmt(x: dict, digits: int = 3) -> str:
    return f"{x['value']:.{digits}g} [{x['low']:.{digits}g}, {x['high']:.{digits}g}]"


def _summary(plan: dict, rows: list[dict], fits: dict, plots: list[str], resamples: int,
             times: tuple[float, float] | None) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "started",
                                                               "pending")}
    lines = [f"# Sweep `{plan['sweep']}`", "",
             f"{len(rows)} points: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + "."]
    if times:
        busy, summed = times
        lines.append(f"Wall time {busy:.0f} s with points running; their own wall times add up "
                     f"to {summed:.0f} s, {summed / busy:.2f}x as long (each as it ran beside "
                     f"the others: alone a point may run faster).")
    lines += [(f"Intervals are 95% percentile bootstrap intervals over runs ({resamples} "
               "resamples, within each compute budget)."), "",
              ("| variant | size | N | N_total | D | C | seed | loss | bits/byte | tokens/s | MFU "
               "| wall s | start-up s | overhead | status |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    num = lambda x, f: "-" if x is None else format(x, f)
    for r in rows:
        lines.append(f"| {r['variant']} | {r['size']} | {r['n']:,} | {r['n_total']:,} | "
                     f"{r['tokens']:,} | {r['compute']:.3g} | {r['seed']} | "
                     f"{num(r['loss'], '.4f')} | {num(r['bpb'], '.4f')} | "
                     f"{num(r['tokens_per_s'], ',.0f')} | {num(r['mfu'], '.1%')} | "
                     f"{num(r['wall_s'], '.0f')} | {num(r['startup_s'], '.1f')} | "
                     f"{num(r['overhead'], '.0%')} | {r['status']} |")
    lines += ["", "## Fits", ""]
    for v, entry in fits["variants"].items():
        iso = entry.get("isoflop")
        if iso:
            lines.append(f"- **{v}** (IsoFLOP, {len(iso['profiles'])} budgets): "
                         f"L_opt = {iso['loss_law']['a']:.3g} C^-b with b = "
                         f"{_fmt(iso['loss_law']['b'])}; N_opt ~ C^p with p = "
                         f"{_fmt(iso['n_opt_law']['p'])}; D_opt ~ C^q with q = "
                         f"{_fmt(iso['d_opt_law']['q'])}; at C = {fits['compute']:.3g}: N_opt = "
                         f"{iso['n_opt_at_compute']:.3g}, D_opt = {iso['d_opt_at_compute']:.3g}.")
        else:
            lines.append(f"- **{v}**: no IsoFLOP fit (needs two or more budgets, each with three "
                         "or more sizes whose losses curve upward).")
        ch = entry.get("chinchilla")
        if ch:
            lines.append(f"  L(N, D) = E + A/N^alpha + B/D^beta: E = {_fmt(ch['E'])}, "
                         f"A = {_fmt(ch['A'])}, alpha = {_fmt(ch['alpha'])}, "
                         f"B = {_fmt(ch['B'])}, beta = {_fmt(ch['beta'])}.")
    if fits["multipliers"]:
        lines += ["", (f"## Compute multipliers against `{fits['baseline']}` at C = "
                  f"{fits['compute']:.3g} FLOPs"), "",
                  "Above 1: the variant reaches the baseline's loss with less compute.", ""]
        budgets = [r["budget"] for r in rows if r.get("budget")]
        for v, m in fits["multipliers"].items():
            verdict = ("the interval excludes 1" if m["low"] > 1 or m["high"] < 1 else
                       "the interval includes 1: no difference is resolved at this scale")
            # The multiplier reads the baseline's fitted law at multiplier x C: outside the
            # measured budgets that is an extrapolation of the law, not a measurement.
            if budgets and not min(budgets) <= m["value"] * fits["compute"] <= max(budgets):
                verdict += (f"; extrapolated: the baseline's law is read at "
                            f"{m['value'] * fits['compute']:.3g} FLOPs, outside the measured "
                            f"{min(budgets):.3g}-{max(budgets):.3g}")
            lines.append(f"- {v}: {_fmt(m)} ({verdict})")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(root: str | Path, compute: float | None = None, resamples: int = 200,
                 out: str | Path | None = None) -> str:
    """Write everything into ``out`` (default ``root/report``); returns the summary's path."""
    root = Path(root)
    plan = read_plan(root)
    out = Path(out) if out else root / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows = collect(root)
    _write_tables(rows, out)
    runs = _runs_by_variant(rows, plan)
    compute = compute or plan.get("reference_compute") or max(
        (p["budget"] if plan["budget_kind"] == "compute" else p["compute"])
        for p in plan["points"])
    fits = fit_all(runs, plan["baseline"], compute, resamples,
                   isoflop=plan["budget_kind"] == "compute")
    (out / "fits.json").write_text(json.dumps(fits, indent=1))
    plots = _plots(runs, fits, out) if runs else []
    path = out / "summary.md"
    path.write_text(_summary(plan, rows, fits, plots, resamples, side_by_side(root)))
    return str(path)
