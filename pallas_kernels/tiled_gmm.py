"""Mosaic GPU kernel: grouped matmul over row tiles that each belong to one group, skipping tiles
that belong to none.

Reference: :func:`tiled_gmm_reference` (each row times its tile's group's weights, fp32
accumulation). The rows are laid out so that every group starts on a multiple of ``BLOCK_M`` rows
(the dispatch pads each group; see ``k3jax.ops.grouped_matmul``); then tile ``t`` of ``BLOCK_M``
rows is one group's (``tile_group[t]``) or padding past the last group (``-1``). One CTA per
``(column tile, row tile)`` runs a TMA-pipelined WGMMA loop over ``K`` (bf16 operands, fp32
accumulation) and stores a full tile; a padding tile returns at once. A WGMMA is asynchronous, so
the pipeline refills a step's shared-memory slot only after the next step has been issued
(``delay_release=1``): refilled at once, as the copy of a later step was before, the slot
could be overwritten while the product still read it (on an H200 that corrupted a few percent of
the rows of ``k3_small``'s input-gradient products). jax's ``ragged_dot_mgpu``
instead lets tiles straddle groups and walks a grid fixed by the row count, so a worst-case-sized
expert buffer (dropless expert parallelism: ``E_p`` times the balanced load) costs its full size
in tensor-core time; here it costs its real rows.

With ``transpose_rhs`` the weights are ``[G, N, K]`` and the product is ``x @ w[g].T`` (the input
gradient of the forward product).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.row_tiles import COLUMNS, TILE_ROWS, WIDE_COLUMNS, column_tile

BLOCK_M, BLOCK_K = TILE_ROWS, 64
# Slots of the pipeline over K by the output tile's width: at k3_small's expert products (K = N =
# 384) and at K = 768, three were the fastest of two to four for 128-column tiles, two for 192
# (one H100; docs/benchmarks.md).
SLOTS = {COLUMNS: 3, WIDE_COLUMNS: 2}


def tiling(n: int) -> tuple[int, int, int]:
    """``(columns, slots, K step)`` of the kernel for an output ``N`` columns wide."""
    columns = column_tile(n)
    return columns, SLOTS[columns], BLOCK_K


def tiled_gmm_reference(x, w, tile_group, *, transpose_rhs: bool = False):
    """``out[r] = x[r] @ w[tile_group[r // BLOCK_M]]`` (zero where the tile's group is ``-1``),
    fp32 accumulation, ``x.dtype`` out.

    ``x [M, K]``, ``w [G, K, N]``, ``tile_group [M / BLOCK_M]``."""
    w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    group = jnp.repeat(tile_group, BLOCK_M)
    picked = jnp.take(w, jnp.maximum(group, 0), axis=0)                      # [M, K, N]
    out = jnp.einsum("mk,mkn->mn", x, picked, preferred_element_type=jnp.float32)
    return jnp.where((group >= 0)[:, None], out, 0.0).astype(x.dtype)


def check_tiled_gmm_args(x, w, tile_group, transpose_rhs: bool) -> None:
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    k_w = w.shape[2] if transpose_rhs else w.shape[1]
    if k_w != k:
        raise ValueError(f"tiled_gmm: x is [M, K={k}] but w {w.shape} (transpose_rhs="
                         f"{transpose_rhs}) has K={k_w}")
    if m % BLOCK_M or k % BLOCK_K or n % COLUMNS:
        raise ValueError(f"tiled_gmm: M={m}, K={k}, N={n} must be multiples of "
                         f"{BLOCK_M}, {BLOCK_K}, {COLUMNS}")
    if tile_group.shape != (m // BLOCK_M,):
        raise ValueError(f"tiled_gmm: tile_group must be [{m // BLOCK_M}], got {tile_group.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"tiled_gmm: x and w must share a dtype, got {x.dtype} and {w.dtype}")


def tiled_gmm(x, w, tile_group, *, transpose_rhs: bool = False, interpret: bool = False):
    """The kernel: ``x [M, K]``, ``w [G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``),
    ``tile_group [M / BLOCK_M]`` int32 -> ``[M, N]`` in ``x.dtype``; rows of ``-1`` tiles are left
    unwritten (unspecified)."""
    check_tiled_gmm_args(x, w, tile_group, transpose_rhs)
    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    block_n, slots, block_k = tiling(n)

    def body(group_ref, x_ref, w_ref, o_ref):
        ni, mi = lax.axis_index("n"), lax.axis_index("m")
        group = group_ref[mi]

        @pl.when(group >= 0)
        def _():
            def accumulate(acc_ref):
                def step(_, x_smem, w_smem):
                    plgpu.wgmma(acc_ref, x_smem, w_smem.T if transpose_rhs else w_smem)

                # delay_release: the asynchronous product of a step still reads its slot.
                w_spec = (plgpu.BlockSpec((block_n, block_k), lambda kk: (ni, kk), delay_release=1)
                          if transpose_rhs else
                          plgpu.BlockSpec((block_k, block_n), lambda kk: (kk, ni), delay_release=1))
                x_spec = plgpu.BlockSpec((BLOCK_M, block_k), lambda kk: (mi, kk), delay_release=1)
                plgpu.emit_pipeline(
                    step, grid=(k // block_k,), in_specs=[x_spec, w_spec],
                    max_concurrent_steps=slots,
                )(x_ref, w_ref.at[group])
                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((BLOCK_M, block_n)))

            def store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, o_ref.at[pl.ds(mi * BLOCK_M, BLOCK_M), pl.ds(ni * block_n, block_n)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(store, plgpu.SMEM((BLOCK_M, block_n), x.dtype))

    run = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(n // block_n, m // BLOCK_M), grid_names=("n", "m"), kernel_name="tiled_gmm",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return run(tile_group, x, w)


__all__ = ["BLOCK_K", "BLOCK_M", "check_tiled_gmm_args", "tiled_gmm", "tiled_gmm_reference",
           "tiling"]
