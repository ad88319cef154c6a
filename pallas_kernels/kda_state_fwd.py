"""Mosaic GPU kernel: the serial KDA state pass over chunks, forward (math §3.3).

Reference: :func:`pallas_kernels.kda_prep.state_pass_reference`. One CTA per
``(value tile of 64 columns, or 32 with few chains (:func:`value_tile`), head, batch)`` walks the
chunks in order. Per chunk (operands bf16 in
SMEM, fp32 accumulation on WGMMA):

    Vt = U - W S;   O = Qg S + Aqk Vt;   S <- gamma * S + Kg^T Vt

Only the first and last products are serial, so the CTA's two warpgroups split them: warpgroup 0
carries ``S [K, 64]`` in fp32 registers and publishes each chunk's ``S`` and ``Vt`` (bf16 SMEM, two
chunks in flight); warpgroup 1 computes ``O`` from them meanwhile. At 16 heads, where one CTA per
chain leaves most SMs idle, the chain's step time is the kernel's time, so ``O`` is kept off the
chain.
Each warpgroup's inputs arrive by TMA one chunk ahead (two SMEM slots). ``O`` leaves in the caller's
layout and dtype (bf16 ``[B, Tp, H, V]``), so XLA neither transposes nor converts it. For the
backward warpgroup 0 stores the state entering each chunk (bf16, ``[B, H, NC, K, V]``) and ``Vt``
(bf16, ``[B, H, Tp, V]``).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels._mgpu import (
    BF16,
    F32,
    ROW,
    copy_all,
    finish_together,
    kernel,
    load,
    matmul,
    per_row,
    tiles,
)

BLOCK_V = 64  # the widest value tile of a CTA (its SMEM leaves one CTA an SM)
FEW_CHAINS = 16  # (batch, head) chains up to which the state kernels take half-width value tiles


def value_tile(b: int, h: int) -> int:
    """Value columns per CTA of the state kernels for ``b * h`` chains. With few chains a CTA per
    chain and 64-column tile leaves most SMs idle and the chains' serial steps are the kernel's
    time: 32-column tiles halve each step's tensor-core work and put twice the CTAs on the SMs."""
    return BLOCK_V // 2 if b * h <= FEW_CHAINS else BLOCK_V


def operand_tiles(shape: tuple[int, ...], bv: int) -> plgpu.SMEM:
    """bf16 SMEM for the state kernels' WGMMA operands when value tiles are ``bv`` wide: every
    product pairs a ``[., K]`` or ``[., C]`` tile with a ``bv``-wide one, so all take the swizzle
    of a ``bv``-wide bf16 row."""
    return tiles(shape, swizzle=min(2 * bv, 128))


def state_fwd(qg, kg, w, u, aqk, gamma, h0, *, chunk_size: int, save: bool = True,
              block_v: int | None = None, interpret: bool = False):
    """Run the forward state pass; ``save=False`` (no backward to follow) skips the two outputs
    kept for it; ``block_v``: the value tile (default :func:`value_tile`).

    Args:
      qg, kg, w: ``[B, H, Tp, K]`` bf16.  u: ``[B, H, Tp, V]`` fp32.  aqk: ``[B, H, Tp, C]`` bf16.
      gamma: ``[B, H, NC, K]`` fp32.  h0: ``[B, H, K, V]`` fp32 (zeros for no initial state).

    Returns:
      ``(o [B, Tp, H, V] bf16, final [B, H, K, V] fp32, states [B, H, NC, K, V] bf16,
      vt [B, H, Tp, V] bf16)``, the last two only with ``save``.
    """
    b, h, tp, dk = qg.shape
    dv, c = u.shape[-1], chunk_size
    nc, bv = tp // c, block_v or value_tile(b, h)
    out_type = (jax.ShapeDtypeStruct((b, tp, h, dv), BF16),
                jax.ShapeDtypeStruct((b, h, dk, dv), F32))
    if save:
        out_type += (jax.ShapeDtypeStruct((b, h, nc, dk, dv), BF16),
                     jax.ShapeDtypeStruct((b, h, tp, dv), BF16))

    def body(qg_ref, kg_ref, w_ref, u_ref, a_ref, gam_ref, h0_ref, o_ref, fin_ref, *refs):
        (st_ref, vt_ref), refs = (refs[:2], refs[2:]) if save else ((None, None), refs)
        qg_s, kg_s, w_s, u_s, a_s, gam_s, s_s, vt_s, o_s, state_in, out_in, ready, free, done = refs
        bi, hi, vi, wg = (lax.axis_index(n) for n in ("b", "h", "v", "wg"))
        cols = pl.ds(vi * bv, bv)

        @pl.when(wg == 0)
        def _():  # the state: Vt = U - W S, S <- gamma S + Kg^T Vt
            def fetch(n, slot):
                tok = pl.ds(n * c, c)
                srcs = (kg_ref.at[bi, hi, tok], w_ref.at[bi, hi, tok], u_ref.at[bi, hi, tok, cols],
                        gam_ref.at[bi, hi, n])
                copy_all(srcs, (kg_s, w_s, u_s, gam_s), slot, state_in.at[slot])

            def step(n, s):
                slot = lax.rem(n, 2)
                pl.when(n + 1 < nc)(lambda: fetch(n + 1, 1 - slot))
                plgpu.barrier_wait(state_in.at[slot])
                # chunk n-2's outputs read it
                pl.when(n >= 2)(lambda: plgpu.barrier_wait(free.at[slot]))
                if save:  # chunk n-2's stores of S and Vt have read this slot
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                s_s.at[slot][...] = s.astype(BF16)
                plgpu.commit_smem()
                if save:
                    plgpu.copy_smem_to_gmem(s_s.at[slot], st_ref.at[bi, hi, n, :, cols],
                                            commit_group=False)
                vt = load(u_s.at[slot]) - matmul((c, bv), (w_s.at[slot], s_s.at[slot]))
                vt_s.at[slot][...] = vt.astype(BF16)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ready.at[slot])
                if save:
                    plgpu.copy_smem_to_gmem(vt_s.at[slot],
                                            vt_ref.at[bi, hi, pl.ds(n * c, c), cols],
                                            commit_group=False)
                    plgpu.commit_smem_to_gmem_group()
                decay = per_row(load(gam_s.at[slot], ROW), (dk, bv))
                return s * decay + matmul((dk, bv), (kg_s.at[slot].T, vt_s.at[slot]))

            fetch(0, 0)
            s = lax.fori_loop(0, nc, step, load(h0_ref.at[bi, hi, :, cols]))
            fin_ref.at[bi, hi, :, cols][...] = s
            for n in range(max(nc - 2, 0), nc):  # observe the outputs' last arrivals
                plgpu.barrier_wait(free.at[n % 2])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _():  # the outputs, off the state's path: O = Qg S + Aqk Vt
            def fetch(n, slot):
                tok = pl.ds(n * c, c)
                copy_all((qg_ref.at[bi, hi, tok], a_ref.at[bi, hi, tok]), (qg_s, a_s), slot,
                         out_in.at[slot])

            def step(n, carry):
                slot = lax.rem(n, 2)
                pl.when(n + 1 < nc)(lambda: fetch(n + 1, 1 - slot))
                plgpu.barrier_wait(out_in.at[slot])
                plgpu.barrier_wait(ready.at[slot])
                o = matmul((c, bv), (qg_s.at[slot], s_s.at[slot]), (a_s.at[slot], vt_s.at[slot]))
                plgpu.barrier_arrive(free.at[slot])
                # chunk n-2's store has read o_s[slot]
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                o_s.at[slot][...] = o.astype(BF16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s.at[slot], o_ref.at[bi, pl.ds(n * c, c), hi, cols])
                return carry

            fetch(0, 0)
            lax.fori_loop(0, nc, step, None)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    bf16_tiles = lambda shape: operand_tiles(shape, bv)  # noqa: E731
    scratch = (
        bf16_tiles((2, c, dk)), bf16_tiles((2, c, dk)), bf16_tiles((2, c, dk)),  # qg, kg, w
        tiles((2, c, bv), F32),  # u
        bf16_tiles((2, c, c)),  # aqk
        plgpu.SMEM((2, dk), F32),  # gamma
        bf16_tiles((2, dk, bv)),  # state entering the chunk (two chunks in flight)
        bf16_tiles((2, c, bv)),  # vt
        bf16_tiles((2, c, bv)),  # o
        plgpu.Barrier(num_arrivals=4, num_barriers=2),  # the state's inputs
        plgpu.Barrier(num_arrivals=2, num_barriers=2),  # the outputs' inputs
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # S and Vt of a chunk are in SMEM
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # the outputs are done reading them
        plgpu.Barrier(num_arrivals=2),  # both warpgroups are done (finish_together)
    )
    run = kernel(body, "kda_state_fwd", interpret, out_type=out_type, grid=(dv // bv, h, b),
                 grid_names=("v", "h", "b"), num_threads=2, thread_name="wg", scratch_types=scratch)
    return run(qg, kg, w, u, aqk, gamma, h0)
