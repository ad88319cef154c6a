"""Cross-entropy per token of logits against integer targets, in fp32, with a one-pass backward.

``nats[b, t] = logsumexp(logits[b, t]) - logits[b, t, targets[b, t]]`` (math §2, the training loss),
what ``optax.softmax_cross_entropy_with_integer_labels`` computes, and its gradient
``(softmax(logits) - onehot(targets)) * g``. Autodiff of the usual form puts the target's ``-g``
into the softmax's cotangent with a scatter; on a GPU that splits the backward into three passes
over the ``[B, T, V]`` logits (the softmax's cotangent written in fp32, the scatter in place, the
head's cast to bf16), where one pass that reads the logits and writes the cast cotangent does. Here
the one-hot is a comparison with the vocabulary index, so the backward is one elementwise
expression that XLA fuses with the cast after it.

Logits in a narrower dtype (the bf16 head's) are widened to fp32 where they are read, in both
passes: the forward keeps them in their own dtype for the backward, and the gradient comes back in
that dtype, as the head's backward products take it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


@jax.custom_vjp
def token_nats(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``logits [..., V]`` (any float dtype), ``targets [...]`` int -> nats ``[...]`` fp32."""
    return _nats_and_lse(logits, targets)[0]


def _nats_and_lse(logits, targets):
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - picked, lse


def _fwd(logits, targets):
    nats, lse = _nats_and_lse(logits, targets)
    return nats, (logits, lse, targets)


def _bwd(res, g):
    logits, lse, targets = res
    vocab = lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    onehot = (vocab == targets[..., None]).astype(jnp.float32)
    grad = (jnp.exp(logits.astype(jnp.float32) - lse[..., None]) - onehot) * g[..., None]
    return grad.astype(logits.dtype), None


token_nats.defvjp(_fwd, _bwd)
