"""Causal softmax attention for MLA's training path (math §4): cuDNN's fused kernel on Hopper GPUs,
XLA's composition of the formula elsewhere.

``o = softmax(scale * q k^T + mask) v`` per head, with a causal, segment-aware boolean mask.

* :func:`attention_reference` -- the formula in fp32, scores materialised: the oracle;
* :func:`causal_attention` -- what the model calls. On an sm_90 GPU with bf16 or fp16 inputs it is
  cuDNN's flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``, causal, the
  segment mask as a constant bias): the ``[B, H, T, T]`` scores never reach memory and the upper
  triangle is skipped. Otherwise XLA's attention, whose scores and probabilities are
  ``[B, H, T, T]`` fp32 arrays. Both want equal q/k/v head dims: ``v`` is zero-padded to the
  query's (MLA's values are narrower than its queries), the extra output columns dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.devices import hopper_gpus


def attention_reference(q, k, v, mask, scale: float) -> jax.Array:
    """``q [B, T, H, Dk]``, ``k [B, S, H, Dk]``, ``v [B, S, H, Dv]``, ``mask [B, 1, T, S]`` bool
    -> ``[B, T, H, Dv]`` fp32."""
    f32 = jnp.float32
    s = jnp.einsum("bthd,bshd->bhts", q.astype(f32), k.astype(f32),
                   precision=jax.lax.Precision.HIGHEST) * scale
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v.astype(f32), precision=jax.lax.Precision.HIGHEST)


def causal_attention(q, k, v, mask, scale: float) -> jax.Array:
    """Attention of ``q`` over ``k, v`` under ``mask`` (which must include the causal mask):
    shapes as :func:`attention_reference`; returns ``[B, T, H, Dv]`` in ``q``'s dtype."""
    pad = q.shape[-1] - v.shape[-1]
    if pad < 0:
        raise ValueError(f"causal_attention: value head dim {v.shape[-1]} larger than the query's "
                         f"{q.shape[-1]} is not supported")
    # jax.nn.dot_product_attention wants the query's head dim for the values too: zero columns
    v_in = jnp.pad(v, ((0, 0),) * 3 + ((0, pad),)) if pad else v
    impl = "cudnn" if _cudnn_supports(q) else None
    out = jax.nn.dot_product_attention(q, k, v_in, mask=mask, scale=scale, is_causal=True,
                                       implementation=impl)
    return out[..., :v.shape[-1]]


def _cudnn_supports(q) -> bool:
    """cuDNN's flash attention: sm_90, half-precision inputs, a head dim <= 256 and a multiple
    of 8, an even sequence length (with a bias)."""
    return (hopper_gpus() and q.dtype in (jnp.bfloat16, jnp.float16)
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and q.shape[1] % 2 == 0)
