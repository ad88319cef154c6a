"""The output head: fp32 logits from compute-dtype operands, with a compute-dtype backward.

``logits = h @ W`` with bf16 ``h [B, T, d]`` and ``W [d, V]`` accumulates in fp32 and returns fp32
logits (the loss wants them). Plain autodiff of that product differentiates against an fp32
cotangent: both backward products, ``dh = g W^T`` and ``dW = h^T g``, then run with one fp32
operand, i.e. as fp32 (TF32) matrix products, the largest of a small model's step (``V`` is its
widest dimension). Here the cotangent is rounded to the operands' dtype once, as mixed-precision
training rounds every other activation gradient, and both products run in that dtype with fp32
accumulation. ``dW`` is returned in ``w``'s dtype: the model casts its fp32 master weights to the
compute dtype for the call, so their gradient is rounded to that dtype once and widened back to
fp32 by the cast's transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def head_logits(h: jax.Array, w: jax.Array) -> jax.Array:
    """``h [B, T, d] @ w [d, V] -> [B, T, V]`` fp32; ``h`` and ``w`` in the compute dtype."""
    return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)


def _fwd(h, w):
    return head_logits(h, w), (h, w)


def _bwd(res, g):
    h, w = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("btv,dv->btd", g, w, preferred_element_type=jnp.float32).astype(h.dtype)
    dw = jnp.einsum("btd,btv->dv", h, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dw


head_logits.defvjp(_fwd, _bwd)
