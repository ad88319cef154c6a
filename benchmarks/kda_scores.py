"""Where the KDA scores kernels spend their time: the kernel pair alone, and with parts taken out.

The intra-chunk scores kernels (``pallas_kernels/kda_scores.py``) are bound by latency rather than
by their loads, stores and WGMMAs: to see which part costs what, this times the forward kernel
(``Aqk`` and ``Akk``) and the backward kernel (with the gates' chain rule) alone at one shape,
jitted, median of 5 x 10 calls, for:

- ``kernels``: the kernels as they are (correct results; the benchmark's lower-bound gate makes
  every chunk bounded, so the two-level fast path runs), ``exact_exp``: the same without Mosaic's
  approximate math (``ex2.approx``, which the kernels use), and ``exact_levels``: every chunk
  flagged unbounded, so the six exact levels run (what a steep softplus gate costs);
- ablations, **timing only, wrong results**: each swaps one helper of the kernel module while it is
  traced, to show what that part costs: ``no_exp`` (every level's factors without their
  exponentials), ``no_anchors`` (the exact levels' ``P_s G`` WGMMAs left out; with ``exact_levels``'
  flags, as only those levels have them).

One JSON line per variant and kernel: ``{"variant", "kernel": "fwd"|"bwd", "ms", "shape"}`` (or an
``error``). On a CPU, ``--lower-only`` only checks that every variant lowers for sm_90 and prints
the size of each lowered module (the serialized Mosaic GPU kernel dominates it).

    PYTHONPATH=. python benchmarks/kda_scores.py [--shape 8,4096,16,128]
                                                 [--variants kernels,exact_levels,...]
                                                 [--lower-only] [--out FILE]
"""

from __future__ import annotations

import sys

import _ablations as ablations
import jax
import jax.numpy as jnp

from pallas_kernels import kda_scores
from pallas_kernels._mgpu import CHUNK, KT

F32 = jnp.float32
SCALE = 128**-0.5


def _no_anchors(p_ref, parts):
    return jnp.zeros((CHUNK, KT), F32)


def _no_bounded_chunks(g):
    return jnp.zeros(g.shape[:2] + (g.shape[2] // CHUNK,), jnp.int32)


_KERNEL = kda_scores.kernel  # the launcher itself: ``exact_exp`` swaps the module's name for it


def _exact_kernel(*args, approx_math, **kwargs):
    return _KERNEL(*args, approx_math=False, **kwargs)


ABLATIONS = {  # variant -> {kernel-module attribute: stand-in}
    "kernels": {},
    "exact_exp": {"kernel": _exact_kernel},
    "exact_levels": {"bounded_chunks": _no_bounded_chunks},
    "no_anchors": {"_anchors": _no_anchors, "bounded_chunks": _no_bounded_chunks},
    "no_exp": {"_decays": lambda g, anchor, bounded: (g - anchor, g - anchor)},
}


def _kernels(shape) -> ablations.Kernels:
    """The forward and backward kernels, freshly jitted, with their inputs at ``shape``."""
    (q, k, g), ds = _inputs(*shape)

    def fwd(q, k, g):
        return kda_scores._fwd_call(q, k, g, kda_scores.bounded_chunks(g), (), scale=SCALE,
                                    interpret=False)

    def bwd(q, k, g, daqk, dakk, dqg, dkg, dxk, dgamma):
        return kda_scores._bwd_call(q, k, g, daqk, dakk, (dqg, dkg, dxk), dgamma,
                                    kda_scores.bounded_chunks(g), (), scale=SCALE, interpret=False)

    return {"fwd": (jax.jit(fwd), (q, k, g)), "bwd": (jax.jit(bwd), (q, k, g, *ds))}


def _inputs(b, t, h, d):
    """q, k ``[B, T, H, D]`` bf16 (the caller's layout), ``G`` head-major, and one cotangent per
    forward output in its dtype."""
    ks = jax.random.split(jax.random.PRNGKey(0), 9)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (b, t, h, d))).astype(jnp.bfloat16)
    k = unit(jax.random.normal(ks[1], (b, t, h, d))).astype(jnp.bfloat16)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[2], (b, h, t // 64, 64, d)))
    g_cum = jnp.cumsum(g, axis=-2).reshape(b, h, t, d)
    shapes = (((b, h, t, 64), jnp.bfloat16), ((b, h, t, 64), F32),
              *(((b, h, t, d), jnp.bfloat16),) * 3, ((b, h, t // 64, d), F32))
    cts = tuple(jax.random.normal(key, shp).astype(dt) for key, (shp, dt) in zip(ks[3:], shapes))
    return (q, k, g_cum), cts


def main(argv=None) -> int:
    return ablations.main(__doc__.splitlines()[0], kda_scores, ABLATIONS, _kernels, argv)


if __name__ == "__main__":
    sys.exit(main())
