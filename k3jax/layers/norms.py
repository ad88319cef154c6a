"""RMSNorm and the gated head-wise RMSNorm of the KDA output (math §3.1 step 7)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.layers.param import ones
from k3jax.ops.attnres import rms_norm_read
from k3jax.ops.gated_head_norm import gated_head_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learnable weight (init 1), of ``[B, ..., d]`` rows: on a
    Hopper GPU through the AttnRes read kernels (:func:`~k3jax.ops.attnres.rms_norm_read`)."""

    eps: float = 1e-5
    dtype: str = "float32"
    param_dtype: str = "float32"
    axis_name: str = "norm"

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm_read(x, self.weight(x.shape[-1]), self.eps).astype(jnp.dtype(self.dtype))

    @nn.compact
    def weight(self, d: int) -> jax.Array:
        """The weight ``[d]``, for an op that applies the norm itself (an AttnRes read's)."""
        return self.param("scale", ones((self.axis_name,)), (d,), jnp.dtype(self.param_dtype))


class GatedHeadRMSNorm(nn.Module):
    """``RMSNorm_head(o) * w * sigmoid(gate)``: per-head norm over V channels, then an output gate.

    Shapes: ``o`` and ``gate`` ``[B, T, H, V]`` -> ``[B, T, H, V]``. The weight ``[V]`` is shared by
    heads, as in the released checkpoints.
    """

    eps: float = 1e-5
    dtype: str = "float32"
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        w = self.param("scale", ones(("kv",)), (o.shape[-1],), jnp.dtype(self.param_dtype))
        return gated_head_norm(o, gate, w, self.eps, jnp.dtype(self.dtype))
