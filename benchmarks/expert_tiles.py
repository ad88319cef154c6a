"""The experts' grouped matmuls at each tiling: which tiles and pipeline slots are fastest.

Two kernels run every MoE layer's expert products on a Hopper GPU (``grouped_matmul="mosaic"``):

- ``tile_matmul``: ``pallas_kernels/tiled_gmm.py``, the forward and (``transposed``) the input
  gradient; a tiling is ``columns x slots x K step`` (the rows are the dispatch's 128-row tiles).
  Each variant swaps the module's ``tiling`` while the kernel is traced.
- ``weight_grad``: jax's transposed grouped matmul, the weight gradient ``[G, K, N]``; a tiling is
  ``rows x columns x slots x K step`` of its output tiles, passed as its arguments.

Each kernel alone on ``--rows`` rows in ``--groups`` equal groups, bf16, jitted, median of 5 x 20
calls. One JSON line per kernel, ``K x N`` and tiling: ``ms``, ``tflops``, ``shipped`` (the
tiling the library picks for that shape) and ``max_diff`` (largest difference from the first
tiling's output over the largest output: the tilings sum K in the same order, so 0 is expected).
With ``--lower-only`` (no GPU needed) the tile matmul's variants are lowered for sm_90 and the
size of each module printed instead (jax's weight-gradient kernel asks the GPU for its SM count
as it traces, so it needs one).

    PYTHONPATH=. python benchmarks/expert_tiles.py [--rows 131072] [--groups 16]
                                                   [--dims 384x384,384x768,768x384] [--lower-only]
                                                   [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import _ablations as ablations
import jax
import jax.numpy as jnp
import numpy as np
from _timing import error_text, output, timed

from k3jax.devices import hopper_gpus
from k3jax.ops import grouped_matmul
from pallas_kernels import tiled_gmm
from pallas_kernels.row_tiles import TILE_ROWS

# columns x slots x K step; the first of each list is the reference of max_diff
TILE_MATMUL = ((128, 3, 64), (128, 2, 64), (128, 4, 64), (128, 2, 128), (192, 3, 64),
               (192, 2, 64), (192, 2, 128))
# rows x columns x slots x K step
WEIGHT_GRAD = ((128, 128, 4, 64), (128, 128, 3, 64), (128, 128, 2, 64), (128, 192, 4, 64),
               (128, 192, 3, 64), (128, 192, 2, 64), (128, 256, 3, 64), (64, 128, 4, 64),
               (128, 128, 3, 128))


def _tile_matmul(x, w, tile_group, transposed: bool, tiling, lower_only: bool) -> dict:
    fn = jax.jit(lambda x, w, t: tiled_gmm.tiled_gmm(x, w, t, transpose_rhs=transposed))
    with ablations.swapped(tiled_gmm, {"tiling": lambda n: tiling}):
        if lower_only:
            lowered = fn.trace(x, w, tile_group).lower(lowering_platforms=("cuda",))
            return {"module_chars": len(lowered.as_text())}
        return {"out": fn(x, w, tile_group), "ms": timed(fn, (x, w, tile_group), 20, 5)}


def _weight_grad(x, g, sizes, tiling) -> dict:
    fn = jax.jit(lambda x, g, s: grouped_matmul.weight_grad_on_tiles(x, g, s, tiling))
    return {"out": fn(x, g, sizes), "ms": timed(fn, (x, g, sizes), 20, 5)}


def _records(kernel: str, k: int, n: int, rows: int, tilings, run, shipped) -> list[dict]:
    """One record per tiling of ``run(tiling)``; ``max_diff`` against the first tiling's."""
    out, first = [], None
    for tiling in tilings:
        rec = {"bench": "expert_tiles", "kernel": kernel, "K": k, "N": n, "tiling": list(tiling),
               "shipped": tiling == shipped}
        try:
            result = run(tiling)
        except Exception as e:  # a tiling that does not fit (shared memory, registers): say so
            out.append({**rec, "error": error_text(e, 300)})
            continue
        if "out" in result:
            got = np.asarray(result.pop("out"), np.float32)
            first = got if first is None else first
            rec["max_diff"] = float(np.max(np.abs(got - first)) / np.max(np.abs(first)))
            rec["tflops"] = round(2 * rows * k * n / result["ms"] / 1e9, 1)
            result["ms"] = round(result["ms"], 4)
        out.append({**rec, **result})
    return out


def _dims(p: argparse.ArgumentParser, text: str) -> list[tuple[int, int]]:
    try:
        dims = [tuple(int(v) for v in d.split("x")) for d in text.split(",")]
    except ValueError:
        dims = []
    if not dims or any(len(d) != 2 or d[0] % 128 or d[1] % 128 for d in dims):
        p.error(f"--dims: expected KxN pairs, multiples of 128, comma-separated; got {text!r}")
    return dims


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=131072, help="rows of x (k3_small: 32 x 2048 x 2)")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--dims", default="384x384,384x768,768x384",
                   help="KxN of the products (k3_small's experts: 384x384)")
    p.add_argument("--lower-only", action="store_true", help="lower for sm_90 (no GPU needed)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    dims = _dims(p, a.dims)
    if a.rows % (a.groups * TILE_ROWS):
        p.error(f"--rows: expected a multiple of --groups x {TILE_ROWS}, got {a.rows}")
    if not (a.lower_only or hopper_gpus()):
        p.error("times Mosaic GPU kernels: it needs an sm_90 GPU (or --lower-only)")
    per_group = a.rows // a.groups
    sizes = jnp.full((a.groups,), per_group, jnp.int32)
    tile_group = jnp.repeat(jnp.arange(a.groups, dtype=jnp.int32), per_group // TILE_ROWS)
    keys = jax.random.split(jax.random.key(0), 3)
    failed = False
    with output(a.out) as emit:
        for k, n in dims:
            x = jax.random.normal(keys[0], (a.rows, k), jnp.bfloat16)
            for transposed in (False, True):
                w = (jax.random.normal(keys[1], (a.groups, n, k) if transposed
                                       else (a.groups, k, n), jnp.bfloat16) / k**0.5)
                name = "tile_matmul_transposed" if transposed else "tile_matmul"
                tilings = [t for t in TILE_MATMUL if n % t[0] == 0]  # the columns divide N
                for rec in _records(name, k, n, a.rows, tilings, lambda t: _tile_matmul(
                        x, w, tile_group, transposed, t, a.lower_only), tiled_gmm.tiling(n)):
                    emit(rec)
                    failed |= "error" in rec
            if a.lower_only:
                continue
            g = jax.random.normal(keys[2], (a.rows, n), jnp.bfloat16)
            tilings = [t for t in WEIGHT_GRAD if n % t[1] == 0]
            for rec in _records("weight_grad", k, n, a.rows, tilings,
                                lambda t: _weight_grad(x, g, sizes, t),
                                grouped_matmul.weight_grad_tiling(n)):
                emit(rec)
    return 1 if failed and a.lower_only else 0


if __name__ == "__main__":
    sys.exit(main())
