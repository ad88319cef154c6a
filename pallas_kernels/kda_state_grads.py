"""Mosaic GPU kernel: the per-chunk gradients of the state pass's inputs, once the serial part is
done.

With ``S`` the state entering a chunk and ``dS`` the gradient of the state leaving it (both saved
``[K, V]`` per chunk by the state kernels), ``Vt`` the chunk's ``U - W S`` and ``dVt`` its gradient
(saved negated, as the serial kernel uses it):

    dQg = dO S^T      dAqk = dO Vt^T      dKg = Vt dS^T      dW = (-dVt) S^T
    dgamma = rowsum(S * dS)

(:func:`pallas_kernels.kda_state_bwd.state_bwd` gives the derivation;
:func:`chunk_products_reference` is the same in plain JAX.) Every chunk is independent: one CTA per
``(chunk, head, batch)`` takes the chunk's five tiles by TMA and its two warpgroups split the
products, warpgroup 0 the two with ``dO``, warpgroup 1 the other two and ``dgamma``; bf16 operands,
fp32 accumulation, bf16 results through swizzled SMEM and TMA (the cotangents of bf16 inputs): one
kernel instead of batched XLA einsums with fp32 results, slices and converts.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu import (
    BF16,
    F32,
    column_tiles,
    finish_together,
    kernel,
    load,
    products,
    tiles,
)


def chunk_products_reference(states, dstates, vt, neg_dvt, do):
    """The products of the module docstring in plain JAX (bf16 operands, fp32 accumulation).

    Args:
      states, dstates: ``[B, H, NC, K, V]``.  vt, neg_dvt (``-dVt``): ``[B, H, Tp, V]``.
      do: ``[B, Tp, H, V]``.

    Returns:
      ``(dqg, dkg, dw [B, H, Tp, K], daqk [B, H, Tp, C], dgamma [B, H, NC, K])``, fp32.
    """
    b, h, nc, dk, dv = states.shape
    c = vt.shape[2] // nc

    def chunks(x):  # [B, H, Tp, V] -> [B, H, NC, C, V]
        return x.astype(BF16).reshape(b, h, nc, c, dv)

    do_c = jnp.moveaxis(do.astype(BF16).reshape(b, nc, c, h, dv), 3, 1)
    vt_c, neg_dvt_c = chunks(vt), chunks(neg_dvt)
    s, ds = states.astype(BF16), dstates.astype(BF16)

    def product(spec, x, y):
        return jnp.einsum(spec, x, y, preferred_element_type=F32)

    flat = lambda x: x.reshape(b, h, nc * c, x.shape[-1])  # noqa: E731
    dqg = product("bhncv,bhnkv->bhnck", do_c, s)
    daqk = product("bhncv,bhnjv->bhncj", do_c, vt_c)
    dkg = product("bhncv,bhnkv->bhnck", vt_c, ds)
    dw = product("bhncv,bhnkv->bhnck", neg_dvt_c, s)
    dgamma = product("bhnkv,bhnkv->bhnk", s, ds)
    return flat(dqg), flat(dkg), flat(dw), flat(daqk), dgamma


def state_grads(states, dstates, vt, neg_dvt, do, *, interpret: bool = False):
    """The products of the module docstring as one Mosaic GPU kernel.

    Args:
      states, dstates: ``[B, H, NC, K, V]`` bf16.  vt, neg_dvt (``-dVt``): ``[B, H, Tp, V]`` bf16.
      do: ``[B, Tp, H, V]`` bf16 (the layout of the forward's ``o``).

    Returns:
      ``(dqg, dkg, dw [B, H, Tp, K], daqk [B, H, Tp, C]`` bf16, ``dgamma [B, H, NC, K]`` fp32).
    """
    b, h, nc, dk, dv = states.shape
    tp = vt.shape[2]
    c = tp // nc
    rows = lambda n: jax.ShapeDtypeStruct((b, h, tp, n), BF16)  # noqa: E731
    out_type = (rows(dk), rows(dk), rows(dk), rows(c), jax.ShapeDtypeStruct((b, h, nc, dk), F32))

    def body(st_ref, dst_ref, vt_ref, neg_dvt_ref, do_ref, dqg_ref, dkg_ref, dw_ref, da_ref,
             dgam_ref, s_s, ds_s, vt_s, neg_dvt_s, do_s, dqg_s, dkg_s, dw_s, da_s, bar, done):
        bi, hi, ni, wg = (lax.axis_index(n) for n in ("b", "h", "n", "wg"))
        tok = pl.ds(ni * c, c)

        @pl.when(wg == 0)
        def _():
            srcs = (st_ref.at[bi, hi, ni], dst_ref.at[bi, hi, ni], vt_ref.at[bi, hi, tok],
                    neg_dvt_ref.at[bi, hi, tok], do_ref.at[bi, tok, hi])
            for src, dst in zip(srcs, (s_s, ds_s, vt_s, neg_dvt_s, do_s)):
                plgpu.copy_gmem_to_smem(src, dst, bar)

        plgpu.barrier_wait(bar)

        def store(pairs):  # fp32 results -> bf16 SMEM -> GMEM
            for value, smem, _ in pairs:
                smem[...] = value.astype(BF16)
            plgpu.commit_smem()
            for _, smem, ref in pairs:
                plgpu.copy_smem_to_gmem(smem, ref.at[bi, hi, tok])

        @pl.when(wg == 0)
        def _():
            dqg, da = products(((c, dk), (do_s, s_s.T)), ((c, c), (do_s, vt_s.T)))
            store(((dqg, dqg_s, dqg_ref), (da, da_s, da_ref)))

        @pl.when(wg == 1)
        def _():
            dkg, dw = products(((c, dk), (vt_s, ds_s.T)), ((c, dk), (neg_dvt_s, s_s.T)))
            store(((dkg, dkg_s, dkg_ref), (dw, dw_s, dw_ref)))
            dgamma = sum(jnp.sum(load(s_s.at[:, ch]).astype(F32) * load(ds_s.at[:, ch]).astype(F32),
                                 axis=1)
                         for ch in column_tiles(dv))
            dgam_ref.at[bi, hi, ni][...] = dgamma

        plgpu.wait_smem_to_gmem(0)
        finish_together(done)

    scratch = (
        tiles((dk, dv)), tiles((dk, dv)),  # S, dS
        tiles((c, dv)), tiles((c, dv)), tiles((c, dv)),  # Vt, -dVt, dO
        # dQg, dKg, dW, dAqk (bf16 out)
        tiles((c, dk)), tiles((c, dk)), tiles((c, dk)), tiles((c, c)),
        plgpu.Barrier(num_arrivals=5),
        plgpu.Barrier(num_arrivals=2),
    )
    run = kernel(body, "kda_state_grads", interpret, out_type=out_type, grid=(nc, h, b),
                 grid_names=("n", "h", "b"), num_threads=2, thread_name="wg", scratch_types=scratch)
    return run(states, dstates, vt, neg_dvt, do)


__all__ = ["chunk_products_reference", "state_grads"]
