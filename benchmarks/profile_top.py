"""Where a profiled program's GPU time goes: the kernels of ``jax.profiler.trace`` files, summed by
name, as JSON lines (most time first), with each kernel's share of the device's busy time.

    PYTHONPATH=. python benchmarks/profile_top.py TRACE.xplane.pb [...] [--top 25]

The traces come from a benchmark's ``--profile DIR`` (``DIR/**/*.xplane.pb``); reading them needs
only jax, so they can be summarised on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os

from _timing import emit
from jax.profiler import ProfileData


def kernel_times(path: str) -> dict[str, collections.Counter]:
    """``{device plane: Counter(kernel name -> total ns)}`` of one ``.xplane.pb`` file."""
    data = ProfileData.from_file(path)
    planes = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        totals = collections.Counter()
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for event in line.events:
                totals[event.name] += event.duration_ns
        planes[plane.name] = totals
    return planes


def traces(paths: list[str]) -> list[str]:
    """Files as given, directories searched for ``*.xplane.pb``."""
    found = []
    for p in paths:
        found += (sorted(glob.glob(os.path.join(p, "**", "*.xplane.pb"), recursive=True))
                  if os.path.isdir(p) else [p])
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help=".xplane.pb files or directories holding them")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    for path in traces(args.paths):
        for plane, totals in kernel_times(path).items():
            busy = sum(totals.values())
            emit({"trace": os.path.basename(path), "plane": plane, "busy_ms": busy / 1e6,
                  "kernels": len(totals)})
            for name, ns in totals.most_common(args.top):
                emit({"plane": plane, "kernel": name[:160], "ms": ns / 1e6, "share": ns / busy})


if __name__ == "__main__":
    main()
