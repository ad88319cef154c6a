"""Causal depthwise short convolution with segment-aware masking and decode state (§3.1 step 2).

The weight ``[W, C]`` applies ``w[W-1]`` to the current token and ``w[W-1-i]`` to the token ``i``
steps back. A tap never reads across a segment boundary, so packed documents stay independent.
The decode state holds the last ``W-1`` inputs ``[B, W-1, C]``, oldest first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None,
                state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv (no activation).

    Args:
      x: ``[B, T, C]`` inputs.
      w: ``[W, C]`` taps.
      segment_ids: ``[B, T]`` int or None; taps only reach tokens of the same segment.
      state: ``[B, W-1, C]`` inputs preceding ``x`` (a continued sequence), or None for zeros. They
        belong to the segment of ``x``'s first token.
    Returns:
      ``(y [B, T, C], new_state [B, W-1, C])`` where ``new_state`` is the last ``W-1`` inputs.
    """
    width = w.shape[0]
    b, t, c = x.shape
    if state is None:
        state = jnp.zeros((b, width - 1, c), x.dtype)
    xs = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    if segment_ids is not None:
        first = segment_ids[:, :1]
        seg = jnp.concatenate([jnp.broadcast_to(first, (b, width - 1)), segment_ids], axis=1)
    y = jnp.zeros((b, t, c), jnp.float32)
    for i in range(width):  # i steps back; W is 4, so the loop stays tiny
        tap = jax.lax.dynamic_slice_in_dim(xs, width - 1 - i, t, axis=1).astype(jnp.float32)
        if segment_ids is not None:
            same = jax.lax.dynamic_slice_in_dim(seg, width - 1 - i, t, axis=1) == segment_ids
            tap = jnp.where(same[..., None], tap, 0.0)
        y = y + tap * w[width - 1 - i].astype(jnp.float32)
    return y.astype(x.dtype), xs[:, -(width - 1):] if width > 1 else xs[:, :0]


def causal_conv_step(x: jax.Array, w: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One decode token: ``x [B, C]``, ``state [B, W-1, C]`` -> ``(y [B, C], new_state)``."""
    window = jnp.concatenate([state.astype(x.dtype), x[:, None]], axis=1)  # [B, W, C]
    y = jnp.einsum("bwc,wc->bc", window.astype(jnp.float32), w.astype(jnp.float32))
    return y.astype(x.dtype), window[:, 1:]
