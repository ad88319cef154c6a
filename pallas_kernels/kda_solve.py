"""Mosaic GPU kernels: KDA's WY products ``W = T X``, ``U = T Y`` with ``T = (I + L)^-1`` (math
§3.3), formed from KDA's raw pieces.

Per chunk of ``C = 64`` rows (one batch, head, chunk; one CTA) the kernel reads ``Akk`` (fp32),
``beta`` (fp32), ``xk = k exp(G)`` (``[C, K]``, head-major) and ``v`` (``[C, V]``, in the caller's
token-major ``[B, T, H, V]`` layout) and scales in registers ``L[r, j] = beta_r Akk[r, j]``
(``r > j``, strictly lower triangular), so XLA never writes these products to HBM. It forms ``T``
in two stages, no powers of ``L``:

1. The four 16x16 diagonal blocks are inverted exactly in fp32 by forward elimination, all blocks
   at once (held stacked as one ``[C, 16]`` array): starting from ``S = I``, pivot ``j`` (row ``j``
   of every block is then final) updates the rows below it, ``S_i -= L[i, j] S_j``.
2. The blocks are merged 16 -> 32 -> 64 with ``inv([[P, 0], [B, Q]]) = D - D B D``,
   ``D = diag(inv(P), inv(Q))``.

then ``W = T X`` and ``U = T Y`` with ``X = beta xk``, ``Y = beta v`` in the same CTA, as
``(T diag(beta)) xk`` and ``(T diag(beta)) v``: ``xk`` and ``v`` are the tensor cores' operands as
they are (bf16, or an fp32 input's two bf16 parts), and ``beta`` scales ``T``'s columns once. It
saves ``T`` for the backward kernel, which forms
``dT = dW X^T + dU Y^T``, ``dX = T^T dW``, ``dY = T^T dU`` and ``dL = -tril(T^T dT T^T, -1)``
(``T = M^-1``, ``M = I + L``: ``dM = -T^T dT T^T``; only ``L``'s strictly lower entries are free),
then through the scaling: ``dAkk = beta dL``, ``dxk = beta dX``, ``dv = beta dY`` (written
token-major) and
``dbeta_r = sum_j dL[r, j] Akk[r, j] + sum_c dX[r, c] xk[r, c] + sum_c dY[r, c] v[r, c]``.
Every product runs on the tensor cores with each fp32 operand split into a bf16 high and low part
(two or three WGMMAs per product, ~16 significant bits), 64 x 64 x 64 at a time. The merges take
``B D`` as ``L D`` kept where ``B`` is nonzero (``D`` is block-diagonal), with ``L``'s parts read
from SMEM, and accumulate ``-D (B D)`` onto ``D``, whose parts are the left operand in registers;
the backward's ``(T^T dT) T^T`` also takes its left operand from registers. ``T diag(beta)``, the
left operand of the forward's ``W`` and ``U`` products, goes through SMEM like every right operand
(not measured from registers: those products hold four accumulators at once).

The blocked inverse (exact small diagonal blocks, then ``D - D B D`` merges) is the design of fla's
``solve_tril`` and of jax-linear-attention's Mosaic port, which also splits merge operands into bf16
parts; the code here is written from the algebra above.

Why no powers: with nearly parallel keys, ``beta`` near 1 and little decay, ``L^32`` reaches ~1e16
while ``T`` stays bounded by 1: the product formula ``(I - L)(I + L^2)...(I + L^32)`` then has a
relative error of ~1e9 even in fp32, ~1e13 in bf16 (``tests/test_pallas_kda.py`` runs that regime).
The pivots, the two merges and the column tiles are loops in the kernel, not unrolled Python
loops: each unrolled copy was thousands of register loads and stores, and rolling them up halved
both modules and their compile time at the same speed (docs/benchmarks.md).

For a forward without backward, :func:`scaled_inverse` writes ``T diag(beta)`` alone (bf16) for a
state pass that applies it (:mod:`pallas_kernels.kda_state_fwd`). Every bf16 result (``T
diag(beta)``, a bf16 ``W``, the bf16 gradients of ``xk`` and ``v``) leaves through a free SMEM
tile and TMA (:func:`~pallas_kernels._mgpu.store_result`), which took 9% off the WY forward and
16% off the WY backward (H100) against stores from registers.

Reference: :func:`wy_reference` (a triangular solve and matmuls in fp32) and
:func:`scaled_inverse_reference`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._mgpu import (
    BF16,
    CHUNK,
    COL,
    F32,
    KT,
    ROW,
    Registers,
    column_tiles,
    iota,
    kernel,
    load,
    matmul,
    matmul_onto,
    part_views,
    per_col,
    per_row,
    products,
    shared_lowering,
    store_result,
    store_split,
    tiles,
    zeros,
)

BLOCK = 16  # rows of a diagonal block inverted by elimination
FULL = (CHUNK, CHUNK)
ALL = pl.ds(0, CHUNK)  # every column of an [., C] operand
OPERAND_DTYPES = (jnp.dtype(F32), jnp.dtype(BF16))  # of xk, v and W
_HI = lax.Precision.HIGHEST


def unit_lower_inverse_reference(lower):
    """``(I + L)^-1`` per chunk by a triangular solve in fp32 (XLA): ``[B, H, Tp, C]`` -> same;
    entries on or above the diagonal are not read."""
    nb, h, tp, c = lower.shape
    m = jnp.eye(c, dtype=F32) + lower.astype(F32).reshape(nb, h, tp // c, c, c)
    eye = jnp.broadcast_to(jnp.eye(c, dtype=F32), m.shape)
    t = jax.scipy.linalg.solve_triangular(m, eye, lower=True, unit_diagonal=True)
    return t.reshape(lower.shape)


def scaled_inverse_reference(akk, beta):
    """``T diag(beta)`` per chunk, fp32 (XLA), with ``T = (I + L)^-1``, ``L = beta tril(Akk, -1)``;
    arguments as in :func:`wy`. Returns ``[B, H, Tp, C]``."""
    nb, h, tp, c = akk.shape
    rows = beta.astype(F32)[..., None]
    strict = jnp.asarray(np.tile(np.tri(c, k=-1, dtype=bool), (tp // c, 1)))
    t = unit_lower_inverse_reference(jnp.where(strict, akk.astype(F32), 0.0) * rows)
    columns = beta.astype(F32).reshape(nb, h, tp // c, 1, c)
    return (t.reshape(nb, h, tp // c, c, c) * columns).reshape(akk.shape)


def wy_reference(akk, beta, xk, v):
    """``(T X, T Y)``, fp32 (XLA), with ``T = (I + L)^-1``, ``L = beta tril(Akk, -1)``,
    ``X = beta xk`` and ``Y = beta v`` per chunk; arguments as in :func:`wy` (``v`` token-major).
    Returns ``(W [B, H, Tp, K], U [B, H, Tp, V])`` fp32."""
    nb, h, tp, c = akk.shape
    tb = scaled_inverse_reference(akk, beta).reshape(nb, h, tp // c, c, c)

    def apply(z):  # [B, H, Tp, D] -> (T diag(beta)) z, per chunk
        zc = z.astype(F32).reshape(nb, h, tp // c, c, z.shape[-1])
        return jnp.matmul(tb, zc, precision=_HI).reshape(z.shape)

    return apply(xk), apply(jnp.swapaxes(v, 1, 2))


def _diagonal_blocks_inverse(l_s, s_s):
    """``[C, 16]`` fp32: row ``i`` holds row ``i mod 16`` of the inverse of ``i``'s diagonal
    block."""
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

    def eliminate(j, s):            # pivot j: row j of every block is final
        pivot = None
        for b in range(CHUNK // BLOCK):
            row = per_col(load(s_s.at[BLOCK * b + j], COL), tile)
            pivot = row if pivot is None else jnp.where(block == b, row, pivot)
        coef = per_row(jnp.sum(jnp.where(cols == j, ldiag, 0.0), axis=1), tile)
        s = jnp.where(offset > j, s - coef * pivot, s)
        s_s[...] = s
        plgpu.commit_smem()         # the next pivot row is read back by other threads
        return s

    return lax.fori_loop(0, BLOCK - 1, eliminate, s)


def _split_pairs(x_parts, y_parts):
    """The WGMMA operand pairs of ``x @ y`` from their bf16 parts (one, or a high and a low part,
    each), without low times low: below the ~16 bits the parts carry."""
    return [(x, y) for i, x in enumerate(x_parts) for j, y in enumerate(y_parts) if i + j < 2]


def _product(x_parts, y_parts):
    """``x @ y`` (``[C, C]`` fp32) from split operands: refs or transposed refs of bf16 parts."""
    return matmul(FULL, *_split_pairs(x_parts, y_parts))


def _register_parts(x) -> list[Registers]:
    """fp32 ``x``'s bf16 parts as left operands read from registers."""
    return [Registers(part) for part in bf16_parts(x)]


def _precise_product(x_parts, y, split_s, interpret: bool, onto=None):
    """``x @ y`` (or ``onto + x @ y``), fp32 ``[C, C]``: ``y`` (fp32 registers) goes to the two
    SMEM tiles ``split_s`` as its bf16 parts; ``x_parts``: ``x``'s bf16 parts, SMEM refs or
    :class:`Registers`. With ``onto``, its registers become the accumulator's."""
    store_split(y, split_s)
    plgpu.commit_smem()
    pairs = _split_pairs(x_parts, split_s)
    if onto is None:
        return matmul(FULL, *pairs, interpret=interpret)
    return matmul_onto(onto, *pairs, interpret=interpret)


def _chunk_inverse(l_parts, s_s, d_s, split_s, interpret: bool):
    """``[C, C]`` fp32 ``T = (I + L)^-1`` (module docstring) from ``L`` in SMEM: fp32 in ``d_s``
    (``D`` takes its place) and as bf16 parts in ``l_parts``."""
    s = _diagonal_blocks_inverse(d_s, s_s)
    block = iota((CHUNK, BLOCK), 0) >> 4
    for b in range(CHUNK // BLOCK):   # D1 = diag(inverses of the 16x16 blocks)
        d_s.at[:, pl.ds(BLOCK * b, BLOCK)][...] = jnp.where(block == b, s, 0.0)
    plgpu.commit_smem()

    # 16 -> 32: blocks (1, 0) and (3, 2); 32 -> 64: the lower-left quadrant. With D block-diagonal,
    # B D is L D where B is nonzero, so L's parts enter the tensor cores from SMEM as they are,
    # and D (B D) accumulates onto D: no copy of L, B or a second accumulator is held in
    # registers (178 registers a thread when they were, 128 without: four CTAs an SM where two fit).
    def merge(level, d):
        rb, cb = iota(FULL, 0) >> 4, iota(FULL, 1) >> 4
        below = jnp.where(level == 0, (rb - cb == 1) & ((rb & 1) == 1), (rb >= 2) & (cb < 2))
        bd = jnp.where(below, _precise_product(part_views(l_parts), d, split_s, interpret), 0.0)
        return _precise_product(_register_parts(-d), bd, split_s, interpret, onto=d)

    return lax.fori_loop(0, 2, merge, load(d_s))


class _Chunk(NamedTuple):
    """This CTA's chunk on the grid ``("n", "h", "b")``: batch ``b``, head ``h``, rows ``tok``."""

    b: jax.Array
    h: jax.Array
    tok: pl.Slice


def _this_chunk() -> _Chunk:
    tok = pl.ds(lax.axis_index("n") * CHUNK, CHUNK)
    return _Chunk(lax.axis_index("b"), lax.axis_index("h"), tok)


def _view(ref, at: _Chunk, cols, token_major: bool = False):
    """The chunk's rows, columns ``cols``, of a head-major ``[B, H, Tp, D]`` or (``token_major``)
    a token-major ``[B, Tp, H, D]`` GMEM ref: a ``[C, 64]`` view."""
    return ref.at[at.b, at.tok, at.h, cols] if token_major else ref.at[at.b, at.h, at.tok, cols]


def _beta_rows(beta_ref, at: _Chunk):
    """``[C, C]`` fp32, ``beta_r`` across row ``r``: scales any ``[C, 64]`` tile row-wise."""
    return per_row(load(beta_ref.at[at.b, at.h, at.tok], ROW), FULL)


def _scaled_tile(ref, at: _Chunk, cols, beta_rows, token_major: bool = False):
    """``(z, beta z)`` fp32 ``[C, 64]`` for one tile ``z`` of ``ref`` (any float dtype): the raw
    operand and the one the products use. Read from GMEM into registers: each is read once."""
    raw = load(_view(ref, at, cols, token_major)).astype(F32)
    return raw, raw * beta_rows


def bf16_parts(z):
    """``z`` as the bf16 tensor-core operands whose sum is ``z``: itself if bf16, else a high and a
    low part (~16 significant bits, as the kernels' other split products)."""
    if z.dtype == BF16:
        return (z,)
    hi = z.astype(BF16)
    return hi, (z.astype(F32) - hi.astype(F32)).astype(BF16)


class _Staged(NamedTuple):
    """An operand the WY kernels bring to SMEM by TMA as its bf16 parts (:func:`bf16_parts`), into
    ``[parts, width / KT, C, KT]`` tiles: the tensor cores' operands as they are."""

    parts: int
    width: int
    token_major: bool

    def tile(self, z_s, i) -> list:
        """Column tile ``i`` of every part."""
        return [z_s.at[p, i] for p in range(self.parts)]


def _split_refs(refs, counts):
    """``refs`` cut into groups of ``counts``, then the rest."""
    groups = []
    for n in counts:
        groups.append(refs[:n])
        refs = refs[n:]
    return groups, refs


def _stage(staged, part_refs, smem, at: _Chunk, bar) -> None:
    """Start the TMA copies of this chunk's tiles of every staged operand, all on ``bar``."""
    for op, refs, z_s in zip(staged, part_refs, smem, strict=True):
        for p, ref in enumerate(refs):
            for i, cols in enumerate(column_tiles(op.width)):
                plgpu.copy_gmem_to_smem(_view(ref, at, cols, op.token_major), z_s.at[p, i], bar)


def _staging_scratch(staged) -> tuple:
    """SMEM for the staged operands, then the barrier their copies arrive on."""
    copies = sum(op.parts * (op.width // KT) for op in staged)
    return (*(tiles((op.parts, op.width // KT, CHUNK, KT)) for op in staged),
            plgpu.Barrier(num_arrivals=copies))


def _inverse(akk_ref, beta_ref, at: _Chunk, scratch, interpret: bool):
    """The chunk's ``T`` (fp32 ``[C, C]`` registers) from ``Akk`` and ``beta`` in GMEM;
    ``scratch``: :func:`_inverse_scratch`."""
    l_parts, s_s, d_s, *split_s = scratch
    lower = jnp.where(_strictly_lower(),  # Akk on and above the diagonal may be anything
                      _scaled_tile(akk_ref, at, ALL, _beta_rows(beta_ref, at))[1], 0.0)
    d_s[...] = lower
    store_split(lower, part_views(l_parts))
    plgpu.commit_smem()
    return _chunk_inverse(l_parts, s_s, d_s, split_s, interpret)


def _inverse_scratch():
    """SMEM of :func:`_inverse`: ``L``'s two bf16 parts, the diagonal blocks, ``L`` then ``D`` in
    fp32, and two bf16 split tiles (free again once ``T`` is formed).

    ``L``/``D`` is loaded and stored whole from WGMMA-layout registers about five times a chunk: in
    a plain row-major tile a warp's eight rows fall on the same banks, so it takes the 64-byte
    swizzle, whose 16-column fp32 tiles keep the diagonal blocks' column slices whole tiles. The
    diagonal blocks' buffer stays plain: the pivots read single rows of it."""
    return (tiles((2, CHUNK, CHUNK)), plgpu.SMEM((CHUNK, BLOCK), F32),
            tiles(FULL, F32, swizzle=BLOCK * jnp.dtype(F32).itemsize), tiles(FULL), tiles(FULL))


def _scaled_columns(t, beta_ref, at: _Chunk):
    """``T diag(beta)``: ``beta_j`` scales column ``j``."""
    return t * per_col(load(beta_ref.at[at.b, at.h, at.tok], COL), FULL)


def _scaled_inverse_call(akk, beta, *, interpret):
    """Raw kernel: ``T diag(beta)``, bf16 ``[B, H, Tp, C]``."""
    nb, h, tp, _ = akk.shape

    def body(akk_ref, beta_ref, out_ref, *scratch):
        at = _this_chunk()
        tb = _scaled_columns(_inverse(akk_ref, beta_ref, at, scratch, interpret), beta_ref, at)
        store_result(tb, _view(out_ref, at, ALL), scratch[3])  # a split tile, free by now
        plgpu.wait_smem_to_gmem(0)

    run = kernel(body, "kda_scaled_inverse", interpret,
                 out_type=jax.ShapeDtypeStruct(akk.shape, BF16),
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"),
                 scratch_types=_inverse_scratch())
    return run(akk, beta)


def _fwd_call(akk, beta, xk_parts, v_parts, *, w_dtype, save_t: bool, interpret):
    """Raw forward kernel:
    ``(T [B, H, Tp, C] fp32, W [B, H, Tp, K] w_dtype, U [B, H, Tp, V] fp32)``, without ``T``
    (kept for the backward) unless ``save_t``; ``xk_parts`` and ``v_parts``: :func:`bf16_parts` of
    ``xk`` and ``v``.

    ``W = T (beta xk) = (T diag(beta)) xk``: ``beta`` scales ``T``'s columns once, so ``xk`` and
    ``v`` go to the tensor cores as they are, from SMEM, where TMA brings them while ``T`` is
    formed (read into registers when the products start, their latency was exposed in every
    CTA), and every product of the chunk is issued at once."""
    nb, h, tp, _ = akk.shape
    dk, dv = xk_parts[0].shape[-1], v_parts[0].shape[-1]
    staged = (_Staged(len(xk_parts), dk, False), _Staged(len(v_parts), dv, True))

    def body(akk_ref, beta_ref, *refs):
        part_refs, refs = _split_refs(refs, [op.parts for op in staged])
        t_ref, refs = (refs[0], refs[1:]) if save_t else (None, refs)
        w_ref, u_ref, l_parts, s_s, d_s, t_hi, t_lo, xk_s, v_s, bar = refs
        at = _this_chunk()
        _stage(staged, part_refs, (xk_s, v_s), at, bar)
        t = _inverse(akk_ref, beta_ref, at, (l_parts, s_s, d_s, t_hi, t_lo), interpret)
        if save_t:
            _view(t_ref, at, ALL)[...] = t
        store_split(_scaled_columns(t, beta_ref, at), (t_hi, t_lo))
        plgpu.commit_smem()
        plgpu.barrier_wait(bar)
        for op, z_s, out_ref in zip(staged, (xk_s, v_s), (w_ref, u_ref)):
            specs = [((CHUNK, KT), *_split_pairs((t_hi, t_lo), op.tile(z_s, i)))
                     for i in range(op.width // KT)]
            for i, (cols, out) in enumerate(zip(column_tiles(op.width), products(*specs))):
                # L's parts, free once T is formed, stage a bf16 W
                store_result(out, _view(out_ref, at, cols), l_parts.at[i])
        plgpu.wait_smem_to_gmem(0)

    scratch = (*_inverse_scratch(), *_staging_scratch(staged))
    sds = jax.ShapeDtypeStruct
    out_type = (sds(akk.shape, F32),) * save_t + (sds((nb, h, tp, dk), w_dtype),
                                                  sds((nb, h, tp, dv), F32))
    run = kernel(body, "kda_wy_fwd", interpret, out_type=out_type, grid=(tp // CHUNK, h, nb),
                 grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(akk, beta, *xk_parts, *v_parts)


def _strictly_lower():
    return iota(FULL, 0) > iota(FULL, 1)


def _lower_grad(dt, t_parts, split_s, interpret: bool):
    """``dL = -tril(T^T dT T^T, -1)``, fp32 ``[C, C]``; ``t_parts``: ``T``'s bf16 parts in SMEM,
    ``split_s``: two free bf16 tiles."""
    t_tr = [t.T for t in t_parts]
    store_split(dt, split_s)
    plgpu.commit_smem()
    tdt = _product(t_tr, split_s)                                                   # T^T dT
    dm = matmul(FULL, *_split_pairs(_register_parts(tdt), t_tr), interpret=interpret)  # tdt T^T
    return jnp.where(_strictly_lower(), -dm, 0.0)


def _bwd_call(t, akk, beta, xk_parts, v_parts, dw_parts, du, *, interpret):
    """Raw backward kernel: ``(dAkk, dbeta, dxk, dv)`` in the shapes of ``akk`` (fp32, zero on and
    above the diagonal), ``beta`` (fp32), ``xk`` and ``v`` (``dv`` token-major), each gradient in
    its input's dtype (bf16 for one part, else fp32); ``xk_parts``, ``v_parts``, ``dw_parts``:
    :func:`bf16_parts`; ``du`` fp32.

    With ``X = beta xk``: ``dT = (dW xk^T + dU v^T) diag(beta)``, so, as in the forward, the bf16
    operands go to the tensor cores as they are, brought by TMA at the start; only ``dU`` (fp32) is
    split, from registers loaded while they arrive."""
    nb, h, tp, _ = t.shape
    dk, dv = xk_parts[0].shape[-1], v_parts[0].shape[-1]
    xk_op, v_op, _ = staged = (_Staged(len(xk_parts), dk, False),
                                   _Staged(len(v_parts), dv, True),
                                   _Staged(len(dw_parts), dk, False))

    def body(t_ref, akk_ref, beta_ref, *refs):
        part_refs, refs = _split_refs(refs, [op.parts for op in staged])
        du_ref, dakk_ref, dbeta_ref, dxk_ref, dv_ref, t_hi, t_lo, *scratch = refs
        (a_hi, a_lo), (xk_s, v_s, dw_s), bar = scratch[:2], scratch[2:5], scratch[5]
        at = _this_chunk()
        _stage(staged, part_refs, (xk_s, v_s, dw_s), at, bar)
        du_tiles = [load(_view(du_ref, at, cols)) for cols in column_tiles(dv)]
        beta_rows = _beta_rows(beta_ref, at)
        t_parts = (t_hi, t_lo)
        store_split(load(_view(t_ref, at, ALL)), t_parts)
        plgpu.commit_smem()
        plgpu.barrier_wait(bar)
        xk_t, v_t, dw_t = (functools.partial(op.tile, z_s)
                           for op, z_s in zip(staged, (xk_s, v_s, dw_s)))
        t_tr = [x.T for x in t_parts]
        # dW's products, every tile at once: dW xk^T (summed over tiles) and T^T dW per tile
        nk = dk // KT
        dt, *dxs = products(
            (FULL, *[pair for i in range(nk)
                     for pair in _split_pairs(dw_t(i), [z.T for z in xk_t(i)])]),
            *[((CHUNK, KT), *_split_pairs(t_tr, dw_t(i))) for i in range(nk)])
        dbeta = zeros((CHUNK,), ROW)
        outs = [(dxs, xk_t, dxk_ref, False, dk)]
        dys = []
        for i, du_tile in enumerate(du_tiles):  # dU is split: one tile at a time
            store_split(du_tile, (a_hi, a_lo))
            plgpu.commit_smem()
            part, dy = products((FULL, *_split_pairs((a_hi, a_lo), [z.T for z in v_t(i)])),
                                ((CHUNK, KT), *_split_pairs(t_tr, (a_hi, a_lo))))
            dt, dys = dt + part, dys + [dy]
        outs.append((dys, v_t, dv_ref, True, dv))
        for grads, z_t, out_ref, token_major, n in outs:
            for i, (cols, dz) in enumerate(zip(column_tiles(n), grads)):
                z = sum(load(part).astype(F32) for part in z_t(i))
                dbeta = dbeta + jnp.sum(dz * z, axis=1)
                # z's own tile, read just now, stages a bf16 gradient
                store_result(dz * beta_rows, _view(out_ref, at, cols, token_major), z_t(i)[0])
        beta_cols = per_col(load(beta_ref.at[at.b, at.h, at.tok], COL), FULL)
        dl = _lower_grad(dt * beta_cols, t_parts, (a_hi, a_lo), interpret)
        akk = load(_view(akk_ref, at, ALL))
        _view(dakk_ref, at, ALL)[...] = dl * beta_rows
        # where, not a product alone: Akk's junk on and above the diagonal may be anything
        dbeta = dbeta + jnp.sum(jnp.where(_strictly_lower(), dl * akk, 0.0), axis=1)
        dbeta_ref.at[at.b, at.h, at.tok][...] = dbeta
        plgpu.wait_smem_to_gmem(0)

    dtype = lambda op: BF16 if op.parts == 1 else F32  # noqa: E731
    scratch = (*(tiles(FULL) for _ in range(4)), *_staging_scratch(staged))
    sds = jax.ShapeDtypeStruct
    out_type = (sds(akk.shape, F32), sds(beta.shape, F32),
                sds((nb, h, tp, dk), dtype(xk_op)), sds((nb, tp, h, dv), dtype(v_op)))
    run = kernel(body, "kda_wy_bwd", interpret, out_type=out_type, grid=(tp // CHUNK, h, nb),
                 grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(t, akk, beta, *xk_parts, *v_parts, *dw_parts, du)


_fwd_jit = shared_lowering(_fwd_call, ("w_dtype", "save_t"))
_bwd_jit = shared_lowering(_bwd_call, ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _wy(akk, beta, xk, v, w_dtype, interpret):
    return _fwd_jit(akk, beta, bf16_parts(xk), bf16_parts(v), w_dtype=w_dtype, save_t=False,
                    interpret=interpret)


def _wy_fwd(akk, beta, xk, v, w_dtype, interpret):
    t, w, u = _fwd_jit(akk, beta, bf16_parts(xk), bf16_parts(v), w_dtype=w_dtype, save_t=True,
                       interpret=interpret)
    return (w, u), (t, akk, beta, xk, v)


def _wy_bwd(w_dtype, interpret, res, cts):
    t, akk, beta, xk, v = res
    dw, du = cts  # dW in w_dtype, dU fp32
    return _bwd_jit(t, akk, beta, bf16_parts(xk), bf16_parts(v), bf16_parts(dw),
                    du.astype(F32), interpret=interpret)


_wy.defvjp(_wy_fwd, _wy_bwd)


def _check_inverse_args(fn: str, akk, beta) -> None:
    """ValueError naming ``akk`` or ``beta`` of ``fn`` if its shape or dtype is wrong."""
    if akk.ndim != 4 or akk.shape[3] != CHUNK or akk.shape[2] % CHUNK:
        raise ValueError(f"{fn}: akk must be [B, H, Tp, {CHUNK}] with Tp a multiple of {CHUNK}, "
                         f"got {akk.shape}")
    nb, h, tp, _ = akk.shape
    if beta.shape != (nb, h, tp):
        raise ValueError(f"{fn}: beta must be [B, H, Tp] = {(nb, h, tp)}, got {beta.shape}")
    for name, z in (("akk", akk), ("beta", beta)):
        if not jnp.issubdtype(z.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be floating point, got {z.dtype}")


def _check_args(akk, beta, xk, v, w_dtype) -> None:
    """ValueError naming the first argument of :func:`wy` with a wrong shape or dtype."""
    _check_inverse_args("wy", akk, beta)
    nb, h, tp, _ = akk.shape
    if xk.ndim != 4 or xk.shape[:3] != (nb, h, tp) or xk.shape[3] % CHUNK:
        raise ValueError(f"wy: xk must be [B, H, Tp, K] = {(nb, h, tp)} "
                         f"+ (a multiple of {CHUNK},), "
                         f"got {xk.shape}")
    if v.ndim != 4 or v.shape[:3] != (nb, tp, h) or v.shape[3] % CHUNK:
        raise ValueError(f"wy: v must be token-major [B, Tp, H, V] = {(nb, tp, h)} "
                         "+ (a multiple of "
                         f"{CHUNK},), got {v.shape}")
    for name, dtype in (("xk", xk.dtype), ("v", v.dtype), ("w_dtype", w_dtype)):
        if jnp.dtype(dtype) not in OPERAND_DTYPES:
            raise ValueError(f"wy: {name} must be float32 or bfloat16, got {dtype}")


def wy(akk, beta, xk, v, *, w_dtype=F32, interpret: bool = False):
    """``(W, U) = (T X, T Y)`` per chunk of 64 rows, with ``T = (I + L)^-1``,
    ``L[r, j] = beta_r Akk[r, j]`` (``r > j``), ``X = beta xk`` and ``Y = beta v``.

    Args:
      akk: ``[B, H, Tp, 64]``: row ``t`` holds chunk-local row ``t mod 64`` of ``Akk`` (only
        entries strictly below the diagonal are read; the rest may hold anything).
      beta: ``[B, H, Tp]`` (head-major).
      xk: ``[B, H, Tp, K]``, float32 or bfloat16: ``k exp(G)``, already masked.
      v: ``[B, Tp, H, V]``, float32 or bfloat16, in the caller's token-major layout (read and its
        gradient written in place, no transpose). ``K, V`` multiples of 64.
      w_dtype: dtype of ``W`` (float32 or bfloat16).
      interpret: run in the Mosaic GPU interpreter (CPU tests).

    Returns ``(W [B, H, Tp, K] in w_dtype, U [B, H, Tp, V] fp32)``. Differentiable in all four
    inputs (``akk``'s gradient is zero on and above the diagonal; ``xk``'s and ``v``'s come in their
    dtypes); the backward is a Mosaic kernel.
    """
    _check_args(akk, beta, xk, v, w_dtype)
    return _wy(akk.astype(F32), beta.astype(F32), xk, v, jnp.dtype(w_dtype), interpret)


_scaled_inverse_jit = shared_lowering(_scaled_inverse_call, ())


def scaled_inverse(akk, beta, *, interpret: bool = False):
    """``T diag(beta)`` per chunk of 64 rows (``T`` as in :func:`wy`), bf16: the chunk inverse
    for a state pass that applies it itself, ``U - W S = (T diag(beta)) (v - xk S)``, so that
    ``W`` and ``U`` never reach HBM. Its product's other operand, ``v - xk S``, is bf16 too, and
    the result is rounded to bf16: a low bf16 part of ``T`` as a second product moved the state
    pass's error by 1e-7 of its 2.4e-3 (the applying-inverse case of ``tests/test_pallas_kda.py``)
    and cost one more product on the serial chain. Forward only (no VJP: a backward needs ``W``).
    ``akk``, ``beta``: as in :func:`wy`.

    Returns ``[B, H, Tp, 64]`` bf16.
    """
    _check_inverse_args("scaled_inverse", akk, beta)
    return _scaled_inverse_jit(akk.astype(F32), beta.astype(F32), interpret=interpret)


__all__ = ["scaled_inverse", "scaled_inverse_reference", "unit_lower_inverse_reference", "wy",
           "wy_reference"]
