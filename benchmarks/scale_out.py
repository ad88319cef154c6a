"""Weak scaling of a preset's train step over the devices of one host: the same batch per device
on 1, 2, 4, ... devices, in the mesh layouts asked for, each point a ``step_profile.py`` run of
its own on devices of its own.

A layout is the mesh's axis sizes, ``data=2,expert=4`` (axes left out are 1); its devices are
their product, and the global batch is ``--per-device-batch`` times the devices that hold
different tokens (``data``, ``fsdp``, ``expert``; ``tensor`` splits matrices, not tokens). A
layout with ``expert`` above 1 takes ``--expert-dispatch`` (the MoE's tokens travel to their
experts' devices) unless ``--set model.moe.dispatch=...`` says otherwise. Points whose devices fit
beside each other start together and compile side by side, and each times and traces its steps
alone (``step_profile.py --serialize-with``); other points may still be compiling on the host
meanwhile, which ``--sequential`` (one point at a time) rules out. One JSON line per point (and
a table of them on stderr)::

    {"bench": "scale_out", "layout": "fsdp=2,expert=4", "devices": 8, "batch": 128,
     "tokens_per_s": ..., "tokens_per_s_per_device": ..., "step_ms": ..., "mfu": ...,
     "peak_GiB": ...,                      # the fullest device's peak
     "collective_ms": ..., "collective_share": ...,   # communication kernels, per step
     "dispatch_ms": ..., "dispatch_share": ...,       # the MoE dispatch's attributed kernels
     "efficiency": {"1": 0.97, "2": 0.99}}   # per-device tokens/s over the best point on 1 / 2

``dispatch_ms`` sums the profile's sources under the MoE's ``dispatch`` scope (the permutations,
the collectives and the experts' own products; kernels XLA records into command buffers do not
name their source: ``--attribute`` turns them off). ``--out DIR`` keeps each point's
``step_profile.py`` output in ``DIR/<layout>/``.

    PYTHONPATH=. python3 benchmarks/scale_out.py --config k3_1b --per-device-batch 16 \\
        --layouts data=1 data=2 fsdp=2 expert=2 fsdp=2,expert=2 fsdp=4,expert=2 --out DIR
    PYTHONPATH=. python3 benchmarks/scale_out.py --platform cpu --config k3_tiny \\
        --per-device-batch 2 --seq 32 --layouts data=1 data=2 --steps 1   # simulated devices
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _timing import emit

from k3jax.config.mesh import parse_sizes
from k3jax.sweep.runner import visible_gpus

ROOT = Path(__file__).resolve().parents[1]
TOKEN_AXES = ("data", "fsdp", "expert")  # the mesh axes that hold different tokens
POLL_S = 0.5


@dataclass(frozen=True)
class Point:
    """One layout: its mesh axis sizes (every axis of ``MESH_AXES``)."""

    sizes: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.sizes if v > 1) or "data=1"

    @property
    def devices(self) -> int:
        return math.prod(v for _, v in self.sizes)

    @property
    def token_devices(self) -> int:
        return math.prod(v for k, v in self.sizes if k in TOKEN_AXES)


def parse_layout(text: str) -> Point:
    """``"data=2,expert=4"`` -> :class:`Point`; a ValueError naming ``--layouts`` for anything
    else."""
    return Point(tuple(parse_sizes(text, "--layouts").items()))


def point_args(point: Point, args, out_dir: Path, lock: str) -> list[str]:
    """``step_profile.py``'s command line for ``point``."""
    sets = [f"mesh.{k}={v}" for k, v in point.sizes]
    if dict(point.sizes)["expert"] > 1 and not any(
            s.startswith("model.moe.dispatch=") for s in args.overrides):
        sets.append(f"model.moe.dispatch={args.expert_dispatch}")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--config", args.config,
           "--batch", str(args.per_device_batch * point.token_devices),
           "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--trace-steps", str(args.trace_steps), "--top", "0",
           "--serialize-with", lock, "--out", str(out_dir)]
    cmd += ["--seq", str(args.seq)] if args.seq else []
    cmd += ["--attribute"] if args.attribute else []
    for s in [*args.overrides, *sets]:
        cmd += ["--set", s]
    return cmd


def point_env(point: Point, platform: str, gpus: list[str]) -> dict[str, str]:
    """The point's environment: its own GPUs, or as many simulated CPU devices."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if platform == "cpu":
        flags = env.get("XLA_FLAGS", "")
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=(
            f"{flags} --xla_force_host_platform_device_count={point.devices}").strip())
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


@dataclass
class Running:
    """A point's ``step_profile.py`` process, the devices it holds and its output files."""

    proc: subprocess.Popen
    devices: list[str]
    start: float
    out_dir: Path
    files: tuple


def start_point(point: Point, devices: list[str], args, out_root: Path, lock: str) -> Running:
    out_dir = out_root / point.name
    out_dir.mkdir(parents=True, exist_ok=True)
    files = (open(out_dir / "stdout.jsonl", "w"), open(out_dir / "stderr.log", "w"))
    proc = subprocess.Popen(point_args(point, args, out_dir, lock), cwd=ROOT,
                            env=point_env(point, args.platform, devices), stdout=files[0],
                            stderr=files[1])
    print(f"[scale_out] {point.name}: started on {args.platform} devices {','.join(devices)}",
          file=sys.stderr, flush=True)
    return Running(proc, devices, time.time(), out_dir, files)


def finish_point(point: Point, run: Running) -> list[dict]:
    """The point's JSON lines once its process has ended (or was stopped), or its error."""
    for f in run.files:
        f.close()
    seconds = time.time() - run.start
    print(f"[scale_out] {point.name}: done in {seconds:.0f} s", file=sys.stderr, flush=True)
    if run.proc.returncode != 0:
        tail = (run.out_dir / "stderr.log").read_text()[-1500:]
        return [{"error": f"step_profile.py exited with {run.proc.returncode} after "
                          f"{seconds:.0f} s: {tail}"}]
    text = (run.out_dir / "stdout.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_points(points: list[Point], args, out_root: Path, lock: str) -> dict[Point, list[dict]]:
    """Every point's JSON lines; points start as soon as enough devices are free (the largest
    first, so the host is never left waiting on it at the end)."""
    free = visible_gpus() if args.platform == "gpu" else [str(i) for i in range(args.cpus)]
    waiting = sorted(points, key=lambda p: -p.devices)
    running: dict[Point, Running] = {}
    results: dict[Point, list[dict]] = {}
    while waiting or running:
        for point in list(waiting):
            if point.devices > len(free) or (args.sequential and running):
                continue
            taken, free = free[:point.devices], free[point.devices:]
            running[point] = start_point(point, taken, args, out_root, lock)
            waiting.remove(point)
        for point, run in list(running.items()):
            if run.proc.poll() is None and time.time() - run.start < args.point_timeout:
                continue
            if run.proc.poll() is None:  # a hung point must not hold the others' results
                run.proc.kill()
                run.proc.wait()
            results[point] = finish_point(point, running.pop(point))
            free += run.devices
        time.sleep(POLL_S)
    return results


def summarise(point: Point, rows: list[dict], ops: list[dict]) -> dict:
    """One point's line from its ``step_profile.py`` lines and kernels (``ops.jsonl``), before
    the efficiencies."""
    line = {"bench": "scale_out", "layout": point.name, "devices": point.devices}
    errors = [r["error"] for r in rows if "error" in r]
    heads = [r for r in rows if r.get("bench") == "step_profile"]
    if errors or not heads:
        return {**line, "error": errors[0] if errors else "no step_profile line"}
    head = heads[0]
    busy = head["kernel_ms"] or float("nan")
    collective = sum(r["ms"] for r in rows if r.get("category") == "collective"
                     and "source" not in r)
    dispatch = sum(op["ms"] for op in ops if "dispatch" in op["source"].split("/"))
    return {**line, "batch": head["batch"], "seq": head["seq"],
            "tokens_per_s": head["tokens_per_s"],
            "tokens_per_s_per_device": round(head["tokens_per_s"] / point.devices),
            "step_ms": head["step_ms"], "mfu": head["mfu"], "peak_GiB": head["peak_GiB"],
            "start_to_first_step_s": head["start_to_first_step_s"],
            "collective_ms": round(collective, 3), "collective_share": round(collective / busy, 4),
            "dispatch_ms": round(dispatch, 3), "dispatch_share": round(dispatch / busy, 4)}


def read_ops(out_dir: Path) -> list[dict]:
    """The kernels ``step_profile.py`` wrote to ``out_dir/ops.jsonl`` (none if it failed)."""
    path = out_dir / "ops.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def with_efficiency(lines: list[dict]) -> list[dict]:
    """Each line's per-device tokens/s over the best per-device rate on 1 and on 2 devices."""
    best = {}
    for line in lines:
        if "error" not in line and line["devices"] in (1, 2):
            n = str(line["devices"])
            best[n] = max(best.get(n, 0), line["tokens_per_s_per_device"])
    return [line if "error" in line else
            {**line, "efficiency": {n: round(line["tokens_per_s_per_device"] / rate, 4)
                                    for n, rate in sorted(best.items())}}
            for line in lines]


def table(lines: list[dict]) -> str:
    rows = ["| layout | devices | batch | tokens/s | per device | MFU | step (ms) | peak (GiB) | "
            "collectives | dispatch | vs 1 / 2 devices |", "|---" * 11 + "|"]
    for r in lines:
        if "error" in r:
            rows.append(f"| {r['layout']} | {r['devices']} | error | | | | | | | | |")
            continue
        eff = " / ".join(f"{r['efficiency'].get(n, float('nan')):.1%}" for n in ("1", "2"))
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        rows.append(f"| {r['layout']} | {r['devices']} | {r['batch']} | {r['tokens_per_s']:,} | "
                    f"{r['tokens_per_s_per_device']:,} | {mfu} | {r['step_ms']} | "
                    f"{'-' if r['peak_GiB'] is None else r['peak_GiB']} | "
                    f"{r['collective_share']:.1%} | "
                    f"{r['dispatch_share']:.1%} | {eff} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_1b", help="a preset's name or a config file")
    ap.add_argument("--layouts", nargs="+", required=True, metavar="AXIS=N[,AXIS=N]")
    ap.add_argument("--per-device-batch", type=int, required=True,
                    help="rows of --seq tokens per device that holds its own tokens")
    ap.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every point (repeatable)")
    ap.add_argument("--expert-dispatch", default="ring",
                    help="model.moe.dispatch of layouts with expert > 1 (default ring)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=1)
    ap.add_argument("--attribute", action="store_true",
                    help="no XLA command buffers: every kernel names its source")
    ap.add_argument("--point-timeout", type=float, default=1200.0, metavar="S",
                    help="seconds after which a point's run is stopped and reported as an error")
    ap.add_argument("--sequential", action="store_true",
                    help="one point at a time (no compile on the host beside a timed step)")
    ap.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                    help="cpu: simulated devices, to check the script anywhere")
    ap.add_argument("--cpus", type=int, default=8, help="simulated devices in all (cpu)")
    ap.add_argument("--out", help="directory for each point's step_profile.py output")
    args = ap.parse_args(argv)
    try:
        points = list(dict.fromkeys(parse_layout(t) for t in args.layouts))
    except ValueError as e:
        ap.error(str(e))
    available = len(visible_gpus()) if args.platform == "gpu" else args.cpus
    too_big = [p.name for p in points if p.devices > available]
    if too_big:
        ap.error(f"--layouts {' '.join(too_big)}: more devices than the {available} "
                 f"{args.platform.upper()} devices here")
    with tempfile.TemporaryDirectory(prefix="scale_out_") as tmp:
        out_root = Path(args.out or tmp)
        results = run_points(points, args, out_root, f"{tmp}/timing.lock")
        lines = with_efficiency([summarise(p, results[p], read_ops(out_root / p.name))
                                 for p in points])
    for line in lines:
        emit(line)
    print(table(lines), file=sys.stderr)  # for the eye: stdout holds the JSON lines alone


if __name__ == "__main__":
    main()
