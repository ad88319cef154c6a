"""Mosaic GPU kernels: KDA's chunk-local cumulative log-decay ``G_r = sum_{i <= r} g_i`` (§3.3),
with the gated operands, and its reverse.

Per chunk of 64 tokens (one batch, head, chunk; one CTA) the cumsum runs in SMEM, one thread a
column, token after token in fp32: bit for bit a sequential cumsum. (The tensor-core form, a
product with the triangular ones matrix of ``g`` split into three exact bf16 parts, took two
rounds of splits, stores, fences and WGMMAs a chunk for what is 64 dependent adds a thread.)
The forward kernel reads the gates in the caller's ``[B, T, H, K]`` layout and writes ``G``
head-major, ``[B, H, T, K]``, the layout of the other KDA kernels, and, while it holds ``G``, the
gated operands ``Qg``, ``Kg``, ``Xk``, ``gamma`` (:mod:`pallas_kernels.kda_gates`). The reverse
cumsum (the sums up each chunk: the cumsum's VJP) goes from head-major back to the caller's
layout. Both are raw kernels:
:func:`pallas_kernels.kda_scores.gated_scores` joins them under its VJP. (XLA's cumsum is an
associative scan on the GPU, and a triangular fp32 einsum needs transposes around an FFMA GEMM.)

With a ``lower_bound`` the kernels also apply K3's gate (math §3.1 step 4): the forward reads the
gate's logits ``z`` and sums ``g = lower_bound * sigmoid(z)`` as it loads them, and the reverse
multiplies its sums by ``dg/dz`` on their way out (it reads ``z`` beside the cotangent), so the
fp32 log-decay and its gradient never travel through memory on their own (an XLA fusion wrote
``g`` from ``z`` and another ``dz`` from ``dg``: a read and a write of a ``[B, T, H, K]`` fp32
array each, per layer and direction).

Reference: ``jnp.cumsum`` over each chunk (:func:`chunk_cumsum_reference`).
"""

from __future__ import annotations

from typing import NamedTuple

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
    WARPGROUP,
    column_tiles,
    kernel,
    load,
    optional_refs,
    shared_lowering,
    tiles,
)
from pallas_kernels.kda_gates import bounded_channels, gate_factors, gated_operands


def _lanes(dk: int) -> int:
    """Rows of the chunk a running-sum step loads: one a thread of the warpgroup (1 or 2)."""
    return WARPGROUP // dk


def _chunk_rows(dk: int, reverse: bool):
    """The rows of :func:`_scratch`'s chunk buffer that hold the chunk (the padding row, at
    ``K = 64``, sits before them, or after them for the reverse sums)."""
    return pl.ds(0 if reverse else _lanes(dk) - 1, CHUNK)


def _sigmoid(z):
    return 1.0 / (1.0 + jnp.exp(-z))  # 0 at z = -inf, the padding's logits


class _Gate(NamedTuple):
    """K3's gate inside the running sums: ``lower_bound * sigmoid(z + bias)`` of the logits ``z``
    (math §3.1 step 4; reference :func:`k3jax.ops.kda_gate.bounded_gate`), ``bias`` this head's
    ``[lanes, K]`` registers (:func:`_bias_rows`)."""

    bias: jax.Array
    lower_bound: float

    def __call__(self, z):
        return self.lower_bound * _sigmoid(z + self.bias)

    def slope(self, z):
        s = _sigmoid(z + self.bias)
        return self.lower_bound * s * (1.0 - s)


def _running_sums(x_s, reverse: bool, gate: _Gate | None = None, logits_s=None):
    """In place, each column of the chunk in ``x_s`` (:func:`_scratch`'s buffer, fp32) summed down
    its rows (up them with ``reverse``), in fp32, token after token. With a ``gate`` the values
    are the gate's logits, gated as they are loaded (the forward); with ``logits_s`` too (a
    buffer like ``x_s`` holding the logits) each sum is stored times the gate's slope at its row
    instead (the reverse: ``dz``), and the column sums of what was stored are returned
    (``[lanes, K]``; at ``K = 64`` the first lane's sum the chunk's), else None.

    One thread a column: a step loads ``128 // K`` consecutive rows at once, one value a thread.
    At ``K = 64`` the second row's threads run the same sums one row ahead, so each value is
    written twice, bit for bit the same (``0 + x = x``), and the first step reads the padding
    row, taken as zero. Every row is read before any is written, so the loads run back to back,
    then the chain of adds; at ``K = 64`` a barrier between them, as the lagging threads read rows
    the leading ones write (at ``K = 128`` each thread reads and writes its own column only)."""
    lanes = _lanes(x_s.shape[-1])
    steps = list(reversed(range(CHUNK)) if reverse else range(CHUNK))
    views = [x_s.at[pl.ds(i, lanes)] for i in steps]
    values = [view[...] for view in views]
    scales = [None] * len(views)
    if logits_s is not None:
        scales = [gate.slope(logits_s.at[pl.ds(i, lanes)][...]) for i in steps]
    elif gate is not None:
        values = [gate(value) for value in values]
    if lanes > 1:
        lane = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, values[0].shape, 0),
                                 plgpu.Layout.WG_STRIDED(values[0].shape, 1))
        values[0] = jnp.where(lane == (lanes - 1 if reverse else 0), 0.0, values[0])
        plgpu.commit_smem()
    acc = total = None
    for view, value, scale in zip(views, values, scales):
        acc = value if acc is None else acc + value
        out = acc if scale is None else acc * scale
        view[...] = out
        if scale is not None:
            total = out if total is None else total + out
    return total


def _bias_rows(bias, dk: int):
    """The gate's bias ``[H, K]`` as ``[H, lanes, K]`` fp32: a head's rows as the running sums
    load them, one copy a lane."""
    return jnp.broadcast_to(bias.astype(F32)[:, None, :], (bias.shape[0], _lanes(dk), dk))


def _this_chunk():
    """``(batch, head, chunk, the chunk's rows)`` of this CTA on the grid ``("n", "h", "b")``."""
    bi, hi, ni = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    return bi, hi, ni, pl.ds(ni * CHUNK, CHUNK)


def _scratch(dk):
    """The chunk (plain fp32, :func:`_running_sums`' padding row included) and its barrier."""
    return plgpu.SMEM((CHUNK + _lanes(dk) - 1, dk), F32), plgpu.Barrier(num_arrivals=1)


def _gate_scratch(dk: int, lower_bound: float | None) -> tuple:
    """SMEM for the gate's bias rows (:func:`_bias_rows`), none without a ``lower_bound``."""
    return () if lower_bound is None else (plgpu.SMEM((_lanes(dk), dk), F32),)


def _load_gate(bias_refs, bias_s, hi, lower_bound, bar):
    """Start the copy of head ``hi``'s bias rows into ``bias_s`` on ``bar``; returns the function
    that, once ``bar`` has been waited on, gives the :class:`_Gate` (or None without one)."""
    for src, dst in zip(bias_refs, bias_s):
        plgpu.copy_gmem_to_smem(src.at[hi], dst, bar)

    def gate():
        if not bias_s:
            return None
        rows = bias_s[0]
        return _Gate(load(rows, plgpu.Layout.WG_STRIDED(rows.shape, 1)), lower_bound)
    return gate


def _reverse_call(dg_cum, *gate_inputs, lower_bound: float | None, interpret: bool):
    """The sums of ``dG`` up each chunk: ``[B, H, Tp, K]`` -> ``[B, Tp, H, K]``, fp32. With
    ``lower_bound``, ``gate_inputs = (logits [B, Tp, H, K], bias rows [H, lanes, K])`` fp32 and
    the sums leave times the gate's slope (``dz``), with their sums over each chunk's rows
    ``[B, H, NC, lanes, K]`` (the bias's gradient, lane 0's)."""
    nb, h, tp, dk = dg_cum.shape
    rows, lanes = _chunk_rows(dk, reverse=True), _lanes(dk)
    gated = lower_bound is not None

    def body(x_ref, *refs):
        z_ref, refs = optional_refs(refs, gated)
        bias_ref, refs = optional_refs(refs, gated)
        o_ref, refs = refs[0], refs[1:]
        part_ref, (x_s, bar, *gate_s) = optional_refs(refs, gated)
        z_s, bias_s, part_s = gate_s[:1], gate_s[1:2], gate_s[2:]
        bi, hi, ni, tok = _this_chunk()
        chunk = x_s.at[rows]
        plgpu.copy_gmem_to_smem(x_ref.at[bi, hi, tok], chunk, bar)
        for src, dst in zip(z_ref, z_s):
            plgpu.copy_gmem_to_smem(src.at[bi, tok, hi], dst.at[rows], bar)
        gate = _load_gate(bias_ref, bias_s, hi, lower_bound, bar)
        plgpu.barrier_wait(bar)
        total = _running_sums(x_s, reverse=True, gate=gate(), logits_s=z_s[0] if gated else None)
        for dst in part_s:
            dst[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(chunk, o_ref.at[bi, tok, hi])
        for src, dst in zip(part_s, part_ref):
            plgpu.copy_smem_to_gmem(src, dst.at[bi, hi, ni])
        plgpu.wait_smem_to_gmem(0)

    chunk_s, _ = _scratch(dk)
    out_type = jax.ShapeDtypeStruct((nb, tp, h, dk), F32)
    if gated:
        out_type = (out_type, jax.ShapeDtypeStruct((nb, h, tp // CHUNK, lanes, dk), F32))
    scratch = (chunk_s, plgpu.Barrier(num_arrivals=1 + len(gate_inputs)),
               *((chunk_s, *_gate_scratch(dk, lower_bound), plgpu.SMEM((lanes, dk), F32))
                 if gated else ()))
    run = kernel(body, "kda_cumsum_bwd", interpret, approx_math=True, out_type=out_type,
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(dg_cum, *gate_inputs)


def _cumsum_gates_call(g, q, k, masks, bias, *, scale: float, lower_bound: float | None,
                       interpret: bool):
    """The cumsum that also writes the gated operands (:mod:`pallas_kernels.kda_gates`) while it
    holds ``G``: ``(G [B, H, Tp, K] fp32, Qg, Kg, Xk [B, H, Tp, K] bf16, gamma [B, H, NC, K] fp32,
    bounded [B, H, NC, K] fp32)`` from ``g [B, Tp, H, K]`` fp32 (with a ``lower_bound``, the
    gate's logits less their bias, ``bias = (bias rows [H, lanes, K],)``, else ``()``) and
    ``q, k [B, Tp, H, K]`` bf16; ``bounded`` is :func:`~pallas_kernels.kda_gates.bounded_channels`
    per chunk; ``masks``: ``()`` or ``(seg, enter, leave)``.

    Every operand comes in and every product goes out by TMA: ``q`` and ``k`` arrive while the
    cumsum runs, and ``Qg``, ``Kg`` are written over the tiles they were made from (80 KB of SMEM
    at ``K = 128``: two CTAs share an SM).
    (With register loads and stores straight from and to GMEM, where a warpgroup waits out every
    load, this kernel moved under half of HBM's bandwidth.)"""
    nb, tp, h, dk = g.shape
    nh = dk // KT
    heads_major = lambda dt: jax.ShapeDtypeStruct((nb, h, tp, dk), dt)  # noqa: E731
    per_chunk = jax.ShapeDtypeStruct((nb, h, tp // CHUNK, dk), F32)
    out_type = (heads_major(F32), *(heads_major(BF16) for _ in range(3)), per_chunk, per_chunk)

    def body(g_ref, q_ref, k_ref, *refs):
        mask_refs, refs = refs[:len(masks)], refs[len(masks):]
        bias_ref, refs = refs[:len(bias)], refs[len(bias):]
        (gc_ref, qg_ref, kg_ref, xk_ref, gam_ref, ok_ref), refs = refs[:6], refs[6:]
        x_s, bar, qkx_s, qk_bar, *bias_s = refs
        bi, hi, ni, tok = _this_chunk()
        chunk = x_s.at[_chunk_rows(dk, reverse=False)]
        plgpu.copy_gmem_to_smem(g_ref.at[bi, tok, hi], chunk, bar)
        gate = _load_gate(bias_ref, bias_s, hi, lower_bound, bar)
        for t, ch in enumerate(column_tiles(dk)):  # behind g: they are needed after the cumsum
            for i, src in enumerate((q_ref, k_ref)):
                plgpu.copy_gmem_to_smem(src.at[bi, tok, hi, ch], qkx_s.at[i, t], qk_bar)
        plgpu.barrier_wait(bar)
        _running_sums(x_s, reverse=False, gate=gate())  # g is spent: G takes its place
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(chunk, gc_ref.at[bi, hi, tok])
        plgpu.barrier_wait(qk_bar)

        def gate_tile(t, _):
            ch, q_s, k_s = pl.ds(t * KT, KT), qkx_s.at[0, t], qkx_s.at[1, t]
            g_tile = chunk.at[:, ch]
            g = load(g_tile)  # both the factors and the flags read it
            factors = gate_factors(g, g_tile.at[CHUNK - 1], mask_refs, bi, ni)
            products = gated_operands(q_s, k_s, factors, scale)
            for dst, x in zip((q_s, k_s, qkx_s.at[2, t]), products):
                dst[...] = x.astype(BF16)
            gam_ref.at[bi, hi, ni, ch][...] = factors[2]
            ok_ref.at[bi, hi, ni, ch][...] = bounded_channels(g, g_tile)

        lax.fori_loop(0, nh, gate_tile, None)
        plgpu.commit_smem()
        for t, ch in enumerate(column_tiles(dk)):
            for i, dst in enumerate((qg_ref, kg_ref, xk_ref)):
                plgpu.copy_smem_to_gmem(qkx_s.at[i, t], dst.at[bi, hi, tok, ch])
        plgpu.wait_smem_to_gmem(0)

    chunk_s, _ = _scratch(dk)
    scratch = (chunk_s, plgpu.Barrier(num_arrivals=1 + len(bias)), tiles((3, nh, CHUNK, KT)),
               plgpu.Barrier(num_arrivals=2 * nh), *_gate_scratch(dk, lower_bound))
    run = kernel(body, "kda_cumsum_gates", interpret, approx_math=True, out_type=out_type,
                 grid=(tp // CHUNK, h, nb), grid_names=("n", "h", "b"), scratch_types=scratch)
    return run(g, q, k, *masks, *bias)


_reverse_jit = shared_lowering(_reverse_call, ("lower_bound",))
_cumsum_gates_jit = shared_lowering(_cumsum_gates_call, ("scale", "lower_bound"))


def _check_gate(fn, g, lower_bound, bias) -> None:
    if (lower_bound is None) != (bias is None):
        raise ValueError(f"{fn}: lower_bound and bias go together, got lower_bound={lower_bound} "
                         f"and bias {'given' if bias is not None else None}")
    if bias is not None and bias.shape != g.shape[-2:]:
        raise ValueError(f"{fn}: bias must be [H, K] = {g.shape[-2:]}, got {bias.shape}")


def cumsum_and_gates(g, q, k, masks=(), *, scale: float, lower_bound: float | None = None,
                     bias=None, interpret: bool = False):
    """Raw forward of the cumsum with the gated operands (:func:`_cumsum_gates_call`; no VJP of its
    own: :func:`pallas_kernels.kda_scores.gated_scores` owns the chain rule):
    ``(G, Qg, Kg, Xk, gamma, flags)`` with ``flags [B, H, NC]`` int32, equal to
    :func:`~pallas_kernels.kda_gates.bounded_chunks` of ``G``. With ``lower_bound`` and ``bias``
    (``[H, K]``), ``g`` holds the gate's logits less their bias and ``G`` sums
    ``lower_bound * sigmoid(g + bias)``."""
    _check_gate("cumsum_and_gates", g, lower_bound, bias)
    rows = () if bias is None else (_bias_rows(bias, g.shape[-1]),)
    *outs, ok = _cumsum_gates_jit(g, q, k, tuple(masks), rows, scale=scale,
                                  lower_bound=lower_bound, interpret=interpret)
    return (*outs, jnp.min(ok, axis=-1).astype(jnp.int32))


def reverse_cumsum(dg_cum, *, interpret: bool = False):
    """The cumsum's VJP: ``[B, H, Tp, K]`` head-major -> ``[B, Tp, H, K]`` (fp32)."""
    return _reverse_jit(dg_cum.astype(F32), lower_bound=None, interpret=interpret)


def reverse_cumsum_through_gate(dg_cum, logits, bias, *, lower_bound: float,
                                interpret: bool = False):
    """The VJP of :func:`cumsum_and_gates`' ``G`` with a gate: ``(dz [B, Tp, H, K], dbias [H, K])``
    fp32 for the logits ``logits`` (the forward's ``g``) and ``bias``."""
    _check_gate("reverse_cumsum_through_gate", logits, lower_bound, bias)
    dz, parts = _reverse_jit(dg_cum.astype(F32), logits.astype(F32),
                             _bias_rows(bias, logits.shape[-1]), lower_bound=lower_bound,
                             interpret=interpret)
    return dz, jnp.sum(parts[..., 0, :], axis=(0, 2))  # lane 0 covers each chunk's rows


def chunk_cumsum_reference(g):
    """``G`` of :func:`cumsum_and_gates` in plain fp32 (a sequential cumsum per chunk):
    ``[B, Tp, H, K]`` -> head-major ``[B, H, Tp, K]``."""
    nb, tp, h, dk = g.shape
    chunks = g.astype(F32).reshape(nb, tp // CHUNK, CHUNK, h, dk)
    g_cum = jnp.cumsum(chunks, axis=2).reshape(nb, tp, h, dk)
    return jnp.swapaxes(g_cum, 1, 2)


__all__ = ["chunk_cumsum_reference", "cumsum_and_gates", "reverse_cumsum",
           "reverse_cumsum_through_gate"]
