"""Where KDA's inverse kernels spend their time: each kernel alone, and with parts taken out.

The kernels of ``pallas_kernels/kda_solve.py`` form ``T = (I + L)^-1`` per chunk (the 16 x 16
diagonal blocks by 15 pivot steps of elimination, then two merges of split-bf16 products) and use
it: ``scaled_inverse`` writes ``T diag(beta)`` (a forward without backward above 8 chains),
``wy_fwd`` forms ``W`` and ``U`` and saves ``T`` (training), ``wy_bwd`` is its backward. One chunk
per CTA and little work each, they are bound by latency rather than by their bytes; to see which
part costs what, this times each kernel alone at one shape (jitted, median of 5 x 10 calls) for:

- ``kernels``: the kernels as they are (correct results);
- ablations, **timing only, wrong results**, each swapping one helper of the kernel module while
  it is traced: ``no_akk_load`` (``L`` from ``beta`` alone: no ``Akk`` read from HBM),
  ``no_pivots`` (the diagonal blocks' inverses taken as the identity: no elimination),
  ``no_merges`` (the merges' products left out), ``no_lower_grad`` (the backward's
  ``-tril(T^T dT T^T)`` left out).

Inputs: ``Akk`` fp32 and ``beta`` as the forward makes them, ``xk``, ``v`` and ``dW`` bf16, ``dU``
fp32 (the training path's dtypes). Output and ``--lower-only`` as in ``benchmarks/_ablations.py``.

    PYTHONPATH=. python benchmarks/kda_inverse.py [--shape 8,4096,16,128]
                                                  [--variants kernels,no_pivots,...]
                                                  [--lower-only] [--out FILE]
"""

from __future__ import annotations

import sys

import _ablations as ablations
import jax
import jax.numpy as jnp

from pallas_kernels import kda_solve
from pallas_kernels._mgpu import CHUNK, iota

F32, BF16 = jnp.float32, jnp.bfloat16


def _beta_only_tile(ref, at, cols, beta_rows, token_major=False):
    return beta_rows, 0.01 * beta_rows


def _identity_blocks(l_s, s_s):
    tile = (CHUNK, kda_solve.BLOCK)
    return jnp.where(iota(tile, 1) == (iota(tile, 0) & (kda_solve.BLOCK - 1)), 1.0, 0.0)


ABLATIONS = {  # variant -> {kernel-module attribute: stand-in}
    "kernels": {},
    "no_akk_load": {"_scaled_tile": _beta_only_tile},
    "no_pivots": {"_diagonal_blocks_inverse": _identity_blocks},
    "no_merges": {"_precise_product":
                  lambda x, y, split_s, interpret, onto=None: 0.0 * y if onto is None else onto},
    "no_lower_grad": {"_lower_grad": lambda dt, t_parts, split_s, interpret: 0.0 * dt},
}


def _inputs(b, t, h, d):
    """``Akk [B, H, T, 64]`` (scaled like unit keys' dot products), ``beta [B, H, T]``, ``xk``
    head-major and ``v`` token-major, the saved ``T``, and the cotangents ``dW``, ``dU``."""
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    akk = 0.1 * jax.random.normal(ks[0], (b, h, t, CHUNK), F32)
    beta = jax.nn.sigmoid(jax.random.normal(ks[1], (b, h, t), F32))
    xk = jax.random.normal(ks[2], (b, h, t, d), F32).astype(BF16)
    v = jax.random.normal(ks[3], (b, t, h, d), F32).astype(BF16)
    dw = jax.random.normal(ks[4], (b, h, t, d), F32).astype(BF16)
    du = jax.random.normal(ks[5], (b, h, t, d), F32)
    t_saved = jnp.broadcast_to(jnp.tile(jnp.eye(CHUNK, dtype=F32), (t // CHUNK, 1)), akk.shape)
    return akk, beta, xk, v, t_saved, dw, du


def _kernels(shape) -> ablations.Kernels:
    """The three kernels, freshly jitted, with their inputs at ``shape``."""
    akk, beta, xk, v, t_saved, dw, du = _inputs(*shape)

    def scaled_inverse(akk, beta):
        return kda_solve._scaled_inverse_call(akk, beta, interpret=False)

    def wy_fwd(akk, beta, xk, v):
        return kda_solve._fwd_call(akk, beta, (xk,), (v,), w_dtype=BF16, save_t=True,
                                   interpret=False)

    def wy_bwd(t, akk, beta, xk, v, dw, du):
        return kda_solve._bwd_call(t, akk, beta, (xk,), (v,), (dw,), du, interpret=False)

    return {"scaled_inverse": (jax.jit(scaled_inverse), (akk, beta)),
            "wy_fwd": (jax.jit(wy_fwd), (akk, beta, xk, v)),
            "wy_bwd": (jax.jit(wy_bwd), (t_saved, akk, beta, xk, v, dw, du))}


def main(argv=None) -> int:
    return ablations.main(__doc__.splitlines()[0], kda_solve, ABLATIONS, _kernels, argv)


if __name__ == "__main__":
    sys.exit(main())
