"""Where a profiled program's GPU time goes: the kernels of ``jax.profiler.trace`` files, summed by
name, as JSON lines (most time first), with each kernel's share of the device's busy time.

    PYTHONPATH=. python benchmarks/profile_top.py TRACE.xplane.pb [...] [--top 25] [--calls N]

The traces come from a benchmark's ``--profile DIR`` (``DIR/**/*.xplane.pb``); reading them needs
only jax, so they can be summarised on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os

from _timing import emit
from _trace import device_kernels, trace_files


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help=".xplane.pb files or directories holding them")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--calls", type=int, default=1,
                   help="calls of the program in each trace: times are given per call")
    args = p.parse_args(argv)
    for path in trace_files(args.paths):
        for plane, kernels in device_kernels(path).items():
            totals = collections.Counter()
            for k in kernels:
                totals[k.name] += k.duration_ns
            busy = sum(totals.values())
            per_call_ms = 1e-6 / args.calls
            emit({"trace": os.path.basename(path), "plane": plane,
                  "busy_ms": busy * per_call_ms, "kernels": len(totals)})
            for name, ns in totals.most_common(args.top):
                emit({"plane": plane, "kernel": name[:160], "ms": ns * per_call_ms,
                      "share": ns / busy})


if __name__ == "__main__":
    main()
