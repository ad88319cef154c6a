"""Mosaic GPU kernel: KDA's chunk-local cumulative log-decay ``G_r = sum_{i <= r} g_i`` (SPEC 3.3).

Per chunk of 64 tokens (one batch, head, chunk; one CTA) the cumsum is a product with the
lower-triangular ones matrix on the tensor cores, ``g`` split into three bf16 parts whose sum is
``g`` exactly: every product is one part times one or zero, accumulated in fp32, so the result is
a sum of the same fp32 terms as a sequential cumsum, in another order. The kernel reads the gates
in the caller's ``[B, T, H, K]`` layout and writes ``G`` head-major, ``[B, H, T, K]``, the layout of
the other KDA kernels, so XLA transposes neither; the VJP (a reverse cumsum: the upper-triangular
product) goes from head-major back to the caller's layout. (XLA's cumsum is an associative scan on
the GPU, and a triangular fp32 einsum needs transposes around an FFMA GEMM.)

Reference: ``jnp.cumsum`` over each chunk (:func:`chunk_cumsum_reference`).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import (BF16, F32, KT, SPLITS, column_tiles, iota, kernel, load, matmul,
                                  shared_lowering, store_split, tiles)
from pallas_kernels.kda_gates import gate_factors, gated_operands

CHUNK = 64
HEAD_DIMS = (64, 128)


def _chunk_sums(x_s, tri_s, parts, dk):
    """``[(channel slice, Tri @ x on that tile)]``: ``x_s`` plain SMEM ``[C, dk]`` fp32, ``Tri`` in
    ``tri_s``, ``x`` split into the bf16 ``parts`` (one ``[nh, C, KT]`` tile set each)."""
    channels = column_tiles(dk)
    for t, ch in enumerate(channels):
        store_split(load(x_s.at[:, ch]), [part.at[t] for part in parts])
    plgpu.commit_smem()
    return [(ch, matmul((CHUNK, KT), *[(tri_s, part.at[t]) for part in parts])) for t, ch in enumerate(channels)]


def _triangle(tri_s, upper: bool) -> None:
    rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)
    tri_s[...] = jnp.where(rows <= cols if upper else rows >= cols, 1.0, 0.0).astype(BF16)


def _scratch(dk):
    return (plgpu.SMEM((CHUNK, dk), F32), tiles((CHUNK, CHUNK)),
            *(tiles((dk // KT, CHUNK, KT)) for _ in range(SPLITS)), plgpu.Barrier(num_arrivals=1))


def _triangular_call(x, *, upper: bool, interpret: bool):
    """``Tri @ x`` per chunk, ``Tri`` the lower (``upper=False``: cumsum; input ``[B, Tp, H, K]``,
    output ``[B, H, Tp, K]``) or upper (reverse cumsum; the other way round) ones matrix, fp32."""
    if upper:
        nb, h, tp, dk = x.shape
        out_shape = (nb, tp, h, dk)
    else:
        nb, tp, h, dk = x.shape
        out_shape = (nb, h, tp, dk)

    def body(x_ref, o_ref, x_s, tri_s, *rest):
        parts, bar = rest[:SPLITS], rest[SPLITS]
        bi, hi, ni = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        tok = pl.ds(ni * CHUNK, CHUNK)
        plgpu.copy_gmem_to_smem(x_ref.at[bi, hi, tok] if upper else x_ref.at[bi, tok, hi], x_s, bar)
        _triangle(tri_s, upper)
        plgpu.barrier_wait(bar)
        for ch, out in _chunk_sums(x_s, tri_s, parts, dk):
            (o_ref.at[bi, tok, hi, ch] if upper else o_ref.at[bi, hi, tok, ch])[...] = out

    run = kernel(body, "kda_cumsum_bwd" if upper else "kda_cumsum_fwd", interpret,
                 out_type=jax.ShapeDtypeStruct(out_shape, F32), grid=(tp // CHUNK, h, nb),
                 grid_names=("n", "h", "b"), scratch_types=_scratch(dk))
    return run(x)


def _cumsum_gates_call(g, q, k, masks, *, scale: float, interpret: bool):
    """The cumsum that also writes the gated operands (:mod:`pallas_kernels.kda_gates`) while it holds
    ``G``: ``(G [B, H, Tp, K] fp32, Qg, Kg, Xk [B, H, Tp, K] bf16, gamma [B, H, NC, K] fp32)`` from
    ``g [B, Tp, H, K]`` fp32 and ``q, k [B, Tp, H, K]`` bf16 (read GMEM -> registers, once each, so the
    kernel's SMEM stays that of the plain cumsum); ``masks``: ``()`` or ``(seg, enter, leave)``."""
    nb, tp, h, dk = g.shape
    heads_major = lambda dt: jax.ShapeDtypeStruct((nb, h, tp, dk), dt)  # noqa: E731
    out_type = (heads_major(F32), *(heads_major(BF16) for _ in range(3)),
                jax.ShapeDtypeStruct((nb, h, tp // CHUNK, dk), F32))

    def body(g_ref, q_ref, k_ref, *refs):
        mask_refs, refs = refs[:len(masks)], refs[len(masks):]
        (gc_ref, *product_refs, gam_ref), (x_s, tri_s, *rest) = refs[:5], refs[5:]
        parts, bar = rest[:SPLITS], rest[SPLITS]
        bi, hi, ni = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        tok = pl.ds(ni * CHUNK, CHUNK)
        plgpu.copy_gmem_to_smem(g_ref.at[bi, tok, hi], x_s, bar)
        _triangle(tri_s, upper=False)
        plgpu.barrier_wait(bar)
        for ch, g_cum in _chunk_sums(x_s, tri_s, parts, dk):
            gc_ref.at[bi, hi, tok, ch][...] = g_cum
            x_s.at[:, ch][...] = g_cum  # g is spent: G's last row is read back from here
        plgpu.commit_smem()
        for ch in column_tiles(dk):
            factors = gate_factors(x_s.at[:, ch], mask_refs, bi, ni)
            products = gated_operands(q_ref.at[bi, tok, hi, ch], k_ref.at[bi, tok, hi, ch], factors, scale)
            for ref, x in zip(product_refs, products):
                ref.at[bi, hi, tok, ch][...] = x.astype(BF16)
            gam_ref.at[bi, hi, ni, ch][...] = factors[2]

    run = kernel(body, "kda_cumsum_gates", interpret, approx_math=True, out_type=out_type,
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"), scratch_types=_scratch(dk))
    return run(g, q, k, *masks)


_triangular_jit = shared_lowering(_triangular_call, ("upper",))
_cumsum_gates_jit = shared_lowering(_cumsum_gates_call, ("scale",))


def cumsum_and_gates(g, q, k, masks=(), *, scale: float, interpret: bool = False):
    """Raw forward of the cumsum with the gated operands (:func:`_cumsum_gates_call`; no VJP of its
    own: :func:`pallas_kernels.kda_scores.gated_scores` owns the chain rule)."""
    return _cumsum_gates_jit(g, q, k, tuple(masks), scale=scale, interpret=interpret)


def reverse_cumsum(dg_cum, *, interpret: bool = False):
    """The cumsum's VJP: ``[B, H, Tp, K]`` head-major -> ``[B, Tp, H, K]`` (fp32)."""
    return _triangular_jit(dg_cum.astype(F32), upper=True, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cumsum(g, interpret):
    return _triangular_jit(g, upper=False, interpret=interpret)


def _cumsum_fwd(g, interpret):
    return _cumsum(g, interpret), None


def _cumsum_bwd(interpret, _, dg_cum):
    return (reverse_cumsum(dg_cum, interpret=interpret),)


_cumsum.defvjp(_cumsum_fwd, _cumsum_bwd)


def chunk_cumsum(g, *, interpret: bool = False):
    """Chunk-local cumsum of the log-decay, head-major: ``g [B, Tp, H, K]`` fp32 -> ``[B, H, Tp, K]``.

    ``Tp`` a multiple of 64 (pad first: :func:`pallas_kernels.kda_prep.pad_time`), ``K`` in
    {64, 128}. Differentiable (the VJP is the reverse cumsum, also a Mosaic GPU kernel);
    ``interpret`` runs the kernels in the Mosaic GPU interpreter (CPU tests).
    """
    if g.ndim != 4 or g.shape[1] % CHUNK or g.shape[3] not in HEAD_DIMS:
        raise ValueError(f"chunk_cumsum: g must be [B, Tp, H, K] with Tp a multiple of {CHUNK} and K in "
                         f"{HEAD_DIMS}, got {g.shape}")
    if g.dtype != F32:
        raise ValueError(f"chunk_cumsum: g must be float32, got {g.dtype}")
    return _cumsum(g, interpret)


def chunk_cumsum_reference(g):
    """Plain fp32 reference of :func:`chunk_cumsum` (a sequential cumsum per chunk)."""
    nb, tp, h, dk = g.shape
    chunks = g.astype(F32).reshape(nb, tp // CHUNK, CHUNK, h, dk)
    g_cum = jnp.cumsum(chunks, axis=2).reshape(nb, tp, h, dk)
    return jnp.swapaxes(g_cum, 1, 2)


__all__ = ["chunk_cumsum", "chunk_cumsum_reference", "cumsum_and_gates", "reverse_cumsum", "CHUNK", "HEAD_DIMS"]
