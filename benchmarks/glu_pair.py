"""The FFNs' gated-activation gradient on one gate|up product: the Triton kernel against XLA's
fusion of the same formula, and the kernel's tilings.

One JSON line per (shape, path) with the median milliseconds of the gradient alone (``d_pair [N,
2, m]`` from the product ``pair [N, 2, m]`` and the output gradient ``dh [N, m]``; host clock
around ``block_until_ready``, median of 5 batches of 20 calls after compilation), the bytes its
ideal pass moves (read ``pair`` and ``dh``, write ``d_pair``) and the rate that implies, and the
largest difference from XLA's result (the two round the same fp32 values once: a bf16 ulp at
most). ``xla`` is :func:`k3jax.ops.glu_pair.glu_pair_reference` jitted (the two halves'
derivatives, stacked); ``kernel_RxCwW`` is :mod:`pallas_kernels.glu_pair` with blocks of ``R``
rows and ``C`` columns and ``W`` warps. The shapes default to ``k3_small``'s shared expert and
dense FFN at its batch.

    python benchmarks/glu_pair.py [--shapes 65536,768 65536,2048] [--tiles 16x128x4,32x128x4]
                                  [--out results.jsonl]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _timing import output, timed

from k3jax.devices import hopper_gpus
from k3jax.ops.activations import GLUSpec
from k3jax.ops.glu_pair import glu_pair_reference
from pallas_kernels import glu_pair as kernels


def _tiles(text: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, tile.split("x"))) for tile in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["65536,768", "65536,2048"], help="N,m")
    ap.add_argument("--tiles", default="16x128x4,32x128x4,8x256x4,64x128x8",
                    help="the kernel's rows x columns x warps, comma-separated")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not hopper_gpus():
        raise SystemExit("glu_pair.py times the Triton kernel: it needs an sm_90 GPU")
    act = GLUSpec("situ_glu", 4.0, 25.0)
    with output(args.out) as emit:
        for shape in args.shapes:
            n, m = map(int, shape.split(","))
            kp, kd = jax.random.split(jax.random.key(0))
            pair = (6 * jax.random.normal(kp, (n, 2, m))).astype(jnp.bfloat16)
            dh = (6 * jax.random.normal(kd, (n, m))).astype(jnp.bfloat16)
            gigabytes = 2 * (2 * pair.size + dh.size) / 1e9
            xla = jax.jit(lambda p, g: glu_pair_reference(p, g, act))
            want = xla(pair, dh).astype(jnp.float32)
            paths = {"xla": xla}
            for tiling in _tiles(args.tiles):
                paths["kernel_{}x{}w{}".format(*tiling)] = jax.jit(
                    lambda p, g, tiling=tiling: kernels.glu_pair_vjp(p, g, act=act, tiling=tiling))
            for name, fn in paths.items():
                record = {"bench": "glu_pair", "shape": [n, 2, m], "path": name}
                try:
                    ms = timed(fn, (pair, dh), 20, 5)
                    diff = jnp.max(jnp.abs(fn(pair, dh).astype(jnp.float32) - want))
                    emit({**record, "ms": round(ms, 4), "TB_s": round(gigabytes / ms, 2),
                          "max_abs_diff": float(diff)})
                except Exception as e:  # a tiling that does not divide the shape, say
                    emit({**record, "error": f"{type(e).__name__}: {e}"[:300]})


if __name__ == "__main__":
    main()
