"""Mosaic GPU kernel: the serial KDA state pass over chunks, backward.

Reverse-mode of :func:`pallas_kernels.kda_state_fwd.state_fwd` (reference: ``jax.vjp`` of
:func:`pallas_kernels.kda_prep.state_pass_reference`). One CTA (one warpgroup) per
``(value tile of 64 columns, head, batch)`` walks the chunks last to first with ``dS``, the
gradient of the state leaving the chunk, in fp32 registers. With ``S`` the state entering the
chunk (saved by the forward) and ``Vt`` its saved ``U - W S``, per chunk:

    dVt  = Aqk^T dO + Kg dS            (= dU)
    dAqk = dO Vt^T      dQg = dO S^T      dKg = Vt dS^T      dW = -dVt S^T
    dgamma = rowsum(S * dS)
    dS  <- gamma * dS + Qg^T dO - W^T dVt

Products over the value columns (dAqk, dQg, dKg, dW, dgamma) are partial sums of one value
tile; the caller adds the tiles (``[NV, ...]`` outputs).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import BF16, F32, ROW, copy_all, kernel, load, matmul, tiles
from pallas_kernels.kda_state_fwd import BLOCK_V


def state_bwd(qg, kg, w, aqk, gamma, states, vt, do, dfinal, *, chunk_size: int, interpret: bool = False):
    """Run the backward state pass.

    Args:
      qg, kg, w: ``[B, H, Tp, K]`` bf16.  aqk: ``[B, H, Tp, C]`` bf16.  gamma: ``[B, H, NC, K]`` fp32.
      states: ``[B, H, NC, K, V]`` bf16 and vt ``[B, H, Tp, V]`` bf16 from the forward.
      do: ``[B, H, Tp, V]`` bf16.  dfinal: ``[B, H, K, V]`` fp32.

    Returns:
      ``(dqg, dkg, dw [NV, B, H, Tp, K], daqk [NV, B, H, Tp, C], dgamma [NV, B, H, NC, K],
      du [B, H, Tp, V], dh0 [B, H, K, V])``, all fp32.
    """
    b, h, tp, dk = qg.shape
    dv, c = vt.shape[-1], chunk_size
    nc, bv = tp // c, BLOCK_V
    nv = dv // bv
    sds = jax.ShapeDtypeStruct
    out_type = (sds((nv, b, h, tp, dk), F32), sds((nv, b, h, tp, dk), F32), sds((nv, b, h, tp, dk), F32),
                sds((nv, b, h, tp, c), F32), sds((nv, b, h, nc, dk), F32), sds((b, h, tp, dv), F32),
                sds((b, h, dk, dv), F32))

    def body(qg_ref, kg_ref, w_ref, a_ref, gam_ref, st_ref, vt_ref, do_ref, df_ref,
             dqg_ref, dkg_ref, dw_ref, da_ref, dgam_ref, du_ref, dh0_ref,
             qg_s, kg_s, w_s, a_s, gam_s, s_s, vt_s, do_s, ds_s, dvt_s, bars):
        bi, hi, vi = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        cols = pl.ds(vi * bv, bv)

        def fetch(n, slot):
            tok, bar = pl.ds(n * c, c), bars.at[slot]
            srcs = (qg_ref.at[bi, hi, tok], kg_ref.at[bi, hi, tok], w_ref.at[bi, hi, tok],
                    a_ref.at[bi, hi, tok], gam_ref.at[bi, hi, n], st_ref.at[bi, hi, n, :, cols],
                    vt_ref.at[bi, hi, tok, cols], do_ref.at[bi, hi, tok, cols])
            copy_all(srcs, (qg_s, kg_s, w_s, a_s, gam_s, s_s, vt_s, do_s), slot, bar)

        fetch(nc - 1, 0)
        ds0 = load(df_ref.at[bi, hi, :, cols])

        def step(i, ds):
            n = nc - 1 - i
            slot = lax.rem(i, 2)

            @pl.when(n > 0)
            def _():
                fetch(n - 1, 1 - slot)

            plgpu.barrier_wait(bars.at[slot])
            tok = pl.ds(n * c, c)
            ds_s[...] = ds.astype(BF16)
            plgpu.commit_smem()
            dvt = matmul((c, bv), (a_s.at[slot].T, do_s.at[slot]), (kg_s.at[slot], ds_s))
            du_ref.at[bi, hi, tok, cols][...] = dvt
            dvt_s[...] = dvt.astype(BF16)
            plgpu.commit_smem()
            da_ref.at[vi, bi, hi, tok][...] = matmul((c, c), (do_s.at[slot], vt_s.at[slot].T))
            dqg_ref.at[vi, bi, hi, tok][...] = matmul((c, dk), (do_s.at[slot], s_s.at[slot].T))
            dkg_ref.at[vi, bi, hi, tok][...] = matmul((c, dk), (vt_s.at[slot], ds_s.T))
            dw_ref.at[vi, bi, hi, tok][...] = -matmul((c, dk), (dvt_s, s_s.at[slot].T))
            s = load(s_s.at[slot]).astype(F32)
            dgam_ref.at[vi, bi, hi, n][...] = jnp.sum(s * ds, axis=1)  # ROW layout
            decay = lax.broadcast_in_dim(load(gam_s.at[slot], ROW), (dk, bv), [0])
            read = matmul((dk, bv), (qg_s.at[slot].T, do_s.at[slot]))
            erase = matmul((dk, bv), (w_s.at[slot].T, dvt_s))
            return ds * decay + read - erase

        ds = lax.fori_loop(0, nc, step, ds0)
        dh0_ref.at[bi, hi, :, cols][...] = ds

    scratch = (
        tiles((2, c, dk)), tiles((2, c, dk)), tiles((2, c, dk)),  # qg, kg, w
        tiles((2, c, c)),  # aqk
        plgpu.SMEM((2, dk), F32),  # gamma
        tiles((2, dk, bv)),  # state entering the chunk
        tiles((2, c, bv)), tiles((2, c, bv)),  # vt, do
        tiles((dk, bv)),  # dS (bf16 operand)
        tiles((c, bv)),  # dVt (bf16 operand)
        plgpu.Barrier(num_arrivals=8, num_barriers=2),
    )
    run = kernel(body, "kda_state_bwd", interpret, out_type=out_type, grid=(nv, h, b),
                 grid_names=("v", "h", "b"), scratch_types=scratch)
    return run(qg, kg, w, aqk, gamma, states, vt, do, dfinal)
