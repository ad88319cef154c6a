"""Timing and output helpers shared by the benchmarks (host clock around ``block_until_ready``)."""

from __future__ import annotations

import json
import statistics
import time

import jax


def emit(record: dict, out=None) -> None:
    """Print one JSON line (and append it to ``out``, an open file, when given)."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def timed(fn, args, iters: int, repeats: int) -> float:
    """Median milliseconds per call of ``fn(*args)``; the first call (compile) is not timed."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(times)
