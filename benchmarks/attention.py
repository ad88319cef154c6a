"""MLA's training attention (``causal_attention``, k3jax/ops/attention.py) at a preset's shape:
cuDNN with packed documents through its packed layout (as the training loop runs it, the layout
chosen on the host; and ``checked``, as ``model.apply`` runs it, behind the device-side check),
through the ``[B, 1, T, T]`` mask, and with one document a row (``single``: promised by the
layout, as the loop runs such batches; ``one_document``: no segment ids); forward and forward +
backward. Values have their own head dim (MLA's 128 against the queries' 192).

JSON lines ``{"variant", "batch", "seq", "heads", "head_dim", "docs_per_row", "fwd_ms",
"fwd_bwd_ms"}``, and for each variant with documents its largest difference from the masked
kernel's output (both compute the same attention). Rows hold 1 to ``--docs`` documents of random
lengths. On a machine without cuDNN (CPU) every variant is XLA's attention.

    PYTHONPATH=. python3 benchmarks/attention.py [--batch 32 --seq 2048 --heads 6 --head-dim 192
                                                  --v-head-dim 128]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from _data import packed_segments
from _timing import emit, timed

from k3jax.ops.attention import PACKED_SEGMENTS, causal_attention

VARIANTS = {  # the masked kernel first: the packed paths' outputs are compared with it
    "masked": functools.partial(causal_attention, documents="masked"),
    "packed": functools.partial(causal_attention, documents="packed"),
    "checked": causal_attention,
    "single": functools.partial(causal_attention, documents="single"),
    "one_document": lambda q, k, v, seg, scale: causal_attention(q, k, v, None, scale),
}
ONE_DOCUMENT_A_ROW = ("single", "one_document")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=192, help="of the queries and keys")
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--docs", type=int, default=12, help=f"at most {PACKED_SEGMENTS} to fit")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.v_head_dim > a.head_dim:
        p.error(f"--v-head-dim {a.v_head_dim} must be at most --head-dim {a.head_dim} (MLA's "
                "values are no wider than its queries)")
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    values = (a.batch, a.seq, a.heads, a.v_head_dim)
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q, k = jax.random.normal(kq, shape, dtype), jax.random.normal(kk, shape, dtype)
    v, ct = jax.random.normal(kv, values, dtype), jax.random.normal(kc, values, dtype)
    packed, scale = jnp.asarray(packed_segments(a.batch, a.seq, a.docs)), a.head_dim ** -0.5
    one_a_row = jnp.zeros((a.batch, a.seq), jnp.int32)
    masked_out = None
    for name, attend in VARIANTS.items():
        seg = one_a_row if name in ONE_DOCUMENT_A_ROW else packed
        fwd = jax.jit(lambda q, k, v, s, attend=attend: attend(q, k, v, s, scale))
        loss = lambda q, k, v, s, attend=attend: jnp.vdot(  # noqa: E731
            attend(q, k, v, s, scale).astype(jnp.float32), ct.astype(jnp.float32))
        fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        rec = {"variant": name, "batch": a.batch, "seq": a.seq, "heads": a.heads,
               "head_dim": a.head_dim, "v_head_dim": a.v_head_dim,
               "docs_per_row": [1, 1] if name in ONE_DOCUMENT_A_ROW else [1, min(a.docs, a.batch)],
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
