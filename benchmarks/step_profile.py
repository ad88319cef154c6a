"""Where a preset's train step spends its GPU time: a profiler trace of the step ``train.py``
runs, every kernel tied to the HLO instruction and the model code it came from.

The step is built as the training loop builds it (the preset's mesh, sharded state, donated
buffers, its micro-batches and optimiser) on random tokens (one document a row, or up to ``--docs``
packed in a row, as a corpus gives them), and compiled as the loop compiles it: on a worker thread
while the state is initialised, with a new compilation cache seeded with the XLA autotuning
results k3jax ships (as a first ``train.py`` run; ``--cold``: without them). The script times
the compile stages (trace, lower, XLA compile), the set-up beside it, the first call and
``start_to_first_step_s`` (from the start to the first step done), runs ``--warmup`` steps,
times ``--steps`` steps (tokens/s, MFU as ``train.py`` counts it), then traces ``--trace-steps``
more. JSON lines::

    {"bench": "step_profile", "preset", "tokens_per_s", "step_ms", "mfu", "compile_s", ...,
     "busy_ms", "gap_ms", "temp_GiB"}                  # per step; gap = device idle inside a step
    {"category": "matmul" | "attention" | "mosaic:<kernel>" | "fusion" | "copy" | "memset" |
     "collective" | ..., "ms": ..., "share": ..., "kernels": ...}   # per step, share of busy time
    {"program": "jit_gradients" | "jit_update", "ms": ..., "share": ...}   # per step
    {"source": "MLALayer/kv_norm/mul", "category": "fusion", "pass": "fwd" | "bwd", "ms", "share",
     "GB", "TB_s"}        # bytes the instructions read and write a step, and their rate

then a short table. A source is the JAX name stack of the instruction (``op_name`` metadata) with
transforms and layer indices dropped, so the same op in every layer adds up; ``bwd`` marks the
backward pass; ``(made by XLA)`` are instructions XLA added itself (layout copies, loop carries).
Kernels that XLA records into command buffers (CUDA graphs) do not name their instruction:
library and Mosaic kernels are still sorted by their names, but their source reads ``(in a
command buffer)``; ``--attribute`` turns command buffers off so every kernel names its source
(on an H200 the k3_small step ran within a few percent of its usual time that way). A fusion's
kernel there is found by its name, and XLA compiles fusions of equal code once, naming the kernel
after the first: its time is split evenly among them (``ops.jsonl`` has a row for each source,
with its share of the calls).
``--out DIR`` also writes ``ops.jsonl`` there (every distinct kernel with its program,
instruction, category, source and time per step) and ``hlo.txt.gz`` (the compiled modules, whose
instruction names ``ops.jsonl`` refers to); ``--keep-trace`` keeps the trace under it too.

    PYTHONPATH=. python benchmarks/step_profile.py --config k3_small        # one GPU, its batch
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/step_profile.py --config k3_tiny \\
        --batch 2 --seq 64 --steps 1 --trace-steps 1                        # the CPU's thunks
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import gzip
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np
from _data import packed_segments
from _timing import emit
from _trace import device_kernels, hlo_instructions, summarize, trace_files

from k3jax.accounting import count_params, mfu_fn
from k3jax.config.experiment import apply_overrides, load_config
from k3jax.model import abstract_variables_and_axes
from k3jax.parallel import (
    batch_placement,
    init_sharded_state,
    make_mesh,
    sharded_state_shapes,
    start_devices,
)
from k3jax.parallel.compile_cache import use_compilation_cache
from k3jax.sweep.ladder import scale_width
from k3jax.train.loop import compile_step_async
from k3jax.train.optim import build_optimizer
from k3jax.train.step import init_state


def build(cfg, docs: int = 1):
    """``(step, state, inputs, stages, ready)`` as the training loop makes them: the jitted step,
    a fresh sharded state and the step's other inputs (a batch of random tokens in rows of up to
    ``docs`` documents, :func:`packed_segments`; the schedule's numbers), the step compiled on a
    worker thread while the state is initialised. ``stages``: the compile stages' seconds, XLA's
    temporaries, the HLO text and ``setup_s`` (initialising, while XLA compiles); ``ready``: the
    ``time.perf_counter()`` at which the step and the state were both there (before the HLO text,
    which the loop never writes, is read out)."""
    micro = cfg.data.batch_size // cfg.train.micro_batches
    shape = (micro, cfg.data.seq_len)
    mesh, rules = make_mesh(cfg.mesh), cfg.mesh.rules
    start_devices(mesh)
    variables, axes = abstract_variables_and_axes(cfg.model, shape)
    optimizer = build_optimizer(cfg.optim, cfg.train.steps, variables["params"], axes["params"])

    def make_state(p, b):
        return init_state(p, b, optimizer, cfg.train.seed)

    rng = np.random.default_rng(0)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    host = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": packed_segments(b, t, docs), "weights": np.ones((b, t), np.float32)}
    shapes = sharded_state_shapes(cfg.model, mesh, rules, make_state, variables, axes)
    lr_args, compiling = compile_step_async(cfg, mesh, shapes, axes["params"], host)
    t0 = time.perf_counter()
    state = init_sharded_state(cfg.model, mesh, rules, jax.random.PRNGKey(cfg.train.seed),
                               make_state, shape, axes)
    jax.block_until_ready(state)
    setup_s = time.perf_counter() - t0
    compiled = compiling.result()
    ready = time.perf_counter()  # what follows is this script's, not the loop's
    temp = compiled.temp_bytes()
    stages = {**{k: round(v, 2) for k, v in compiled.seconds.items()}, "setup_s": round(setup_s, 2),
              "temp_GiB": None if temp is None else round(temp / 2**30, 2),
              "hlo": compiled.as_text()}
    batch = batch_placement(mesh, rules, b)(host)
    return compiled.run, state, (batch, lr_args), stages, ready


def run_steps(compiled, state, inputs, n: int):
    """``n`` steps, blocking once at the end; -> (state, seconds)."""
    t0 = time.perf_counter()
    for _ in range(n):
        state, _ = compiled(state, *inputs)
    jax.block_until_ready(state)
    return state, time.perf_counter() - t0


def profile(compiled, state, inputs, steps: int, trace_dir: str, hlo: str) -> dict:
    """Trace ``steps`` steps into ``trace_dir`` and summarise the first device's kernels."""
    with jax.profiler.trace(trace_dir):
        state, _ = run_steps(compiled, state, inputs, steps)
    planes = {}
    for path in trace_files([trace_dir]):
        for plane, kernels in device_kernels(path).items():
            planes.setdefault(plane, []).extend(kernels)
    if not planes:
        raise RuntimeError(f"no device kernels in the trace under {trace_dir}")
    return summarize(planes[sorted(planes)[0]], hlo_instructions(hlo))


def report(summary: dict, steps: int, top: int, out_dir: str | None) -> None:
    """The category and source lines (per step), the table, and ``ops.jsonl`` in ``out_dir``."""
    busy = summary["kernel_ns"] or 1.0
    per = lambda ns: round(ns / steps / 1e6, 3)
    counts = {}
    for _, (_, calls, cat, *_) in summary["ops"].items():
        counts[cat] = counts.get(cat, 0) + calls / steps
    for cat, ns in summary["categories"].most_common():
        emit({"category": cat, "ms": per(ns), "share": round(ns / busy, 4),
              "kernels": round(counts.get(cat, 0))})
    for program, ns in summary["programs"].most_common():
        emit({"program": program, "ms": per(ns), "share": round(ns / busy, 4)})
    sources = [(key, ns, _traffic(summary["source_bytes"][key], ns, steps))
               for key, ns in summary["sources"].most_common(top)]
    for (cat, where, scope), ns, traffic in sources:
        emit({"source": scope, "category": cat, "pass": where, "ms": per(ns),
              "share": round(ns / busy, 4), **traffic})
    if out_dir:
        with open(f"{out_dir}/ops.jsonl", "w") as f:
            for (name, op, module, _), (ns, calls, cat, where, scope, moved) in sorted(
                    summary["ops"].items(), key=lambda kv: -kv[1][0]):
                f.write(json.dumps({"kernel": name[:200], "hlo_op": op, "module": module,
                                    "category": cat, "pass": where, "source": scope,
                                    "ms": per(ns), "calls": _count(calls / steps),
                                    **_traffic(moved, ns, steps)}) + "\n")
    print(f"\n{'program / category':<34}{'ms/step':>10}{'share':>8}", file=sys.stderr)
    for name, ns in [*summary["programs"].most_common(), *summary["categories"].most_common(12)]:
        print(f"{name[:33]:<34}{per(ns):>10.2f}{ns / busy:>8.1%}", file=sys.stderr)
    print(f"\n{'source':<58}{'pass':>5}{'ms/step':>10}{'share':>8}{'TB/s':>7}", file=sys.stderr)
    for (cat, where, scope), ns, traffic in sources[:20]:
        rate = traffic.get("TB_s")
        print(f"{(cat + ' ' + scope)[:57]:<58}{where:>5}{per(ns):>10.2f}{ns / busy:>8.1%}"
              f"{'' if rate is None else f'{rate:7.2f}'}", file=sys.stderr)


def _count(calls: float) -> int | float:
    """Calls a step: whole, or a share of a kernel that ran several fusions (``_trace``)."""
    return int(calls) if calls == int(calls) else round(calls, 2)


def _traffic(moved: int, ns: float, steps: int) -> dict:
    """``GB`` a step and ``TB_s`` of the bytes the kernels' instructions read and write (their
    operands and results once each, from the compiled HLO's shapes), when known."""
    if not moved or not ns:
        return {}
    return {"GB": round(moved / steps / 1e9, 3), "TB_s": round(moved / ns / 1e3, 2)}


@contextlib.contextmanager
def _exclusive(path: str | None):
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _peak_gib() -> float | None:
    """The fullest local device's peak memory."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return round(max(peaks) / 2**30, 2) if peaks else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_small", help="a preset's name or a config file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--width", type=int, help="d_model of the preset scaled by the sweep "
                    "ladder's width rule (heads, FFN and latent widths in proportion)")
    ap.add_argument("--batch", type=int, help="global batch (default: the preset's)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    ap.add_argument("--docs", type=int, default=1,
                    help="documents a row, up to (row b holds 1 + b %% DOCS, split at random "
                         "tokens, as a packed corpus gives them); default one a row")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (untraced)")
    ap.add_argument("--trace-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30, help="source lines to print")
    ap.add_argument("--attribute", action="store_true",
                    help="no XLA command buffers: every kernel tied to its instruction")
    ap.add_argument("--out", help="directory for ops.jsonl")
    ap.add_argument("--keep-trace", action="store_true", help="keep the trace under --out")
    ap.add_argument("--cold", action="store_true",
                    help="compile without the autotuning results k3jax ships (by default the step "
                         "compiles as a first train.py run does: with a new compilation cache "
                         "seeded with them)")
    ap.add_argument("--serialize-with", metavar="FILE",
                    help="time and trace only while holding an exclusive lock on FILE: several "
                         "profiles can compile side by side and still run their steps alone")
    args = ap.parse_args(argv)
    if args.attribute:  # read when the backend starts, i.e. at the first computation below
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    cfg = apply_overrides(load_config(args.config), args.overrides)
    if args.width:
        cfg = dataclasses.replace(cfg, model=scale_width(cfg.model, args.width, multiple=64))
    data = dataclasses.replace(cfg.data, batch_size=args.batch or cfg.data.batch_size,
                               seq_len=args.seq or cfg.data.seq_len)
    cfg = dataclasses.replace(cfg, data=data)
    if data.batch_size % cfg.train.micro_batches:
        ap.error(f"--batch {data.batch_size} is not divisible by "
                 f"train.micro_batches={cfg.train.micro_batches}")

    if args.keep_trace and not args.out:
        ap.error("--keep-trace needs --out")
    if args.out:
        os.makedirs(args.out, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="step_profile_") as tmp:
        t0 = time.perf_counter()
        if not args.cold:
            use_compilation_cache(f"{tmp}/jax_cache")
        compiled, state, inputs, stages, ready = build(cfg, args.docs)
        ready_s = ready - t0  # waiting for --serialize-with's lock is not counted
        hlo = stages.pop("hlo")
        with _exclusive(args.serialize_with):
            state, first_s = run_steps(compiled, state, inputs, 1)
            state, _ = run_steps(compiled, state, inputs, args.warmup)
            state, seconds = run_steps(compiled, state, inputs, args.steps)
            trace_dir = f"{args.out}/trace" if args.keep_trace else f"{tmp}/trace"
            summary = profile(compiled, state, inputs, args.trace_steps, trace_dir, hlo)
    step_s = seconds / max(args.steps, 1)
    tokens = data.batch_size * data.seq_len
    mfu = mfu_fn(cfg.model, data.seq_len, jax.devices()[0].device_kind, jax.device_count())
    per_step = lambda ns: round(ns / args.trace_steps / 1e6, 3)
    params = count_params(cfg.model)
    emit({"bench": "step_profile", "preset": args.config, "overrides": args.overrides,
          "d_model": cfg.model.d_model, "params_total": params.total,
          "params_active": params.active,
          "batch": data.batch_size, "seq": data.seq_len, "docs_per_row": args.docs,
          "micro_batches": cfg.train.micro_batches,
          "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
          "tokens_per_s": round(tokens / step_s), "step_ms": round(step_s * 1e3, 2),
          "mfu": None if mfu is None else round(mfu(tokens / step_s), 4),
          **stages, "first_call_s": round(first_s, 2),
          "start_to_first_step_s": round(ready_s + first_s, 2),
          "busy_ms": per_step(summary["busy_ns"]), "kernel_ms": per_step(summary["kernel_ns"]),
          "gap_ms": per_step(summary["span_ns"] - summary["busy_ns"]),
          "peak_GiB": _peak_gib()})
    report(summary, args.trace_steps, args.top, args.out)
    if args.out:
        with gzip.open(f"{args.out}/hlo.txt.gz", "wt") as f:
            f.write(hlo)


if __name__ == "__main__":
    main()
