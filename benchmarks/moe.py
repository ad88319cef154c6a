"""MoE expert-parallel benchmark: one GPU (expert axis 1) against two (expert axis 2).

JSON lines, one per measurement:

- ``grouped_matmul``: one grouped matmul ``[tokens*k, latent] x [E, latent, m]`` (forward, and
  forward+backward), ``jax.lax.ragged_dot`` against the Mosaic GPU kernels, TFLOP/s;
- ``dispatch``: the dispatch alone (fwd, fwd+bwd w.r.t. tokens, weights and expert weights) for
  each implementation on 1 and 2 devices, with its relative RMS error against the single-device
  ``ragged`` dispatch on the same global tokens (math §10 bf16 bound 5e-3);
- ``moe_step``: a training step of ``--layers`` residual Stable LatentMoE blocks (router, latent
  projections and norm, shared MLP, QB statistics; forward, backward, SGD update) at equal
  per-device batch -> tokens/s, and for two devices the speedup over the best one-device figure;
- ``summary``: the best speedup.

Timing: jitted, compiled first, median of ``--repeats`` batches of ``--iters`` calls (host clock
around ``block_until_ready``). A configuration that fails to compile or run prints an ``error``
line and the rest continues.

    PYTHONPATH=. python benchmarks/moe.py [--out moe.jsonl]  # 2 GPUs: the full run
    PYTHONPATH=. python benchmarks/moe.py --tiny             # CPU smoke test (2 host devices)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--tiny" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):
    # The CPU smoke test needs two devices; the flag must be set before jax is imported.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _timing import error_text, output, timed  # noqa: E402

import k3jax.parallel as kp  # noqa: E402
from k3jax.config import ModelConfig, MoEConfig  # noqa: E402
from k3jax.config.mesh import MeshConfig  # noqa: E402
from k3jax.layers.moe import MoEBlock  # noqa: E402
from k3jax.model import SCANNED_COLLECTIONS  # noqa: E402
from k3jax.ops.activations import GLUSpec  # noqa: E402
from k3jax.ops.balancing import update_balance  # noqa: E402
from k3jax.ops.ep_dispatch import EP_DISPATCHES, ep_dispatch  # noqa: E402
from k3jax.ops.grouped_matmul import grouped_matmul  # noqa: E402
from k3jax.ops.moe_dispatch import ExpertWeights, ragged_dispatch  # noqa: E402
from k3jax.ops.tolerance import BF16_OUT_TOL, rel_rms  # noqa: E402

FULL = dict(d_model=2048, num_experts=64, top_k=8, latent_dim=1024, expert_intermediate=768,
            shared_intermediate=2048, layers=4, tokens_per_device=16384, seq_len=2048)
TINY = dict(d_model=32, num_experts=8, top_k=2, latent_dim=16, expert_intermediate=16,
            shared_intermediate=16, layers=1, tokens_per_device=64, seq_len=16)


def split_name(name: str) -> tuple[str, float | None]:
    """``"all_to_all@1.25"`` -> ``("all_to_all", 1.25)`` (capacity factor); plain: dropless."""
    kind, _, cf = name.partition("@")
    return kind, (float(cf) if cf else None)


def model_config(shape: dict, name: str, gmm: str) -> ModelConfig:
    """The benchmark's model with dispatch ``name``; the expert-parallel dispatches run their
    experts with the grouped matmul ``gmm``, the single-device ones with ``ragged_dot``."""
    dispatch, cf = split_name(name)
    moe = MoEConfig(capacity_factor=cf, num_experts=shape["num_experts"], top_k=shape["top_k"],
                    grouped_matmul=gmm if dispatch in EP_DISPATCHES else "ragged_dot",
                    expert_intermediate=shape["expert_intermediate"],
                    latent_dim=shape["latent_dim"],
                    shared_intermediate=shape["shared_intermediate"],
                    balancing="quantile_hist", dispatch=dispatch)
    return ModelConfig(d_model=shape["d_model"], moe=moe, dtype="bfloat16", param_dtype="float32",
                       init_std=0.02)


def mesh_of(n: int):
    cfg = MeshConfig(data=1, expert=n)
    return kp.make_mesh(cfg, jax.devices()[:n]), cfg.rules


# -- grouped matmul ------------------------------------------------------------------------------

def bench_grouped_matmul(shape, impls, args, emit):
    rows = shape["tokens_per_device"] * shape["top_k"]
    e, k, n = shape["num_experts"], shape["latent_dim"], shape["expert_intermediate"]
    x = jax.random.normal(jax.random.key(0), (rows, k), jnp.bfloat16)
    w = (0.02 * jax.random.normal(jax.random.key(1), (e, k, n))).astype(jnp.bfloat16)
    sizes = jnp.full((e,), rows // e, jnp.int32).at[0].add(rows - e * (rows // e))
    # "mosaic_tiled" (the tile kernel) needs groups of whole 128-row tiles: true for these shapes
    flops = 2 * rows * k * n
    ref = None
    for name in impls:
        impl, aligned = ("mosaic", True) if name == "mosaic_tiled" else (name, False)
        try:
            fwd = jax.jit(lambda x, w: grouped_matmul(x, w, sizes, impl, aligned))
            both = jax.jit(jax.grad(
                lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, impl, aligned)), argnums=(0, 1)))
            y = fwd(x, w)
            ref = y if ref is None else ref
            ms = timed(fwd, (x, w), args.iters, args.repeats)
            ms_both = timed(both, (x, w), args.iters, args.repeats)
            emit({"bench": "grouped_matmul", "impl": name, "m": rows, "k": k, "n": n,
                  "groups": e, "fwd_ms": ms, "fwd_bwd_ms": ms_both,
                  "fwd_tflops": flops / ms / 1e9, "fwd_bwd_tflops": 3 * flops / ms_both / 1e9,
                  "rel_rms_vs_first": rel_rms(ref.astype(jnp.float32), y.astype(jnp.float32)),
                  "platform": jax.devices()[0].platform})
        except Exception as e:  # noqa: BLE001 - report and go on
            emit({"bench": "grouped_matmul", "impl": name, "error": error_text(e)})


# -- dispatch alone ------------------------------------------------------------------------------

def dispatch_inputs(shape, devices: int):
    tokens = shape["tokens_per_device"] * devices
    e, d, m, k = (shape["num_experts"], shape["latent_dim"], shape["expert_intermediate"],
                  shape["top_k"])
    ks = jax.random.split(jax.random.key(2), 6)
    x = jax.random.normal(ks[0], (tokens, d), jnp.bfloat16)
    ids = jax.lax.top_k(jax.random.normal(ks[1], (tokens, e)), k)[1].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (tokens, k)), axis=-1)
    ew = ExpertWeights(*((0.02 * jax.random.normal(kk, s)).astype(jnp.bfloat16)
                         for kk, s in zip(ks[3:], [(e, d, m), (e, d, m), (e, m, d)])))
    return x, ids, w, ew


def bench_dispatch(shape, dispatches, gmms, args, emit):
    act = GLUSpec()
    for devices in (1, 2):
        if devices > len(jax.devices()):
            continue
        x, ids, w, ew = dispatch_inputs(shape, devices)
        with jax.default_device(jax.devices()[0]):
            ref = jax.jit(lambda *a: ragged_dispatch(*a, act))(x, ids, w, ew)
        mesh, rules = mesh_of(devices)
        for name in dispatches:
            for gmm in (gmms if split_name(name)[0] in EP_DISPATCHES else ("ragged_dot",)):
                kind, cf = split_name(name)
                rec = {"bench": "dispatch", "dispatch": name, "gmm": gmm, "devices": devices,
                       "tokens": int(x.shape[0])}
                if name == "ragged" and devices > 1:
                    continue
                if kind == "ragged_all_to_all" and jax.default_backend() == "cpu":
                    emit({**rec, "skipped": "no CPU lowering"})
                    continue
                try:
                    if kind == "ragged":
                        f = lambda x, ids, w, ew: (  # noqa: E731
                            ragged_dispatch(x, ids, w, ew, act), jnp.zeros((), jnp.int32))
                    else:
                        f = (lambda nm, c, g: lambda x, ids, w, ew: ep_dispatch(  # noqa: E731
                            nm, x, ids, w, ew, act, capacity_factor=c, gmm=g))(kind, cf, gmm)
                    loss = lambda x, w, ew, f=f: jnp.sum(  # noqa: E731
                        f(x, ids, w, ew)[0].astype(jnp.float32))
                    with kp.use_mesh(mesh, rules):
                        fwd, fwd_args = compile_for(lambda x, w, ew, f=f: f(x, ids, w, ew),
                                                    (x, w, ew))
                        both, both_args = compile_for(jax.grad(loss, argnums=(0, 1, 2)),
                                                      (x, w, ew))
                        y, dropped = fwd(*fwd_args)
                        rec["dropped_fraction"] = int(dropped) / ids.size
                        rec["fwd_ms"] = timed(fwd, fwd_args, args.iters, args.repeats)
                        rec["fwd_bwd_ms"] = timed(both, both_args, args.iters, args.repeats)
                    err = rel_rms(ref.astype(jnp.float32), y.astype(jnp.float32))
                    rec["rel_rms_vs_ragged"] = err
                    if cf is None:              # with a capacity factor, drops change the result
                        rec["within_bf16_tol"] = bool(err <= BF16_OUT_TOL)
                except Exception as e:  # noqa: BLE001
                    rec["error"] = error_text(e)
                emit(rec)


def compile_for(fn, args: tuple):
    """``fn`` jitted and compiled for ``args``, and ``args`` laid out as that program takes them.
    The inputs are made on the first device; left there, every call of a program sharding them
    over two would first move them (at full size, hundreds of MB of tokens and expert weights)
    inside the timed region."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, jax.device_put(args, compiled.input_shardings[0])


# -- training step of a MoE stack ----------------------------------------------------------------

class _Residual(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, h, _):
        return h + MoEBlock(self.cfg, name="moe")(h, deterministic=False), None


class MoEStack(nn.Module):
    """``layers`` residual MoE blocks, under one ``nn.scan`` (``scan``: as the model stacks its
    layer groups, one traced body) or one after another (``unrolled``)."""
    cfg: ModelConfig
    layers: int
    stack: str = "scan"

    @nn.compact
    def __call__(self, h):
        if self.stack == "unrolled":
            for i in range(self.layers):
                h = _Residual(self.cfg, name=f"moe_{i}")(h, None)[0]
            return h
        scanned = nn.scan(_Residual, variable_axes={c: 0 for c in SCANNED_COLLECTIONS},
                          split_rngs={"params": True}, length=self.layers,
                          metadata_params={nn.PARTITION_NAME: "layers"})
        return scanned(self.cfg, name="moe")(h, None)[0]


def bench_step(shape, dispatches, gmm, args, emit):
    results = {}
    for devices in (1, 2):
        if devices > len(jax.devices()):
            continue
        mesh, rules = mesh_of(devices)
        batch = shape["tokens_per_device"] * devices // shape["seq_len"]
        x = jax.random.normal(jax.random.key(3), (batch, shape["seq_len"], shape["d_model"]),
                              jnp.bfloat16)
        x = jax.device_put(x, kp.batch_sharding(mesh, rules, ndim=3))
        for name in dispatches:
            for stack in args.stacks.split(","):
                rec = {"bench": "moe_step", "dispatch": name, "gmm": gmm, "stack": stack,
                       "devices": devices, "expert_axis": devices, "layers": shape["layers"],
                       "tokens_per_device": shape["tokens_per_device"]}
                if name == "ragged" and devices > 1:
                    continue
                if split_name(name)[0] == "ragged_all_to_all" and jax.default_backend() == "cpu":
                    emit({**rec, "skipped": "no CPU lowering"})
                    continue
                try:
                    model = MoEStack(model_config(shape, name, gmm), shape["layers"], stack)
                    profile = (os.path.join(args.profile, f"{name}_{stack}_{devices}gpu")
                               if args.profile else None)
                    rec["step_ms"], rec["first_step_s"], rec["dropped_fraction"] = run_step(
                        model, mesh, rules, x, args, profile)
                    rec["tokens_per_s"] = batch * shape["seq_len"] / rec["step_ms"] * 1e3
                    results[(devices, name, stack)] = rec["tokens_per_s"]
                    if devices == 2:
                        rec.update(speedups(results, name, stack))
                except Exception as e:  # noqa: BLE001
                    rec["error"] = error_text(e)
                emit(rec)
    ones = [v for (d, *_), v in results.items() if d == 1]
    twos = [v for (d, *_), v in results.items() if d == 2]
    if ones and twos:
        emit({"bench": "summary", "best_1gpu_tokens_per_s": max(ones),
              "best_2gpu_tokens_per_s": max(twos), "speedup": max(twos) / max(ones)})


def speedups(results: dict, name: str, stack: str) -> dict:
    """Two-GPU tokens/s of ``(name, stack)`` over the best one-GPU figure and over its own."""
    rec = {}
    best_one = max((v for (d, *_), v in results.items() if d == 1), default=None)
    if best_one:
        rec["speedup_vs_best_1gpu"] = results[(2, name, stack)] / best_one
    if (1, name, stack) in results:
        rec["speedup_vs_same_1gpu"] = results[(2, name, stack)] / results[(1, name, stack)]
    return rec


def run_step(model: MoEStack, mesh, rules, x, args, profile: str | None = None):
    """Median ms of one SGD step (forward, backward, update) of the MoE stack, seconds of the
    first step (compilation included) and the last step's dropped fraction of slots (capacity
    variants); with ``profile``, a ``jax.profiler`` trace of ``iters`` more steps goes there."""
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), x[:1]))
    shardings = kp.logical_to_sharding(nn.get_partition_spec(boxed), mesh, rules)

    def init(rng):
        return nn.meta.unbox(dict(model.init(rng, x[:1])))

    with kp.use_mesh(mesh, rules):
        variables = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
    state = (variables["params"], variables["balance"])
    shardings = jax.tree.map(lambda a: a.sharding, state)

    def step(state, x):
        params, balance = state

        def loss(p):
            h, mut = model.apply({"params": p, "balance": balance}, x,
                                 mutable=["balance_stats", "diagnostics"])
            return jnp.mean(jnp.square(h.astype(jnp.float32))), mut
        grads, mut = jax.grad(loss, has_aux=True)(params)
        # Quantile balancing keeps the experts' loads even as in training (without it the SGD
        # steps drift the router and the load on one device, not the dispatch, sets the time).
        balance = update_balance(balance, mut["balance_stats"], model.cfg.moe)
        dropped = sum(jnp.sum(d) for d in jax.tree.leaves(mut.get("diagnostics", {})))
        return (jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), balance), dropped

    def run(state, steps):
        for _ in range(steps):
            state, dropped = jitted(state, x)
        return jax.block_until_ready(state), int(dropped)

    with kp.use_mesh(mesh, rules):
        jitted = jax.jit(step, out_shardings=(shardings, None), donate_argnums=(0,))
        t0 = time.perf_counter()
        state, _ = run(state, 1)                                 # compile
        first_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            state, dropped = run(state, args.iters)
            times.append((time.perf_counter() - t0) / args.iters * 1e3)
        if profile:
            with jax.profiler.trace(profile):
                state, _ = run(state, args.iters)
    slots = x.shape[0] * x.shape[1] * model.cfg.moe.top_k * model.layers
    return statistics.median(times), first_s, dropped / slots


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes for a CPU smoke test")
    p.add_argument("--dispatches", default="ragged,all_to_all,all_to_all@1.25,ring,ring@1.25,"
                   "ragged_all_to_all", help="NAME or NAME@CAPACITY_FACTOR, comma separated")
    p.add_argument("--gmm", default="ragged_dot,mosaic", help="grouped matmuls to compare (the "
                   "grouped_matmul line also takes mosaic_tiled: the tile kernel on aligned rows)")
    p.add_argument("--step-gmm", default="ragged_dot", help="grouped matmul of the step benchmark")
    p.add_argument("--skip", default="", help="comma list of grouped_matmul,dispatch,step")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--stacks", default="scan",
                   help="comma list of scan,unrolled (the step's layers)")
    p.add_argument("--profile", default=None, help="directory for jax.profiler traces of each step")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    shape = dict(TINY if args.tiny else FULL)
    args.iters = args.iters or (2 if args.tiny else 10)
    args.repeats = args.repeats or (2 if args.tiny else 5)
    dispatches = [d for d in args.dispatches.split(",") if d]
    gmms = [g for g in args.gmm.split(",") if g]
    skip = set(args.skip.split(","))
    with output(args.out) as emit:
        emit({"bench": "setup", "devices": [str(d) for d in jax.devices()],
              "jax": jax.__version__, **shape})
        if "grouped_matmul" not in skip:
            bench_grouped_matmul(shape, gmms, args, emit)
        if "dispatch" not in skip:
            bench_dispatch(shape, dispatches, gmms, args, emit)
        if "step" not in skip:
            bench_step(shape, dispatches, args.step_gmm, args, emit)


if __name__ == "__main__":
    main()
