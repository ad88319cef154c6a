"""Mosaic GPU kernel: the serial KDA state pass over chunks, forward (SPEC 3.3).

Reference: :func:`pallas_kernels.kda_prep.state_pass_reference`. One CTA (one warpgroup) per
``(value tile of 64 columns, head, batch)`` walks the chunks in order with the state
``S [K, 64]`` in fp32 registers. Per chunk (operands bf16 in SMEM, fp32 accumulation on WGMMA):

    Vt = U - W S;   O = Qg S + Aqk Vt;   S <- gamma * S + Kg^T Vt

The chunk's inputs arrive by TMA one chunk ahead (two SMEM slots). ``O`` leaves in the caller's
layout and dtype (bf16 ``[B, Tp, H, V]``), so XLA neither transposes nor converts it. For the
backward it stores the state entering each chunk (bf16, ``[B, H, NC, K, V]``) and ``Vt`` (bf16,
``[B, H, Tp, V]``).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels._mgpu import BF16, F32, ROW, copy_all, kernel, load, per_row, products, tiles

BLOCK_V = 64


def state_fwd(qg, kg, w, u, aqk, gamma, h0, *, chunk_size: int, interpret: bool = False):
    """Run the forward state pass.

    Args:
      qg, kg, w: ``[B, H, Tp, K]`` bf16.  u: ``[B, H, Tp, V]`` fp32.  aqk: ``[B, H, Tp, C]`` bf16.
      gamma: ``[B, H, NC, K]`` fp32.  h0: ``[B, H, K, V]`` fp32 (zeros for no initial state).

    Returns:
      ``(o [B, Tp, H, V] bf16, final [B, H, K, V] fp32, states [B, H, NC, K, V] bf16,
      vt [B, H, Tp, V] bf16)``.
    """
    b, h, tp, dk = qg.shape
    dv, c = u.shape[-1], chunk_size
    nc, bv = tp // c, BLOCK_V
    out_type = (jax.ShapeDtypeStruct((b, tp, h, dv), BF16), jax.ShapeDtypeStruct((b, h, dk, dv), F32),
                jax.ShapeDtypeStruct((b, h, nc, dk, dv), BF16), jax.ShapeDtypeStruct((b, h, tp, dv), BF16))

    def body(qg_ref, kg_ref, w_ref, u_ref, a_ref, gam_ref, h0_ref, o_ref, fin_ref, st_ref, vt_ref,
             qg_s, kg_s, w_s, u_s, a_s, gam_s, s_s, vt_s, o_s, bars):
        bi, hi, vi = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        cols = pl.ds(vi * bv, bv)

        def fetch(n, slot):
            tok, bar = pl.ds(n * c, c), bars.at[slot]
            srcs = (qg_ref.at[bi, hi, tok], kg_ref.at[bi, hi, tok], w_ref.at[bi, hi, tok],
                    u_ref.at[bi, hi, tok, cols], a_ref.at[bi, hi, tok], gam_ref.at[bi, hi, n])
            copy_all(srcs, (qg_s, kg_s, w_s, u_s, a_s, gam_s), slot, bar)

        fetch(0, 0)
        s0 = load(h0_ref.at[bi, hi, :, cols])

        def step(n, s):
            slot = lax.rem(n, 2)

            @pl.when(n + 1 < nc)
            def _():
                fetch(n + 1, 1 - slot)

            plgpu.barrier_wait(bars.at[slot])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last chunk's stores have read s_s, vt_s, o_s
            s_s[...] = s.astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_s, st_ref.at[bi, hi, n, :, cols], commit_group=False)
            # Two rounds of WGMMAs, each pair issued together and waited for once: W S with Qg S,
            # then Aqk Vt with Kg^T Vt (O is off the state's critical path).
            ws, o = products(((c, bv), (w_s.at[slot], s_s)), ((c, bv), (qg_s.at[slot], s_s)))
            vt = load(u_s.at[slot]) - ws
            vt_s[...] = vt.astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(vt_s, vt_ref.at[bi, hi, pl.ds(n * c, c), cols], commit_group=False)
            o_vt, update = products(((c, bv), (a_s.at[slot], vt_s)), ((dk, bv), (kg_s.at[slot].T, vt_s)))
            o_s[...] = (o + o_vt).astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[bi, pl.ds(n * c, c), hi, cols], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            decay = per_row(load(gam_s.at[slot], ROW), (dk, bv))
            return s * decay + update

        s = lax.fori_loop(0, nc, step, s0)
        fin_ref.at[bi, hi, :, cols][...] = s
        plgpu.wait_smem_to_gmem(0)

    scratch = (
        tiles((2, c, dk)), tiles((2, c, dk)), tiles((2, c, dk)),  # qg, kg, w
        plgpu.SMEM((2, c, bv), F32),  # u
        tiles((2, c, c)),  # aqk
        plgpu.SMEM((2, dk), F32),  # gamma
        tiles((dk, bv)),  # state entering the chunk
        tiles((c, bv)),  # vt
        plgpu.SMEM((c, bv), BF16),  # o
        plgpu.Barrier(num_arrivals=6, num_barriers=2),
    )
    run = kernel(body, "kda_state_fwd", interpret, out_type=out_type, grid=(dv // bv, h, b),
                 grid_names=("v", "h", "b"), scratch_types=scratch)
    return run(qg, kg, w, u, aqk, gamma, h0)
