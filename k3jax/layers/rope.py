"""Rotary position embedding, kept only as an ablation option for MLA (K3 itself is NoPE)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.documents import segment_starts


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs ``(x[2i], x[2i+1])``. ``x [B, T, ..., D]``, ``positions [B, T]`` int."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B, T, D/2]
    ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
    x32 = x.astype(jnp.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def segment_positions(segment_ids: jax.Array | None, batch: int, length: int,
                      offset: jax.Array | int = 0) -> jax.Array:
    """Positions ``[B, T]`` that restart at 0 at every segment start (plus ``offset``)."""
    pos = jnp.broadcast_to(jnp.arange(length), (batch, length))
    if segment_ids is None:
        return pos + offset
    last_start = jax.lax.cummax(jnp.where(segment_starts(segment_ids), pos, 0), axis=1)
    return pos - last_start + offset
