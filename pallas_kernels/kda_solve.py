"""Mosaic GPU kernel: a chunk's inverse ``T = (I + L)^-1`` for KDA's WY form (SPEC 3.3).

Per chunk of ``C = 64`` rows (one batch, head, chunk; one CTA), ``L`` is strictly lower triangular
(``L[r, j] = beta_r Akk[r, j]``), fp32. Two stages, no powers of ``L``:

1. The four 16x16 diagonal blocks are inverted exactly in fp32 by forward elimination, all blocks
   at once (held stacked as one ``[C, 16]`` array): starting from ``S = I``, pivot ``j`` (row ``j``
   of every block is then final) updates the rows below it, ``S_i -= L[i, j] S_j``.
2. The blocks are merged 16 -> 32 -> 64 with ``inv([[P, 0], [B, Q]]) = D - D B D``,
   ``D = diag(inv(P), inv(Q))``, on the tensor cores with each operand split into a bf16 high and
   low part (three WGMMAs per product, ~16 significant bits).

The blocked design (exact small diagonal blocks, then ``D - D B D`` merges) is the one of fla's
``solve_tril`` and of jax-linear-attention's Mosaic port, which also splits merge operands into bf16
parts; the code here is written from the algebra above.

Why no powers: with nearly parallel keys, ``beta`` near 1 and little decay, ``L^32`` reaches ~1e16
while ``T`` stays bounded by 1, and inverses built from powers lose every digit even in fp32
(docs/benchmarks.md; ``tests/test_pallas_kda.py`` runs that regime). Reference:
:func:`unit_lower_inverse_reference` (a triangular solve in fp32).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import BF16, COL, F32, iota, kernel, load, matmul, shared_lowering, tiles

CHUNK = 64
BLOCK = 16  # rows of a diagonal block inverted by elimination
_HI = lax.Precision.HIGHEST


def unit_lower_inverse_reference(lower):
    """``(I + L)^-1`` per chunk by a triangular solve in fp32 (XLA): ``[B, H, Tp, C]`` -> same;
    entries on or above the diagonal are not read."""
    nb, h, tp, c = lower.shape
    m = jnp.eye(c, dtype=F32) + lower.astype(F32).reshape(nb, h, tp // c, c, c)
    eye = jnp.broadcast_to(jnp.eye(c, dtype=F32), m.shape)
    t = jax.scipy.linalg.solve_triangular(m, eye, lower=True, unit_diagonal=True)
    return t.reshape(lower.shape)


def _diagonal_blocks_inverse(l_s, s_s):
    """``[C, 16]`` fp32: row ``i`` holds row ``i mod 16`` of the inverse of ``i``'s diagonal block."""
    tile = (CHUNK, BLOCK)
    rows, cols = iota(tile, 0), iota(tile, 1)
    offset, block = rows & (BLOCK - 1), rows >> 4
    ldiag = None                    # ldiag[i, j] = L[i, 16 block(i) + j]
    for b in range(CHUNK // BLOCK):
        part = load(l_s.at[:, pl.ds(BLOCK * b, BLOCK)])
        ldiag = part if ldiag is None else jnp.where(block == b, part, ldiag)
    s = jnp.where(cols == offset, 1.0, 0.0)
    s_s[...] = s
    plgpu.commit_smem()
    for j in range(BLOCK - 1):      # static pivots: row j of every block is final
        pivot = None
        for b in range(CHUNK // BLOCK):
            row = lax.broadcast_in_dim(load(s_s.at[BLOCK * b + j], COL), tile, (1,))
            pivot = row if pivot is None else jnp.where(block == b, row, pivot)
        coef = lax.broadcast_in_dim(jnp.sum(jnp.where(cols == j, ldiag, 0.0), axis=1), tile, (0,))
        s = jnp.where(offset > j, s - coef * pivot, s)
        s_s[...] = s
        plgpu.commit_smem()         # the next pivot row is read back by other threads
    return s


def _precise_product(x, y, split_s):
    """``x @ y`` for fp32 ``[C, C]`` register arrays: bf16 high and low parts on the tensor cores."""
    x_hi_s, x_lo_s, y_hi_s, y_lo_s = split_s
    for value, hi_s, lo_s in ((x, x_hi_s, x_lo_s), (y, y_hi_s, y_lo_s)):
        hi = value.astype(BF16)
        hi_s[...] = hi
        lo_s[...] = (value - hi.astype(F32)).astype(BF16)
    plgpu.commit_smem()
    return matmul((CHUNK, CHUNK), (x_hi_s, y_hi_s), (x_hi_s, y_lo_s), (x_lo_s, y_hi_s))


def _inverse_call(lower, *, interpret):
    nb, h, tp, _ = lower.shape
    full = (CHUNK, CHUNK)

    def body(l_ref, t_ref, l_s, s_s, d_s, x_hi_s, x_lo_s, y_hi_s, y_lo_s, bar):
        bi, hi, ni = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        tok = pl.ds(ni * CHUNK, CHUNK)
        plgpu.copy_gmem_to_smem(l_ref.at[bi, hi, tok], l_s, bar)
        plgpu.barrier_wait(bar)
        s = _diagonal_blocks_inverse(l_s, s_s)
        block = iota((CHUNK, BLOCK), 0) >> 4
        for b in range(CHUNK // BLOCK):   # D1 = diag(inverses of the 16x16 blocks)
            d_s.at[:, pl.ds(BLOCK * b, BLOCK)][...] = jnp.where(block == b, s, 0.0)
        plgpu.commit_smem()
        d, lower_full = load(d_s), load(l_s)
        rb, cb = iota(full, 0) >> 4, iota(full, 1) >> 4
        split = (x_hi_s, x_lo_s, y_hi_s, y_lo_s)
        # 16 -> 32: blocks (1, 0) and (3, 2); 32 -> 64: the lower-left 32x32 quadrant.
        for below in ((rb - cb == 1) & ((rb & 1) == 1), (rb >= 2) & (cb < 2)):
            b_part = jnp.where(below, lower_full, 0.0)
            d = d - _precise_product(d, _precise_product(b_part, d, split), split)
        t_ref.at[bi, hi, tok][...] = d

    scratch = (plgpu.SMEM(full, F32), plgpu.SMEM((CHUNK, BLOCK), F32), plgpu.SMEM(full, F32),
               *(tiles(full) for _ in range(4)), plgpu.Barrier(num_arrivals=1))
    run = kernel(body, "kda_unit_lower_inverse", interpret,
                 out_type=jax.ShapeDtypeStruct(lower.shape, F32), grid=(tp // CHUNK, h, nb),
                 grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(lower)


_inverse_jit = shared_lowering(_inverse_call, ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _inverse(lower, interpret):
    return _inverse_jit(lower, interpret=interpret)


def _inverse_fwd(lower, interpret):
    t = _inverse(lower, interpret)
    return t, t


def _inverse_bwd(interpret, t, dt):
    # T = M^-1, M = I + L: dM = -T^T dT T^T, and only L's strictly lower entries are free.
    nb, h, tp, c = t.shape
    tc, dtc = (x.reshape(nb, h, tp // c, c, c) for x in (t, dt.astype(F32)))
    dm = -jnp.einsum("...ji,...jk,...lk->...il", tc, dtc, tc, precision=_HI)
    return (jnp.tril(dm, -1).reshape(t.shape),)


_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def unit_lower_inverse(lower, *, interpret: bool = False):
    """``(I + L)^-1`` per chunk of 64 rows: ``lower [B, H, Tp, 64]`` (row ``t`` holds chunk-local
    row ``t mod 64`` of a strictly lower-triangular ``L``; the kernel never reads entries on or
    above the diagonal), fp32 -> same shape, fp32. Differentiable in ``lower`` (gradient on its
    strictly lower entries; the backward is two batched fp32 matmuls)."""
    if lower.ndim != 4 or lower.shape[3] != CHUNK or lower.shape[2] % CHUNK:
        raise ValueError(f"unit_lower_inverse: lower must be [B, H, Tp, {CHUNK}] with Tp a multiple "
                         f"of {CHUNK}, got {lower.shape}")
    if not jnp.issubdtype(lower.dtype, jnp.floating):
        raise ValueError(f"unit_lower_inverse: lower must be floating point, got {lower.dtype}")
    return _inverse(lower.astype(F32), interpret)


__all__ = ["CHUNK", "unit_lower_inverse", "unit_lower_inverse_reference"]
