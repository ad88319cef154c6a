"""KDA's gated head-wise output norm (math §3.1 step 7): ``RMSNorm_head(o) * w * sigmoid(g)``.

The norm is over each head's ``V`` channels with one weight ``w [V]`` shared by the heads, the
gate ``g`` the output gate's projection; fp32 math, one rounding. On a Hopper GPU the backward is
the Triton kernel of :mod:`pallas_kernels.gated_head_norm` (one pass over ``o``, ``g`` and the
output gradient, where XLA's fusions of the formula took three); elsewhere, and with
``impl="reference"``, JAX's autodiff of :func:`gated_head_norm_reference`, which is also the
kernel's reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.ops.kernel_launch import launcher, takes_kernels
from k3jax.ops.per_device import on_own_rows
from k3jax.ops.rms_norm import rms_norm

IMPLS = ("auto", "pallas", "reference")


def gated_head_norm_reference(o: jax.Array, g: jax.Array, w: jax.Array, eps: float,
                              out_dtype) -> jax.Array:
    """The formula: ``o``, ``g`` ``[..., H, V]``, ``w [V]`` -> ``[..., H, V]`` in ``out_dtype``."""
    y = rms_norm(o.astype(jnp.float32), w, eps) * jax.nn.sigmoid(g.astype(jnp.float32))
    return y.astype(out_dtype)


def gated_head_norm(o: jax.Array, g: jax.Array, w: jax.Array, eps: float, out_dtype,
                    impl: str = "auto", interpret: bool = False) -> jax.Array:
    """:func:`gated_head_norm_reference`, differentiated by the kernel where ``impl`` takes it:
    ``"pallas"`` always (ValueError when it cannot take the call), ``"auto"`` on a Hopper GPU for
    shapes it takes. ``interpret``: run the kernel in Pallas's interpreter (CPU tests)."""
    if o.ndim < 2 or g.shape != o.shape or w.shape != o.shape[-1:]:
        raise ValueError(f"gated_head_norm: o and g must be one shape [..., H, V] and w [V], got "
                         f"{o.shape}, {g.shape}, {w.shape}")
    if impl not in IMPLS:
        raise ValueError(f"gated_head_norm: impl must be one of {IMPLS}, got {impl!r}")
    if not _takes_kernel(o, g, w, impl):
        return gated_head_norm_reference(o, g, w, eps, out_dtype)
    return _kernel_path(o, g, w, float(eps), jnp.dtype(out_dtype), interpret)


def _takes_kernel(o, g, w, impl: str) -> bool:
    rows = (math.prod(o.shape[:-2]), *o.shape[-2:])
    return takes_kernels(impl, "gated_head_norm", jax.ShapeDtypeStruct(rows, o.dtype),
                         jax.ShapeDtypeStruct(rows, g.dtype), w,
                         jax.ShapeDtypeStruct(rows, o.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _kernel_path(o, g, w, eps, out_dtype, interpret):
    return gated_head_norm_reference(o, g, w, eps, out_dtype)


def _fwd(o, g, w, eps, out_dtype, interpret):
    return _kernel_path(o, g, w, eps, out_dtype, interpret), (o, g, w)


def _bwd(eps, out_dtype, interpret, res, dy):
    o, g, w = res
    rows = lambda a: a.reshape(-1, *o.shape[-2:])  # noqa: E731
    vjp = launcher("gated_head_norm", "gated_head_norm_vjp", ("eps",))
    do, dg, dw_parts = on_own_rows(
        lambda o, g, w, dy: vjp(o, g, w, dy, eps=eps, interpret=interpret), rows(o).shape[0],
        lambda r: (P(r), P(r), P(), P(r)), lambda r: (P(r), P(r), P(r)))(
        rows(o), rows(g), w, rows(dy))
    return (do.reshape(o.shape), dg.reshape(g.shape),
            jnp.sum(dw_parts, axis=(0, 1)).astype(w.dtype))


_kernel_path.defvjp(_fwd, _bwd)


__all__ = ["IMPLS", "gated_head_norm", "gated_head_norm_reference"]
