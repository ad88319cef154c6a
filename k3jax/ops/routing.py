"""The sigmoid top-k router of the MoE and its auxiliary balance loss (math §6 and 7).

Shapes: ``N`` routed tokens, ``E`` experts, ``k`` experts per token. Everything here runs in fp32:
routing decisions made in bf16 flip on near-ties and make the balancing statistics noisy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.fp32_projection import fp32_projection

# Added to the sum of the chosen scores before renormalising (math §6), so an all-zero row stays
# finite.
RENORM_EPS = 1e-20


def router_scores(x: jax.Array, w_router: jax.Array) -> jax.Array:
    """``sigmoid(x W)`` in fp32. ``x`` ``[..., d]``, ``w_router`` ``[d, E]`` -> ``[..., E]``
    fp32."""
    return jax.nn.sigmoid(fp32_projection(x, w_router))


def select_experts(scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """The ``top_k`` experts of ``scores + bias`` per token: ``[..., E]``, ``[E]`` -> ids
    ``[..., k]`` int32.

    The bias only chooses; it is a balancing state, so no gradient flows into it.
    """
    biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    _, ids = jax.lax.top_k(biased, top_k)
    return ids.astype(jnp.int32)


def gate_weights(scores: jax.Array, ids: jax.Array, routed_scaling_factor: float) -> jax.Array:
    """Renormalised unbiased scores of the chosen experts times ``routed_scaling_factor``.

    ``w = s[ids] / (sum s[ids] + 1e-20) * rsf``. Shapes ``[..., E]``, ``[..., k]`` -> ``[..., k]``
    fp32.
    """
    chosen = jnp.take_along_axis(scores, ids, axis=-1)
    return chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + RENORM_EPS) * routed_scaling_factor


def route(scores: jax.Array, bias: jax.Array, top_k: int,
          routed_scaling_factor: float) -> tuple[jax.Array, jax.Array]:
    """Select with ``scores + bias``, weigh with ``scores``: ->
    ``(ids [..., k] int32, weights [..., k] fp32)``."""
    ids = select_experts(scores, bias, top_k)
    return ids, gate_weights(scores, ids, routed_scaling_factor)


def aux_balance_loss(scores: jax.Array, ids: jax.Array, alpha: float,
                     per_sequence: bool = False) -> jax.Array:
    """DeepSeek-V3 balance loss ``alpha * E * sum_j f_j P_j`` (math §7), a scalar fp32.

    ``scores`` ``[B, T, E]`` (sigmoid scores), ``ids`` ``[B, T, k]``. ``f_j`` is expert j's fraction
    of the routed slots (a count: no gradient), ``P_j`` its mean share ``s_tj / sum_i s_ti``. With
    ``per_sequence`` the loss is taken per sequence and averaged over the batch (DeepSeek-V3's
    sequence-wise form); otherwise over all ``B * T`` tokens at once. A perfectly even router gives
    ``alpha``.
    """
    if scores.ndim != 3 or ids.ndim != 3 or scores.shape[:2] != ids.shape[:2]:
        raise ValueError(f"aux_balance_loss: expected scores [B, T, E] and ids [B, T, k], got "
                         f"{scores.shape} and {ids.shape}")
    num_experts, top_k = scores.shape[-1], ids.shape[-1]
    share = scores / (jnp.sum(scores, axis=-1, keepdims=True) + RENORM_EPS)
    slots = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=-2)   # [B, T, E]
    axes = (1,) if per_sequence else (0, 1)
    f = jnp.mean(slots, axis=axes) / top_k            # fraction of routed slots per expert
    p = jnp.mean(share, axis=axes)                    # mean score share per expert
    per_group = num_experts * jnp.sum(f * p, axis=-1)
    return alpha * jnp.mean(per_group)


__all__ = ["RENORM_EPS", "aux_balance_loss", "gate_weights", "route", "router_scores",
           "select_experts"]
