"""An Attention Residuals read and the RMSNorm after it: the Triton kernels against XLA's fusions of
the two steps (``depth_mix``'s custom VJP, then the norm under autodiff).

One JSON line per (path, number of sources) with forward and forward + backward median
milliseconds (host clock around ``block_until_ready``, median of 5 batches of 20 calls after
compilation), the bytes the kernels move (forward: read the sources, write the output; backward:
read the sources and the output gradient, write each source's gradient) and the rate that implies,
and XLA's time over the kernels'. The sources are bf16 ``[B, T, d]`` blocks, the last the partial
sum; the gradients are those of every source, the query, the key-norm weight and the norm weight.

    python benchmarks/depth_mix_norm.py [--shape 32,2048,768] [--sources 2,5] [--out results.jsonl]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _timing import kernels_vs_xla, output

from k3jax.devices import hopper_gpus
from k3jax.ops.attnres import depth_mix_norm

EPS = 1e-5


def paths(impl: str):
    """Jitted forward and forward + backward of one path."""
    def forward(blocks, partial, w, g, scale):
        return depth_mix_norm(blocks, partial, w, g, scale, EPS, EPS, impl=impl)[0]

    def forward_backward(blocks, partial, w, g, scale, dx):
        return jax.vjp(forward, blocks, partial, w, g, scale)[1](dx)

    return jax.jit(forward), jax.jit(forward_backward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32,2048,768", help="B,T,d")
    ap.add_argument("--sources", default="2,5", help="sources a read mixes, comma-separated")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not hopper_gpus():
        raise SystemExit("depth_mix_norm.py times the Triton kernels: it needs an sm_90 GPU")
    shape = tuple(map(int, args.shape.split(",")))
    d = shape[-1]
    keys = jax.random.split(jax.random.key(0), 20)
    w = jax.random.normal(keys[0], (d,)) / d ** 0.5
    g, scale = jnp.ones((d,)), jnp.ones((d,))
    dx = jax.random.normal(keys[1], shape, jnp.bfloat16)
    gb = dx.size * dx.dtype.itemsize / 1e9
    programs = {"kernels": paths("pallas"), "xla": paths("xla")}
    with output(args.out) as emit:
        for n in map(int, args.sources.split(",")):
            sources = [jax.random.normal(keys[2 + i], shape, jnp.bfloat16) for i in range(n)]
            operands = (tuple(sources[:-1]), sources[-1], w, g, scale)
            kernels_vs_xla(programs, operands, dx, ((n + 1) * gb, (3 * n + 2) * gb),
                           {"bench": "depth_mix_norm", "shape": list(shape), "sources": n}, emit)


if __name__ == "__main__":
    main()
