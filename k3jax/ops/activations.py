"""Gated activations of the feed-forward blocks (SPEC 6), computed in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def situ_glu(gate: jax.Array, up: jax.Array, beta_gate: float = 4.0, beta_up: float = 25.0) -> jax.Array:
    """SiTU-GLU: ``[beta_g tanh(a / beta_g) sigmoid(a)] * [beta_u tanh(b / beta_u)]``.

    The soft caps bound both branches, which is what keeps K3's FFN outputs from spiking.
    Shapes: ``gate``, ``up`` ``[..., m]`` -> ``[..., m]`` in the input dtype.
    """
    a, b = gate.astype(jnp.float32), up.astype(jnp.float32)
    y = beta_gate * jnp.tanh(a / beta_gate) * jax.nn.sigmoid(a) * (beta_up * jnp.tanh(b / beta_up))
    return y.astype(gate.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU: ``silu(a) * b`` in fp32, cast back. Shapes as :func:`situ_glu`."""
    y = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return y.astype(gate.dtype)


def glu(gate: jax.Array, up: jax.Array, activation: str, beta_gate: float = 4.0,
        beta_up: float = 25.0) -> jax.Array:
    """The gated activation named by a config (``"swiglu"`` or ``"situ_glu"``)."""
    if activation == "swiglu":
        return swiglu(gate, up)
    if activation == "situ_glu":
        return situ_glu(gate, up, beta_gate, beta_up)
    raise ValueError(f"activation={activation!r} is invalid: expected 'swiglu' or 'situ_glu'")
