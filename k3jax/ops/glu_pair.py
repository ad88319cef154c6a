"""The gated activation of one product that holds both its inputs (math §6).

A feed-forward block that computes its gate and up columns as one product, ``x @ [W_gate | W_up]``
stacked as ``[d, 2, m]``, gets its input's gradient as one product as well (``d_pair @ W^T`` with
``2m`` contracted), where two separate products would write two gradients of ``x`` for XLA to add.
:func:`glu_of_pair` is ``act(pair[..., 0, :], pair[..., 1, :])`` with a backward that keeps only
the product and computes the activation's derivatives again from it: autodiff of the fp32 formula
keeps its ``tanh`` and sigmoid values, fp32 arrays of the product's size that the forward writes
and the backward reads. On a Hopper GPU the backward is the Triton kernel of
:mod:`pallas_kernels.glu_pair` (one pass: XLA's fusions of the same formula took a second pass or
twice the arithmetic); elsewhere the formula below, which is also the kernel's reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.ops.activations import GLUSpec
from k3jax.ops.kernel_launch import launcher, takes_kernels
from k3jax.ops.per_device import on_own_rows

IMPLS = ("auto", "pallas", "reference")


def glu_of_pair(pair: jax.Array, act: GLUSpec, impl: str = "auto",
                interpret: bool = False) -> jax.Array:
    """``act(pair[..., 0, :], pair[..., 1, :])`` ``[..., m]`` in ``pair.dtype``, computed in fp32,
    for ``pair [..., 2, m]`` (the gate first).

    ``impl``: the backward's path: ``"pallas"`` the kernel (ValueError when it cannot take the
    call), ``"reference"`` the formula, ``"auto"`` the kernel where it can run (a Hopper GPU,
    rows and columns that its blocks divide). ``interpret``: run the kernel in Pallas's
    interpreter (CPU tests)."""
    if pair.ndim < 2 or pair.shape[-2] != 2:
        raise ValueError(f"glu_of_pair: pair must be [..., 2, m], got shape {pair.shape}")
    if impl not in IMPLS:
        raise ValueError(f"glu_of_pair: impl must be one of {IMPLS}, got {impl!r}")
    return _glu_of_pair(pair, act, _takes_kernel(pair, impl), interpret)


def _takes_kernel(pair, impl: str) -> bool:
    """Whether the backward runs the kernel (for ``"pallas"`` the kernel's argument checks run
    here, so a call it cannot take fails now, not when differentiated)."""
    n, m = math.prod(pair.shape[:-2]), pair.shape[-1]
    return takes_kernels(impl, "glu_pair", jax.ShapeDtypeStruct((n, 2, m), pair.dtype),
                         jax.ShapeDtypeStruct((n, m), pair.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _glu_of_pair(pair, act, kernel: bool, interpret: bool):
    return act(pair[..., 0, :], pair[..., 1, :])


def _fwd(pair, act, kernel, interpret):
    return _glu_of_pair(pair, act, kernel, interpret), pair


def _bwd(act, kernel, interpret, pair, dh):
    rows = pair.reshape(-1, 2, pair.shape[-1])
    dh = dh.reshape(-1, pair.shape[-1]).astype(pair.dtype)
    if kernel:
        vjp = launcher("glu_pair", "glu_pair_vjp", ("act",))
        d_pair = on_own_rows(lambda p, g: vjp(p, g, act=act, interpret=interpret), rows.shape[0],
                             lambda r: (P(r), P(r)), lambda r: P(r))(rows, dh)
    else:
        # The barrier keeps XLA from taking the forward's fp32 intermediates instead of computing
        # them again here (what jax.checkpoint's barrier does for glu_recomputed); the kernel
        # computes them itself.
        d_pair = glu_pair_reference(jax.lax.optimization_barrier(rows), dh, act)
    return (d_pair.reshape(pair.shape),)


_glu_of_pair.defvjp(_fwd, _bwd)


def glu_pair_reference(pair: jax.Array, dh: jax.Array, act: GLUSpec) -> jax.Array:
    """``d_pair [..., 2, m]`` in ``pair.dtype``: ``act.vjp`` of the two halves in fp32, stacked,
    for the output gradient ``dh [..., m]``."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    dgate, dup = act.vjp(f32(pair[..., 0, :]), f32(pair[..., 1, :]), f32(dh))
    return jnp.stack([dgate, dup], axis=-2).astype(pair.dtype)


__all__ = ["IMPLS", "glu_of_pair", "glu_pair_reference"]
