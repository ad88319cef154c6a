"""Plot training runs from their ``metrics.jsonl``.

    python -m k3jax.plot runs/tiny [runs/other ...] [--out DIR]

Writes PNGs (matplotlib, Agg backend): ``loss.png`` and ``bpb.png`` (train and held-out curves of
every run), ``maxvio.png`` (MaxVio per MoE layer over training, when the model has MoE) and
``attnres_depth_RUN.png`` (each run's latest AttnRes depth-attention weights: one row per
sub-layer's read, one column per source, when the model uses AttnRes).
"""

from __future__ import annotations

import argparse
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


def _depth_order(key: str) -> tuple:
    """Sort key in depth order: numbers compare as numbers (layer_10 after layer_9), a layer's
    mixer reads before its FFN, the final read comes last."""
    key = key.replace("residual_mixer", "residual_0").replace("residual_ffn", "residual_1")
    parts = re.split(r"(\d+)", key)
    return (key.startswith("diag/final"), [int(p) if p.isdigit() else p for p in parts])


def depth_weight_rows(record: dict) -> tuple[list[str], np.ndarray]:
    """One row per AttnRes read: its depth-attention weights over the sources, in depth order.

    Each sub-layer's rule logs ``diag/.../depth_weights`` as ``[N + 1]`` (slot 0 the embedding,
    slot ``i`` block ``i``; zero for blocks not yet begun); a scanned layer group logs
    ``[repeats, N + 1]``, one row per repeat. Returns the row labels and a ``[rows, N + 1]`` array.
    """
    labels, rows = [], []
    for key in sorted((k for k in record if k.startswith("diag/")
                       and k.endswith("/depth_weights")), key=_depth_order):
        arr = np.asarray(record[key], dtype=float)
        name = key[len("diag/"):-len("/depth_weights")]
        arr2 = arr.reshape(-1, arr.shape[-1])
        for r, row in enumerate(arr2):
            labels.append(name if arr.ndim == 1 else f"{name}[{r}]")
            rows.append(row)
    return labels, np.stack(rows) if rows else np.zeros((0, 0))


def _depth_heatmaps(plt, runs: dict, out: Path) -> list[Path]:
    """The newest AttnRes depth weights of each run as one heatmap (reads x sources)."""
    written = []
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
        safe = "".join(c if c.isalnum() else "_" for c in name)
        path = out / f"attnres_depth_{safe}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def plot_runs(workdirs: list[str], out: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {Path(w).name or str(w): read_metrics(w) for w in workdirs}
    empty = [w for w, (n, r) in zip(workdirs, runs.items()) if not r]
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
