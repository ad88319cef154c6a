"""Dense gated feed-forward block (SwiGLU or SiTU-GLU, math §6), also the MoE's shared MLP."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.layers.param import normal
from k3jax.ops.activations import GLUSpec
from k3jax.ops.glu_pair import glu_of_pair


class GLUMLP(nn.Module):
    """``W_down( act(W_gate x, W_up x) )`` with no biases. Shapes: ``[..., d] -> [..., d]``."""

    d_model: int
    intermediate: int
    activation: str = "situ_glu"
    beta_gate: float = 4.0
    beta_up: float = 25.0
    init_std: float = 0.02
    dtype: str = "bfloat16"
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """``deterministic`` is unused; every FFN shares the MoE block's signature."""
        cdt, pdt = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
        w_gate = self.param("w_gate", normal(self.init_std, ("embed", "mlp")),
                            (self.d_model, self.intermediate), pdt)
        w_up = self.param("w_up", normal(self.init_std, ("embed", "mlp")),
                          (self.d_model, self.intermediate), pdt)
        w_down = self.param("w_down", normal(self.init_std, ("mlp", "embed")),
                            (self.intermediate, self.d_model), pdt)
        w_gate_up = jnp.stack([w_gate, w_up], axis=1).astype(cdt)    # [d, 2, m]: "mlp" stays last
        # The barrier keeps XLA from merging this product with another one of the same input (the
        # MoE's latent down-projection): the backward keeps this product, and a slice of a merged
        # one is copied out to be kept (2.6 ms a step on an H100 without the barrier).
        x = jax.lax.optimization_barrier(x.astype(cdt))
        h = glu_of_pair(jnp.einsum("...d,dkm->...km", x, w_gate_up),
                        GLUSpec(self.activation, self.beta_gate, self.beta_up))
        # Through this barrier the output's gradient reaches the down-projection's backward as a
        # value of its own: XLA merged that product with another of the same gradient (the MoE's
        # latent up-projection), a column-major [N, m + latent] result whose [N, m] part the
        # activation's gradient kernel then took as a copy.
        return jax.lax.optimization_barrier(h @ w_down.astype(cdt))


def dense_ffn(cfg, lift: Callable[[type[nn.Module]], type[nn.Module]]) -> GLUMLP:
    """The dense FFN of a :class:`~k3jax.config.ModelConfig` (layers ``< first_k_dense``);
    ``lift`` transforms the module class (see :mod:`k3jax.layers.decoder`)."""
    f = cfg.dense_ffn
    return lift(GLUMLP)(cfg.d_model, f.intermediate_size, f.activation, f.situ_beta_gate,
                        f.situ_beta_up, cfg.init_std, cfg.dtype, cfg.param_dtype, name="ffn")
