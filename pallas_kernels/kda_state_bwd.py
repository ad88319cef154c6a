"""Mosaic GPU kernel: the serial KDA state pass over chunks, backward.

Reverse-mode of :func:`pallas_kernels.kda_state_fwd.state_fwd` (reference: ``jax.vjp`` of
:func:`pallas_kernels.kda_prep.state_pass_reference`). One CTA per ``(head, batch)`` walks the chunks
last to first, with one warpgroup per value tile of 64 columns holding its columns of ``dS``, the
gradient of the state leaving the chunk, in fp32 registers. With ``S`` the state entering the
chunk (saved by the forward) and ``Vt`` its saved ``U - W S``, per chunk:

    dVt  = Aqk^T dO + Kg dS            (= dU; per value tile)
    dAqk = dO Vt^T      dQg = dO S^T      dKg = Vt dS^T      dW = -dVt S^T
    dgamma = rowsum(S * dS)
    dS  <- gamma * dS + Qg^T dO - W^T dVt   (per value tile)

The four products in the second line contract over all value columns: each warpgroup puts its
tile of ``dS`` and ``dVt`` in SMEM, and the products are split between the warpgroups, so every
output is written once (a CTA per value tile would write partial sums for XLA to add: at
(8, 4096, 16, 128) about 1.6 GB more memory traffic per call).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import BF16, F32, ROW, finish_together, kernel, load, matmul, tiles
from pallas_kernels.kda_state_fwd import BLOCK_V


def state_bwd(qg, kg, w, aqk, gamma, states, vt, do, dfinal, *, chunk_size: int, interpret: bool = False):
    """Run the backward state pass.

    Args:
      qg, kg, w: ``[B, H, Tp, K]`` bf16.  aqk: ``[B, H, Tp, C]`` bf16.  gamma: ``[B, H, NC, K]`` fp32.
      states: ``[B, H, NC, K, V]`` bf16 and vt ``[B, H, Tp, V]`` bf16 from the forward.
      do: ``[B, Tp, H, V]`` bf16 (the layout of the forward's ``o``).  dfinal: ``[B, H, K, V]`` fp32.

    Returns:
      ``(dqg, dkg, dw [B, H, Tp, K], daqk [B, H, Tp, C], dgamma [NV, B, H, NC, K], du [B, H, Tp, V],
      dh0 [B, H, K, V])``, all fp32; ``dgamma`` is one partial sum per value tile (``NV = V / 64``).
    """
    b, h, tp, dk = qg.shape
    dv, c = vt.shape[-1], chunk_size
    nc, bv = tp // c, BLOCK_V
    nv = dv // bv
    sds = jax.ShapeDtypeStruct
    out_type = (sds((b, h, tp, dk), F32), sds((b, h, tp, dk), F32), sds((b, h, tp, dk), F32),
                sds((b, h, tp, c), F32), sds((nv, b, h, nc, dk), F32), sds((b, h, tp, dv), F32),
                sds((b, h, dk, dv), F32))

    def body(qg_ref, kg_ref, w_ref, a_ref, gam_ref, st_ref, vt_ref, do_ref, df_ref,
             dqg_ref, dkg_ref, dw_ref, da_ref, dgam_ref, du_ref, dh0_ref,
             qg_s, kg_s, w_s, a_s, s_s, vt_s, do_s, ds_s, dvt_s, bars, vbar, shared, done):
        bi, hi, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
        cols = pl.ds(wg * bv, bv)
        vcols = [pl.ds(v * bv, bv) for v in range(nv)]

        # Issued by warpgroup 0 (gamma, 512 bytes a chunk, is read from GMEM directly). The inputs over K are double-buffered, one chunk ahead; those over
        # V (S, Vt, dO) have one buffer, filled once both warpgroups are done with the last chunk:
        # two buffers of everything would exceed the SMEM at K = V = 128.
        def fetch_k(n, slot):
            tok, bar = pl.ds(n * c, c), bars.at[slot]
            for src, dst in ((qg_ref.at[bi, hi, tok], qg_s), (kg_ref.at[bi, hi, tok], kg_s),
                             (w_ref.at[bi, hi, tok], w_s), (a_ref.at[bi, hi, tok], a_s)):
                plgpu.copy_gmem_to_smem(src, dst.at[slot], bar)

        def fetch_v(n):
            tok = pl.ds(n * c, c)
            for v, vc in enumerate(vcols):
                plgpu.copy_gmem_to_smem(st_ref.at[bi, hi, n, :, vc], s_s.at[v], vbar)
                plgpu.copy_gmem_to_smem(vt_ref.at[bi, hi, tok, vc], vt_s.at[v], vbar)
                plgpu.copy_gmem_to_smem(do_ref.at[bi, tok, hi, vc], do_s.at[v], vbar)

        @pl.when(wg == 0)
        def _():
            fetch_k(nc - 1, 0)
            fetch_v(nc - 1)

        ds0 = load(df_ref.at[bi, hi, :, cols])

        def step(i, ds):
            n = nc - 1 - i
            slot = lax.rem(i, 2)

            @pl.when(jnp.logical_and(n > 0, wg == 0))
            def _():
                fetch_k(n - 1, 1 - slot)

            plgpu.barrier_wait(bars.at[slot])
            plgpu.barrier_wait(vbar)
            tok = pl.ds(n * c, c)
            do_mine = do_s.at[wg]
            ds_s.at[wg][...] = ds.astype(BF16)
            plgpu.commit_smem()
            dvt = matmul((c, bv), (a_s.at[slot].T, do_mine), (kg_s.at[slot], ds_s.at[wg]))
            du_ref.at[bi, hi, tok, cols][...] = dvt
            dvt_s.at[wg][...] = dvt.astype(BF16)
            plgpu.commit_smem()
            s = load(s_s.at[wg]).astype(F32)
            dgam_ref.at[wg, bi, hi, n][...] = jnp.sum(s * ds, axis=1)  # ROW layout
            finish_together(shared)  # every tile's dS and dVt is in SMEM

            @pl.when(wg == 0)
            def _():
                da_ref.at[bi, hi, tok][...] = matmul(
                    (c, c), *[(do_s.at[v], vt_s.at[v].T) for v in range(nv)])
                dqg_ref.at[bi, hi, tok][...] = matmul(
                    (c, dk), *[(do_s.at[v], s_s.at[v].T) for v in range(nv)])

            @pl.when(wg == nv - 1)
            def _():
                dkg_ref.at[bi, hi, tok][...] = matmul(
                    (c, dk), *[(vt_s.at[v], ds_s.at[v].T) for v in range(nv)])
                dw_ref.at[bi, hi, tok][...] = -matmul(
                    (c, dk), *[(dvt_s.at[v], s_s.at[v].T) for v in range(nv)])

            decay = lax.broadcast_in_dim(load(gam_ref.at[bi, hi, n], ROW), (dk, bv), [0])
            read = matmul((dk, bv), (qg_s.at[slot].T, do_mine))
            erase = matmul((dk, bv), (w_s.at[slot].T, dvt_s.at[wg]))
            finish_together(done)  # the slot, S, Vt, dO, dS and dVt may be overwritten

            @pl.when(jnp.logical_and(n > 0, wg == 0))
            def _():
                fetch_v(n - 1)

            return ds * decay + read - erase

        ds = lax.fori_loop(0, nc, step, ds0)
        dh0_ref.at[bi, hi, :, cols][...] = ds

    scratch = (
        tiles((2, c, dk)), tiles((2, c, dk)), tiles((2, c, dk)),  # qg, kg, w
        tiles((2, c, c)),  # aqk
        tiles((nv, dk, bv)),  # state entering the chunk, per value tile
        tiles((nv, c, bv)), tiles((nv, c, bv)),  # vt, do
        tiles((nv, dk, bv)),  # dS (bf16 operand), one tile per warpgroup
        tiles((nv, c, bv)),  # dVt (bf16 operand)
        plgpu.Barrier(num_arrivals=4, num_barriers=2), plgpu.Barrier(num_arrivals=3 * nv),
        plgpu.Barrier(num_arrivals=nv), plgpu.Barrier(num_arrivals=nv),
    )
    run = kernel(body, "kda_state_bwd", interpret, out_type=out_type, grid=(h, b), grid_names=("h", "b"),
                 num_threads=nv, thread_name="wg", scratch_types=scratch)
    return run(qg, kg, w, aqk, gamma, states, vt, do, dfinal)
