"""Timing and output helpers shared by the benchmarks (host clock around ``block_until_ready``)."""

from __future__ import annotations

import contextlib
import functools
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


@contextlib.contextmanager
def output(path: str | None = None):
    """Inside the block, a function ``emit(record)``: the record printed as one JSON line and, with
    ``path``, appended to that file (opened once, closed when the block is left)."""
    with open(path, "a") if path else contextlib.nullcontext() as out:
        yield functools.partial(emit, out=out)


def error_text(e: BaseException, limit: int = 500) -> str:
    """``"TypeName: message"`` cut to ``limit`` characters: the ``error`` field of a JSON line (a
    compiler's message can run to pages)."""
    return f"{type(e).__name__}: {e}"[:limit]


def timed(fn, args, iters: int, repeats: int, warm_up: bool = True) -> float:
    """Median milliseconds per call of ``fn(*args)`` over ``repeats`` batches of ``iters`` calls.
    A first call (compile) comes before, untimed; ``warm_up=False`` leaves it out, for a caller
    that has made (and timed) that call itself."""
    if warm_up:
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


def kernels_vs_xla(programs: dict, operands: tuple, cotangent, gigabytes: tuple[float, float],
                   record: dict, emit, iters: int = 20, repeats: int = 5) -> None:
    """Kernels against XLA's fusions of the same formula: ``programs`` maps each path,
    ``"kernels"`` and ``"xla"``, to its jitted ``(forward(*operands), forward_backward(*operands,
    cotangent))``. One line per path: ``record`` with the path, its median forward and forward +
    backward ms (:func:`timed`), the rates those imply for ``gigabytes`` (the (forward,
    forward + backward) traffic of the ideal pass, GB; GB / ms = TB/s) and XLA's time over the
    path's, ``xla_over_this`` (forward, forward + backward)."""
    times = {path: (timed(fwd, operands, iters, repeats),
                    timed(fwd_bwd, (*operands, cotangent), iters, repeats))
             for path, (fwd, fwd_bwd) in programs.items()}
    xla = times["xla"]
    for path, (f, fb) in times.items():
        emit({**record, "path": path, "fwd_ms": round(f, 4), "fwd_bwd_ms": round(fb, 4),
              "fwd_TB_s": round(gigabytes[0] / f, 2), "fwd_bwd_TB_s": round(gigabytes[1] / fb, 2),
              "xla_over_this": [round(xla[0] / f, 2), round(xla[1] / fb, 2)]})
