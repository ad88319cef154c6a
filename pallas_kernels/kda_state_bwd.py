"""The serial KDA state pass over chunks, backward: a Mosaic GPU recurrence, then the per-chunk
products.

Reverse-mode of :func:`pallas_kernels.kda_state_fwd.state_fwd` (reference: ``jax.vjp`` of
:func:`pallas_kernels.kda_prep.state_pass_reference`). With ``S`` the state entering a chunk (saved
by the forward), ``Vt`` its saved ``U - W S`` and ``dS`` the gradient of the state leaving it:

    dVt  = Aqk^T dO + Kg dS            (= dU)
    dS  <- gamma * dS + Qg^T dO - W^T dVt
    dAqk = dO Vt^T      dQg = dO S^T      dKg = Vt dS^T      dW = -dVt S^T
    dgamma = rowsum(S * dS)

Only the first two lines are serial. The recurrence kernel runs them (one CTA, one warpgroup, per
``(value tile, head, batch)``, the tile's width by
:func:`~pallas_kernels.kda_state_fwd.value_tile`, chunks last to first, ``dS`` in fp32 registers,
the chunk's inputs by TMA one chunk ahead) and saves each chunk's ``dS`` and ``-dVt`` (bf16, as the
forward saves ``S`` and ``Vt``; ``-dVt`` is the operand of ``- W^T dVt``, which accumulates onto
``gamma * dS`` with ``Qg^T dO``: a 128 x 128 fp32 ``dS`` leaves no registers for a separate
accumulator) and ``dVt`` in fp32, the gradient of ``U``; the last two lines are
independent per chunk and run afterwards in :mod:`pallas_kernels.kda_state_grads`, over all value
columns at once. (Doing all of it per chunk in the recurrence would put the products on the serial
chain, whose step time is the kernel's time when few heads leave most SMs idle.)
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
    kernel,
    load,
    matmul,
    matmul_onto,
    optional_refs,
    per_row,
    zeros,
)
from pallas_kernels.kda_state_fwd import operand_tiles, value_tile
from pallas_kernels.kda_state_grads import state_grads


def _recurrence_call(qg, kg, w, aqk, gamma, do, dfinal, *, chunk_size: int, block_v: int | None,
                     initial_grad: bool, interpret: bool):
    """The serial kernel: ``(du [B, H, Tp, V] fp32, -dVt`` (bf16, the products' operand),
    ``dstates [B, H, NC, K, V] bf16``, then ``dh0`` fp32 with ``initial_grad``)."""
    b, h, tp, dk = qg.shape
    dv, c = do.shape[-1], chunk_size
    nc, bv = tp // c, block_v or value_tile(b, h, dv)
    sds = jax.ShapeDtypeStruct
    out_type = (sds((b, h, tp, dv), F32), sds((b, h, tp, dv), BF16), sds((b, h, nc, dk, dv), BF16),
                *[sds((b, h, dk, dv), F32)] * initial_grad)

    def body(qg_ref, kg_ref, w_ref, a_ref, gam_ref, do_ref, *refs):
        df_refs, refs = optional_refs(refs, dfinal is not None)
        du_ref, neg_dvt_ref, dst_ref, *refs = refs
        dh0_refs, refs = optional_refs(refs, initial_grad)
        qg_s, kg_s, w_s, a_s, do_s, gam_s, ds_s, neg_dvt_s, bars = refs
        bi, hi, vi = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        cols = pl.ds(vi * bv, bv)

        def fetch(n, slot):
            tok = pl.ds(n * c, c)
            srcs = (qg_ref.at[bi, hi, tok], kg_ref.at[bi, hi, tok], w_ref.at[bi, hi, tok],
                    a_ref.at[bi, hi, tok], do_ref.at[bi, tok, hi, cols], gam_ref.at[bi, hi, n])
            copy_all(srcs, (qg_s, kg_s, w_s, a_s, do_s, gam_s), slot, bars.at[slot])

        fetch(nc - 1, 0)
        ds0 = load(df_refs[0].at[bi, hi, :, cols]) if df_refs else zeros((dk, bv))

        def step(i, ds):
            n = nc - 1 - i
            slot, tok = lax.rem(i, 2), pl.ds(n * c, c)

            @pl.when(n > 0)
            def _():
                fetch(n - 1, 1 - slot)

            plgpu.barrier_wait(bars.at[slot])
            gam = load(gam_s.at[slot], ROW)
            # the last chunk's stores have read dS and -dVt
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            ds_s[...] = ds.astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(ds_s, dst_ref.at[bi, hi, n, :, cols], commit_group=False)
            dvt = matmul((c, bv), (a_s.at[slot].T, do_s.at[slot]), (kg_s.at[slot], ds_s))
            neg_dvt_s[...] = (-dvt).astype(BF16)  # the operand of -W^T dVt (and of dW)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(neg_dvt_s, neg_dvt_ref.at[bi, hi, tok, cols],
                                    commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            # fp32 straight from registers: a 128-column tile leaves no SMEM to stage it
            du_ref.at[bi, hi, tok, cols][...] = dvt
            # dS <- gamma dS + Qg^T dO - W^T dVt, accumulated onto gamma dS
            return matmul_onto(ds * per_row(gam, (dk, bv)), (qg_s.at[slot].T, do_s.at[slot]),
                               (w_s.at[slot].T, neg_dvt_s), interpret=interpret)

        ds = lax.fori_loop(0, nc, step, ds0)
        for dh0_ref in dh0_refs:
            dh0_ref.at[bi, hi, :, cols][...] = ds
        plgpu.wait_smem_to_gmem(0)

    bf16_tiles = lambda shape: operand_tiles(shape, bv)  # noqa: E731
    scratch = (
        bf16_tiles((2, c, dk)), bf16_tiles((2, c, dk)), bf16_tiles((2, c, dk)),  # qg, kg, w
        bf16_tiles((2, c, c)),  # aqk
        bf16_tiles((2, c, bv)),  # do
        plgpu.SMEM((2, dk), F32),  # gamma
        bf16_tiles((dk, bv)),  # dS (bf16 operand, and what is saved)
        bf16_tiles((c, bv)),  # -dVt (bf16 operand, and what is saved)
        plgpu.Barrier(num_arrivals=6, num_barriers=2),
    )
    run = kernel(body, "kda_state_bwd", interpret, out_type=out_type, grid=(dv // bv, h, b),
                 grid_names=("v", "h", "b"), scratch_types=scratch)
    return run(qg, kg, w, aqk, gamma, do, *(x for x in (dfinal,) if x is not None))


def state_bwd(qg, kg, w, aqk, gamma, states, vt, do, dfinal, *, chunk_size: int,
              block_v: int | None = None, initial_grad: bool = True, interpret: bool = False):
    """Run the backward state pass: the serial kernel, then
    :func:`pallas_kernels.kda_state_grads.state_grads`.

    Args:
      qg, kg, w: ``[B, H, Tp, K]`` bf16.  aqk: ``[B, H, Tp, C]`` bf16.
      gamma: ``[B, H, NC, K]`` fp32.
      states: ``[B, H, NC, K, V]`` bf16 and vt ``[B, H, Tp, V]`` bf16 from the forward.
      do: ``[B, Tp, H, V]`` bf16 (the layout of the forward's ``o``).
      dfinal: ``[B, H, K, V]`` fp32, or None where the final state has no cotangent (nothing
        read: the reverse recurrence starts from zero).
      block_v: the value tile of the serial kernel (default
        :func:`~pallas_kernels.kda_state_fwd.value_tile`).
      initial_grad: return ``dh0`` (False where there is no initial state: None, nothing written).

    Returns:
      ``(dqg, dkg, dw [B, H, Tp, K], daqk [B, H, Tp, C]`` bf16,
      ``dgamma [B, H, NC, K], du [B, H, Tp, V], dh0 [B, H, K, V]`` fp32 or None).
    """
    du, neg_dvt, dstates, *dh0 = _recurrence_call(qg, kg, w, aqk, gamma, do, dfinal,
                                                  chunk_size=chunk_size, block_v=block_v,
                                                  initial_grad=initial_grad, interpret=interpret)
    return (*state_grads(states, dstates, vt, neg_dvt, do, interpret=interpret), du,
            dh0[0] if dh0 else None)
