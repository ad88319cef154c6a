"""Mosaic GPU kernels: the experts' gated activation and its input gradients on row tiles that each
belong to one group, skipping tiles that belong to none.

Reference: :func:`tiled_glu_reference` (the activation and its written-out gradient on the tiles
that hold a group). The rows are laid out as for :mod:`pallas_kernels.tiled_gmm`: every group
starts on a multiple of ``BLOCK_M`` rows, so tile ``t`` is one group's or padding past the last
group (``tile_group[t] == -1``). A dropless expert-parallel buffer is sized for the worst case (up
to ``E_p`` times its real rows); XLA's elementwise fusions would compute the activation, its
gradient and their casts on every row, these kernels only on the real tiles. One CTA per row tile
pipelines ``BLOCK_N``-column blocks through shared memory and computes in fp32; each block's results
leave through one of two shared-memory buffers, so a block's stores overlap the next block's math.

Rows of ``-1`` tiles are left unwritten (unspecified), as in the tile matmul that consumes them.

The activation is the caller's ``act``, a hashable static argument (the ops pass their
``GLUSpec``), called on fp32 blocks as ``act(gate, up) -> h`` and
``act.vjp(gate, up, dh) -> (dgate, dup)``: the kernels own the tile schedule and the activation's
math stays with the ops, which call these kernels (a kernel module imports nothing from the ops).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.row_tiles import TILE_ROWS

# On an H200 at k3_small's expert width (384 columns), 32-column blocks with two output buffers
# took the gradient kernel from 0.316 to 0.188 ms and the forward from 0.154 to 0.123 (64 columns
# and one buffer before; docs/benchmarks.md).
BLOCK_M, BLOCK_N, STAGES, OUT_BUFFERS = TILE_ROWS, 32, 2, 2


def tiled_glu_reference(gate, up, tile_group, act, dh=None):
    """``act(gate, up)`` (or, given ``dh``, its ``(dgate, dup)``) in fp32, cast to ``gate.dtype``,
    zero on rows of ``-1`` tiles. ``gate``, ``up``, ``dh`` ``[M, N]``;
    ``tile_group [M / BLOCK_M]``."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    real = (jnp.repeat(tile_group, BLOCK_M) >= 0)[:, None]
    if dh is None:
        outs = (act(f32(gate), f32(up)),)
    else:
        outs = act.vjp(f32(gate), f32(up), f32(dh))
    outs = tuple(jnp.where(real, o, 0.0).astype(gate.dtype) for o in outs)
    return outs[0] if dh is None else outs


def check_tiled_glu_args(gate, up, tile_group, dh=None) -> None:
    m, n = gate.shape
    for name, a in (("up", up), ("dh", dh)):
        if a is not None and (a.shape != gate.shape or a.dtype != gate.dtype):
            raise ValueError(f"tiled_glu: {name} must match gate {gate.shape} {gate.dtype}, "
                             f"got {a.shape} {a.dtype}")
    if m % BLOCK_M or n % BLOCK_N:
        raise ValueError(f"tiled_glu: rows M={m} and columns N={n} must be multiples of "
                         f"{BLOCK_M} and {BLOCK_N}")
    if tile_group.shape != (m // BLOCK_M,):
        raise ValueError(f"tiled_glu: tile_group must be [{m // BLOCK_M}], got {tile_group.shape}")


def _run_on_tiles(math, operands, num_out: int, tile_group, name: str, interpret: bool):
    """``num_out`` arrays like ``operands[0]`` whose blocks are ``math(*operand blocks)`` (fp32
    in, fp32 out), on the row tiles whose ``tile_group`` is not ``-1``."""
    m, n = operands[0].shape
    dtype = operands[0].dtype

    def body(group_ref, *refs):
        mi = lax.axis_index("m")
        in_refs, out_refs = refs[:len(operands)], refs[len(operands):]

        def tiles(*out_smem):
            def step(idx, *in_smem):
                cols = pl.ds(idx[0] * BLOCK_N, BLOCK_N)
                buffer = lax.rem(idx[0], OUT_BUFFERS)
                results = math(*(r[...].astype(jnp.float32) for r in in_smem))
                for smem, value in zip(out_smem, results):
                    smem.at[buffer][...] = value.astype(dtype)
                plgpu.commit_smem()
                for smem, gmem in zip(out_smem, out_refs):
                    plgpu.copy_smem_to_gmem(smem.at[buffer],
                                            gmem.at[pl.ds(mi * BLOCK_M, BLOCK_M), cols])
                # The next block writes the other buffer: the stores of the block before this
                # one, which used it, must have left shared memory.
                plgpu.wait_smem_to_gmem(OUT_BUFFERS - 1, wait_read_only=True)

            spec = plgpu.BlockSpec((BLOCK_M, BLOCK_N), lambda j: (mi, j))
            plgpu.emit_pipeline(step, grid=(n // BLOCK_N,), in_specs=[spec] * len(operands),
                                max_concurrent_steps=STAGES)(*in_refs)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        # Outputs leave through shared memory written in the step (not the pipeline's out_specs,
        # whose predicated copies the Mosaic GPU interpreter cannot run).
        pl.when(group_ref[mi] >= 0)(lambda: pl.run_scoped(
            tiles, *[plgpu.SMEM((OUT_BUFFERS, BLOCK_M, BLOCK_N), dtype)] * num_out))

    run = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((m, n), dtype),) * num_out,
        grid=(m // BLOCK_M,), grid_names=("m",), kernel_name=name,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return run(tile_group, *operands)


def tiled_glu(gate, up, tile_group, *, act, interpret: bool = False):
    """``act(gate, up)``: ``gate``, ``up`` ``[M, N]``, ``tile_group [M / BLOCK_M]`` int32 ->
    ``[M, N]`` in ``gate.dtype`` (rows of ``-1`` tiles unwritten)."""
    check_tiled_glu_args(gate, up, tile_group)
    (h,) = _run_on_tiles(lambda a, b: (act(a, b),), (gate, up), 1, tile_group, "tiled_glu",
                         interpret)
    return h


def tiled_glu_vjp(gate, up, dh, tile_group, *, act, interpret: bool = False):
    """``(dgate, dup)`` of :func:`tiled_glu` for output gradient ``dh`` (all ``[M, N]``), in
    ``gate.dtype`` (rows of ``-1`` tiles unwritten)."""
    check_tiled_glu_args(gate, up, tile_group, dh)
    return _run_on_tiles(act.vjp, (gate, up, dh), 2, tile_group, "tiled_glu_vjp", interpret)


__all__ = ["BLOCK_M", "BLOCK_N", "check_tiled_glu_args", "tiled_glu", "tiled_glu_reference",
           "tiled_glu_vjp"]
