"""Compile time of a preset's forward, gradient and full train step (one per optimiser).

JSON lines, one per measured function::

    {"part": "forward" | "grad" | "step", "optimizer": null | "adamw" | "muon", "preset": ...,
     "batch": B, "seq": T, "backend": ..., "trace_s": ..., "lower_s": ..., "compile_s": ...,
     "total_s": ..., "temp_GiB": ...}

Nothing is allocated or run: every function is traced from ``jax.ShapeDtypeStruct`` inputs, then
lowered and compiled (``jit(f).trace(...).lower().compile()``), each stage timed with the host
clock. The persistent compilation cache is switched off so every number is a cold compile.
``step`` is compiled as ``train.py`` compiles it: ``make_train_step`` with ``build_optimizer``
over the preset's mesh, its gradient and update programs traced and lowered on this thread, each
compiled on a worker thread from the moment it is lowered (``compile_s`` from the first compile's
start until both are done, ``total_s`` from the start of tracing: the stages overlap;
``temp_GiB`` the larger program's). ``--one-program`` jits the same step as one program instead
(how the loop compiled it before), without the mesh wrapper. A part that fails prints an
``error`` line and the rest continues.

``kernels`` compiles each distinct Pallas kernel of the gradient (name and input shapes; a kernel
called by several layers compiles once) as a program of its own: the part's line has their number
(``kernels``) and total ``lower_s`` and ``compile_s``, then one line per kernel, most compile
seconds first. These are the Mosaic GPU compiles that XLA otherwise runs one after another inside
the step's compile; ``lower_s`` is the kernel's Pallas-to-Mosaic lowering, host work that the
step's lowering does once per distinct kernel. Without a GPU each kernel is only lowered for sm_90
(``compile_s`` null; the lowering is the same work)::

    {"part": "kernels", "kernel": "kda_scores_bwd", "calls": 9, "lower_s": 0.62, "compile_s": 2.73,
     "module_chars": 1603015, "shapes": [[16, 2048, 6, 128], ...]}

``--phases DIR`` traces each XLA compile with ``jax.profiler`` (into ``DIR/<part>``) and adds, per
part, the compiler's host events with the most seconds, one line each (events nest, so their
seconds overlap; ``threads`` > 1 means XLA ran the event on its compile thread pool; Python frames
are left out)::

    {"part": ..., "optimizer": ..., "event": "config-assigner", "s": 23.0, "n": 1, "threads": 1}

    # k3_small, B=2, T=256
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/compile_time.py
    PYTHONPATH=. python benchmarks/compile_time.py --batch 32 --seq 2048           # the GPU shape
    PYTHONPATH=. python benchmarks/compile_time.py --parts step --optimizers muon
    PYTHONPATH=. python benchmarks/compile_time.py --parts step --optimizers muon --one-program
    PYTHONPATH=. python benchmarks/compile_time.py --parts grad --set model.kda.impl=chunked
    PYTHONPATH=. python benchmarks/compile_time.py --batch 32 --seq 2048 --parts step \
        --optimizers muon --phases /tmp/phases                  # where XLA's compile time goes
    PYTHONPATH=. python benchmarks/compile_time.py --batch 16 --seq 2048 --parts kernels
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from _timing import compile_stages, error_text
from _trace import host_events, trace_files
from jax.extend.core import ClosedJaxpr, Jaxpr

from k3jax.config.experiment import apply_overrides, load_config
from k3jax.devices import hopper_target
from k3jax.model import K3Model, abstract_variables, logical_axes
from k3jax.ops.cross_entropy import token_nats
from k3jax.parallel import make_mesh, sharded_state_shapes
from k3jax.train.loop import compile_step_async
from k3jax.train.optim import build_optimizer, schedule_args
from k3jax.train.step import (
    BATCH_KEYS,
    MUTABLE,
    _variables,
    init_state,
    make_train_step,
)


def timed_compile(fn, *args, trace_dir: str | None = None) -> dict:
    """Seconds spent tracing, lowering and compiling ``jax.jit(fn)`` for ``args`` (abstract); the
    compile is profiled into ``trace_dir`` when given."""
    around = (lambda: jax.profiler.trace(trace_dir)) if trace_dir else contextlib.nullcontext
    return compile_stages(lambda: jax.jit(fn).trace(*args), around)[1]


def compile_phases(trace_dir: str, top: int) -> list[dict]:
    """The ``top`` host events of the traces under ``trace_dir`` by total seconds."""
    seconds, calls, threads = collections.Counter(), collections.Counter(), {}
    for path in trace_files([trace_dir]):
        for thread, name, s in host_events(path):
            if name.startswith("$"):  # a Python frame (the profiler's Python tracer), not XLA
                continue
            name = name.split(":")[0]
            seconds[name] += s
            calls[name] += 1
            threads.setdefault(name, set()).add(thread)
    return [{"event": name, "s": round(s, 2), "n": calls[name], "threads": len(threads[name])}
            for name, s in seconds.most_common(top)]


def batch_struct(b: int, t: int) -> dict:
    """Abstract ``[B, T]`` batch as the train step receives it."""
    dt = {"tokens": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32,
          "weights": jnp.float32}
    return {k: jax.ShapeDtypeStruct((b, t), dt[k]) for k in BATCH_KEYS}


def _zeros(batch: dict) -> dict:
    return {k: np.zeros(s.shape, s.dtype) for k, s in batch.items()}


def loss_fn(model):
    """``(params, balance, batch) -> mean nats`` (the train step's loss, one micro-batch)."""

    def loss(params, balance, batch):
        logits, _ = model.apply(_variables(params, balance), batch["tokens"],
                                segment_ids=batch["segment_ids"], deterministic=False,
                                mutable=MUTABLE, rngs={"dropout": jax.random.key(0)})
        nats = token_nats(logits, batch["targets"]) * batch["weights"]
        return jnp.sum(nats) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

    return loss


KERNEL_CALLS = ("pallas_call", "mpmd_map")  # the primitives a Pallas kernel call traces to


def kernel_calls(jaxpr) -> list:
    """Every Pallas kernel call in ``jaxpr`` and the jaxprs nested in it (not inside kernels)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in KERNEL_CALLS:
            found.append(eqn)
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, ClosedJaxpr):
                    found += kernel_calls(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    found += kernel_calls(sub)
    return found


def loss_and_args(cfg, batch: dict):
    """:func:`loss_fn` of ``cfg``'s model and its abstract ``(params, balance, batch)``."""
    b, t = batch["tokens"].shape
    variables = abstract_variables(cfg.model, (b, t))
    return loss_fn(K3Model(cfg.model)), (variables["params"], variables.get("balance", {}), batch)


def kernel_compiles(cfg, batch: dict) -> list[dict]:
    """Compile seconds of each distinct kernel of the gradient, compiled alone (most first)."""
    loss, args = loss_and_args(cfg, batch)
    closed = jax.make_jaxpr(jax.grad(loss))(*args)
    distinct: dict[tuple, list] = {}
    for eqn in kernel_calls(closed.jaxpr):
        shapes = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars)
        distinct.setdefault((str(eqn.params.get("name")), shapes), []).append(eqn)
    on_gpu = jax.default_backend() == "gpu"
    rows = []
    for (name, shapes), eqns in distinct.items():
        eqn = eqns[0]
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        call = lambda *a, e=eqn: e.primitive.bind(*a, **e.params)  # noqa: E731
        # Without a GPU the kernel is only lowered for one (a check that it still builds).
        with contextlib.nullcontext() if on_gpu else hopper_target():
            traced = jax.jit(call).trace(*avals)
            t0 = time.perf_counter()
            lowered = traced.lower() if on_gpu else traced.lower(lowering_platforms=("cuda",))
            t1 = time.perf_counter()
        if on_gpu:
            lowered.compile()
        rows.append({"kernel": name, "calls": len(eqns), "lower_s": round(t1 - t0, 2),
                     "compile_s": round(time.perf_counter() - t1, 2) if on_gpu else None,
                     "module_chars": len(lowered.as_text()),  # a rough measure of code size
                     "shapes": [list(s) for s, _ in shapes]})
    return sorted(rows, key=lambda r: -(r["compile_s"] or 0.0))


def loop_compile(cfg, batch: dict, make_state, axes: dict, trace_dir: str | None = None) -> dict:
    """Seconds of the train step compiled as the training loop compiles it (module docstring)."""
    mesh = make_mesh(cfg.mesh)
    variables = abstract_variables(cfg.model, batch["tokens"].shape)
    shapes = sharded_state_shapes(cfg.model, mesh, cfg.mesh.rules, make_state, variables,
                                  {"params": axes})
    with jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext():
        t0 = time.perf_counter()
        # zeros: one document a row, so the step of the packed attention (train.py's usual one)
        compiled = compile_step_async(cfg, mesh, shapes, axes, _zeros(batch))[1].result()
        total = time.perf_counter() - t0  # the stages overlap: the update traces as XLA compiles
    temp = compiled.temp_bytes()
    seconds = {k: round(v, 2) for k, v in compiled.seconds.items()}
    return {**seconds, "total_s": round(total, 2),
            "temp_GiB": None if temp is None else round(temp / 2**30, 2)}


def measure(part: str, cfg, batch: dict, optimizer_name: str | None,
            trace_dir: str | None = None, one_program: bool = False) -> dict:
    loss, args = loss_and_args(cfg, batch)
    params, balance, _ = args
    if part == "forward":
        return timed_compile(loss, *args, trace_dir=trace_dir)
    if part == "grad":
        return timed_compile(jax.grad(loss), *args, trace_dir=trace_dir)
    optim = dataclasses.replace(cfg.optim, name=optimizer_name)
    axes = logical_axes(cfg.model, batch["tokens"].shape)["params"]
    optimizer = build_optimizer(optim, cfg.train.steps, params, axes)
    make_state = lambda p, bal: init_state(p, bal, optimizer, cfg.train.seed)  # noqa: E731
    if not one_program:
        return loop_compile(dataclasses.replace(cfg, optim=optim), batch, make_state, axes,
                            trace_dir)
    state = jax.eval_shape(make_state, params, balance)
    step = make_train_step(K3Model(cfg.model), optim, cfg.train.micro_batches, cfg.model.moe,
                           axes)
    return timed_compile(step, state, batch, schedule_args(optim, cfg.train.steps),
                         trace_dir=trace_dir)


def main(argv=None) -> None:
    jax.config.update("jax_enable_compilation_cache", False)  # every number a cold compile
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="k3_small", help="a preset's name or a config file")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="override train.micro_batches (default: the preset's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted config override as in train.py (repeatable)")
    ap.add_argument("--parts", default="forward,grad,step")
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--phases", metavar="DIR",
                    help="profile each compile into DIR and print its longest compiler events")
    ap.add_argument("--top", type=int, default=25, help="compiler events to print (--phases)")
    ap.add_argument("--one-program", action="store_true",
                    help="compile the step as one program (default: as train.py, two at once)")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    for p in parts:
        if p not in ("forward", "grad", "step", "kernels"):
            ap.error(f"--parts: unknown part {p!r}; expected forward, grad, step, kernels")
    opts = args.optimizers.split(",")
    for o in opts:
        if o not in ("adamw", "muon"):
            ap.error(f"--optimizers: unknown optimiser {o!r}; expected adamw, muon")

    cfg = apply_overrides(load_config(args.config), args.overrides)
    if args.micro_batches is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, micro_batches=args.micro_batches))
    batch = batch_struct(args.batch, args.seq)
    jobs = [(p, None) for p in parts if p != "step"]
    jobs += [("step", o) for o in opts] if "step" in parts else []
    for part, opt in jobs:
        row = {"part": part, "optimizer": opt, "preset": args.config, "batch": args.batch,
               "seq": args.seq, "micro_batches": cfg.train.micro_batches,
               "overrides": args.overrides,
               "backend": jax.default_backend()}
        # Each kernel compiles as its own program: there is no one compile to profile.
        trace_dir = (os.path.join(args.phases, part if opt is None else f"{part}_{opt}")
                     if args.phases and part != "kernels" else None)
        kernels = []
        try:
            if part == "kernels":
                kernels = kernel_compiles(cfg, batch)
                seconds = [k["compile_s"] for k in kernels]
                row.update(kernels=len(kernels),
                           lower_s=round(sum(k["lower_s"] for k in kernels), 2),
                           compile_s=None if None in seconds else round(sum(seconds), 2))
            else:
                row.update(measure(part, cfg, batch, opt, trace_dir, args.one_program))
        except Exception as e:  # noqa: BLE001 - report and go on with the other parts
            traceback.print_exc(file=sys.stderr)
            row["error"] = error_text(e)
        print(json.dumps(row), flush=True)
        for kernel in kernels:
            print(json.dumps({"part": part, **kernel}), flush=True)
        if trace_dir and "error" not in row:
            for event in compile_phases(trace_dir, args.top):
                print(json.dumps({"part": part, "optimizer": opt, **event}), flush=True)


if __name__ == "__main__":
    main()
