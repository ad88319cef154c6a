"""Grouped matmul of the experts: ``x [M, K]`` rows in group order times ``w [G, K, N]`` -> fp32.

Two implementations behind one call, chosen by name:

- ``"ragged_dot"`` (reference, every backend): ``jax.lax.ragged_dot`` with fp32 accumulation;
- ``"mosaic"`` (Hopper GPUs): jax's Mosaic GPU kernels from ``jax.experimental.pallas.ops.gpu``
  (``ragged_dot_mgpu`` forward and input gradient, ``transposed_ragged_dot_mgpu`` for the weight
  gradient) under a ``custom_vjp``. It is fail-closed (the rule of jla's ``impl="auto"``): shapes,
  dtypes or platforms the kernels do not cover take the reference path.

Rows past ``sum(group_sizes)`` are padding: their output is unspecified for ``"mosaic"`` (zero for
``"ragged_dot"``), so callers mask them. jax's forward kernel runs its full WGMMA loop on every row
tile, padding included, which doubles the work of a dropless expert-parallel buffer (sized for the
worst case, twice the balanced load on two devices); given ``expected_rows`` (the balanced load),
the Mosaic path runs the rows in :func:`row_segments` pieces and skips the pieces past the last
real row. The weight gradient's kernel walks each group's own rows, so it runs once, unsplit.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

GROUPED_MATMULS = ("ragged_dot", "mosaic")

# Tile sizes of the Mosaic kernels (H100/H200 friendly; the kernels' own sweeps pick among these).
_BLOCK_M, _BLOCK_N, _BLOCK_K, _STAGES, _GRID_N = 128, 128, 64, 4, 1
_T_BLOCK_M, _T_BLOCK_N, _T_BLOCK_K = 64, 128, 64


def check_grouped_matmul(name: str) -> None:
    if name not in GROUPED_MATMULS:
        raise ValueError(f"grouped_matmul={name!r} is not known; expected one of {GROUPED_MATMULS}")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   impl: str = "ragged_dot", expected_rows: int | None = None) -> jax.Array:
    """``y[r] = x[r] @ w[g(r)]`` for rows in group order. ``[M, K]``, ``[G, K, N]``, ``[G]`` int32
    -> ``[M, N]`` fp32. ``expected_rows``: the usual number of real rows, when ``M`` is a
    worst-case size (the Mosaic path then skips row pieces past the real rows)."""
    check_grouped_matmul(impl)
    if impl == "mosaic" and _mosaic_covers(x, w):
        m = x.shape[0]
        segments = tuple(row_segments(m, expected_rows)) if expected_rows else ((0, m),)
        return segmented_gmm(x, w, group_sizes.astype(jnp.int32), segments, MOSAIC_KERNELS)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


def row_segments(rows: int, expected: int, max_coarse: int = 8) -> list[tuple[int, int]]:
    """``[start, end)`` pieces of a buffer of ``rows`` rows whose real load is usually ``expected``.

    The first piece covers ``expected`` rows; then two fine pieces of ``expected / 16`` rows (a
    balanced load's usual overshoot costs at most one of them); then coarse pieces of twice that,
    or of whatever size keeps them at ``max_coarse``. Pieces after the first run only when real rows
    reach them: a load over ``expected`` by up to an eighth computes at most ``expected / 16`` rows
    past its last real row, a larger one at most one coarse piece; and the kernels see a handful of
    row counts, not one per piece (each is a kernel to compile).
    """
    first = max(1, min(rows, expected))
    fine = -(-expected // 16)
    bounds = [0, first]
    for _ in range(2):
        if bounds[-1] < rows:
            bounds.append(min(rows, bounds[-1] + fine))
    coarse = max(2 * fine, -(-(rows - bounds[-1]) // max_coarse))
    while bounds[-1] < rows:
        bounds.append(min(rows, bounds[-1] + coarse))
    return list(zip(bounds[:-1], bounds[1:]))


def _in_pieces(kernel, x: jax.Array, group_sizes: jax.Array, segments, cols: int) -> jax.Array:
    """``kernel(x_piece, piece_group_sizes) -> [rows, cols]`` on each ``[start, end)`` segment of
    ``x``'s rows, concatenated; a segment past the last real row is skipped (zeros)."""
    if len(segments) == 1:
        return kernel(x, group_sizes)
    ends = jnp.cumsum(group_sizes)
    starts, total = ends - group_sizes, ends[-1]
    outs = []
    for (a, b), piece in zip(segments, jax.lax.split(x, [b - a for a, b in segments])):
        sizes = (jnp.clip(ends, a, b) - jnp.clip(starts, a, b)).astype(jnp.int32)
        if a == 0:
            outs.append(kernel(piece, sizes))
        else:
            outs.append(jax.lax.cond(total > a, kernel,
                                     lambda p, s: jnp.zeros((p.shape[0], cols), p.dtype),
                                     piece, sizes))
    return jnp.concatenate(outs)


def _mosaic_covers(x: jax.Array, w: jax.Array) -> bool:
    """The shapes, dtypes and platform the Mosaic kernels handle (else: reference path)."""
    try:
        gpu = jax.devices()[0].platform == "gpu"
    except RuntimeError:
        gpu = False
    _, k, n = w.shape
    return (gpu and x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)
            # forward tiles K by _BLOCK_K and N by _BLOCK_N; the input gradient swaps K and N; the
            # weight gradient tiles K by _T_BLOCK_M and N by _T_BLOCK_N: multiples of 128 cover all.
            and k % 128 == 0 and n % 128 == 0)


@functools.lru_cache(maxsize=1)
def _kernels():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


# jit: every MoE layer calls the kernels with the same shapes, and a jitted call is lowered once
# and shared by all call sites (the Mosaic lowering otherwise repeats per layer and per direction).
@functools.partial(jax.jit, static_argnames=("transpose_rhs",))
def _fwd_kernel(x, w, group_sizes, transpose_rhs=False):
    ragged, _ = _kernels()
    return ragged(x, w, group_sizes=group_sizes, block_m=_BLOCK_M, block_n=_BLOCK_N,
                  block_k=_BLOCK_K, max_concurrent_steps=_STAGES, grid_block_n=_GRID_N,
                  transpose_rhs=transpose_rhs)


@jax.jit
def _weight_grad_kernel(x, g, group_sizes):
    _, transposed = _kernels()
    return transposed(x, g, group_sizes=group_sizes, block_m=_T_BLOCK_M, block_n=_T_BLOCK_N,
                      block_k=_T_BLOCK_K, max_concurrent_steps=_STAGES, grid_block_n=_GRID_N)


class GMMKernels(NamedTuple):
    """The two kernels a :func:`segmented_gmm` is built from.

    ``forward(x [M, K], w [G, K, N], sizes [G], transpose_rhs) -> [M, N]`` in ``x.dtype`` (with
    ``transpose_rhs``: ``w`` is ``[G, N, K]``); rows past ``sum(sizes)`` may hold anything.
    ``weight_grad(x [M, K], g [M, N], sizes [G]) -> [G, K, N]``: ``x_g^T g_g`` per group.
    """
    forward: Callable
    weight_grad: Callable


MOSAIC_KERNELS = GMMKernels(_fwd_kernel, _weight_grad_kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def segmented_gmm(x, w, group_sizes, segments, kernels: GMMKernels):
    """:func:`grouped_matmul` from ``kernels``, the rows run in ``segments`` (``[start, end)``
    pieces, the first from row 0), skipping pieces past ``sum(group_sizes)`` -> ``[M, N]`` fp32."""
    def forward(piece, sizes):
        return kernels.forward(piece, w, sizes, False)
    return _in_pieces(forward, x, group_sizes, segments, w.shape[2]).astype(jnp.float32)


def _segmented_fwd(x, w, group_sizes, segments, kernels):
    return segmented_gmm(x, w, group_sizes, segments, kernels), (x, w, group_sizes)


def _segmented_bwd(segments, kernels, res, g):
    x, w, group_sizes = res
    g = g.astype(x.dtype)

    # dx = g @ w[g]^T (rows in group order); dw[g] = x_g^T g_g (the ragged axis is contracted).
    def input_grad(piece, sizes):
        return kernels.forward(piece, w, sizes, True)
    dx = _in_pieces(input_grad, g, group_sizes, segments, x.shape[1])
    dw = kernels.weight_grad(x, g, group_sizes)
    # Padding rows past the groups carry no gradient (their forward output is masked by callers).
    rows = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    dx = jnp.where(rows[:, None], dx, 0)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


segmented_gmm.defvjp(_segmented_fwd, _segmented_bwd)

__all__ = ["GMMKernels", "GROUPED_MATMULS", "MOSAIC_KERNELS", "check_grouped_matmul",
           "grouped_matmul", "row_segments", "segmented_gmm"]
