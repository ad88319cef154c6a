"""Serving a 3:1 KDA:MLA hybrid against a pure-MLA model of the same width and depth (one GPU).

JSON lines, one per measurement:

* ``prefill``: time of a batch-1 prefill of ``T`` tokens (in ``--chunk`` pieces), the bytes of the
  cache it produces (MLA latents ``T x (kv_lora + rope) x 2`` per MLA layer, plus the fixed KDA and
  conv states) and the KV throughput = cache bytes / prefill time;
* ``decode``: tokens/s of one decode step at batch ``B`` over a cache of ``--context`` tokens, the
  bytes the step must read (weights as stored, plus the whole cache: MLA latents, KDA and conv
  states, read and written) and that over the step time against the H200's 4.8 TB/s;
* ``ttft``: time to the first token of a request = a shared ``--shared`` prompt + ``--suffix`` new
  tokens, without and with a prefix-cache hit on the shared prompt (the store holds the snapshot at
  its end).

Both models take ``--config``'s widths (default k3_small) with a dense FFN and the plain residual
(neither keeps anything across time, so they do not change what is measured); ``pure_mla`` makes
every layer MLA. Compile time is reported separately and never part of a timing.

    python benchmarks/serve.py [--config k3_small] [--seqs 4096,16384,65536,131072]
                               [--batches 1,8,64] [--context 8192] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import output, timed

from k3jax.config import ResidualConfig
from k3jax.config.experiment import load_config
from k3jax.generate import cache_bytes, decode, init_cache, prefill
from k3jax.generate.prefix_cache import PrefixCache
from k3jax.layers.kda import KDACache
from k3jax.parallel import init_on_one_device

H200_BYTES_PER_S = 4.8e12


def models(config: str):
    base = load_config(config).model
    base = base.replace(moe=None, first_k_dense=base.num_layers,
                        residual=ResidualConfig(kind="plain"), dtype="bfloat16")
    return {"hybrid": base, "pure_mla": base.replace(mla_every=1)}


def _tokens(cfg, b, t, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t)), jnp.int32)


def bench_prefill(name, cfg, variables, t, chunk, repeats, emit):
    tokens = _tokens(cfg, 1, t)
    run = lambda: prefill(cfg, variables, tokens, init_cache(cfg, 1, t), chunk=chunk)  # noqa: E731
    t0 = time.perf_counter()
    logits, cache = run()
    jax.block_until_ready(logits)
    first = time.perf_counter() - t0
    nbytes = cache_bytes(cache)
    del cache
    secs = timed(lambda: run()[0], (), 1, repeats, warm_up=False) / 1e3
    emit({"bench": "prefill", "model": name, "T": t, "chunk": chunk, "prefill_s": secs,
          "first_call_s": first, "cache_bytes": nbytes, "kv_throughput_GBps": nbytes / secs / 1e9,
          "tokens_per_s": t / secs})


def bench_decode(name, cfg, variables, batch, context, steps, emit):
    cache = init_cache(cfg, batch, context)
    # a full-looking cache: decode cost does not depend on the cached values
    cache = cache.replace(last_segment=jnp.ones_like(cache.last_segment),
                          positions=jnp.full_like(cache.positions, context - steps - 4),
                          length=np.int32(context - steps - 4))

    def step(logits, cache):
        # The next token is picked on the device, as a server would: its argmax is part of the
        # step, so the warm-up below runs this very function (the argmax compiles once per batch
        # shape, and the first model timed would otherwise pay it inside the timed loop).
        return decode(cfg, variables, jnp.argmax(logits, -1).astype(jnp.int32), cache)

    logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)  # -> token 0 in every row
    t0 = time.perf_counter()
    logits, cache = step(logits, cache)
    jax.block_until_ready(logits)
    first = time.perf_counter() - t0
    for _ in range(2):
        logits, cache = step(logits, cache)
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, cache = step(logits, cache)
    jax.block_until_ready(logits)
    step_s = (time.perf_counter() - t0) / steps
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(variables))
    kda_mla = cache_bytes(cache)
    state = sum(a.size * a.dtype.itemsize for a in _kda_arrays(cache))
    read = weights + kda_mla + state  # KDA and conv states are also written back
    emit({"bench": "decode", "model": name, "batch": batch, "context": context,
          "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s, "first_call_s": first,
          "weight_bytes": weights, "cache_bytes": kda_mla, "bytes_per_step": read,
          "achieved_TBps": read / step_s / 1e12,
          "fraction_of_h200_bw": read / step_s / H200_BYTES_PER_S})


def _kda_arrays(cache):
    """The KDA layers' conv and recurrent states (the part of the cache a step also writes)."""
    flat = jax.tree.leaves(cache.layers, is_leaf=lambda x: isinstance(x, KDACache))
    return [a for c in flat if isinstance(c, KDACache) for a in c]


def bench_ttft(name, cfg, variables, shared, suffix, chunk, repeats, emit):
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, cfg.vocab_size, shared).astype(np.int32)
    tail = rng.integers(0, cfg.vocab_size, suffix).astype(np.int32)
    request = np.concatenate([prefix, tail])
    max_len = shared + suffix
    cold = lambda: prefill(cfg, variables, request[None], init_cache(cfg, 1, max_len),  # noqa: E731
                           chunk=chunk)[0]
    cold_s = timed(cold, (), 1, repeats) / 1e3
    store = PrefixCache(cfg, max_len, grid=shared, budget_bytes=1 << 40)
    store.prefill(variables, prefix, chunk=chunk)  # the shared prompt's snapshot
    snap = store.lookup(request)

    def warm():
        cache = store.restore(snap)
        return prefill(cfg, variables, request[None, shared:], cache, chunk=chunk)[0]

    warm_s = timed(warm, (), 1, repeats) / 1e3
    emit({"bench": "ttft", "model": name, "shared": shared, "suffix": suffix,
          "cold_ms": cold_s * 1e3, "prefix_hit_ms": warm_s * 1e3, "speedup": cold_s / warm_s,
          "snapshot_bytes": snap.nbytes})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3_small", help="a preset's name or a config file")
    p.add_argument("--models", default="hybrid,pure_mla")
    p.add_argument("--seqs", default="4096,16384,65536,131072")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--shared", type=int, default=8192)
    p.add_argument("--suffix", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    with output(args.out) as emit:
        emit({"bench": "device", "device": str(jax.devices()[0]), "preset": args.config})
        for name, cfg in models(args.config).items():
            if name in args.models.split(","):
                bench_model(name, cfg, args, emit)
    return 0


def bench_model(name, cfg, args, emit):
    """Every measurement of one model."""
    t0 = time.perf_counter()
    variables = init_on_one_device(cfg, jax.random.key(0))
    variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16)
                             if a.dtype == jnp.float32 and a.ndim >= 2 else a, variables)
    emit({"bench": "init", "model": name, "layers": "".join(x[0].upper() for x in cfg.layer_types),
          "seconds": time.perf_counter() - t0})
    for t in (int(s) for s in args.seqs.split(",")):
        bench_prefill(name, cfg, variables, t, min(args.chunk, t), args.repeats, emit)
    for b in (int(s) for s in args.batches.split(",")):
        bench_decode(name, cfg, variables, b, args.context, args.steps, emit)
    bench_ttft(name, cfg, variables, args.shared, args.suffix, args.chunk, args.repeats, emit)


if __name__ == "__main__":
    sys.exit(main())
