"""RMSNorm, the formula (docs/math.md, Conventions): statistics in fp32, one rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * w`` over the last axis: ``[..., d] -> [..., d]`` in
    x.dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


__all__ = ["rms_norm"]
