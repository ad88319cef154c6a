"""The output head: logits in the compute dtype, accumulated in fp32, with a compute-dtype backward.

``logits = h @ W`` with bf16 ``h [B, T, d]`` and ``W [d, V]`` accumulates in fp32 and rounds the
logits to bf16 once, as every other activation of a bf16 model (MaxText, torchtitan and vLLM
write bf16 logits too); the loss and the samplers take them to fp32 where they read them. The
logits are a small model's largest activation (``V`` is its widest dimension): fp32 logits cost a
bf16 model twice their bytes in the head's write and in every pass of the loss over them.

Plain autodiff of an fp32-accumulated product rounded afterwards would widen the bf16 cotangent
to fp32 and run both backward products, ``dh = g W^T`` and ``dW = h^T g``, with one fp32 operand,
i.e. as fp32 (TF32) matrix products; here both run in the operands' dtype with fp32 accumulation.
``dW`` is returned in ``w``'s dtype: the model casts its fp32 master weights to the compute dtype
for the call, so their gradient is rounded to that dtype once and widened back to fp32 by the
cast's transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def head_logits(h: jax.Array, w: jax.Array) -> jax.Array:
    """``h [B, T, d] @ w [d, V] -> [B, T, V]`` in ``h``'s dtype; ``h`` and ``w`` in the compute
    dtype."""
    return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32).astype(h.dtype)


def _fwd(h, w):
    return head_logits(h, w), (h, w)


def _bwd(res, g):
    h, w = res
    dh = jnp.einsum("btv,dv->btd", g, w, preferred_element_type=jnp.float32).astype(h.dtype)
    dw = jnp.einsum("btd,btv->dv", h, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dw


head_logits.defvjp(_fwd, _bwd)
