"""KDA kernel benchmark: ours (Pallas Mosaic GPU), our chunked JAX op, fla's chunk_kda, jla's KDA.

One JSON line per (implementation, shape) with forward and forward+backward median milliseconds,
each peer's time over ours, and our achieved TFLOP/s and GB/s against the H200 roofline.

Inputs: bf16 q, k, v (q, k L2-normalised before timing, so no implementation pays for
it), lower-bound gate ``g = -5 sigmoid(f)`` and ``beta = sigmoid(.)`` in fp32, no initial state,
chunk 64. JAX paths are jitted and timed as the median of 5 batches of 10 calls after compilation
(host clock around ``block_until_ready``); fla with ``triton.testing.do_bench`` (median). A
summary table follows on stderr.

    python benchmarks/kda.py [--shapes 1,8192,16,128 ...] [--impls ours_pallas,jla,fla]
                             [--out results.jsonl] [--breakdown [B,T,H,D]] [--profile DIR]

``--profile DIR`` writes ``jax.profiler`` traces of five forward calls and five forward+backward
calls of each JAX implementation in ``--impls`` at the first shape to ``DIR/NAME/forward`` and
``DIR/NAME/forward_backward`` (``benchmarks/profile_top.py --calls 5 DIR/NAME/forward`` sums its
GPU kernels per call): which XLA fusions and kernels take the time.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import error_text, output, timed

SHAPES = ((1, 8192, 16, 128), (8, 4096, 16, 128), (2, 8192, 64, 128), (1, 32768, 16, 128))
PEAK_TFLOPS, PEAK_TBPS = 800.0, 4.8  # H200: dense bf16 matmul measured here ~790, HBM3e 4.8 TB/s


def flops(b, t, h, d, c=64):
    """As-implemented forward FLOPs (math §3.3): ``6KV + 2K(C+16) + 2CK + 4CV + C^2/3`` per
    token-head."""
    per = 6 * d * d + 2 * d * (c + 16) + 2 * c * d + 4 * c * d + c * c / 3
    return b * t * h * per


def min_bytes(b, t, h, d):
    """Unavoidable forward traffic: read q, k, v (bf16), g (fp32), beta; write o (bf16)."""
    return b * t * h * (3 * d * 2 + d * 4 + 4 + d * 2)


def make_inputs(b, t, h, d, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (b, t, h, d), jnp.float32)).astype(jnp.bfloat16)
    k = unit(jax.random.normal(ks[1], (b, t, h, d), jnp.float32)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (b, t, h, d), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h), jnp.float32))
    return q, k, v, g, beta


def jax_pair(op, args, iters: int = 10, repeats: int = 5):
    """(fwd ms, fwd+bwd ms) of a JAX ``op(q, k, v, g, beta) -> o``."""
    fwd = jax.jit(op)

    def loss(q, k, v, g, beta):
        return jnp.sum(op(q, k, v, g, beta).astype(jnp.float32))

    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    return timed(fwd, args, iters, repeats), timed(fb, args, iters, repeats)


def ours(q, k, v, g, beta):
    from pallas_kernels.kda import kda_pallas
    return kda_pallas(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]


def chunked(q, k, v, g, beta):
    from k3jax.ops.kda_chunked import kda_chunked
    return kda_chunked(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]


def jla_kda(q, k, v, g, beta):
    from jla.ops.mosaic_gpu.kda import kda
    return kda(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]


def fla_pair(args):
    import torch
    import triton
    from fla.ops.kda import chunk_kda

    tq, tk, tv, tg, tb = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda() for x in args)
    tq, tk, tv = (x.to(torch.bfloat16).requires_grad_() for x in (tq, tk, tv))
    tg, tb = tg.requires_grad_(), tb.requires_grad_()  # fp32, as the JAX paths get them
    scale = tq.shape[-1] ** -0.5
    fwd = lambda: chunk_kda(tq, tk, tv, tg, tb, scale=scale)[0]

    def fb():
        o = fwd()
        o.float().sum().backward()

    return (triton.testing.do_bench(fwd, return_mode="median"),
            triton.testing.do_bench(fb, return_mode="median", grad_to_none=[tq, tk, tv, tg, tb]))


JAX_OPS = {"ours_pallas": ours, "ours_chunked_jax": chunked, "jla": jla_kda}


def breakdown(args, iters: int = 10, repeats: int = 5):
    """Split our forward+backward into the token-parallel part and the two state kernels (ms)."""
    from pallas_kernels._mgpu import CHUNK
    from pallas_kernels.kda_prep import prepare
    from pallas_kernels.kda_state_bwd import state_bwd
    from pallas_kernels.kda_state_fwd import state_fwd

    q, v = args[0], args[2]
    scale = q.shape[-1] ** -0.5
    prep = lambda *a: prepare(*a, scale=scale, chunk_size=CHUNK)
    p = jax.jit(prep)(*args)
    bf = lambda x: x.astype(jnp.bfloat16)
    h0 = jnp.zeros(q.shape[:1] + q.shape[2:3] + (q.shape[3], v.shape[3]), jnp.float32)
    kin = (bf(p.qg), bf(p.kg), bf(p.w), p.u, bf(p.aqk), p.gamma, h0)
    fwd_k = jax.jit(lambda *a: state_fwd(*a, chunk_size=CHUNK))
    o, fin, st, vt = fwd_k(*kin)
    bwd_k = jax.jit(lambda *a: state_bwd(*a, chunk_size=CHUNK))
    bin_ = (kin[0], kin[1], kin[2], kin[4], p.gamma, st, vt, o, fin)
    prep_vjp = jax.jit(lambda *a: jax.vjp(prep, *a)[1](p))
    timed_ms = lambda fn, a: timed(fn, a, iters, repeats)  # noqa: E731
    return {"prep_fwd_ms": timed_ms(jax.jit(prep), args),
            "state_fwd_kernel_ms": timed_ms(fwd_k, kin),
            "state_bwd_kernel_ms": timed_ms(bwd_k, bin_),
            "prep_fwd_plus_vjp_ms": timed_ms(prep_vjp, args)}


PROFILED_CALLS = 5


def profile_op(op, args, out_dir: str, calls: int = PROFILED_CALLS) -> None:
    """``jax.profiler`` traces of ``calls`` compiled calls of ``op``: the forward alone in
    ``out_dir/forward``, forward+backward in ``out_dir/forward_backward`` with the optimized HLO of
    that call (``hlo.txt.gz`` beside its trace: it names the trace's fusions)."""
    loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32))  # noqa: E731
    programs = {"forward": jax.jit(op),
                "forward_backward": jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))}
    for part, fn in programs.items():
        compiled = fn.lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        trace_dir = os.path.join(out_dir, part)
        os.makedirs(trace_dir, exist_ok=True)
        with gzip.open(os.path.join(trace_dir, "hlo.txt.gz"), "wt") as f:
            f.write(compiled.as_text())
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(compiled(*args))


def _record(name, shape, r, device):
    rec = {"impl": name, "shape": list(shape), "device": device, "fwd_ms": round(r[0], 4),
           "fwd_bwd_ms": round(r[1], 4)}
    if name == "ours_pallas":
        f, by = flops(*shape), min_bytes(*shape)
        rec["fwd_tflops"] = round(f / r[0] / 1e9, 2)
        rec["fwd_tflops_frac_of_800"] = round(f / r[0] / 1e9 / PEAK_TFLOPS, 4)
        rec["fwd_min_bytes_gbps"] = round(by / r[0] / 1e6, 1)
        rec["fwd_bw_frac_of_4.8TBps"] = round(by / r[0] / 1e9 / PEAK_TBPS, 4)
        # forward+backward: ~2.5x the forward FLOPs (the usual count for a chunked delta rule)
        rec["fwd_bwd_tflops_at_2.5x"] = round(2.5 * f / r[1] / 1e9, 2)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=None, help="B,T,H,D entries")
    ap.add_argument("--impls", default="ours_pallas,jla,fla,ours_chunked_jax",
                    help="comma-separated subset of ours_pallas, ours_chunked_jax, jla, fla (run "
                         "in this order, each over all shapes, so a slow peer last cannot starve "
                         "the others)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--breakdown", nargs="?", const="8,4096,16,128", default=None,
                    help="also time our parts separately at this B,T,H,D (default 8,4096,16,128)")
    ap.add_argument("--iters", type=int, default=10, help="calls per timed batch")
    ap.add_argument("--repeats", type=int, default=5, help="timed batches (the median is kept)")
    ap.add_argument("--profile", default=None,
                    help="directory for jax.profiler traces of the JAX impls at the first shape")
    a = ap.parse_args(argv)
    unknown = set(a.impls.split(",")) - {*JAX_OPS, "fla"}
    if unknown:
        ap.error(f"--impls: unknown {sorted(unknown)}; known: {sorted({*JAX_OPS, 'fla'})}")
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    with output(a.out) as emit:
        results = _run(a, shapes, emit)
    # A table for the eye, on stderr: stdout holds the JSON lines alone.
    print("summary: shape | " + " | ".join(f"{n} fwd, fwd+bwd ms" for n in a.impls.split(",")),
          file=sys.stderr)
    for shape in shapes:
        cells = [("%.3f, %.3f" % results[n, shape]) if (n, shape) in results else "-"
                 for n in a.impls.split(",")]
        print(shape, "|", " | ".join(cells), file=sys.stderr)


def _run(a, shapes, emit) -> dict:
    """Every requested measurement, one JSON line each ->
    ``{(impl, shape): (fwd ms, fwd+bwd ms)}``."""
    dev = jax.devices()[0].device_kind
    results = {}
    if a.breakdown:
        shape = tuple(int(x) for x in a.breakdown.split(","))
        try:
            emit({"impl": "ours_pallas_parts", "shape": list(shape),
                  **breakdown(make_inputs(*shape), a.iters, a.repeats)})
        except Exception as e:
            emit({"impl": "ours_pallas_parts", "shape": list(shape),
                  "error": error_text(e, 300)})
    for name in a.impls.split(","):
        if a.profile and name in JAX_OPS:
            trace_dir = f"{a.profile}/{name}"
            try:
                profile_op(JAX_OPS[name], make_inputs(*shapes[0]), trace_dir)
                emit({"impl": name, "shape": list(shapes[0]), "profile": trace_dir,
                      "calls": PROFILED_CALLS})  # profile_top.py --calls takes it
            except Exception as e:
                emit({"impl": name, "profile": trace_dir,
                      "error": error_text(e, 300)})
        for shape in shapes:
            args = make_inputs(*shape)
            try:
                r = (jax_pair(JAX_OPS[name], args, a.iters, a.repeats) if name in JAX_OPS
                     else fla_pair(args))
                results[name, shape] = r
            except Exception as e:  # a peer not installed or failing: record why, keep going
                emit({"impl": name, "shape": list(shape),
                      "error": error_text(e, 300)})
                continue
            emit(_record(name, shape, r, dev))
    # each peer's time over ours (below 1: the peer is faster)
    for (name, shape), r in results.items():
        base = results.get(("ours_pallas", shape))
        if base is not None and name != "ours_pallas":
            emit({"impl": name, "shape": list(shape), "fwd_ratio_vs_ours": round(r[0] / base[0], 3),
                  "fwd_bwd_ratio_vs_ours": round(r[1] / base[1], 3)})
    return results


if __name__ == "__main__":
    sys.exit(main())
