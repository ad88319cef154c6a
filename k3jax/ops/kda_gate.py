"""KDA's forget gate (math §3.1 step 4): the per-channel log-decay from the gate's projection.

Two forms, both fp32, ``g <= 0``:

- softplus (Kimi Linear): ``g = -exp(A_log[h]) softplus(f)``;
- lower bound (K3): ``g = lower_bound sigmoid(z)`` with the logits ``z = exp(A_log[h]) f``.

The lower-bound form is a function of ``z`` alone, so a caller can fold ``exp(A_log)`` into the
projection that makes ``f`` and hand the KDA op the logits (``kda(..., gate_lower_bound=...)``),
which applies :func:`bounded_gate` where it reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bounded_gate(z: jax.Array, lower_bound: float) -> jax.Array:
    """``lower_bound * sigmoid(z)`` in fp32 (``z = -inf`` gives 0: no decay). Any shape."""
    return lower_bound * jax.nn.sigmoid(z.astype(jnp.float32))


def kda_gate(f: jax.Array, a_log: jax.Array, gate: str, lower_bound: float) -> jax.Array:
    """Log-decay ``g <= 0`` from the gate pre-activation ``f [B, T, H, K]`` and ``A_log [H]``
    (fp32)."""
    a = jnp.exp(a_log.astype(jnp.float32))[:, None]  # [H, 1]
    f = f.astype(jnp.float32)
    if gate == "softplus":
        return -a * jax.nn.softplus(f)
    return bounded_gate(a * f, lower_bound)


__all__ = ["bounded_gate", "kda_gate"]
