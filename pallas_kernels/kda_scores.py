"""Mosaic GPU kernels: KDA's decayed intra-chunk scores and their VJP (SPEC 3.3).

Per chunk of ``C = 64`` rows (one batch, head, chunk), for ``r >= j`` (0 above the diagonal)::

    S[r, j] = sum_c a[r, c] b[j, c] exp(G[r, c] - G[j, c])

with ``G`` the chunk-local cumulative log-decay (non-increasing down a chunk: every gate is ``<= 0``).
``Aqk`` is ``S`` for ``a = scale q, b = k`` and the strict lower part of ``Akk`` is ``S`` for
``a = b = k``; :func:`qk_kk_scores` computes both in one call and shares the decay work.

Numerics (SPEC 3.3, PITFALLS "KDA"): ``exp(G_r - G_j)`` is never split over a span that can grow.
As in :func:`pallas_kernels.kda_prep._tree_scores`, a pair ``r > j`` belongs to exactly one level
``s`` (32, 16, 8, 4, 2, 1) of a binary tree of row blocks: ``r`` in a right block ``[p, p + s)``,
``j`` in its left sibling ``[p - s, p)``. There the decay factors through the right block's *first*
row ``p``: ``exp(G_r - G_p) exp(G_p - G_j)``, both factors ``<= 1`` for any gate magnitude. Each row
``x`` has one anchor per level, ``p(x) = (x & ~(2s - 1)) + s``, and one factor
``E[x] = exp(-|G_x - G_p(x)|)`` serves both sides (right-block rows take ``exp(G_x - G_p)``,
left-block rows ``exp(G_p - G_x)``). Per level, one WGMMA ``(a E) (b E)^T`` (bf16 operands, fp32
accumulation) over all 64 x 64 pairs, kept only where ``(r, j)`` are siblings at that level. The
diagonal ``r = j`` has no decay: ``sum_c a_rc b_rc`` in fp32.

Backward: with ``da[r] = sum_j dS[r, j] b[j] exp(G_r - G_j)`` and
``db[j] = sum_r dS[r, j] a[r] exp(G_r - G_j)`` (same anchored levels: ``E (dS_s (b E))`` and
``E (dS_s^T (a E))``, ``dS_s`` the cotangent masked to level ``s``'s pairs), the log-decay gradient is
``dG = a da - b db`` (elementwise; the diagonal's terms cancel, so they are left out of it).

Bounded chunks (the fast path): when no row of a 32-row block is more than ``BOUND`` nats of decay
from the block's middle row ``m`` (row 16, counting from 0; every chunk of K3's lower-bound gate, whose 16-token
spans stay under ``16 * 5 = 80`` nats), the levels below 32 are replaced by one level that factors
every pair of a 32-row block through ``m``: rows take ``exp(G_r - G_m)``, columns ``exp(G_m - G_j)``,
each at most ``exp(BOUND)``, so nothing overflows fp32 or bf16 (products of the pairs the mask drops
may, and are dropped). Two WGMMA levels instead of six. The flag is per (batch, head, chunk)
(:func:`bounded_chunks`), so a chunk with a steeper gate (softplus form) takes the exact levels
while its neighbours take the fast path; the same decomposition is FlashKDA's and
jax-linear-attention's bounded path (written here from the algebra).

Anchors: each level needs ``G[p(x)]`` for every row. The top level (one anchor row, 32) and the
bounded level (rows 16 and 48) broadcast their anchor rows. The exact levels below the top form
them as ``P_s G`` on the tensor cores, with a 0/1 matrix ``P_s`` and ``G`` split into three bf16
parts (one nonzero product per entry, so exact to fp32 rounding): every such level runs the same
code, so they are one loop. (A chain of selects over the level's blocks, the first design, needed
the levels unrolled: kernels 3.7x larger and, on the H200, 1.6x slower forward and 2.2x slower
backward; docs/benchmarks.md.)

Exponentials use Mosaic's approximate math (``ex2.approx``, ~2 ulp in fp32, far inside the bf16
operands' rounding): on the H200 4-7% faster per kernel.

Layout: one CTA per ``(chunk, head, batch)``; the key channels are handled in tiles
of 64 (``K`` in {64, 128}). Inputs arrive by TMA in plain SMEM; the scaled operands of each level
are written to swizzled bf16 SMEM tiles for WGMMA.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import (
    BF16,
    COL,
    F32,
    KT,
    SPLITS,
    WG,
    column_tiles,
    finish_together,
    iota,
    kernel,
    load,
    matmul,
    shared_lowering,
    store_split,
    tiles,
)

CHUNK = 64
HEAD_DIMS = (64, 128)
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LOG_LEVELS = (5, 4, 3, 2, 1, 0)  # log2 of each level's block size s = 32, 16, ..., 1 (descending)
BOUNDED_LG = 4  # the fast path's second level: 32-row blocks anchored at their row 16
BOUND = 80.0  # nats of decay a bounded level's factor may span (exp(80) ~ 5.5e34 < bf16 / fp32 max)


# --------------------------------------------------------------------------- in-kernel helpers


def _siblings(lg):
    """``[C, C]`` bool: row ``r`` in a right block of level ``s = 2^lg``, column ``j`` in its left
    sibling (``lg`` a traced int32 scalar: the levels are a loop). The indices are made here, not
    passed in, so no ``[C, C]`` index array stays live across levels."""
    rb, jb = iota((CHUNK, CHUNK), 0) >> lg, iota((CHUNK, CHUNK), 1) >> lg
    return (rb == (jb | 1)) & ((jb & 1) == 0)


def _anchor_matrix(lg):
    """``[C, C]`` bf16 0/1 matrix ``P_s`` with ``P_s[x, p(x)] = 1``: ``P_s G`` picks the anchors."""
    rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)
    anchor_row = ((rows >> (lg + 1)) << (lg + 1)) + (1 << lg)
    return jnp.where(cols == anchor_row, 1.0, 0.0).astype(BF16)


def _anchors(p_ref, parts):
    """``[C, KT]`` fp32: row ``x`` holds ``G[p(x)]`` (module docstring), as ``P_s G`` on the tensor
    cores: one nonzero product per entry and bf16 parts that sum to ``G``, so exact to fp32 rounding."""
    return matmul((CHUNK, KT), *[(p_ref, part) for part in parts])


def _fixed_anchors(lg: int, g_ref):
    """``[C, KT]`` fp32 anchors of a level whose ``lg`` is static (the top level, the bounded level):
    row ``x`` holds ``G[p(x)]``, a broadcast of one of the ``C / 2^(lg + 1)`` anchor rows of the plain
    SMEM tile ``g_ref`` (no tensor-core work)."""
    span = 2 << lg
    rows = iota((CHUNK, KT), 0)
    anchor = None
    for start in range(0, CHUNK, span):
        row = lax.broadcast_in_dim(load(g_ref.at[start + span // 2], COL), (CHUNK, KT), (1,))
        anchor = row if anchor is None else jnp.where(rows >= start, row, anchor)
    return anchor


def _decays(g, anchor, bounded: bool):
    """A level's ``(row factor, column factor)``, ``[C, KT]`` fp32, from ``G`` and its anchors' rows:
    exact level ``E = exp(-|G_x - G_p(x)|)`` for both; bounded level ``exp(G_x - G_p(x))`` and its
    inverse (module docstring)."""
    d = g - anchor
    if bounded:
        return jnp.exp(d), jnp.exp(-d)
    e = jnp.exp(jnp.minimum(d, -d))
    return e, e


def _pairs(lg, bounded: bool):
    """``[C, C]`` bool: the pairs ``(r, j)`` a level computes: siblings (exact level), or every
    ``r > j`` in one block of ``2^(lg + 1)`` rows (bounded level)."""
    if not bounded:
        return _siblings(lg)
    rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)
    return ((rows >> (lg + 1)) == (cols >> (lg + 1))) & (rows > cols)


TOP, BOUNDED, EXACT = "top", "bounded", "exact"  # the kinds of level (see _by_chunk_kind)


def _level_decays(kind: str, lg, g_ref, p_s, parts):
    """``_decays`` of level ``2^lg`` for one channel tile ``g_ref`` (plain SMEM ``[C, KT]``). The top
    and bounded levels read their anchors as broadcast rows; the exact levels below the top (``lg``
    traced) form them as ``P_s G`` from ``G``'s bf16 ``parts`` (``p_s``: SMEM for ``P_s``)."""
    if kind == EXACT:
        p_s[...] = _anchor_matrix(lg)
        plgpu.commit_smem()
        anchor = _anchors(p_s, parts)
    else:
        anchor = _fixed_anchors(lg, g_ref)
    return _decays(load(g_ref), anchor, kind == BOUNDED)


def _scaled_operands(kind: str, which, er, ec, a_refs, b_ref, bp_ref, br_ref, ap_refs):
    """Write one channel tile's WGMMA operands of a level and return each output's row operand.

    ``b E_col`` goes to ``bp_ref`` (every output's column operand) and ``a_i E_row`` to ``ap_refs``;
    ``b`` as a row operand (``which == -1``) is ``bp_ref`` itself where both factors are ``E``, else
    ``b E_row`` in ``br_ref`` (bounded level). ``a_refs``, ``b_ref``: the tile's plain SMEM inputs.
    """
    bounded = kind == BOUNDED
    bvals = load(b_ref).astype(F32)
    bp_ref[...] = (bvals * ec).astype(BF16)
    if bounded and -1 in which:
        br_ref[...] = (bvals * er).astype(BF16)
    for a_ref, ap_ref in zip(a_refs, ap_refs):
        ap_ref[...] = (load(a_ref).astype(F32) * er).astype(BF16)
    b_row = br_ref if bounded else bp_ref
    return [b_row if w < 0 else ap_refs[w] for w in which]


def _exact_levels_below_top(level, carry):
    """``carry = level(lg, carry, EXACT)`` for every level but the top (``lg`` traced)."""
    top = LOG_LEVELS[0]
    return lax.fori_loop(1, len(LOG_LEVELS), lambda i, c: level(top - i, c, EXACT), carry)


def _by_chunk_kind(flags_ref, level, carry, finish, split_g):
    """The top level (32-row blocks, exact either way), then ``finish`` on the result of the bounded
    level where this chunk's flag is set, else of the exact levels below the top, after ``split_g``
    has written ``G``'s bf16 parts for their anchors (``level(lg, carry, kind)``)."""
    carry = level(LOG_LEVELS[0], carry, TOP)
    bounded = flags_ref[lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")] != 0

    @pl.when(bounded)
    def _():
        finish(level(BOUNDED_LG, carry, BOUNDED))

    @pl.when(jnp.logical_not(bounded))
    def _():
        split_g()
        finish(_exact_levels_below_top(level, carry))


def bounded_chunks(g_cum):
    """``[B, H, NC]`` int32: 1 where every row of each 32-row block of the chunk lies within
    :data:`BOUND` nats (every channel) of the block's row 16, the chunks the fast path may take.

    g_cum: ``[B, H, Tp, K]`` chunk-local cumulative log-decay. A NaN fails the test (exact path).
    """
    nb, h, tp, dk = g_cum.shape
    g = g_cum.astype(F32).reshape(nb, h, tp // CHUNK, CHUNK // 32, 32, dk)
    mid = g[..., 16:17, :]
    span = jnp.max(jnp.abs(g - mid), axis=(-3, -2, -1))
    return (span <= BOUND).astype(jnp.int32)


# --------------------------------------------------------------------------- forward kernel


def _fwd_call(lhs, b, g, flags, *, which, out_dtypes, interpret):
    """Raw forward kernel: one ``S`` per entry of ``which`` (an index into ``lhs``, or -1 for ``b``),
    in the matching entry of ``out_dtypes``; ``flags`` is :func:`bounded_chunks` of ``g``.

    Levels are the outer loop, channel tiles the inner one, one warpgroup. (H200, (8, 4096, 16, 128),
    six exact levels: 1.64 ms; tiles outermost, which halves the scaled operands' SMEM, 1.72 ms; one
    warpgroup per output, 2.52 ms: the duplicated decay work costs more than the second warpgroup
    hides.)"""
    nb, h, tp, dk = b.shape
    nl, nh, chs = len(lhs), dk // KT, column_tiles(dk)
    out_type = tuple(jax.ShapeDtypeStruct((nb, h, tp, CHUNK), dt) for dt in out_dtypes)

    def body(*refs):
        a_refs, (b_ref, g_ref, flags_ref), refs = refs[:nl], refs[nl:nl + 3], refs[nl + 3:]
        outs, refs = refs[:len(which)], refs[len(which):]
        a_s, (b_s, g_s, bp_s), refs = refs[:nl], refs[nl:nl + 3], refs[nl + 3:]
        ap_s, bar, refs = refs[:nl], refs[nl], refs[nl + 1:]
        bi, hi, ni = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        tok = pl.ds(ni * CHUNK, CHUNK)
        for src, dst in zip((*a_refs, b_ref, g_ref), (*a_s, b_s, g_s)):
            plgpu.copy_gmem_to_smem(src.at[bi, hi, tok], dst, bar)
        plgpu.barrier_wait(bar)
        lhs_s = [b_s if w < 0 else a_s[w] for w in which]
        rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)

        # Diagonal, exact in fp32.
        scores = []
        for x_s in lhs_s:
            dot = sum(jnp.sum(load(x_s.at[:, ch]).astype(F32) * load(b_s.at[:, ch]).astype(F32), axis=1)
                      for ch in chs)
            scores.append(jnp.where(rows == cols, lax.broadcast_in_dim(dot, (CHUNK, CHUNK), (0,)), 0.0))
        p_s, g_parts = refs[0], refs[1:]
        br_s = g_parts[-1]  # b times the row factor: the bounded path never splits G

        def split_g():
            for t, ch in enumerate(chs):
                store_split(load(g_s.at[:, ch]), [part.at[t] for part in g_parts])

        def level(lg, scores, kind):  # the pairs of one anchored level
            row_operands = []  # [tile][output]
            for t, ch in enumerate(chs):
                er, ec = _level_decays(kind, lg, g_s.at[:, ch], p_s, [part.at[t] for part in g_parts])
                row_operands.append(_scaled_operands(kind, which, er, ec, [a.at[:, ch] for a in a_s],
                                                     b_s.at[:, ch], bp_s.at[t], br_s.at[t],
                                                     [x.at[t] for x in ap_s]))
            plgpu.commit_smem()
            keep = _pairs(lg, kind == BOUNDED)
            return tuple(sc + jnp.where(keep, matmul((CHUNK, CHUNK), *[(row_operands[t][o], bp_s.at[t].T)
                                                                       for t in range(nh)]), 0.0)
                         for o, sc in enumerate(scores))

        def store(scores):
            for out, sc, dt in zip(outs, scores, out_dtypes):
                out.at[bi, hi, tok][...] = sc.astype(dt)

        _by_chunk_kind(flags_ref, level, tuple(scores), store, split_g)

    scratch = (
        *(plgpu.SMEM((CHUNK, dk), BF16) for _ in range(nl)),  # a (plain)
        plgpu.SMEM((CHUNK, dk), BF16), plgpu.SMEM((CHUNK, dk), F32),  # b, G (plain)
        tiles((nh, CHUNK, KT)),  # b times the column factor, per channel tile
        *(tiles((nh, CHUNK, KT)) for _ in range(nl)),  # a times the row factor
        plgpu.Barrier(num_arrivals=nl + 2),
        tiles((CHUNK, CHUNK)), *(tiles((nh, CHUNK, KT)) for _ in range(SPLITS)),  # P_s, G's parts
    )
    run = kernel(body, "kda_scores_fwd", interpret, approx_math=True, out_type=out_type,
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(*lhs, b, g, flags)


# --------------------------------------------------------------------------- backward kernel


def _bwd_call(lhs, b, g, dss, flags, *, which, interpret):
    """Raw backward kernel: ``(da per lhs, db, dg)``, fp32 ``[B, H, Tp, K]``; ``dss`` one per ``which``;
    ``flags`` is :func:`bounded_chunks` of ``g``.

    ``db`` includes the gradients of the ``b``-as-lhs outputs (``which == -1``). One warpgroup per
    channel tile (two at K = 128): the tiles are independent given ``dS``, and the kernel is bound by
    the latency of its dependent WGMMA / exp steps, which a second warpgroup on the SM hides (with
    one warpgroup, its 160 KB of SMEM left room for one CTA per SM; H200: 2.77 -> 2.22 ms at
    (8, 4096, 16, 128), six exact levels).
    """
    nb, h, tp, dk = b.shape
    nl, no, nh = len(lhs), len(which), dk // KT
    sds = jax.ShapeDtypeStruct((nb, h, tp, dk), F32)
    out_type = tuple(sds for _ in range(nl + 2))

    def body(*refs):
        a_refs, (b_ref, g_ref), refs = refs[:nl], refs[nl:nl + 2], refs[nl + 2:]
        ds_refs, (flags_ref,), refs = refs[:no], refs[no:no + 1], refs[no + 1:]
        da_refs, (db_ref, dg_ref), refs = refs[:nl], refs[nl:nl + 2], refs[nl + 2:]
        a_all, (b_all, g_all), refs = refs[:nl], refs[nl:nl + 2], refs[nl + 2:]
        ds_s, refs = refs[:no], refs[no:]
        bp_all, ap_all, refs = refs[0], refs[1:1 + nl], refs[1 + nl:]
        dsl_all, (p_all, *parts_all, bar, done) = refs[:no], refs[no:]
        bi, hi, ni, wg = (lax.axis_index(n) for n in ("b", "h", "n", "wg"))
        tok = pl.ds(ni * CHUNK, CHUNK)

        @pl.when(wg == 0)
        def _():
            for t, ch in enumerate(column_tiles(dk)):  # each channel tile to its own buffer
                for src, dst in zip((*a_refs, b_ref, g_ref), (*a_all, b_all, g_all)):
                    plgpu.copy_gmem_to_smem(src.at[bi, hi, tok, ch], dst.at[t], bar)
            for src, dst in zip(ds_refs, ds_s):
                plgpu.copy_gmem_to_smem(src.at[bi, hi, tok], dst, bar)

        plgpu.barrier_wait(bar)
        # This warpgroup's channel tile and its own operand buffers.
        a_s, b_s, g_s = [x.at[wg] for x in a_all], b_all.at[wg], g_all.at[wg]
        bp_s, ap_s, dsl_s = bp_all.at[wg], [x.at[wg] for x in ap_all], [x.at[wg] for x in dsl_all]
        p_s, g_parts = p_all.at[wg], [x.at[wg] for x in parts_all]
        br_s = g_parts[-1]  # b times the row factor: the bounded path never splits G
        zero = plgpu.layout_cast(jnp.zeros((CHUNK, KT), F32), WG)

        def level(lg, carry, kind):  # (da per output: row side, db: column side)
            da, db = carry
            er, ec = _level_decays(kind, lg, g_s, p_s, g_parts)
            lhs_p = _scaled_operands(kind, which, er, ec, a_s, b_s, bp_s, br_s, ap_s)
            keep = _pairs(lg, kind == BOUNDED)
            for o in range(no):
                dsl_s[o][...] = jnp.where(keep, load(ds_s[o]).astype(F32), 0.0).astype(BF16)
            plgpu.commit_smem()
            da = tuple(d + er * matmul((CHUNK, KT), (dsl_s[o], bp_s)) for o, d in enumerate(da))
            db = db + ec * matmul((CHUNK, KT), *[(dsl_s[o].T, lhs_p[o]) for o in range(no)])
            return da, db

        def finish(carry):
            da, db = carry
            da = list(da)
            ch = pl.ds(wg * KT, KT)
            bvals = load(b_s).astype(F32)
            avals = [bvals if w < 0 else load(a_s[w]).astype(F32) for w in which]
            dg = -bvals * db
            for o in range(no):
                dg = dg + avals[o] * da[o]
            dg_ref.at[bi, hi, tok, ch][...] = dg
            # Diagonal (no decay): dS[r, r] b_r and dS[r, r] a_r.
            diag = iota((CHUNK, CHUNK), 0) == iota((CHUNK, CHUNK), 1)
            for o in range(no):
                w = jnp.sum(jnp.where(diag, load(ds_s[o]).astype(F32), 0.0), axis=1)
                w = lax.broadcast_in_dim(w, (CHUNK, KT), (0,))
                da[o] = da[o] + w * bvals
                db = db + w * avals[o]
            for o, wo in enumerate(which):
                if wo < 0:
                    db = db + da[o]
                else:
                    da_refs[wo].at[bi, hi, tok, ch][...] = da[o]
            db_ref.at[bi, hi, tok, ch][...] = db
            finish_together(done)

        _by_chunk_kind(flags_ref, level, ((zero,) * no, zero), finish,
                       lambda: store_split(load(g_s), g_parts))

    per_tile = lambda dtype: plgpu.SMEM((nh, CHUNK, KT), dtype)  # noqa: E731
    scratch = (
        *(per_tile(BF16) for _ in range(nl)), per_tile(BF16), per_tile(F32),  # a, b, G (plain)
        *(plgpu.SMEM((CHUNK, CHUNK), d.dtype) for d in dss),  # dS (plain, shared)
        tiles((nh, CHUNK, KT)),  # b times the column factor, one per warpgroup
        *(tiles((nh, CHUNK, KT)) for _ in range(nl)),  # a times the row factor
        *(tiles((nh, CHUNK, CHUNK)) for _ in range(no)),  # dS masked to one level
        tiles((nh, CHUNK, CHUNK)), *(tiles((nh, CHUNK, KT)) for _ in range(SPLITS)),  # P_s, G's parts
        plgpu.Barrier(num_arrivals=(nl + 2) * nh + no),
        plgpu.Barrier(num_arrivals=nh),
    )
    run = kernel(body, "kda_scores_bwd", interpret, approx_math=True, out_type=out_type,
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"), num_threads=nh,
                 thread_name="wg", scratch_types=scratch)
    return run(*lhs, b, g, *dss, flags)


_fwd_jit = shared_lowering(_fwd_call, ("which", "out_dtypes"))
_bwd_jit = shared_lowering(_bwd_call, ("which",))


# --------------------------------------------------------------------------- differentiable op


def _bf16(x):
    return x.astype(BF16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _scores(lhs, b, g, which, out_dtypes, interpret):
    return _scores_fwd(lhs, b, g, which, out_dtypes, interpret)[0]


def _scores_fwd(lhs, b, g, which, out_dtypes, interpret):
    flags = bounded_chunks(g)
    out = _fwd_jit(tuple(map(_bf16, lhs)), _bf16(b), g.astype(F32), flags, which=which,
                   out_dtypes=out_dtypes, interpret=interpret)
    return out, (lhs, b, g, flags)


def _scores_bwd(which, out_dtypes, interpret, res, dss):
    lhs, b, g, flags = res
    *da, db, dg = _bwd_jit(tuple(map(_bf16, lhs)), _bf16(b), g.astype(F32), tuple(dss), flags,
                           which=which, interpret=interpret)
    return (tuple(d.astype(x.dtype) for d, x in zip(da, lhs)), db.astype(b.dtype), dg.astype(g.dtype))


_scores.defvjp(_scores_fwd, _scores_bwd)


def _check(name: str, b, g, lhs, out_dtypes):
    shape = b.shape
    if len(shape) != 4 or shape[2] % CHUNK or shape[3] not in HEAD_DIMS:
        raise ValueError(f"{name}: b (or k) must be [B, H, Tp, K] with Tp a multiple of {CHUNK} and K in "
                         f"{HEAD_DIMS}, got {shape}")
    for arg, x in (("g_cum", g), *((f"lhs {i}", a) for i, a in enumerate(lhs))):
        if x.shape != shape:
            raise ValueError(f"{name}: {arg} must have b's shape {shape}, got {x.shape}")
    for arg, x in (("b", b), ("g_cum", g), *((f"lhs {i}", a) for i, a in enumerate(lhs))):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: {arg} must be floating point, got {x.dtype}")
    for dt in out_dtypes:
        if jnp.dtype(dt) not in OUT_DTYPES:
            raise ValueError(f"{name}: out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {dt}")


def scores(a, b, g_cum, *, out_dtype=jnp.float32, interpret: bool = False):
    """``S[r, j] = sum_c a_rc b_jc exp(G_rc - G_jc)`` for ``r >= j`` in each chunk of 64 rows, else 0.

    Args:
      a, b: ``[B, H, Tp, K]`` (``Tp`` a multiple of 64, ``K`` in {64, 128}); rounded to bf16 for the
        tensor cores (pass bf16-representable values for exact operands).
      g_cum: ``[B, H, Tp, K]`` chunk-local cumulative log-decay (non-increasing within a chunk), fp32.
      out_dtype: fp32 or bf16.
      interpret: run in the Mosaic GPU interpreter (CPU tests).

    Returns:
      ``[B, H, Tp, 64]`` (row ``t`` holds chunk-local row ``t mod 64``). Differentiable in ``a, b,
      g_cum`` (backward: a Mosaic GPU kernel); cotangents come back in the inputs' dtypes.
    """
    _check("scores", b, g_cum, (a,), (out_dtype,))
    (s,) = _scores((a,), b, g_cum, (0,), (jnp.dtype(out_dtype),), interpret)
    return s


def qk_kk_scores(q, k, g_cum, *, out_dtype=jnp.float32, interpret: bool = False):
    """``(scores(q, k, g_cum), scores(k, k, g_cum))`` in one kernel call (shared decays and loads).

    ``q`` should already carry the attention scale. Shapes and dtypes as in :func:`scores`, except
    that ``out_dtype`` may be a pair: ``Aqk``'s dtype and ``Akk``'s. The second result includes the
    diagonal ``|k_r|^2`` (KDA's ``L`` uses only its strict lower part).
    """
    pair = tuple(out_dtype) if isinstance(out_dtype, (tuple, list)) else (out_dtype, out_dtype)
    _check("qk_kk_scores", k, g_cum, (q,), pair)
    return _scores((q,), k, g_cum, (0, -1), tuple(map(jnp.dtype, pair)), interpret)


def scores_reference(a, b, g_cum):
    """Plain fp32 reference of :func:`scores` (pairwise, ``[.., C, C, K]`` decays; small inputs only)."""
    nb, h, tp, dk = b.shape
    shp = (nb, h, tp // CHUNK, CHUNK, dk)
    a, b, g = (x.astype(F32).reshape(shp) for x in (a, b, g_cum))
    lower = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    diff = jnp.where(lower[:, :, None], g[..., :, None, :] - g[..., None, :, :], 0.0)  # [.., r, j, K]
    s = jnp.sum(a[..., :, None, :] * b[..., None, :, :] * jnp.exp(diff), axis=-1)
    return jnp.where(lower, s, 0.0).reshape(nb, h, tp, CHUNK)


__all__ = ["scores", "qk_kk_scores", "scores_reference", "bounded_chunks", "CHUNK", "HEAD_DIMS"]
