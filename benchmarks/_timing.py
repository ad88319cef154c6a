"""Timing and output helpers shared by the benchmarks (host clock around ``block_until_ready``)."""

from __future__ import annotations

import contextlib
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


def compile_stages(trace, around_compile=contextlib.nullcontext) -> tuple[object, dict]:
    """``trace()`` (returning a ``jax.stages.Traced``) lowered and compiled, each stage timed:
    ``(compiled, {"trace_s", "lower_s", "compile_s", "total_s", "temp_GiB"})``. The compile stage
    runs inside the context ``around_compile()`` (e.g. a profiler trace)."""
    t0 = time.perf_counter()
    traced = trace()
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    with around_compile():  # entered and left off the clock: a profiler's start is not timed
        t3 = time.perf_counter()
        compiled = lowered.compile()
        t4 = time.perf_counter()
    mem = compiled.memory_analysis()
    temp = None if mem is None else round(mem.temp_size_in_bytes / 2**30, 2)
    return compiled, {"trace_s": round(t1 - t0, 2), "lower_s": round(t2 - t1, 2),
                      "compile_s": round(t4 - t3, 2), "total_s": round(t2 - t0 + t4 - t3, 2),
                      "temp_GiB": temp}
