"""Where the host's main thread spends a run's time: a script (a benchmark, ``train.py``) run under
a sampler of its Python stack.

Each sample is put in a phase by what jax is doing (tracing, lowering, the Mosaic GPU or Triton
kernels' lowering, a transfer to a device, compiling, waiting on another thread, importing) and
by where the run is in the library: the deepest public function (no leading underscore) of the
outermost ``k3jax`` or ``pallas_kernels`` file on the stack, before the stack first leaves that
file (``model.py:abstract_variables_and_axes``, ``train/loop.py:compile_step_async``). JSON lines
after the script's own output: one per stretch of consecutive samples in one phase (at least
``--min-s`` long), in order, then one per phase with its total::

    {"bench": "host_timeline", "start_s": 11.9, "end_s": 19.4, "s": 7.5,
     "activity": "lower", "entry": "parallel/step.py:compile_async"}
    {"bench": "host_timeline", "activity": "lower: Mosaic GPU kernels", "total_s": 4.8,
     "share": 0.11}

Times count from this script's start, before the sampled script's imports. A sample stands for
the time since the one before (the sampler runs late while the main thread holds the interpreter
lock). Only the main thread is sampled: the compiles and the initialisation that other threads run
beside it show up as its ``wait``, where it waits in Python (a wait inside a jax call, e.g.
``block_until_ready``, counts as ``python``). Sampling every 0.1 s costs the run little. The
phases' totals hold; which function inside a phase a sample names does not always (a sample lands
where the main thread gives up the interpreter lock): for that, profile the phase with
``cProfile``.

    PYTHONPATH=. python3 benchmarks/host_timeline.py -- benchmarks/step_profile.py \\
        --config k3_small --warmup 1 --steps 3 --trace-steps 1
"""

from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import threading
import time
from pathlib import Path

T0 = time.perf_counter()
# The checkout as Python names its files, through a symlink or not.
ROOTS = tuple({Path(__file__).absolute().parents[1], Path(__file__).resolve().parents[1]})
LIBRARY = tuple(str(root / package) + os.sep for root in ROOTS
                for package in ("k3jax", "pallas_kernels"))

# (activity, a piece of a frame's "file:function" that marks it), first match wins: the kernels'
# lowering happens inside jax's lowering, a transfer or a trace inside an eager call.
ACTIVITIES = (
    ("lower: Mosaic GPU kernels", ("pallas/mosaic_gpu/", "mosaic/gpu/")),
    ("lower: Triton kernels", ("pallas/triton/",)),
    ("transfer to a device", ("pxla.py:shard_args", "pxla.py:batched_device_put")),
    ("compile", ("jax/_src/compiler.py:",)),
    ("lower", ("interpreters/mlir.py:",)),
    ("trace", ("interpreters/partial_eval.py:",)),
    ("import", ("_bootstrap>:_find_and_load",)),
)


def frame_names(frame) -> list[str]:
    """``"file:function"`` of every frame of a stack, outermost first."""
    names = []
    while frame is not None:
        names.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
        frame = frame.f_back
    return names[::-1]


def classify(names: list[str]) -> tuple[str, str]:
    """``(activity, entry)`` of one sampled stack (module docstring)."""
    activity = "python"
    for name, marks in ACTIVITIES:
        if any(mark in frame for frame in names for mark in marks):
            activity = name
            break
    else:
        if names and names[-1].split(":")[-1] == "wait":
            activity = "wait"
    return activity, _entry(names)


def _entry(names: list[str]) -> str:
    """The deepest public function of the outermost library file among the frames from there
    until the first frame of another file (module docstring)."""
    first = next((i for i, n in enumerate(names) if n.startswith(LIBRARY)), None)
    if first is None:
        return ""
    entry = names[first]
    for name in names[first + 1:]:
        if name.rsplit(":", 1)[0] != entry.rsplit(":", 1)[0]:
            break
        if not name.rsplit(":", 1)[1].startswith("_"):
            entry = name
    for root in ROOTS:
        entry = entry.removeprefix(str(root) + os.sep)
    return entry.removeprefix("k3jax" + os.sep)


class Sampler:
    """Samples the main thread's stack every ``interval`` seconds on a daemon thread."""

    def __init__(self, interval: float):
        self.interval = interval
        # (seconds since T0, seconds since the sample before, activity, entry)
        self.samples: list[tuple[float, float, str, str]] = []
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="host-timeline", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        last = time.perf_counter() - T0
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._main)
            now = time.perf_counter() - T0
            if frame is not None:
                self.samples.append((now, now - last, *classify(frame_names(frame))))
            last = now


def stretches(samples: list[tuple[float, float, str, str]]) -> list[dict]:
    """Consecutive samples of one phase joined: ``start_s``, ``end_s``, ``s``, the phase."""
    out = []
    for t, dt, activity, entry in samples:
        if out and (out[-1]["activity"], out[-1]["entry"]) == (activity, entry):
            out[-1]["end_s"] = round(t, 2)
        else:
            out.append({"start_s": round(t - dt, 2), "end_s": round(t, 2),
                        "activity": activity, "entry": entry})
    for s in out:
        s["s"] = round(s["end_s"] - s["start_s"], 2)
    return out


def report(samples: list[tuple[float, float, str, str]], min_s: float) -> None:
    from _timing import emit  # here: it imports jax, which the timeline measures from T0

    for s in stretches(samples):
        if s["s"] >= min_s:
            emit({"bench": "host_timeline", **s})
    totals: collections.Counter = collections.Counter()
    for _, dt, activity, _ in samples:
        totals[activity] += dt
    whole = sum(totals.values())
    for activity, seconds in totals.most_common():
        emit({"bench": "host_timeline", "activity": activity, "total_s": round(seconds, 2),
              "share": round(seconds / whole, 3)})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 usage="%(prog)s [--interval S] [--min-s S] -- SCRIPT [ARGS...]")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    ap.add_argument("--min-s", type=float, default=0.3,
                    help="shortest stretch printed (every sample counts in the totals)")
    ap.add_argument("script", help="the Python script to run, then its arguments")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.interval <= 0:
        ap.error(f"--interval must be positive, got {args.interval}")
    if not Path(args.script).is_file():
        ap.error(f"script: no such file {args.script!r}")
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, str(Path(args.script).resolve().parent))
    sampler = Sampler(args.interval)
    try:
        with sampler:
            runpy.run_path(args.script, run_name="__main__")
    finally:  # the script's exit or failure: what was sampled up to it is reported all the same
        sys.stdout.flush()
        if sampler.samples:
            report(sampler.samples, args.min_s)


if __name__ == "__main__":
    main()
