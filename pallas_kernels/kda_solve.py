"""Mosaic GPU kernels: KDA's WY products ``W = T X``, ``U = T Y`` with ``T = (I + L)^-1`` (SPEC 3.3).

Per chunk of ``C = 64`` rows (one batch, head, chunk; one CTA), ``L`` is strictly lower triangular
(``L[r, j] = beta_r Akk[r, j]``), ``X = beta Gamma K`` (``[C, K]``) and ``Y = beta V`` (``[C, V]``),
all fp32. The forward kernel forms ``T`` in two stages, no powers of ``L``:

1. The four 16x16 diagonal blocks are inverted exactly in fp32 by forward elimination, all blocks
   at once (held stacked as one ``[C, 16]`` array): starting from ``S = I``, pivot ``j`` (row ``j``
   of every block is then final) updates the rows below it, ``S_i -= L[i, j] S_j``.
2. The blocks are merged 16 -> 32 -> 64 with ``inv([[P, 0], [B, Q]]) = D - D B D``,
   ``D = diag(inv(P), inv(Q))``.

then ``W`` and ``U`` in the same CTA, and saves ``T`` for the backward kernel, which forms
``dT = dW X^T + dU Y^T``, ``dX = T^T dW``, ``dY = T^T dU`` and ``dL = -tril(T^T dT T^T, -1)``
(``T = M^-1``, ``M = I + L``: ``dM = -T^T dT T^T``; only ``L``'s strictly lower entries are free).
Every product runs on the tensor cores with each operand split into a bf16 high and low part
(three WGMMAs per product, ~16 significant bits), 64 x 64 x 64 at a time.

The blocked inverse (exact small diagonal blocks, then ``D - D B D`` merges) is the design of fla's
``solve_tril`` and of jax-linear-attention's Mosaic port, which also splits merge operands into bf16
parts; the code here is written from the algebra above.

Why no powers: with nearly parallel keys, ``beta`` near 1 and little decay, ``L^32`` reaches ~1e16
while ``T`` stays bounded by 1, and inverses built from powers lose every digit even in fp32
(docs/benchmarks.md; ``tests/test_pallas_kda.py`` runs that regime). Reference: :func:`wy_reference`
(a triangular solve and matmuls in fp32).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import (COL, F32, column_tiles, iota, kernel, load, matmul, shared_lowering,
                                  store_split, tiles)

CHUNK = 64
BLOCK = 16  # rows of a diagonal block inverted by elimination
FULL = (CHUNK, CHUNK)
_HI = lax.Precision.HIGHEST


def unit_lower_inverse_reference(lower):
    """``(I + L)^-1`` per chunk by a triangular solve in fp32 (XLA): ``[B, H, Tp, C]`` -> same;
    entries on or above the diagonal are not read."""
    nb, h, tp, c = lower.shape
    m = jnp.eye(c, dtype=F32) + lower.astype(F32).reshape(nb, h, tp // c, c, c)
    eye = jnp.broadcast_to(jnp.eye(c, dtype=F32), m.shape)
    t = jax.scipy.linalg.solve_triangular(m, eye, lower=True, unit_diagonal=True)
    return t.reshape(lower.shape)


def wy_reference(lower, x, y):
    """``(T X, T Y)`` with ``T = (I + L)^-1`` per chunk, fp32 (XLA); shapes as in :func:`wy`."""
    nb, h, tp, c = lower.shape
    t = unit_lower_inverse_reference(lower).reshape(nb, h, tp // c, c, c)

    def apply(z):
        zc = z.astype(F32).reshape(nb, h, tp // c, c, z.shape[-1])
        return jnp.matmul(t, zc, precision=_HI).reshape(z.shape)

    return apply(x), apply(y)


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


def _product(x_parts, y_parts):
    """``x @ y`` (``[C, C]`` fp32) from split operands: refs or transposed refs of bf16 parts."""
    (x_hi, x_lo), (y_hi, y_lo) = x_parts, y_parts
    return matmul(FULL, (x_hi, y_hi), (x_hi, y_lo), (x_lo, y_hi))


def _precise_product(x, y, split_s):
    """``x @ y`` for fp32 ``[C, C]`` register arrays."""
    x_hi_s, x_lo_s, y_hi_s, y_lo_s = split_s
    store_split(x, (x_hi_s, x_lo_s))
    store_split(y, (y_hi_s, y_lo_s))
    plgpu.commit_smem()
    return _product((x_hi_s, x_lo_s), (y_hi_s, y_lo_s))


def _chunk_inverse(l_s, s_s, d_s, split_s):
    """``[C, C]`` fp32 ``T = (I + L)^-1`` from ``L`` in SMEM (module docstring)."""
    s = _diagonal_blocks_inverse(l_s, s_s)
    block = iota((CHUNK, BLOCK), 0) >> 4
    for b in range(CHUNK // BLOCK):   # D1 = diag(inverses of the 16x16 blocks)
        d_s.at[:, pl.ds(BLOCK * b, BLOCK)][...] = jnp.where(block == b, s, 0.0)
    plgpu.commit_smem()
    d, lower_full = load(d_s), load(l_s)
    rb, cb = iota(FULL, 0) >> 4, iota(FULL, 1) >> 4
    # 16 -> 32: blocks (1, 0) and (3, 2); 32 -> 64: the lower-left 32x32 quadrant.
    for below in ((rb - cb == 1) & ((rb & 1) == 1), (rb >= 2) & (cb < 2)):
        b_part = jnp.where(below, lower_full, 0.0)
        d = d - _precise_product(d, _precise_product(b_part, d, split_s), split_s)
    return d


def _fwd_call(lower, x, y, *, interpret):
    """Raw forward kernel: ``(T, W, U)``, fp32, shapes of ``lower``, ``x``, ``y``."""
    nb, h, tp, _ = lower.shape
    dk, dv = x.shape[-1], y.shape[-1]

    def body(l_ref, x_ref, y_ref, t_ref, w_ref, u_ref, l_s, s_s, d_s, t_hi, t_lo, z_hi, z_lo, bar):
        bi, hi, ni = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        tok = pl.ds(ni * CHUNK, CHUNK)
        plgpu.copy_gmem_to_smem(l_ref.at[bi, hi, tok], l_s, bar)
        plgpu.barrier_wait(bar)
        t = _chunk_inverse(l_s, s_s, d_s, (t_hi, t_lo, z_hi, z_lo))  # the inverse's scratch, reused
        t_ref.at[bi, hi, tok][...] = t
        store_split(t, (t_hi, t_lo))
        for z_ref, out_ref, n in ((x_ref, w_ref, dk), (y_ref, u_ref, dv)):
            for cols in column_tiles(n):
                store_split(load(z_ref.at[bi, hi, tok, cols]), (z_hi, z_lo))
                plgpu.commit_smem()
                out_ref.at[bi, hi, tok, cols][...] = _product((t_hi, t_lo), (z_hi, z_lo))

    # X and Y go from GMEM to registers, each read once: the kernel is latency-bound, and without
    # their 64 KB of SMEM (K = V = 128) its SMEM no longer limits an SM to one CTA.
    scratch = (plgpu.SMEM(FULL, F32), plgpu.SMEM((CHUNK, BLOCK), F32), plgpu.SMEM(FULL, F32),
               *(tiles(FULL) for _ in range(4)), plgpu.Barrier(num_arrivals=1))
    out_type = tuple(jax.ShapeDtypeStruct(a.shape, F32) for a in (lower, x, y))
    run = kernel(body, "kda_wy_fwd", interpret, out_type=out_type, grid=(tp // CHUNK, h, nb),
                 grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(lower, x, y)


def _bwd_call(t, x, y, dw, du, *, interpret):
    """Raw backward kernel: ``(dL, dX, dY)``, fp32 (``dL`` zero on and above the diagonal)."""
    nb, h, tp, _ = t.shape
    dk, dv = x.shape[-1], y.shape[-1]

    def body(t_ref, x_ref, y_ref, dw_ref, du_ref, dl_ref, dx_ref, dy_ref,
             t_hi, t_lo, a_hi, a_lo, b_hi, b_lo):
        bi, hi, ni = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        tok = pl.ds(ni * CHUNK, CHUNK)
        store_split(load(t_ref.at[bi, hi, tok]), (t_hi, t_lo))
        dt = None
        for z_ref, dz_ref_in, dz_ref, n in ((x_ref, dw_ref, dx_ref, dk), (y_ref, du_ref, dy_ref, dv)):
            for cols in column_tiles(n):
                store_split(load(dz_ref_in.at[bi, hi, tok, cols]), (a_hi, a_lo))
                store_split(load(z_ref.at[bi, hi, tok, cols]), (b_hi, b_lo))
                plgpu.commit_smem()
                part = _product((a_hi, a_lo), (b_hi.T, b_lo.T))        # dW X^T, one tile of K
                dt = part if dt is None else dt + part
                dz_ref.at[bi, hi, tok, cols][...] = _product((t_hi.T, t_lo.T), (a_hi, a_lo))  # T^T dW
        store_split(dt, (a_hi, a_lo))
        plgpu.commit_smem()
        tt_dt = _product((t_hi.T, t_lo.T), (a_hi, a_lo))              # T^T dT
        store_split(tt_dt, (b_hi, b_lo))
        plgpu.commit_smem()
        dm = _product((b_hi, b_lo), (t_hi.T, t_lo.T))                 # (T^T dT) T^T
        strict = iota(FULL, 0) > iota(FULL, 1)
        dl_ref.at[bi, hi, tok][...] = jnp.where(strict, -dm, 0.0)

    # Every input goes from GMEM to registers (each is read once): without staging them in SMEM
    # (192 KB at K = V = 128) several CTAs share an SM and hide each other's latency.
    scratch = tuple(tiles(FULL) for _ in range(6))
    out_type = tuple(jax.ShapeDtypeStruct(a.shape, F32) for a in (t, x, y))
    run = kernel(body, "kda_wy_bwd", interpret, out_type=out_type, grid=(tp // CHUNK, h, nb),
                 grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(t, x, y, dw, du)


_fwd_jit = shared_lowering(_fwd_call, ())
_bwd_jit = shared_lowering(_bwd_call, ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _wy(lower, x, y, interpret):
    _, w, u = _fwd_jit(lower, x, y, interpret=interpret)
    return w, u


def _wy_fwd(lower, x, y, interpret):
    t, w, u = _fwd_jit(lower, x, y, interpret=interpret)
    return (w, u), (t, x, y)


def _wy_bwd(interpret, res, cts):
    t, x, y = res
    dw, du = (c.astype(F32) for c in cts)
    return _bwd_jit(t, x, y, dw, du, interpret=interpret)


_wy.defvjp(_wy_fwd, _wy_bwd)


def wy(lower, x, y, *, interpret: bool = False):
    """``(W, U) = (T X, T Y)`` with ``T = (I + L)^-1`` per chunk of 64 rows, fp32.

    Args:
      lower: ``[B, H, Tp, 64]``: row ``t`` holds chunk-local row ``t mod 64`` of a strictly
        lower-triangular ``L`` (entries on or above the diagonal are never read).
      x: ``[B, H, Tp, K]``, y: ``[B, H, Tp, V]`` with ``K, V`` multiples of 64.
      interpret: run in the Mosaic GPU interpreter (CPU tests).

    Returns ``(W [B, H, Tp, K], U [B, H, Tp, V])`` fp32. Differentiable in all three inputs (the
    gradient of ``lower`` lives on its strictly lower entries); the backward is a Mosaic kernel.
    """
    if lower.ndim != 4 or lower.shape[3] != CHUNK or lower.shape[2] % CHUNK:
        raise ValueError(f"wy: lower must be [B, H, Tp, {CHUNK}] with Tp a multiple of {CHUNK}, "
                         f"got {lower.shape}")
    for name, z in (("x", x), ("y", y)):
        if z.ndim != 4 or z.shape[:3] != lower.shape[:3] or z.shape[3] % CHUNK:
            raise ValueError(f"wy: {name} must be [B, H, Tp, D] = {lower.shape[:3]} + (a multiple of "
                             f"{CHUNK},), got {z.shape}")
    for name, z in (("lower", lower), ("x", x), ("y", y)):
        if not jnp.issubdtype(z.dtype, jnp.floating):
            raise ValueError(f"wy: {name} must be floating point, got {z.dtype}")
    return _wy(lower.astype(F32), x.astype(F32), y.astype(F32), interpret)


__all__ = ["CHUNK", "wy", "wy_reference", "unit_lower_inverse_reference"]
