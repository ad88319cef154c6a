"""MLA's training attention (``causal_attention``, k3jax/ops/attention.py) at a preset's shape:
cuDNN with packed documents through its packed layout (as the training loop runs it, the layout
chosen on the host; and ``checked``, as ``model.apply`` runs it, behind the device-side check),
through the ``[B, 1, T, T]`` mask, and with one document a row; forward and forward + backward.

JSON lines ``{"variant", "batch", "seq", "heads", "head_dim", "docs_per_row", "fwd_ms",
"fwd_bwd_ms"}``, and for each variant with documents its largest difference from the masked
kernel's output (both compute the same attention). Rows hold 1 to ``--docs`` documents of random
lengths. On a machine without cuDNN (CPU) every variant is XLA's attention.

    PYTHONPATH=. python3 benchmarks/attention.py [--batch 16 --seq 2048 --heads 6 --head-dim 192]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from _data import packed_segments
from _timing import emit, timed

from k3jax.ops.attention import PACKED_SEGMENTS, causal_attention, masked_causal_attention

VARIANTS = {  # the masked kernel first: the packed paths' outputs are compared with it
    "masked": masked_causal_attention,
    "packed": functools.partial(causal_attention, documents="packed"),
    "checked": causal_attention,
    "one_document": lambda q, k, v, seg, scale: causal_attention(q, k, v, None, scale),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=192)
    p.add_argument("--docs", type=int, default=12, help=f"at most {PACKED_SEGMENTS} to fit")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    q, k, v, ct = (jax.random.normal(key, shape, dtype) for key in
                   jax.random.split(jax.random.key(0), 4))
    seg, scale = jnp.asarray(packed_segments(a.batch, a.seq, a.docs)), a.head_dim ** -0.5
    masked_out = None
    for name, attend in VARIANTS.items():
        fwd = jax.jit(lambda q, k, v, s, attend=attend: attend(q, k, v, s, scale))
        loss = lambda q, k, v, s, attend=attend: jnp.vdot(  # noqa: E731
            attend(q, k, v, s, scale).astype(jnp.float32), ct.astype(jnp.float32))
        fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        rec = {"variant": name, "batch": a.batch, "seq": a.seq, "heads": a.heads,
               "head_dim": a.head_dim, "docs_per_row": [1, min(a.docs, a.batch)],
               "fwd_ms": round(timed(fwd, (q, k, v, seg), a.iters, a.repeats), 4),
               "fwd_bwd_ms": round(timed(fwd_bwd, (q, k, v, seg), a.iters, a.repeats), 4)}
        out = fwd(q, k, v, seg).astype(jnp.float32)
        if name == "masked":
            masked_out = out
        elif name in ("packed", "checked"):
            rec["max_abs_diff_vs_masked"] = float(jnp.max(jnp.abs(out - masked_out)))
        emit(rec)


if __name__ == "__main__":
    main()
