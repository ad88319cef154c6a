"""Grouped matmul of the experts: ``x [M, K]`` rows in group order times ``w [G, K, N]``.

Two implementations behind one call, chosen by name:

- ``"ragged_dot"`` (reference, every backend): ``jax.lax.ragged_dot``, fp32 accumulation and output;
- ``"mosaic"`` (Hopper GPUs): Mosaic GPU kernels under a ``custom_vjp``, fp32 accumulation, output
  in the operands' dtype (bf16: what the kernels store; widening it would only add bytes to every
  elementwise pass over a worst-case buffer). Fail-closed (the rule of jla's ``impl="auto"``):
  shapes, dtypes or platforms the kernels do not cover take the reference.

Rows past ``sum(group_sizes)`` are padding: their output is unspecified for ``"mosaic"`` (zero for
``"ragged_dot"``), so callers mask them.

**Tile-aligned rows.** An expert-parallel dropless buffer is sized for the worst case (``E_p``
times the balanced load), and jax's ``ragged_dot_mgpu`` kernel runs its full WGMMA loop on every
row tile of the buffer, padding included. So the dispatches lay rows out with every group starting
on a multiple of :func:`row_alignment` (zero rows in between) and say so (``aligned=True``); the
forward and input gradient then run :mod:`pallas_kernels.tiled_gmm`, which skips the tiles past the
last group, and the buffer costs its real rows. Unaligned rows take jax's kernels. The weight
gradient is jax's ``transposed_ragged_dot_mgpu`` either way: it walks each group's own rows.
"""

from __future__ import annotations

import functools
import typing
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.config.moe import GroupedMatmul
from k3jax.devices import hopper_gpus
from pallas_kernels.row_tiles import TILE_ROWS, column_tile  # the kernels are imported lazily

GROUPED_MATMULS = typing.get_args(GroupedMatmul)

# Tile sizes of jax's Mosaic kernels (H100/H200 friendly; the kernels' own sweeps pick among these).
_BLOCK_M, _BLOCK_N, _BLOCK_K, _STAGES, _GRID_N = 128, 128, 64, 4, 1
# The weight gradient in output tiles of 128 rows (0.116 ms against 0.138 with 64 on an H200 at
# k3_small's experts, 384 x 384 from 131,072 rows) by ``column_tile(N)`` columns.
_T_BLOCK_M, _T_BLOCK_K = 128, 64


def check_grouped_matmul(name: str) -> None:
    if name not in GROUPED_MATMULS:
        raise ValueError(f"grouped_matmul={name!r} is not known; expected one of {GROUPED_MATMULS}")


def row_alignment(impl: str) -> int:
    """Rows each group should start on a multiple of, for ``impl`` to skip padding (1: any)."""
    check_grouped_matmul(impl)
    return TILE_ROWS if impl == "mosaic" else 1


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   impl: str = "ragged_dot", aligned: bool = False) -> jax.Array:
    """``y[r] = x[r] @ w[g(r)]`` for rows in group order. ``[M, K]``, ``[G, K, N]``, ``[G]`` int32
    -> ``[M, N]`` (fp32 for ``ragged_dot``, ``x.dtype`` for ``mosaic``). ``aligned``: every group
    size is a multiple of ``row_alignment(impl)`` and ``M`` is too (the caller's promise; padding
    rows inside a group must be zero rows)."""
    check_grouped_matmul(impl)
    if impl == "mosaic" and _mosaic_covers(x, w):
        kernels = TILED_KERNELS if runs_on_tiles(x, w, impl, aligned) else RAGGED_KERNELS
        return kernel_gmm(x, w, group_sizes.astype(jnp.int32), kernels)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


def runs_on_tiles(x: jax.Array, w: jax.Array, impl: str, aligned: bool) -> bool:
    """Whether :func:`grouped_matmul` runs the tile kernel, which leaves the rows of tiles past the
    last group unwritten in its output and in its input gradient (callers that then compute on
    those rows must skip them too: :mod:`k3jax.ops.tiled_glu`)."""
    return (impl == "mosaic" and aligned and x.shape[0] % TILE_ROWS == 0
            and _mosaic_covers(x, w))


def _mosaic_covers(x: jax.Array, w: jax.Array) -> bool:
    """The shapes, dtypes and devices the Mosaic kernels handle (else: reference path). Hopper
    GPUs only: the kernels issue sm_90 WGMMAs, which an older GPU cannot compile."""
    _, k, n = w.shape
    return (hopper_gpus() and x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)
            # forward tiles K by _BLOCK_K and N by _BLOCK_N; the input gradient swaps K and N; the
            # weight gradient tiles K by _T_BLOCK_M and N by column_tile(N): multiples of 128
            # cover all.
            and k % 128 == 0 and n % 128 == 0)


def tile_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Group of each ``TILE_ROWS``-row tile of tile-aligned rows, ``-1`` past the last group:
    ``[G]`` -> ``[rows / TILE_ROWS]`` int32."""
    ends = jnp.cumsum(group_sizes)
    starts = jnp.arange(rows // TILE_ROWS, dtype=ends.dtype) * TILE_ROWS
    group = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
    return jnp.where(starts < ends[-1], group, -1)


@functools.lru_cache(maxsize=1)
def _jax_kernels():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


# jit: every MoE layer calls the kernels with the same shapes, and a jitted call is lowered once
# and shared by all call sites (the Mosaic lowering otherwise repeats per layer and per direction).
@functools.partial(jax.jit, static_argnames=("transpose_rhs",))
def _ragged_kernel(x, w, group_sizes, transpose_rhs=False):
    ragged, _ = _jax_kernels()
    return ragged(x, w, group_sizes=group_sizes, block_m=_BLOCK_M, block_n=_BLOCK_N,
                  block_k=_BLOCK_K, max_concurrent_steps=_STAGES, grid_block_n=_GRID_N,
                  transpose_rhs=transpose_rhs)


@functools.partial(jax.jit, static_argnames=("transpose_rhs",))
def _tiled_kernel(x, w, group_sizes, transpose_rhs=False):
    from pallas_kernels.tiled_gmm import tiled_gmm
    return tiled_gmm(x, w, tile_groups(group_sizes, x.shape[0]), transpose_rhs=transpose_rhs)


def weight_grad_tiling(n: int) -> tuple[int, int, int, int]:
    """``(rows, columns, slots, K step)`` of the weight gradient's output tiles for a cotangent
    ``N`` columns wide (the rows tile the input's width)."""
    return _T_BLOCK_M, column_tile(n), _STAGES, _T_BLOCK_K


def weight_grad_on_tiles(x, g, group_sizes, tiling: tuple[int, int, int, int]):
    """``[G, K, N]`` weight gradient of ``x [M, K]`` and ``g [M, N]`` by jax's transposed Mosaic
    kernel at ``tiling`` (:func:`weight_grad_tiling`'s form)."""
    _, transposed = _jax_kernels()
    rows, columns, slots, k_step = tiling
    return transposed(x, g, group_sizes=group_sizes, block_m=rows, block_n=columns,
                      block_k=k_step, max_concurrent_steps=slots, grid_block_n=_GRID_N)


@jax.jit
def _weight_grad_kernel(x, g, group_sizes):
    return weight_grad_on_tiles(x, g, group_sizes, weight_grad_tiling(g.shape[1]))


class GMMKernels(NamedTuple):
    """The kernels a :func:`kernel_gmm` is built from.

    ``forward(x [M, K], w [G, K, N], sizes [G], transpose_rhs) -> [M, N]`` in ``x.dtype`` (with
    ``transpose_rhs``: ``w`` is ``[G, N, K]``); rows past ``sum(sizes)`` may hold anything.
    ``weight_grad(x [M, K], g [M, N], sizes [G]) -> [G, K, N]``: ``x_g^T g_g`` per group.
    ``zero_padding_grad``: zero the input gradient's rows past ``sum(sizes)`` (one more pass over
    the buffer). The tile kernels leave them unspecified like their forward rows: on tile-aligned
    rows nothing reads them (the weight gradient walks each group's rows, which end on a tile).
    """
    forward: Callable
    weight_grad: Callable
    zero_padding_grad: bool


RAGGED_KERNELS = GMMKernels(_ragged_kernel, _weight_grad_kernel, zero_padding_grad=True)
TILED_KERNELS = GMMKernels(_tiled_kernel, _weight_grad_kernel, zero_padding_grad=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def kernel_gmm(x, w, group_sizes, kernels: GMMKernels):
    """:func:`grouped_matmul` from ``kernels`` -> ``[M, N]`` in ``x.dtype`` (padding rows
    unspecified; so are the input gradient's unless ``kernels.zero_padding_grad``)."""
    return kernels.forward(x, w, group_sizes, False)


def _kernel_gmm_fwd(x, w, group_sizes, kernels):
    return kernel_gmm(x, w, group_sizes, kernels), (x, w, group_sizes)


def _kernel_gmm_bwd(kernels, res, g):
    x, w, group_sizes = res
    g = g.astype(x.dtype)
    # dx = g @ w[g]^T (rows in group order); dw[g] = x_g^T g_g (the ragged axis is contracted).
    dx = kernels.forward(g, w, group_sizes, True)
    dw = kernels.weight_grad(x, g, group_sizes)
    if kernels.zero_padding_grad:   # padding rows past the groups carry no gradient
        rows = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
        dx = jnp.where(rows[:, None], dx, 0)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


kernel_gmm.defvjp(_kernel_gmm_fwd, _kernel_gmm_bwd)

__all__ = ["GMMKernels", "GROUPED_MATMULS", "RAGGED_KERNELS", "TILED_KERNELS",
           "check_grouped_matmul", "grouped_matmul", "kernel_gmm", "row_alignment", "runs_on_tiles",
           "tile_groups", "weight_grad_on_tiles", "weight_grad_tiling"]
