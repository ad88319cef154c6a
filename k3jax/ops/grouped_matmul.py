"""Grouped matmul of the experts: ``x [M, K]`` rows in group order times ``w [G, K, N]`` -> fp32.

Two implementations behind one call, chosen by name:

- ``"ragged_dot"`` (reference, every backend): ``jax.lax.ragged_dot`` with fp32 accumulation;
- ``"mosaic"`` (Hopper GPUs): jax's Mosaic GPU kernels from ``jax.experimental.pallas.ops.gpu``
  (``ragged_dot_mgpu`` forward and input gradient, ``transposed_ragged_dot_mgpu`` for the weight
  gradient) under a ``custom_vjp``. It is fail-closed (the rule of jla's ``impl="auto"``): shapes,
  dtypes or platforms the kernels do not cover take the reference path.

Rows past ``sum(group_sizes)`` are padding: their output is unspecified for ``"mosaic"`` (zero for
``"ragged_dot"``), so callers mask them.
"""

from __future__ import annotations

import functools

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
                   impl: str = "ragged_dot") -> jax.Array:
    """``y[r] = x[r] @ w[g(r)]`` for rows in group order. ``[M, K]``, ``[G, K, N]``, ``[G]`` int32
    -> ``[M, N]`` fp32."""
    check_grouped_matmul(impl)
    if impl == "mosaic" and _mosaic_covers(x, w):
        return _mosaic_gmm(x, w, group_sizes.astype(jnp.int32))
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


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


@jax.custom_vjp
def _mosaic_gmm(x, w, group_sizes):
    return _fwd_kernel(x, w, group_sizes).astype(jnp.float32)


def _mosaic_fwd(x, w, group_sizes):
    return _mosaic_gmm(x, w, group_sizes), (x, w, group_sizes)


@jax.jit
def _weight_grad_kernel(x, g, group_sizes):
    _, transposed = _kernels()
    return transposed(x, g, group_sizes=group_sizes, block_m=_T_BLOCK_M, block_n=_T_BLOCK_N,
                      block_k=_T_BLOCK_K, max_concurrent_steps=_STAGES, grid_block_n=_GRID_N)


def _mosaic_bwd(res, g):
    x, w, group_sizes = res
    g = g.astype(x.dtype)
    # dx = g @ w[g]^T (rows in group order); dw[g] = x_g^T g_g (the ragged axis is contracted).
    dx = _fwd_kernel(g, w, group_sizes, transpose_rhs=True)
    dw = _weight_grad_kernel(x, g, group_sizes)
    # Padding rows past the groups carry no gradient (their forward output is masked by callers).
    rows = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    dx = jnp.where(rows[:, None], dx, 0)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_mosaic_gmm.defvjp(_mosaic_fwd, _mosaic_bwd)

__all__ = ["GROUPED_MATMULS", "check_grouped_matmul", "grouped_matmul"]
