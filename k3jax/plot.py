"""Plot training runs from their ``metrics.jsonl``.

    python -m k3jax.plot runs/tiny [runs/other ...] [--out DIR]

Writes PNGs (matplotlib, Agg backend): ``loss.png`` and ``bpb.png`` (train and held-out curves of
every run), ``maxvio.png`` (MaxVio per MoE layer over training, when the model has MoE) and
``attnres_depth_RUN.png`` (each run's latest AttnRes depth-attention weights: one row per
sub-layer's read in depth order, one column per source, when the model uses AttnRes). A run is
labelled by its folder name, with as many parent folders as it takes to tell the runs apart.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

import numpy as np

from k3jax.train.metrics import read_metrics


def _series(records, kind: str, key: str):
    points = {r["step"]: r[key] for r in records
              if r.get("kind") == kind and r.get(key) is not None}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def _curves(plt, runs: dict, key: str, ylabel: str, path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for name, records in runs.items():
        for kind, style in (("train", "-"), ("eval", "o-")):
            steps, values = _series(records, kind, key)
            if steps:
                ax.plot(steps, values, style, ms=3, label=f"{name} ({kind})")
                drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def _maxvio(plt, runs: dict, path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for name, records in runs.items():
        keys = sorted({k for r in records if r.get("kind") == "train" for k in r
                       if k.startswith("maxvio/")})
        for key in keys:
            steps, values = _series(records, "train", key)
            arr = np.asarray(values, dtype=float).reshape(len(steps), -1)
            for j in range(arr.shape[1]):
                label = f"{name} {key[7:]}" + (f"[{j}]" if arr.shape[1] > 1 else "")
                ax.plot(steps, arr[:, j], label=label)
                drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel("MaxVio (max load / mean load - 1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


SUBLAYERS = {"residual_mixer": 0, "residual_ffn": 1}  # a layer's mixer reads before its FFN


def _natural(text: str) -> list:
    """Sort key: numbers compare as numbers (block_10_scan after block_9_scan)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def depth_weight_rows(record: dict) -> tuple[list[str], np.ndarray]:
    """One row per AttnRes read: its depth-attention weights over the sources, in depth order.

    Each sub-layer's rule logs ``diag/.../depth_weights`` as ``[N + 1]`` (slot 0 the embedding,
    slot ``i`` block ``i``; zero for blocks not yet begun): an unrolled layer under ``layer_i``, a
    scanned group's layer ``k`` under ``GROUP/layer_k`` as ``[repeats, N + 1]``, one row per
    repeat. Rows are labelled ``layer_i/residual_mixer`` (``_ffn``) by their depth in the stack,
    the final aggregation last. Returns the labels and a ``[rows, N + 1]`` array.
    """
    unrolled, groups, final = {}, {}, {}
    for key, value in record.items():
        if not (key.startswith("diag/") and key.endswith("/depth_weights")):
            continue
        name, arr = key[len("diag/"):-len("/depth_weights")], np.asarray(value, dtype=float)
        if m := re.fullmatch(r"layer_(\d+)/(\w+)", name):
            unrolled[int(m[1]), m[2]] = arr
        elif m := re.fullmatch(r"(\w+)/layer_(\d+)/(\w+)", name):
            groups.setdefault(m[1], {})[int(m[2]), m[3]] = arr.reshape(-1, arr.shape[-1])
        else:
            final[name] = arr
    # A scanned read knows its place in the group and its repeat, not its depth: the scanned layers
    # are the depths no unrolled layer has, taken group after group in the order the stack runs
    # them (each group's layers repeat after repeat).
    taken = {i for i, _ in unrolled}
    free = (d for d in itertools.count() if d not in taken)
    rows = dict(unrolled)
    for group in sorted(groups, key=_natural):
        reads = groups[group]
        period = 1 + max(k for k, _ in reads)
        repeats = max(arr.shape[0] for arr in reads.values())
        depths = [next(free) for _ in range(period * repeats)]
        for (k, sub), arr in reads.items():
            for r, row in enumerate(arr):
                rows[depths[r * period + k], sub] = row
    order = sorted(rows, key=lambda d: (d[0], SUBLAYERS.get(d[1], len(SUBLAYERS)), d[1]))
    last = sorted(final, key=_natural)
    labels = [f"layer_{i}/{sub}" for i, sub in order] + last
    values = [rows[d] for d in order] + [final[n].reshape(-1) for n in last]
    return labels, np.stack(values) if values else np.zeros((0, 0))


def _depth_heatmaps(plt, runs: dict, out: Path) -> list[Path]:
    """The newest AttnRes depth weights of each run as one heatmap (reads x sources)."""
    written = []
    # distinct labels can still meet as file names (a/b and a_b)
    files = dict(zip(runs, _numbered(["".join(c if c.isalnum() else "_" for c in name)
                                      for name in runs], mark="_")))
    for name, records in runs.items():
        latest = next((r for r in reversed(records)
                       if any(k.endswith("/depth_weights") for k in r)), None)
        if latest is None:
            continue
        labels, arr = depth_weight_rows(latest)
        fig, ax = plt.subplots(figsize=(1.2 * arr.shape[1] + 4, 0.3 * arr.shape[0] + 2))
        im = ax.imshow(arr, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
        fig.colorbar(im, ax=ax, label="weight (mean over tokens)")
        ax.set_xticks(range(arr.shape[1]),
                      ["embedding"] + [f"block {i}" for i in range(1, arr.shape[1])])
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("source")
        ax.set_ylabel("AttnRes read (sub-layer)")
        ax.set_title(f"{name}: AttnRes depth weights ({latest.get('kind', '')} step "
                     f"{latest['step']})", fontsize=9)
        fig.tight_layout()
        path = out / f"attnres_depth_{files[name]}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def _numbered(names: list[str], mark: str = "#") -> list[str]:
    """``names`` with each repeat of a name numbered (``#2``, ``#3``, ... with ``mark="#"``)."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}{mark}{seen[name]}")
    return out


def run_labels(workdirs: list[str]) -> list[str]:
    """One distinct label per workdir for legends and file names: its folder name, with as many
    parent folders as it takes to tell the runs apart (``runs/a/tiny``, ``runs/b/tiny`` ->
    ``a/tiny``, ``b/tiny``); a workdir given twice is numbered."""
    parts = [Path(w).resolve().parts for w in workdirs]
    for n in range(1, max(map(len, parts), default=0) + 1):
        labels = ["/".join(p[-n:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return _numbered([str(Path(w).resolve()) for w in workdirs])


def plot_runs(workdirs: list[str], out: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: read_metrics(w) for label, w in zip(run_labels(workdirs), workdirs)}
    empty = [w for w, records in zip(workdirs, runs.values()) if not records]
    if empty:
        raise FileNotFoundError(f"no metrics.jsonl records in {empty}")
    out = Path(out or workdirs[0])
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label, file in (("loss", "loss (nats/token)", "loss.png"),
                             ("bpb", "bits per byte", "bpb.png")):
        if _curves(plt, runs, key, label, out / file):
            written.append(out / file)
    if _maxvio(plt, runs, out / "maxvio.png"):
        written.append(out / "maxvio.png")
    return written + _depth_heatmaps(plt, runs, out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3jax.plot", description=__doc__)
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--out", help="folder for the PNGs (default: the first workdir)")
    args = parser.parse_args(argv)
    try:
        paths = plot_runs(args.workdirs, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
