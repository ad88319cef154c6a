"""KDA's short convolution with its SiLU: the Triton kernels against XLA's fusions of the formula.

One JSON line per (path, documents a row) with forward and forward + backward median milliseconds
(host clock around ``block_until_ready``, median of 5 batches of 20 calls after compilation), the
bytes the ideal pass moves (forward: read ``x``, write the activation; backward: read ``x`` and the
output gradient, write the input gradient) and the rate that implies, and XLA's time over the
kernels'. The input is one projection of a KDA layer, bf16 ``[B, T, C]``, with fp32 taps of width
4; one document a row, or up to ``--docs`` at random cuts (row ``b`` holds ``1 + b % docs``, as
in the other benchmarks). ``--head-dim K`` L2-normalises each head's activation, as for q and k.

    python benchmarks/short_conv.py [--shape 32,2048,768] [--docs 1,12] [--head-dim K]
                                    [--out results.jsonl]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _data import packed_segments
from _timing import kernels_vs_xla, output

from k3jax.devices import hopper_gpus
from k3jax.ops.short_conv import conv_silu


def paths(impl: str, head_dim: int | None):
    """Jitted forward and forward + backward (the gradients of x and w) of one path."""
    def forward(x, w, seg):
        return conv_silu(x, w, seg, impl=impl, head_dim=head_dim)[0]

    def forward_backward(x, w, seg, dout):
        return jax.vjp(lambda x, w: forward(x, w, seg), x, w)[1](dout)

    return jax.jit(forward), jax.jit(forward_backward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32,2048,768", help="B,T,C")
    ap.add_argument("--docs", default="1,12", help="most documents a row, comma-separated")
    ap.add_argument("--head-dim", type=int, help="L2-normalise heads of this many channels")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not hopper_gpus():
        raise SystemExit("short_conv.py times the Triton kernels: it needs an sm_90 GPU")
    b, t, c = map(int, args.shape.split(","))
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (b, t, c), jnp.bfloat16)
    w = jax.random.normal(kw, (4, c), jnp.float32) / 2
    dout = jax.random.normal(kd, (b, t, c), jnp.bfloat16)
    gb = x.size * x.dtype.itemsize / 1e9
    programs = {"kernels": paths("pallas", args.head_dim), "xla": paths("reference", args.head_dim)}
    with output(args.out) as emit:
        for docs in map(int, args.docs.split(",")):
            seg = jnp.asarray(packed_segments(b, t, docs))
            kernels_vs_xla(programs, (x, w, seg), dout, (2 * gb, 5 * gb),
                           {"bench": "short_conv", "shape": [b, t, c], "docs": docs,
                            "head_dim": args.head_dim}, emit)


if __name__ == "__main__":
    main()
