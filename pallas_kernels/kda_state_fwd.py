"""Mosaic GPU kernel: the serial KDA state pass over chunks, forward (math §3.3).

Reference: :func:`pallas_kernels.kda_prep.state_pass_reference`. One CTA per
``(value tile, head, batch)`` walks the chunks in order (the tile's width:
:func:`value_tile`). Per chunk (operands bf16 in SMEM, fp32 accumulation on WGMMA):

    Vt = U - W S;   O = Qg S + Aqk Vt;   S <- gamma * S + Kg^T Vt

Only the first and last products are serial, so the CTA's two warpgroups split them: warpgroup 0
carries ``S [K, bv]`` in fp32 registers and publishes each chunk's ``S`` and ``Vt`` (bf16 SMEM);
warpgroup 1 computes ``O`` from them meanwhile. With few chains, where one CTA per chain leaves
most SMs idle, the chain's step time is the kernel's time, so ``O`` is kept off the chain.
Warpgroup 0's inputs arrive by TMA one chunk ahead (two SMEM slots); the outputs' side (``S``,
``Vt``, ``Qg``, ``Aqk``, ``O``) has two chunks in flight, or one with a 128-wide tile, whose ``S``
and ``U`` leave no SMEM for a second. ``O`` leaves in the caller's layout and dtype (bf16
``[B, Tp, H, V]``), so XLA neither transposes nor converts it. For the backward warpgroup 0 stores
the state entering each chunk (bf16, ``[B, H, NC, K, V]``) and ``Vt`` (bf16, ``[B, H, Tp, V]``).
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
    matmul_onto,
    optional_refs,
    per_row,
    tiles,
    zeros,
)

BLOCK_V = 64  # the value tile between FEW_CHAINS and MANY_CHAINS chains: the widest at which the
# forward keeps two chunks in flight
FEW_CHAINS = 16  # (batch, head) chains up to which the state kernels take half-width value tiles
MANY_CHAINS = 32  # chains above which they take the whole value width in one tile


def value_tile(b: int, h: int, dv: int) -> int:
    """Value columns per CTA of the state kernels (forward and backward) for ``b * h`` chains.

    With few chains a CTA per chain and 64-column tile leaves most SMs idle and the chains' serial
    steps are the kernel's time: 32-column tiles halve each step's tensor-core work and put twice
    the CTAs on the SMs. With many the SMs are full either way and the pass is bound by what it
    reads: every value tile of a chain reads the chain's ``Qg``, ``Kg``, ``W`` and ``Aqk`` again,
    so above :data:`MANY_CHAINS` one tile takes all ``dv`` columns."""
    chains = b * h
    if chains > MANY_CHAINS:
        return dv
    return min(BLOCK_V // 2 if chains <= FEW_CHAINS else BLOCK_V, dv)


def operand_tiles(shape: tuple[int, ...], bv: int) -> plgpu.SMEM:
    """bf16 SMEM for the state kernels' WGMMA operands when value tiles are ``bv`` wide: every
    product pairs a ``[., K]`` or ``[., C]`` tile with a ``bv``-wide one, so all take the swizzle
    of a ``bv``-wide bf16 row."""
    return tiles(shape, swizzle=min(2 * bv, 128))


def state_fwd(qg, kg, w, u, aqk, gamma, h0, *, chunk_size: int, save: bool = True,
              keep_final: bool = True, block_v: int | None = None, inverse=None,
              interpret: bool = False):
    """Run the forward state pass; ``save=False`` (no backward to follow) skips the two outputs
    kept for it, ``keep_final=False`` (nobody reads it) the final state; ``block_v``: the value
    tile (default :func:`value_tile`).

    Args:
      qg, kg, w: ``[B, H, Tp, K]`` bf16.  u: ``[B, H, Tp, V]`` fp32.  aqk: ``[B, H, Tp, C]`` bf16.
      gamma: ``[B, H, NC, K]`` fp32.  h0: ``[B, H, K, V]`` fp32, or None for a zero initial state
        (nothing read).
      inverse: ``None``, or (forward only, ``save=False``) the chunks' ``T diag(beta)``, bf16
        ``[B, H, Tp, C]`` (:func:`~pallas_kernels.kda_solve.scaled_inverse`); then ``w`` is
        ``xk`` and ``u`` the values ``v`` (bf16, token-major ``[B, Tp, H, V]``), and the pass
        forms ``Vt = U - W S = (T diag(beta)) (v - xk S)`` itself: ``W`` and ``U`` are never
        written, for one more product on the serial chain.

    Returns:
      ``(o [B, Tp, H, V] bf16, final [B, H, K, V] fp32 (None without ``keep_final``),
      states [B, H, NC, K, V] bf16, vt [B, H, Tp, V] bf16)``, the last two only with ``save``.
    """
    b, h, tp, dk = qg.shape
    dv, c = u.shape[-1], chunk_size
    nc, bv = tp // c, block_v or value_tile(b, h, dv)
    depth = 1 if bv > BLOCK_V else 2  # chunks in flight on the outputs' side
    applies_inverse = inverse is not None
    if applies_inverse and save:
        raise ValueError("state_fwd: inverse is for a forward without backward (save=False)")
    out_type = (jax.ShapeDtypeStruct((b, tp, h, dv), BF16),
                *[jax.ShapeDtypeStruct((b, h, dk, dv), F32)] * keep_final)
    if save:
        out_type += (jax.ShapeDtypeStruct((b, h, nc, dk, dv), BF16),
                     jax.ShapeDtypeStruct((b, h, tp, dv), BF16))

    def body(qg_ref, kg_ref, w_ref, u_ref, a_ref, gam_ref, *refs):
        h0_refs, refs = optional_refs(refs, h0 is not None)
        t_refs, refs = optional_refs(refs, applies_inverse)
        o_ref, *refs = refs
        fin_refs, refs = optional_refs(refs, keep_final)
        (st_ref, vt_ref), refs = (refs[:2], refs[2:]) if save else ((None, None), refs)
        (qg_s, kg_s, w_s, u_s, a_s, gam_s, s_s, vt_s, o_s, state_in, out_in, ready, free, done,
         *t_s) = refs
        bi, hi, vi, wg = (lax.axis_index(n) for n in ("b", "h", "v", "wg"))
        cols = pl.ds(vi * bv, bv)

        @pl.when(wg == 0)
        def _():  # the state: Vt = U - W S, S <- gamma S + Kg^T Vt
            def fetch(n, slot):
                tok = pl.ds(n * c, c)
                u_view = (u_ref.at[bi, tok, hi, cols] if applies_inverse
                          else u_ref.at[bi, hi, tok, cols])
                srcs = (kg_ref.at[bi, hi, tok], w_ref.at[bi, hi, tok], u_view,
                        gam_ref.at[bi, hi, n], *(t.at[bi, hi, tok] for t in t_refs))
                copy_all(srcs, (kg_s, w_s, u_s, gam_s, *t_s), slot, state_in.at[slot])

            def step(n, s):
                slot, out = lax.rem(n, 2), lax.rem(n, depth)
                pl.when(n + 1 < nc)(lambda: fetch(n + 1, 1 - slot))
                plgpu.barrier_wait(state_in.at[slot])
                gam = load(gam_s.at[slot], ROW)  # loaded early: the state's update waits for it
                # -U too, the first product's accumulator: the stores below would delay it
                neg_u = -load(u_s.at[slot]).astype(F32)
                # the outputs of chunk n - depth read this slot of S and Vt
                pl.when(n >= depth)(lambda: plgpu.barrier_wait(free.at[out]))
                if save:  # chunk n - depth's stores of S and Vt have read it
                    plgpu.wait_smem_to_gmem(depth - 1, wait_read_only=True)
                s_s.at[out][...] = s.astype(BF16)
                plgpu.commit_smem()
                if save:
                    plgpu.copy_smem_to_gmem(s_s.at[out], st_ref.at[bi, hi, n, :, cols],
                                            commit_group=False)
                # W S - U, accumulated onto -U
                neg_vt = matmul_onto(neg_u, (w_s.at[slot], s_s.at[out]), interpret=interpret)
                vt_s.at[out][...] = (-neg_vt).astype(BF16)
                plgpu.commit_smem()
                if applies_inverse:  # that was v - xk S, the operand of T diag(beta)
                    vt = matmul((c, bv), (t_s[0].at[slot], vt_s.at[out]))
                    vt_s.at[out][...] = vt.astype(BF16)
                    plgpu.commit_smem()
                plgpu.barrier_arrive(ready.at[out])
                if save:
                    plgpu.copy_smem_to_gmem(vt_s.at[out],
                                            vt_ref.at[bi, hi, pl.ds(n * c, c), cols],
                                            commit_group=False)
                    plgpu.commit_smem_to_gmem_group()
                return matmul_onto(s * per_row(gam, (dk, bv)), (kg_s.at[slot].T, vt_s.at[out]),
                                   interpret=interpret)

            fetch(0, 0)
            s0 = load(h0_refs[0].at[bi, hi, :, cols]) if h0_refs else zeros((dk, bv))
            s = lax.fori_loop(0, nc, step, s0)
            for fin_ref in fin_refs:
                fin_ref.at[bi, hi, :, cols][...] = s
            for n in range(max(nc - depth, 0), nc):  # observe the outputs' last arrivals
                plgpu.barrier_wait(free.at[n % depth])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _():  # the outputs, off the state's path: O = Qg S + Aqk Vt
            def fetch(n, slot):
                tok = pl.ds(n * c, c)
                copy_all((qg_ref.at[bi, hi, tok], a_ref.at[bi, hi, tok]), (qg_s, a_s), slot,
                         out_in.at[slot])

            def step(n, carry):
                slot = lax.rem(n, depth)
                plgpu.barrier_wait(out_in.at[slot])
                plgpu.barrier_wait(ready.at[slot])
                o = matmul((c, bv), (qg_s.at[slot], s_s.at[slot]), (a_s.at[slot], vt_s.at[slot]))
                plgpu.barrier_arrive(free.at[slot])
                # the product has read this chunk's Qg and Aqk: chunk n + depth's may replace them
                pl.when(n + depth < nc)(lambda: fetch(n + depth, slot))
                # chunk n - depth's store has read o_s[slot]
                plgpu.wait_smem_to_gmem(depth - 1, wait_read_only=True)
                o_s.at[slot][...] = o.astype(BF16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s.at[slot], o_ref.at[bi, pl.ds(n * c, c), hi, cols])
                return carry

            for n in range(min(depth, nc)):
                fetch(n, n)
            lax.fori_loop(0, nc, step, None)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    bf16_tiles = lambda shape: operand_tiles(shape, bv)  # noqa: E731
    scratch = (
        bf16_tiles((depth, c, dk)), bf16_tiles((2, c, dk)), bf16_tiles((2, c, dk)),  # qg, kg, w
        bf16_tiles((2, c, bv)) if applies_inverse else tiles((2, c, bv), F32),  # u (or v)
        bf16_tiles((depth, c, c)),  # aqk
        plgpu.SMEM((2, dk), F32),  # gamma
        bf16_tiles((depth, dk, bv)),  # state entering the chunk
        bf16_tiles((depth, c, bv)),  # vt
        bf16_tiles((depth, c, bv)),  # o
        plgpu.Barrier(num_arrivals=4 + applies_inverse, num_barriers=2),  # the state's inputs
        plgpu.Barrier(num_arrivals=2, num_barriers=depth),  # the outputs' inputs
        plgpu.Barrier(num_arrivals=1, num_barriers=depth),  # S and Vt of a chunk are in SMEM
        plgpu.Barrier(num_arrivals=1, num_barriers=depth),  # the outputs are done reading them
        plgpu.Barrier(num_arrivals=2),  # both warpgroups are done (finish_together)
        *(bf16_tiles((2, c, c)) for _ in range(applies_inverse)),  # T diag(beta)
    )
    name = "kda_state_fwd_applying_inverse" if applies_inverse else "kda_state_fwd"
    run = kernel(body, name, interpret, out_type=out_type, grid=(dv // bv, h, b),
                 grid_names=("v", "h", "b"), num_threads=2, thread_name="wg", scratch_types=scratch)
    out = run(qg, kg, w, u, aqk, gamma, *(x for x in (h0, inverse) if x is not None))
    return out if keep_final else (out[0], None, *out[1:])
