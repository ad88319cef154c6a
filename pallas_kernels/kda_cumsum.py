"""Mosaic GPU kernels: KDA's chunk-local cumulative log-decay ``G_r = sum_{i <= r} g_i`` (§3.3),
with the gated operands, and its reverse.

Per chunk of 64 tokens (one batch, head, chunk; one CTA) the cumsum is a product with the
lower-triangular ones matrix on the tensor cores, ``g`` split into three bf16 parts whose sum is
``g`` exactly: every product is one part times one or zero, accumulated in fp32, so the result is
a sum of the same fp32 terms as a sequential cumsum, in another order. The forward kernel reads the
gates in the caller's ``[B, T, H, K]`` layout and writes ``G`` head-major, ``[B, H, T, K]``, the
layout of the other KDA kernels, and, while it holds ``G``, the gated operands ``Qg``, ``Kg``,
``Xk``, ``gamma`` (:mod:`pallas_kernels.kda_gates`). The reverse cumsum (the upper-triangular
product: the cumsum's VJP) goes from head-major back to the caller's layout. Both are raw kernels:
:func:`pallas_kernels.kda_scores.gated_scores` joins them under its VJP. (XLA's cumsum is an
associative scan on the GPU, and a triangular fp32 einsum needs transposes around an FFMA GEMM.)

Reference: ``jnp.cumsum`` over each chunk (:func:`chunk_cumsum_reference`).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import (
    BF16,
    CHUNK,
    F32,
    KT,
    SPLITS,
    column_tiles,
    iota,
    kernel,
    load,
    matmul,
    over_tiles,
    part_views,
    shared_lowering,
    store_split,
    tiles,
)
from pallas_kernels.kda_gates import bounded_channels, gate_factors, gated_operands


def _chunk_sums(x_s, tri_s, parts, dk, emit):
    """``emit(channel slice, Tri @ x on that tile)`` per channel tile, a loop in the kernel:
    ``x_s`` plain SMEM ``[C, dk]`` fp32, ``Tri`` in ``tri_s``, ``x`` split into the bf16 ``parts``
    (one ``[C, KT]`` tile each, reused by every channel tile)."""
    def tile(ch, _):
        store_split(load(x_s.at[:, ch]), parts)
        plgpu.commit_smem()
        emit(ch, matmul((CHUNK, KT), *[(tri_s, part) for part in parts]))

    over_tiles(dk, tile)


def _triangle(tri_s, upper: bool) -> None:
    rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)
    tri_s[...] = jnp.where(rows <= cols if upper else rows >= cols, 1.0, 0.0).astype(BF16)


def _start_load(x_view, scratch) -> None:
    """Start the TMA copy of this CTA's chunk of ``x`` (the GMEM view ``x_view``, ``[C, dk]``
    fp32) into SMEM; ``scratch``: :func:`_scratch`'s refs (then any the kernel adds)."""
    x_s, _, _, bar = scratch[:4]
    plgpu.copy_gmem_to_smem(x_view, x_s, bar)


def _triangular_sums(upper: bool, dk, scratch, emit) -> None:
    """Once :func:`_start_load`'s chunk has arrived, ``emit(channel slice, Tri @ x)`` per channel
    tile (:func:`_chunk_sums`)."""
    x_s, tri_s, parts_s, bar = scratch[:4]
    _triangle(tri_s, upper)
    plgpu.barrier_wait(bar)
    _chunk_sums(x_s, tri_s, part_views(parts_s), dk, emit)


def _this_chunk():
    """``(batch, head, chunk, the chunk's rows)`` of this CTA on the grid ``("n", "h", "b")``."""
    bi, hi, ni = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    return bi, hi, ni, pl.ds(ni * CHUNK, CHUNK)


def _scratch(dk):
    """The chunk (plain fp32), the triangle, ``x``'s bf16 parts and the chunk's barrier."""
    return (plgpu.SMEM((CHUNK, dk), F32), tiles((CHUNK, CHUNK)), tiles((SPLITS, CHUNK, KT)),
            plgpu.Barrier(num_arrivals=1))


def _reverse_call(dg_cum, *, interpret: bool):
    """``Tri^T @ dG`` per chunk (``Tri^T`` the upper ones matrix): ``[B, H, Tp, K]`` ->
    ``[B, Tp, H, K]``, fp32."""
    nb, h, tp, dk = dg_cum.shape

    def body(x_ref, o_ref, *scratch):
        bi, hi, _, tok = _this_chunk()

        def emit(ch, out):
            o_ref.at[bi, tok, hi, ch][...] = out

        _start_load(x_ref.at[bi, hi, tok], scratch)
        _triangular_sums(True, dk, scratch, emit)

    run = kernel(body, "kda_cumsum_bwd", interpret,
                 out_type=jax.ShapeDtypeStruct((nb, tp, h, dk), F32),
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"), scratch_types=_scratch(dk))
    return run(dg_cum)


def _cumsum_gates_call(g, q, k, masks, *, scale: float, interpret: bool):
    """The cumsum that also writes the gated operands (:mod:`pallas_kernels.kda_gates`) while it
    holds ``G``: ``(G [B, H, Tp, K] fp32, Qg, Kg, Xk [B, H, Tp, K] bf16, gamma [B, H, NC, K] fp32,
    bounded [B, H, NC, K] fp32)`` from ``g [B, Tp, H, K]`` fp32 and ``q, k [B, Tp, H, K]`` bf16;
    ``bounded`` is :func:`~pallas_kernels.kda_gates.bounded_channels` per chunk; ``masks``: ``()``
    or ``(seg, enter, leave)``.

    Every operand comes in and every product goes out by TMA: ``q`` and ``k`` arrive while the
    cumsum runs, and each product is written over the tile it was made from (``Xk`` over ``G``'s
    spent bf16 parts), so the kernel holds no staging buffers and two CTAs still share an SM.
    (With register loads and stores straight from and to GMEM, where a warpgroup waits out every
    load, this kernel moved under half of HBM's bandwidth.)"""
    nb, tp, h, dk = g.shape
    nh = dk // KT
    heads_major = lambda dt: jax.ShapeDtypeStruct((nb, h, tp, dk), dt)  # noqa: E731
    per_chunk = jax.ShapeDtypeStruct((nb, h, tp // CHUNK, dk), F32)
    out_type = (heads_major(F32), *(heads_major(BF16) for _ in range(3)), per_chunk, per_chunk)

    def body(g_ref, q_ref, k_ref, *refs):
        mask_refs, refs = refs[:len(masks)], refs[len(masks):]
        (gc_ref, qg_ref, kg_ref, xk_ref, gam_ref, ok_ref), refs = refs[:6], refs[6:]
        x_s, _, parts_s, _, qk_s, qk_bar = refs
        bi, hi, ni, tok = _this_chunk()
        _start_load(g_ref.at[bi, tok, hi], refs)
        for t, ch in enumerate(column_tiles(dk)):  # behind g: they are needed after the cumsum
            for i, src in enumerate((q_ref, k_ref)):
                plgpu.copy_gmem_to_smem(src.at[bi, tok, hi, ch], qk_s.at[i, t], qk_bar)

        def emit(ch, g_cum):
            x_s.at[:, ch][...] = g_cum  # g is spent: G takes its place

        _triangular_sums(False, dk, refs, emit)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_s, gc_ref.at[bi, hi, tok])
        plgpu.barrier_wait(qk_bar)

        def gate_tile(t, _):
            ch, q_s, k_s = pl.ds(t * KT, KT), qk_s.at[0, t], qk_s.at[1, t]
            g_tile = x_s.at[:, ch]
            g = load(g_tile)  # both the factors and the flags read it
            factors = gate_factors(g, g_tile, mask_refs, bi, ni)
            products = gated_operands(q_s, k_s, factors, scale)
            for dst, x in zip((q_s, k_s, parts_s.at[t]), products):
                dst[...] = x.astype(BF16)
            gam_ref.at[bi, hi, ni, ch][...] = factors[2]
            ok_ref.at[bi, hi, ni, ch][...] = bounded_channels(g, g_tile)

        lax.fori_loop(0, nh, gate_tile, None)
        plgpu.commit_smem()
        for t, ch in enumerate(column_tiles(dk)):
            for src, dst in ((qk_s.at[0, t], qg_ref), (qk_s.at[1, t], kg_ref),
                             (parts_s.at[t], xk_ref)):
                plgpu.copy_smem_to_gmem(src, dst.at[bi, hi, tok, ch])
        plgpu.wait_smem_to_gmem(0)

    assert nh <= SPLITS  # Xk's tiles reuse G's parts
    scratch = (*_scratch(dk), tiles((2, nh, CHUNK, KT)), plgpu.Barrier(num_arrivals=2 * nh))
    run = kernel(body, "kda_cumsum_gates", interpret, approx_math=True, out_type=out_type,
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(g, q, k, *masks)


_reverse_jit = shared_lowering(_reverse_call, ())
_cumsum_gates_jit = shared_lowering(_cumsum_gates_call, ("scale",))


def cumsum_and_gates(g, q, k, masks=(), *, scale: float, interpret: bool = False):
    """Raw forward of the cumsum with the gated operands (:func:`_cumsum_gates_call`; no VJP of its
    own: :func:`pallas_kernels.kda_scores.gated_scores` owns the chain rule):
    ``(G, Qg, Kg, Xk, gamma, flags)`` with ``flags [B, H, NC]`` int32, equal to
    :func:`~pallas_kernels.kda_gates.bounded_chunks` of ``G``."""
    *outs, ok = _cumsum_gates_jit(g, q, k, tuple(masks), scale=scale, interpret=interpret)
    return (*outs, jnp.min(ok, axis=-1).astype(jnp.int32))


def reverse_cumsum(dg_cum, *, interpret: bool = False):
    """The cumsum's VJP: ``[B, H, Tp, K]`` head-major -> ``[B, Tp, H, K]`` (fp32)."""
    return _reverse_jit(dg_cum.astype(F32), interpret=interpret)


def chunk_cumsum_reference(g):
    """``G`` of :func:`cumsum_and_gates` in plain fp32 (a sequential cumsum per chunk):
    ``[B, Tp, H, K]`` -> head-major ``[B, H, Tp, K]``."""
    nb, tp, h, dk = g.shape
    chunks = g.astype(F32).reshape(nb, tp // CHUNK, CHUNK, h, dk)
    g_cum = jnp.cumsum(chunks, axis=2).reshape(nb, tp, h, dk)
    return jnp.swapaxes(g_cum, 1, 2)


__all__ = ["chunk_cumsum_reference", "cumsum_and_gates", "reverse_cumsum"]
