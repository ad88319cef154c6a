"""Mosaic GPU kernels: KDA's decayed intra-chunk scores and gated operands, and their VJP (math
§3.3).

Per chunk of ``C = 64`` rows (one batch, head, chunk), for ``r >= j`` (0 above the diagonal)::

    S[r, j] = sum_c a[r, c] b[j, c] exp(G[r, c] - G[j, c])

with ``G`` the chunk-local cumulative log-decay (non-increasing down a chunk: every gate is
``<= 0``). ``Aqk`` is ``scale S`` for ``a = q, b = k`` and the strict lower part of ``Akk`` is ``S``
for ``a = b = k``; :func:`gated_scores` computes both in one kernel and shares the decay work.

Gates (:mod:`pallas_kernels.kda_gates`): :func:`gated_scores` also returns the other per-token
operands of the chunked form, ``Qg``, ``Kg``, ``Xk`` and ``gamma``, which the gates' cumsum kernel
writes as it makes ``G`` (:func:`pallas_kernels.kda_cumsum.cumsum_and_gates`); both score matrices
are zero across a segment start. The backward kernel adds these products' chain rule to the scores'
gradients and writes ``dq``, ``dk`` once, in the caller's ``[B, T, H, K]`` layout, and ``dG`` for
the reverse cumsum: no fp32 intermediate of the token-parallel part goes through HBM for XLA to
combine. (The cumsum kernel writes them because it is light, with two CTAs per SM; the scores
forward kernel runs one warpgroup per SM, where every store's latency would be exposed.)

Numerics (math §3.3): ``exp(G_r - G_j)`` is never split over a span that can grow (K3's gate takes a
chunk ~320 nats down, and ``exp`` overflows fp32 past 88.7). A pair ``r > j`` belongs to exactly one
level ``s`` (32, 16, 8, 4, 2, 1) of a binary tree of row blocks: ``r`` in a right block
``[p, p + s)``, ``j`` in its left sibling ``[p - s, p)``. There the decay factors through the right
block's *first* row ``p``: ``exp(G_r - G_p) exp(G_p - G_j)``, both factors ``<= 1`` for any gate
magnitude. Each row ``x`` has one anchor per level, ``p(x) = (x & ~(2s - 1)) + s``, and one factor
``E[x] = exp(-|G_x - G_p(x)|)`` serves both sides (right-block rows take ``exp(G_x - G_p)``,
left-block rows ``exp(G_p - G_x)``). Per level, one WGMMA ``(a E) (b E)^T`` (bf16 operands, fp32
accumulation) over all 64 x 64 pairs, kept only where ``(r, j)`` are siblings at that level. The
diagonal ``r = j`` has no decay: ``sum_c a_rc b_rc`` in fp32.

Backward: with ``da[r] = sum_j dS[r, j] b[j] exp(G_r - G_j)`` and
``db[j] = sum_r dS[r, j] a[r] exp(G_r - G_j)`` (same anchored levels: ``E (dS_s (b E))`` and
``E (dS_s^T (a E))``, ``dS_s`` the cotangent masked to level ``s``'s pairs), the log-decay gradient
is ``dG = a da - b db`` (elementwise; the diagonal's terms cancel, so they are left out of it).

Bounded chunks (the fast path): when no row of a 32-row block is more than ``BOUND`` nats of decay
from the block's middle row ``m`` (row 16, counting from 0; every chunk of K3's lower-bound gate,
whose 16-token spans stay under ``16 * 5 = 80`` nats), the levels below 32 are replaced by one level
that factors every pair of a 32-row block through ``m``: rows take ``exp(G_r - G_m)``, columns
``exp(G_m - G_j)``, each at most ``exp(BOUND)``, so nothing overflows fp32 or bf16 (products of the
pairs the mask drops may, and are dropped). Two WGMMA levels instead of six. The flag is per (batch,
head, chunk) (:func:`bounded_chunks`), so a chunk with a steeper gate (softplus form) takes the
exact levels while its neighbours take the fast path; the same decomposition is FlashKDA's and
jax-linear-attention's bounded path (written here from the algebra).

Anchors: each level needs ``G[p(x)]`` for every row. The top level (one anchor row, 32) and the
bounded level (rows 16 and 48) broadcast their anchor rows. The exact levels below the top form
them as ``P_s G`` on the tensor cores, with a 0/1 matrix ``P_s`` and ``G`` split into three bf16
parts (one nonzero product per entry, so exact to fp32 rounding): every such level runs the same
code, so they are one loop. (A chain of selects over the level's blocks would need the levels
unrolled: several times the kernel size, and slower.)

Exponentials use Mosaic's approximate math (``ex2.approx``, ~2 ulp in fp32, far inside the bf16
operands' rounding), which is faster than the exact ``exp``.

Layout: the backward runs one CTA per ``(chunk, head, batch)``, the forward one per up to four
consecutive chunks of a head (the next chunk's inputs load while one is computed); the key
channels are handled in tiles of 64 (``K`` in {64, 128}). ``q``, ``k`` and (backward) ``dS``
arrive by TMA into swizzled SMEM tiles: a plain row-major tile puts the rows one WGMMA-layout load
touches on the same banks. The anchor rows of ``G`` are read one row at a time, which Mosaic lowers
only from untiled SMEM: the forward takes ``G`` into plain SMEM; the backward, which loads the
whole tile three times a chunk, takes it swizzled and its rows :data:`G_ROWS` into a small plain
buffer as well. (Swizzling ``dS`` made the backward kernel 3% faster, ``dS`` and ``G`` together
8%; ``G`` swizzled in the forward measured 3-4% slower, not explained.) The scaled operands of
each level are written to swizzled bf16 SMEM tiles for WGMMA.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kda_gates as gates
from pallas_kernels._mgpu import (
    BF16,
    CHUNK,
    COL,
    F32,
    HEAD_DIMS,
    KT,
    SPLITS,
    column_tiles,
    finish_together,
    iota,
    kernel,
    load,
    matmul,
    per_row,
    shared_lowering,
    store_result,
    store_split,
    tiles,
    zeros,
)
from pallas_kernels.kda_cumsum import (
    chunk_cumsum_reference,
    cumsum_and_gates,
    reverse_cumsum,
    reverse_cumsum_through_gate,
)
from pallas_kernels.kda_gates import (
    BOUNDED_LG,
    SegmentMasks,
    bounded_chunks,
    gate_products,
    same_segment_reference,
)

LOG_LEVELS = (5, 4, 3, 2, 1, 0)  # log2 of each level's block size s = 32, 16, ..., 1 (descending)
# Rows of G the backward reads alone: the top and bounded levels' anchors and the last row (the
# gates' factors). TMA brings them to a small plain buffer (module docstring, "Layout").
G_ROWS = (*gates.anchor_row_indices(LOG_LEVELS[0]), *gates.anchor_row_indices(BOUNDED_LG),
          CHUNK - 1)
SMS = 132  # streaming multiprocessors of an H100 SXM or H200: the forward's CTAs to fill them


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
    cores: one nonzero product per entry and bf16 parts that sum to ``G``, so exact to fp32
    rounding."""
    return matmul((CHUNK, KT), *[(p_ref, part) for part in parts])


def _decays(g, anchor, bounded: bool):
    """A level's ``(row factor, column factor)``, ``[C, KT]`` fp32, from ``G`` and its anchors'
    rows: exact level ``E = exp(-|G_x - G_p(x)|)`` for both; bounded level ``exp(G_x - G_p(x))`` and
    its inverse (module docstring)."""
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


def _copy_g_rows(g_ref, bi, hi, first_row, ch, rows_s, barrier):
    """Start the TMA copies of ``G``'s rows :data:`G_ROWS` of the chunk starting at ``first_row``,
    channels ``ch``, into ``rows_s`` (plain SMEM ``[len(G_ROWS), KT]``)."""
    for i, r in enumerate(G_ROWS):
        plgpu.copy_gmem_to_smem(g_ref.at[bi, hi, first_row + r, ch], rows_s.at[i], barrier)


def _copied_rows(rows_s):
    """``g_row`` of :func:`~pallas_kernels.kda_gates.anchor_rows` for :func:`_copy_g_rows`'s
    buffer."""
    return lambda r: rows_s.at[G_ROWS.index(r)]


def _level_decays(kind: str, lg, g_ref, g_row, p_s, parts):
    """``_decays`` of level ``2^lg`` for one channel tile ``g_ref`` (SMEM ``[C, KT]``; ``g_row``:
    its rows as :func:`~pallas_kernels.kda_gates.anchor_rows` takes them). The top and bounded
    levels read their anchors as broadcast rows; the exact levels below the top (``lg`` traced)
    form them as ``P_s G`` from ``G``'s bf16 ``parts`` (``p_s``: SMEM for ``P_s``)."""
    if kind == EXACT:
        p_s[...] = _anchor_matrix(lg)
        plgpu.commit_smem()
        anchor = _anchors(p_s, parts)
    else:
        anchor = gates.anchor_rows(lg, g_row)
    return _decays(load(g_ref), anchor, kind == BOUNDED)


def _scaled_operands(kind: str, er, ec, q_ref, k_ref, kp_ref, kr_ref, qp_ref):
    """Write one channel tile's WGMMA operands of a level; return the row operands of
    ``(Aqk, Akk)``.

    ``k E_col`` goes to ``kp_ref`` (both outputs' column operand) and ``q E_row`` to ``qp_ref``;
    ``k`` as Akk's row operand is ``kp_ref`` itself where both factors are ``E``, else ``k E_row``
    in ``kr_ref`` (bounded level). ``q_ref``, ``k_ref``: the tile's SMEM inputs.
    """
    kvals = load(k_ref).astype(F32)
    kp_ref[...] = (kvals * ec).astype(BF16)
    qp_ref[...] = (load(q_ref).astype(F32) * er).astype(BF16)
    if kind == BOUNDED:
        kr_ref[...] = (kvals * er).astype(BF16)
    return _row_operands(kind, kp_ref, kr_ref, qp_ref)


def _row_operands(kind: str, kp_ref, kr_ref, qp_ref):
    """The refs :func:`_scaled_operands` leaves the row operands of ``(Aqk, Akk)`` in."""
    return qp_ref, kr_ref if kind == BOUNDED else kp_ref


def _exact_levels_below_top(level, carry):
    """``carry = level(lg, carry, EXACT)`` for every level but the top (``lg`` traced)."""
    top = LOG_LEVELS[0]
    return lax.fori_loop(1, len(LOG_LEVELS), lambda i, c: level(top - i, c, EXACT), carry)


def _by_chunk_kind(bounded, level, carry, finish, split_g):
    """The top level (32-row blocks, exact either way), then ``finish`` on the result of the bounded
    level where the chunk is ``bounded`` (its :func:`bounded_chunks` flag, a traced bool), else of
    the exact levels below the top, after ``split_g`` has written ``G``'s bf16 parts for their
    anchors (``level(lg, carry, kind)``)."""
    carry = level(LOG_LEVELS[0], carry, TOP)

    def exact(carry):
        split_g()
        return _exact_levels_below_top(level, carry)

    finish(lax.cond(bounded, lambda c: level(BOUNDED_LG, c, BOUNDED), exact, carry))


# --------------------------------------------------------------------------- forward kernel

def chunks_per_cta(num_chunks: int, chains: int) -> int:
    """Chunks one CTA of the forward kernel takes in turn (consecutive ones of one sequence and
    head): the largest of 4, 2, 1 that divides ``num_chunks`` and still leaves a CTA for every SM
    with ``chains`` (batch, head) chains; below that, idle SMs would cost more than the hidden
    loads save (a short prefill: one chunk a CTA, as before)."""
    return next((n for n in (4, 2) if num_chunks % n == 0 and chains * num_chunks // n >= SMS), 1)


def _fwd_call(q, k, g, flags, masks, *, scale, interpret):
    """Raw forward kernel: ``(Aqk bf16, Akk fp32)`` ``[B, H, Tp, C]`` (see :func:`gated_scores`).

    q, k: ``[B, Tp, H, K]`` bf16 (the caller's layout); g: ``[B, H, Tp, K]`` fp32 (``G``); flags:
    :func:`bounded_chunks` of ``g``; masks: ``()`` or ``(seg, enter, leave)`` ``[B, Tp]``.

    Levels are the outer loop, channel tiles the inner one, one warpgroup: tiles outermost would
    halve the scaled operands' SMEM but run slower, and one warpgroup per output (``Aqk``, ``Akk``)
    would form the decays twice, which costs more than the second warpgroup hides
    (docs/benchmarks.md has the current times). The kernel's SMEM leaves room for one CTA per SM,
    so a CTA takes :func:`chunks_per_cta` chunks in turn, each chunk's ``q``, ``k`` and ``G``
    arriving by TMA in one of two slots while the chunk before it is computed: one CTA per chunk
    waited for each chunk's loads with nothing else to run on the SM."""
    nb, tp, h, dk = q.shape
    nh, chs = dk // KT, column_tiles(dk)
    per_cta = chunks_per_cta(tp // CHUNK, nb * h)
    heads_major = lambda d, dt: jax.ShapeDtypeStruct((nb, h, tp, d), dt)  # noqa: E731
    out_type = (heads_major(CHUNK, BF16), heads_major(CHUNK, F32))

    def body(q_ref, k_ref, g_ref, flags_ref, *refs):
        mask_refs, refs = refs[:len(masks)], refs[len(masks):]
        (aqk_ref, akk_ref), refs = refs[:2], refs[2:]
        q_in, k_in, g_in, bp_s, ap_s, arrived, p_s, *g_parts = refs
        bi, hi = lax.axis_index("b"), lax.axis_index("h")
        first = lax.axis_index("n") * per_cta
        rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)
        br_s = g_parts[-1]  # k times the row factor: the bounded path never splits G

        def fetch(i, slot):  # chunk first + i into slot, each channel tile to its own buffer
            tok = pl.ds((first + i) * CHUNK, CHUNK)
            for t, ch in enumerate(chs):
                for src, dst in ((q_ref.at[bi, tok, hi, ch], q_in),
                                 (k_ref.at[bi, tok, hi, ch], k_in),
                                 (g_ref.at[bi, hi, tok, ch], g_in)):
                    plgpu.copy_gmem_to_smem(src, dst.at[slot, t], arrived.at[slot])

        def prefetch(i, slot):  # into the slot the chunk before this one used
            plgpu.commit_smem()  # every thread is done reading that chunk
            fetch(i, slot)

        def chunk(i, _):
            slot = lax.rem(i, 2)
            pl.when(i + 1 < per_cta)(lambda: prefetch(i + 1, 1 - slot))
            plgpu.barrier_wait(arrived.at[slot])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's Aqk left P's tile
            q_s, k_s, g_s = q_in.at[slot], k_in.at[slot], g_in.at[slot]
            ni = first + i
            tok = pl.ds(ni * CHUNK, CHUNK)

            # Diagonal, exact in fp32.
            scores = []
            for x_s in (q_s, k_s):
                dot = sum(jnp.sum(load(x_s.at[t]).astype(F32) * load(k_s.at[t]).astype(F32),
                                  axis=1) for t in range(nh))
                scores.append(jnp.where(rows == cols, per_row(dot, (CHUNK, CHUNK)), 0.0))

            def split_g():
                for t in range(nh):
                    store_split(load(g_s.at[t]), [part.at[t] for part in g_parts])

            def level(lg, scores, kind):  # the pairs of one anchored level
                # Channel tiles as a loop in the kernel: unrolled, they made the module 1.5x
                # larger (and slower to compile) for no speed.
                def operands(t, _):
                    g_tile = g_s.at[t]
                    er, ec = _level_decays(kind, lg, g_tile, gates.plain_rows(g_tile), p_s,
                                           [part.at[t] for part in g_parts])
                    _scaled_operands(kind, er, ec, q_s.at[t], k_s.at[t], bp_s.at[t],
                                     br_s.at[t], ap_s.at[t])

                lax.fori_loop(0, nh, operands, None)
                plgpu.commit_smem()
                row_refs = _row_operands(kind, bp_s, br_s, ap_s)
                keep = _pairs(lg, kind == BOUNDED)
                return tuple(sc + jnp.where(keep, matmul((CHUNK, CHUNK),
                                                         *[(row_refs[o].at[t], bp_s.at[t].T)
                                                           for t in range(nh)]), 0.0)
                             for o, sc in enumerate(scores))

            def store(scores):
                same = gates.same_segment(mask_refs, bi, tok)
                for out, sc, factor in zip((aqk_ref, akk_ref), scores, (scale, 1.0)):
                    sc = sc * factor if factor != 1.0 else sc
                    # P's tile, free once the levels are done, stages the bf16 Aqk
                    store_result(sc if same is None else jnp.where(same, sc, 0.0),
                                 out.at[bi, hi, tok], p_s)

            _by_chunk_kind(flags_ref[bi, hi, ni] != 0, level, tuple(scores), store, split_g)

        fetch(0, 0)
        lax.fori_loop(0, per_cta, chunk, None)
        plgpu.wait_smem_to_gmem(0)

    scratch = (
        # q, k (swizzled), G (plain), per slot and channel tile
        tiles((2, nh, CHUNK, KT)), tiles((2, nh, CHUNK, KT)), plgpu.SMEM((2, nh, CHUNK, KT), F32),
        tiles((nh, CHUNK, KT)),  # k times the column factor, per channel tile
        tiles((nh, CHUNK, KT)),  # q times the row factor
        plgpu.Barrier(num_arrivals=3 * nh, num_barriers=2),
        tiles((CHUNK, CHUNK)), *(tiles((nh, CHUNK, KT)) for _ in range(SPLITS)),  # P_s, G's parts
    )
    run = kernel(body, "kda_scores_fwd", interpret, approx_math=True, out_type=out_type,
                 grid=(tp // CHUNK // per_cta, h, nb), grid_names=("n", "h", "b"),
                 scratch_types=scratch)
    return run(q, k, g, flags, *masks)


# --------------------------------------------------------------------------- backward kernel


def _bwd_call(q, k, g, daqk, dakk, d_products, d_gamma, flags, masks, *, scale, interpret):
    """Raw backward kernel: ``(dq, dk)`` ``[B, Tp, H, K]`` in q's and k's dtypes and ``dG``
    ``[B, H, Tp, K]`` fp32, from the cotangents of the six forward outputs (``d_products``: those of
    ``Qg, Kg, Xk``). Inputs as in :func:`_fwd_call`.

    One warpgroup per channel tile (two at K = 128): the tiles are independent given ``dS``, and the
    kernel is bound by the latency of its dependent WGMMA / exp steps, which a second warpgroup on
    the SM hides (with one warpgroup, its 160 KB of SMEM leaves room for one CTA per SM).
    """
    nb, tp, h, dk = q.shape
    no, nh = 2, dk // KT  # outputs (Aqk, Akk), channel tiles
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                jax.ShapeDtypeStruct(g.shape, F32))
    dss = (daqk, dakk)
    ds_scale = (scale, 1.0)  # Aqk carries the attention scale

    def body(q_ref, k_ref, g_ref, *refs):
        ds_refs, refs = refs[:no], refs[no:]
        dprod_refs, (dgam_ref, flags_ref), refs = refs[:3], refs[3:5], refs[5:]
        mask_refs, refs = refs[:len(masks)], refs[len(masks):]
        (dq_ref, dk_ref, dg_ref), refs = refs[:3], refs[3:]
        q_all, k_all, g_all, rows_all, *refs = refs
        ds_s, refs = refs[:no], refs[no:]
        bp_all, ap_all, refs = refs[0], refs[1], refs[2:]
        dsl_all, (p_all, *parts_all, bar, done, dprod_bar) = refs[:no], refs[no:]
        bi, hi, ni, wg = (lax.axis_index(n) for n in ("b", "h", "n", "wg"))
        tok = pl.ds(ni * CHUNK, CHUNK)

        @pl.when(wg == 0)
        def _():
            for t, ch in enumerate(column_tiles(dk)):  # each channel tile to its own buffer
                for src, dst in ((q_ref.at[bi, tok, hi, ch], q_all),
                                 (k_ref.at[bi, tok, hi, ch], k_all),
                                 (g_ref.at[bi, hi, tok, ch], g_all)):
                    plgpu.copy_gmem_to_smem(src, dst.at[t], bar)
                _copy_g_rows(g_ref, bi, hi, ni * CHUNK, ch, rows_all.at[t], bar)
            for src, dst in zip(ds_refs, ds_s):
                plgpu.copy_gmem_to_smem(src.at[bi, hi, tok], dst, bar)

        plgpu.barrier_wait(bar)
        # This warpgroup's channel tile and its own operand buffers.
        q_s, k_s, g_s = q_all.at[wg], k_all.at[wg], g_all.at[wg]
        g_row = _copied_rows(rows_all.at[wg])
        bp_s, ap_s, dsl_s = bp_all.at[wg], ap_all.at[wg], [x.at[wg] for x in dsl_all]
        p_s, g_parts = p_all.at[wg], [x.at[wg] for x in parts_all]
        br_s = g_parts[-1]  # k times the row factor: the bounded path never splits G
        zero = zeros((CHUNK, KT))
        same = gates.same_segment(mask_refs, bi, tok)

        def masked_ds(o, keep):
            ds = load(ds_s[o]).astype(F32)
            ds = ds * ds_scale[o] if ds_scale[o] != 1.0 else ds
            return jnp.where(keep if same is None else keep & same, ds, 0.0)

        def level(lg, carry, kind):  # (da per output: row side, db: column side)
            da, db = carry
            er, ec = _level_decays(kind, lg, g_s, g_row, p_s, g_parts)
            lhs_p = _scaled_operands(kind, er, ec, q_s, k_s, bp_s, br_s, ap_s)
            keep = _pairs(lg, kind == BOUNDED)
            for o in range(no):
                dsl_s[o][...] = masked_ds(o, keep).astype(BF16)
            plgpu.commit_smem()
            da = tuple(d + er * matmul((CHUNK, KT), (dsl_s[o], bp_s)) for o, d in enumerate(da))
            db = db + ec * matmul((CHUNK, KT), *[(dsl_s[o].T, lhs_p[o]) for o in range(no)])
            return da, db

        def finish(carry):
            (dq, dk_row), db = carry
            ch = pl.ds(wg * KT, KT)
            # The cotangents of Qg, Kg, Xk by TMA into G's parts (free once the levels are
            # done), arriving while the diagonal and the gates' factors are formed
            plgpu.commit_smem()
            for r, part in zip(dprod_refs, g_parts):
                plgpu.copy_gmem_to_smem(r.at[bi, hi, tok, ch], part, dprod_bar.at[wg])
            qv, kv = load(q_s).astype(F32), load(k_s).astype(F32)
            dg = qv * dq + kv * dk_row - kv * db
            # Diagonal (no decay): dS[r, r] k_r and dS[r, r] q_r (or k_r).
            diag = iota((CHUNK, CHUNK), 0) == iota((CHUNK, CHUNK), 1)
            w_qk, w_kk = (per_row(jnp.sum(masked_ds(o, diag), axis=1), (CHUNK, KT))
                          for o in range(no))
            dq = dq + w_qk * kv
            dk = db + dk_row + w_qk * qv + 2.0 * w_kk * kv
            factors = gates.gate_factors(load(g_s), g_row(CHUNK - 1), mask_refs, bi, ni)
            plgpu.barrier_wait(dprod_bar.at[wg])
            d_products = [load(part).astype(F32) for part in g_parts]
            dq, dk, dg = gates.gate_chain(dq, dk, dg, qv, kv, factors, d_products,
                                          load(dgam_ref.at[bi, hi, ni, ch], COL), scale,
                                          (p_s, bp_s, ap_s))  # free once the levels are done
            dq_ref.at[bi, tok, hi, ch][...] = dq.astype(dq_ref.dtype)
            dk_ref.at[bi, tok, hi, ch][...] = dk.astype(dk_ref.dtype)
            dg_ref.at[bi, hi, tok, ch][...] = dg
            finish_together(done)

        _by_chunk_kind(flags_ref[bi, hi, ni] != 0, level, ((zero,) * no, zero), finish,
                       lambda: store_split(load(g_s), g_parts))

    scratch = (
        # q, k, G and G's rows G_ROWS
        tiles((nh, CHUNK, KT)), tiles((nh, CHUNK, KT)), tiles((nh, CHUNK, KT), F32),
        plgpu.SMEM((nh, len(G_ROWS), KT), F32),
        *(tiles((CHUNK, CHUNK), d.dtype) for d in dss),  # dS (shared)
        tiles((nh, CHUNK, KT)),  # k times the column factor, one per warpgroup
        tiles((nh, CHUNK, KT)),  # q times the row factor
        *(tiles((nh, CHUNK, CHUNK)) for _ in range(no)),  # dS masked to one level
        # P_s, G's parts
        tiles((nh, CHUNK, CHUNK)), *(tiles((nh, CHUNK, KT)) for _ in range(SPLITS)),
        plgpu.Barrier(num_arrivals=(3 + len(G_ROWS)) * nh + no),
        plgpu.Barrier(num_arrivals=nh),
        plgpu.Barrier(num_arrivals=3, num_barriers=nh),  # the cotangents of Qg, Kg, Xk
    )
    run = kernel(body, "kda_scores_bwd", interpret, approx_math=True, out_type=out_type,
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"), num_threads=nh,
                 thread_name="wg", scratch_types=scratch)
    return run(q, k, g, *dss, *d_products, d_gamma, flags, *masks)


_fwd_jit = shared_lowering(_fwd_call, ("scale",))
_bwd_jit = shared_lowering(_bwd_call, ("scale",))


# --------------------------------------------------------------------------- differentiable op


class GatedScores(NamedTuple):
    """What the state kernels and the chunk inverse need, head-major (see :func:`gated_scores`)."""

    aqk: jax.Array  # [B, H, Tp, C] bf16
    akk: jax.Array  # [B, H, Tp, C] fp32
    qg: jax.Array  # [B, H, Tp, K] bf16
    kg: jax.Array  # [B, H, Tp, K] bf16
    xk: jax.Array  # [B, H, Tp, K] bf16
    gamma: jax.Array  # [B, H, NC, K] fp32


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gated(q, k, g, bias, masks, scale, lower_bound, interpret):
    return _gated_fwd(q, k, g, bias, masks, scale, lower_bound, interpret)[0]


def _gated_fwd(q, k, g, bias, masks, scale, lower_bound, interpret):
    g_cum, qg, kg, xk, gamma, flags = cumsum_and_gates(g, q, k, masks, scale=scale,
                                                       lower_bound=lower_bound, bias=bias,
                                                       interpret=interpret)
    aqk, akk = _fwd_jit(q, k, g_cum, flags, tuple(masks), scale=scale, interpret=interpret)
    logits = None if lower_bound is None else g  # the reverse cumsum's gate slope reads them
    return GatedScores(aqk, akk, qg, kg, xk, gamma), (q, k, g_cum, logits, bias, masks, flags)


def _gated_bwd(scale, lower_bound, interpret, res, cts):
    q, k, g_cum, logits, bias, masks, flags = res
    dq, dk, dg_cum = _bwd_jit(q, k, g_cum, cts.aqk, cts.akk, (cts.qg, cts.kg, cts.xk), cts.gamma,
                              flags, tuple(masks), scale=scale, interpret=interpret)
    if lower_bound is None:
        return dq, dk, reverse_cumsum(dg_cum, interpret=interpret), None, None
    dz, dbias = reverse_cumsum_through_gate(dg_cum, logits, bias, lower_bound=lower_bound,
                                            interpret=interpret)
    return dq, dk, dz, dbias, None


_gated.defvjp(_gated_fwd, _gated_bwd)


def _check(q, k, g, masks):
    shape = q.shape
    if len(shape) != 4 or shape[1] % CHUNK or shape[3] not in HEAD_DIMS:
        raise ValueError(f"gated_scores: q must be [B, Tp, H, K] with Tp a multiple of {CHUNK} "
                         "and K in "
                         f"{HEAD_DIMS}, got {shape}")
    for name, x in (("k", k), ("g", g)):
        if x.shape != shape:
            raise ValueError(f"gated_scores: {name} must have q's shape {shape}, got {x.shape}")
    for name, x in (("q", q), ("k", k)):
        if x.dtype != BF16:
            raise ValueError(f"gated_scores: {name} must be bfloat16 (the tensor cores' operands), "
                             f"got {x.dtype}")
    if g.dtype != F32:
        raise ValueError(f"gated_scores: g must be float32, got {g.dtype}")
    for name, x in zip(SegmentMasks._fields, masks or ()):
        if x.shape != shape[:2]:
            raise ValueError(f"gated_scores: masks.{name} must be [B, Tp] = {shape[:2]}, "
                             f"got {x.shape}")


def gated_scores(q, k, g, *, scale: float, masks: SegmentMasks | None = None,
                 lower_bound: float | None = None, bias=None,
                 interpret: bool = False) -> GatedScores:
    """KDA's intra-chunk scores and gated operands per chunk of 64 tokens (module docstring).

    Args:
      q, k: ``[B, Tp, H, K]`` bf16, the caller's layout (``Tp`` a multiple of 64, ``K`` in
        {64, 128}).
      g: ``[B, Tp, H, K]`` fp32 per-token log-decay (``<= 0``); the kernels take its chunk cumsum.
      scale: the attention scale (multiplies ``Aqk`` and ``Qg``).
      masks: packed documents (:class:`pallas_kernels.kda_gates.SegmentMasks`), or None.
      lower_bound: None, or K3's gate bound: then ``g`` holds the gate's logits ``z`` less their
        ``bias`` (``[H, K]`` fp32, given with it) and the log-decay is
        ``lower_bound * sigmoid(z + bias)``: the cumsum kernels apply it, and the gradients
        returned are those of ``z`` and ``bias``.
      interpret: run in the Mosaic GPU interpreter (CPU tests).

    Returns :class:`GatedScores`: ``aqk = scale S(q, k)`` (bf16) and ``akk = S(k, k)`` (fp32, with
    the diagonal ``|k_r|^2``), both zero across a segment start; ``qg = scale q exp(G) enter``,
    ``kg = k exp(G_last - G) leave``, ``xk = k exp(G) enter`` (bf16) and
    ``gamma = exp(G_last) enter_last`` (fp32 ``[B, H, NC, K]``). Differentiable in ``q, k, g``: the
    backward kernels (scores with the gates' chain rule, then the reverse cumsum) return ``dq, dk``
    in the inputs' dtypes and ``dg`` fp32, all in the caller's layout.
    """
    _check(q, k, g, masks)
    bound = None if lower_bound is None else float(lower_bound)
    bias = None if bias is None else bias.astype(F32)
    return _gated(q, k, g, bias, masks if masks is not None else (), float(scale), bound,
                  interpret)


# --------------------------------------------------------------------------- references


def scores_reference(a, b, g_cum):
    """``S[r, j] = sum_c a_rc b_jc exp(G_rc - G_jc)`` for ``r >= j`` per chunk of 64 rows, else 0;
    plain fp32, pairwise ``[.., C, C, K]`` decays (small inputs only). a, b, g_cum:
    ``[B, H, Tp, K]``."""
    nb, h, tp, dk = b.shape
    shp = (nb, h, tp // CHUNK, CHUNK, dk)
    a, b, g = (x.astype(F32).reshape(shp) for x in (a, b, g_cum))
    lower = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    # [.., r, j, K]
    diff = jnp.where(lower[:, :, None], g[..., :, None, :] - g[..., None, :, :], 0.0)
    s = jnp.sum(a[..., :, None, :] * b[..., None, :, :] * jnp.exp(diff), axis=-1)
    return jnp.where(lower, s, 0.0).reshape(nb, h, tp, CHUNK)


def gated_scores_reference(q, k, g, *, scale: float,
                           masks: SegmentMasks | None = None) -> GatedScores:
    """Plain fp32 :func:`gated_scores` (pairwise decays: small inputs only); q, k, g
    ``[B, Tp, H, K]``."""
    qh, kh = (jnp.swapaxes(x.astype(F32), 1, 2) for x in (q, k))
    g_cum = chunk_cumsum_reference(g)  # [B, H, Tp, K]
    same = same_segment_reference(masks, qh.shape)
    return GatedScores(scale * scores_reference(qh, kh, g_cum) * same,
                       scores_reference(kh, kh, g_cum) * same,
                       *gate_products(qh, kh, g_cum, scale, masks))


__all__ = ["GatedScores", "bounded_chunks", "gated_scores", "gated_scores_reference",
           "scores_reference"]
