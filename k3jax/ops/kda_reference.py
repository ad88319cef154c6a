"""Kimi Delta Attention, token by token: the recurrence of math §3.2 and the test oracle.

Every other KDA path (chunked JAX, Pallas kernel, decode) is checked against this file. It follows
the five steps of math §3.2 literally, in fp32, one token per ``lax.scan`` step:

1. ``S <- Diag(exp(g_t)) S``      decay each key row,
2. ``p = S^T k_t``                 read with the decayed state,
3. ``u = beta_t (v_t - p)``        delta-rule correction,
4. ``S <- S + k_t u^T``            write,
5. ``o_t = S^T (scale q_t)``       read after the write (a token sees itself).

Shapes use the FLA layout: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``; the
state is ``[B, H, K, V]`` fp32 (fp64 when the inputs are fp64, for float64 checks). Inputs are
taken as given (no L2 normalisation here; :mod:`k3jax.ops.kda` does that when asked).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.documents import segment_starts

# The oracle must be true fp32 on every backend (GPUs otherwise run fp32 dots in TF32).
_PREC = jax.lax.Precision.HIGHEST


def _compute_dtype(x):
    """fp32, or fp64 for fp64 inputs (the oracle can then run in fp64 under jax_enable_x64)."""
    return jnp.promote_types(jnp.float32, x.dtype)


def kda_decode_step(q, k, v, g, beta, state, *, scale):
    """One recurrence step (math §3.2) for one token of every sequence.

    Args:
      q, k, g: ``[B, H, K]``; ``g`` is the log-decay (``<= 0``).
      v: ``[B, H, V]``.
      beta: ``[B, H]``.
      state: ``[B, H, K, V]``.
      scale: multiplies ``q`` (usually ``K ** -0.5``).

    Returns:
      ``(o [B, H, V] in q's dtype, new_state [B, H, K, V] fp32)``.
    """
    out_dtype, ct = q.dtype, _compute_dtype(q)
    q, k, v, g, beta = (x.astype(ct) for x in (q, k, v, g, beta))
    s = state.astype(ct) * jnp.exp(g)[..., None]                        # 1. decay
    p = jnp.einsum("bhkv,bhk->bhv", s, k, precision=_PREC)                # 2. read
    u = beta[..., None] * (v - p)                                        # 3. correction
    s = s + k[..., :, None] * u[..., None, :]                            # 4. write
    o = jnp.einsum("bhkv,bhk->bhv", s, q * scale, precision=_PREC)        # 5. read after write
    return o.astype(out_dtype), s


def kda_reference(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None):
    """KDA over whole sequences by the token-by-token recurrence (math §3.2), in fp32.

    Args:
      q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      scale: multiplies ``q``.
      initial_state: optional ``[B, H, K, V]`` (cast to fp32); zeros if None.
      segment_ids: optional integer ``[B, T]``; the state is reset to zero at every token whose id
        differs from the previous token's (packed sequences).

    Returns:
      ``(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32)``.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    ct = _compute_dtype(q)
    state = (jnp.zeros((b, h, dk, dv), ct) if initial_state is None else initial_state.astype(ct))
    if segment_ids is None:
        resets = jnp.zeros((b, t), bool)
    else:
        resets = segment_starts(segment_ids)

    def step(s, xs):
        qt, kt, vt, gt, bt, rt = xs
        s = jnp.where(rt[:, None, None, None], 0.0, s)
        o, s = kda_decode_step(qt, kt, vt, gt, bt, s, scale=scale)
        return s, o

    # Time-major for the scan: [T, B, ...].
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, resets))
    final_state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), final_state


__all__ = ["kda_decode_step", "kda_reference"]
