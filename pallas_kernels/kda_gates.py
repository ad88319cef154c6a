"""KDA's gates per chunk of 64 tokens (math §3.3): the decay factors, the gated operands and their
chain rule, as helpers for the Mosaic GPU kernels, with their plain fp32 reference.

From the chunk-local cumulative log-decay ``G`` (``G_last`` its last row) and the packed-document
masks (:class:`SegmentMasks`): ``into = exp(G) enter``, ``to_end = exp(G_last - G) leave`` and
``gamma = exp(G_last) enter_last``, each at most 1 (every gate is ``<= 0``), give the operands of
the chunked form ``Qg = scale q into``, ``Kg = k to_end``, ``Xk = k into`` (``beta Xk`` is the
``X`` of the chunk inverse) and the state's decay ``gamma``. ``enter[r]``: the state entering the
chunk reaches row ``r`` (no segment starts in the chunk at or before it); ``leave[j]``: row ``j``'s
key reaches the state leaving the chunk (no segment starts after it in the chunk).

The forward products are written by the cumsum kernel (:mod:`pallas_kernels.kda_cumsum`), which
holds ``G`` as it makes it; their chain rule runs in the scores backward kernel
(:mod:`pallas_kernels.kda_scores`), which holds ``q``, ``k`` and ``G`` and writes ``dq``, ``dk``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels._mgpu import (
    BF16,
    CHUNK,
    COL,
    F32,
    KT,
    ROW,
    iota,
    load,
    matmul,
    per_col,
    per_row,
    store_split,
)

BOUNDED_LG = 4  # the scores' fast path factors 32-row blocks (2^(lg + 1)) through their row 16
BOUND = 80.0  # nats of decay a bounded level's factor may span (exp(80) ~ 5.5e34 < bf16 / fp32 max)


class SegmentMasks(NamedTuple):
    """Packed documents, per token ``[B, Tp]`` (shared by the heads; see ``kda_prep``): ``seg``
    int32 (a segment counter: equal within a segment), ``enter`` / ``leave`` fp32 0/1 (the state
    entering the chunk reaches the row / the row's key reaches the state leaving the chunk)."""

    seg: jax.Array
    enter: jax.Array
    leave: jax.Array


# --------------------------------------------------------------------------- in-kernel helpers


def same_segment(masks, bi, tok):
    """``[C, C]`` bool: rows ``r`` and ``j`` of the chunk are in one segment, or None without
    masks."""
    if not masks:
        return None
    seg_ref = masks[0]
    return (per_row(load(seg_ref.at[bi, tok], ROW), (CHUNK, CHUNK))
            == per_col(load(seg_ref.at[bi, tok], COL), (CHUNK, CHUNK)))


def plain_rows(g_tile):
    """``g_row`` of :func:`anchor_rows` for a plain SMEM tile of ``G`` (``[C, KT]``)."""
    return lambda r: g_tile.at[r]


def anchor_row_indices(lg: int) -> tuple[int, ...]:
    """The rows of ``G`` that :func:`anchor_rows` broadcasts: the middle row of each block of
    ``2^(lg + 1)`` rows."""
    span = 2 << lg
    return tuple(range(span // 2, CHUNK, span))


def anchor_rows(lg: int, g_row):
    """``[C, KT]`` fp32: row ``x`` holds ``G`` at the middle row of ``x``'s block of ``2^(lg + 1)``
    rows, a broadcast of one row of ``G`` (no tensor-core work); ``g_row(r)``: a plain SMEM ref of
    ``G``'s row ``r`` (``[KT]``; Mosaic reads a lone row only from untiled SMEM)."""
    half = 1 << lg
    rows = iota((CHUNK, KT), 0)
    anchor = None
    for middle in anchor_row_indices(lg):
        row = per_col(load(g_row(middle), COL), (CHUNK, KT))
        anchor = row if anchor is None else jnp.where(rows >= middle - half, row, anchor)
    return anchor


def bounded_channels(g, g_tile):
    """``[KT]`` COL fp32: 1 for a channel of ``G`` (``g``: the plain SMEM tile ``g_tile``,
    ``[C, KT]``, loaded) whose every row lies within :data:`BOUND` nats of its 32-row block's row
    16, else 0 (also for a NaN): a chunk whose channels are all 1 takes the scores' bounded path
    (:func:`bounded_chunks`)."""
    spread = jnp.abs(g - anchor_rows(BOUNDED_LG, plain_rows(g_tile)))
    # The min over rows spans the warpgroup's four warps, which Mosaic reduces through one SMEM
    # scratch per kernel: only a kernel of one warpgroup may call this (see _last_row_sums).
    return jnp.min(jnp.where(spread <= BOUND, 1.0, 0.0), axis=0)


def gate_factors(g, last_row, masks, bi, ni):
    """One channel tile's decay factors (module docstring, "Gates"):
    ``(into [C, KT], to_end [C, KT], gamma [KT] COL)`` =
    ``(exp(G) enter, exp(G_last - G) leave, exp(G_last) enter_last)``.

    g: the tile of ``G`` (``[C, KT]`` fp32); ``last_row``: a plain SMEM ref of its last row
    (``[KT]``); ``masks``: ``()`` or the refs ``(seg, enter, leave)``.
    """
    last = load(last_row, COL)
    into, to_end, gamma = jnp.exp(g), jnp.exp(per_col(last, (CHUNK, KT)) - g), jnp.exp(last)
    if masks:
        _, enter_ref, leave_ref = masks
        tok = pl.ds(ni * CHUNK, CHUNK)
        into = into * per_row(load(enter_ref.at[bi, tok], ROW), (CHUNK, KT))
        to_end = to_end * per_row(load(leave_ref.at[bi, tok], ROW), (CHUNK, KT))
        gamma = gamma * enter_ref[bi, ni * CHUNK + CHUNK - 1]
    return into, to_end, gamma


def gated_operands(q_tile, k_tile, factors, scale: float):
    """``(Qg, Kg, Xk)`` of one channel tile, fp32 ``[C, KT]``: ``scale q into``, ``k to_end``,
    ``k into``."""
    into, to_end, _ = factors
    kv = load(k_tile).astype(F32)
    return scale * load(q_tile).astype(F32) * into, kv * to_end, kv * into


def _last_row_sums(x, sel_s, parts):
    """``[C, KT]`` fp32: the column sums of ``x`` (fp32 ``[C, KT]``) in the chunk's last row, zeros
    elsewhere, as ``Sel x`` on the tensor cores (``Sel``: ones in its last row; ``x`` in two bf16
    parts, ~16 bits). A sum over rows spans the warpgroup's four warps: Mosaic lowers ``jnp.sum``
    over axis 0 through one SMEM scratch per kernel, which two warpgroups would share: a race that
    corrupts ``dG`` at K = 128."""
    sel_s[...] = jnp.where(iota((CHUNK, CHUNK), 0) == CHUNK - 1, 1.0, 0.0).astype(BF16)
    store_split(x, parts)
    plgpu.commit_smem()
    return matmul((CHUNK, KT), *[(sel_s, part) for part in parts])


def gate_chain(dq, dk, dg, qv, kv, factors, d_products, d_gamma, scale: float, scratch):
    """Add the cotangents of ``(Qg, Kg, Xk)`` (fp32 ``[C, KT]``) and of ``gamma`` (``[KT]`` COL) to
    ``dq, dk, dG``: ``d into / dG = into``, ``d to_end / dG = -to_end`` on its row and ``+to_end``
    at ``G_last`` (the chunk's last row), ``d gamma / dG_last = gamma``. ``qv``, ``kv``: the tile's
    q and k (fp32 values); ``scratch``: a bf16 ``[C, C]`` tile and two ``[C, KT]`` tiles (see
    :func:`_last_row_sums`)."""
    into, to_end, gamma = factors
    dqg, dkg, dxk = d_products
    t = scale * into * dqg
    dq, dg = dq + t, dg + qv * t
    t = into * dxk
    dk, dg = dk + t, dg + kv * t
    t = to_end * dkg
    kt = kv * t
    dk, dg = dk + t, dg - kt
    last_row = iota((CHUNK, KT), 0) == CHUNK - 1
    dg = dg + _last_row_sums(kt, scratch[0], scratch[1:])
    return dq, dk, jnp.where(last_row, dg + per_col(gamma * d_gamma, (CHUNK, KT)), dg)


# --------------------------------------------------------------------------- reference


def gate_products(q, k, g_cum, scale: float, masks: SegmentMasks | None):
    """Plain fp32 ``(Qg, Kg, Xk [B, H, Tp, K], gamma [B, H, NC, K])`` (see :func:`gated_scores`);
    q, k head-major ``[B, H, Tp, K]``."""
    nb, h, tp, dk = q.shape
    shp = (nb, h, tp // CHUNK, CHUNK, dk)
    q, k, g = (x.astype(F32).reshape(shp) for x in (q, k, g_cum))
    last = g[..., -1:, :]
    into, to_end, gamma = jnp.exp(g), jnp.exp(last - g), jnp.exp(last[..., 0, :])
    if masks is not None:
        chunked = lambda x: x.astype(F32).reshape(nb, 1, tp // CHUNK, CHUNK, 1)  # noqa: E731
        into, to_end = into * chunked(masks.enter), to_end * chunked(masks.leave)
        gamma = gamma * chunked(masks.enter)[..., -1, :]
    flat = lambda x: x.reshape(nb, h, tp, dk)  # noqa: E731
    return flat(scale * q * into), flat(k * to_end), flat(k * into), gamma


def bounded_chunks(g_cum):
    """``[B, H, NC]`` int32: 1 where every row of each 32-row block of the chunk lies within
    :data:`BOUND` nats (every channel) of the block's row 16, the chunks the scores' fast path may
    take (the cumsum kernel's flags, in plain JAX).

    g_cum: ``[B, H, Tp, K]`` chunk-local cumulative log-decay. A NaN fails the test (exact path).
    """
    nb, h, tp, dk = g_cum.shape
    g = g_cum.astype(F32).reshape(nb, h, tp // CHUNK, CHUNK // 32, 32, dk)
    mid = g[..., 16:17, :]
    span = jnp.max(jnp.abs(g - mid), axis=(-3, -2, -1))
    return (span <= BOUND).astype(jnp.int32)


def same_segment_reference(masks: SegmentMasks | None, shape):
    """``[B, 1, Tp, C]`` fp32 0/1: rows ``r`` and ``j`` of a chunk in one segment (ones without
    masks)."""
    nb, _, tp, _ = shape
    if masks is None:
        return jnp.ones((nb, 1, tp, CHUNK), F32)
    seg = masks.seg.reshape(nb, tp // CHUNK, CHUNK)
    return (seg[..., :, None] == seg[..., None, :]).astype(F32).reshape(nb, 1, tp, CHUNK)


__all__ = ["BOUND", "BOUNDED_LG", "SegmentMasks", "anchor_row_indices", "anchor_rows",
           "bounded_channels", "plain_rows",
           "bounded_chunks", "gate_factors", "gated_operands", "gate_chain", "same_segment",
           "gate_products", "same_segment_reference"]
