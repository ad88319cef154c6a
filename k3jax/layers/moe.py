"""The MoE feed-forward block: Stable LatentMoE (K3) and the plain MoE (K2 / Kimi Linear), SPEC 6.

Collections besides ``params``:
- ``'balance'``: ``bias [E]`` fp32, non-trainable; chooses experts, never weighs them. Changed only
  by :func:`k3jax.ops.balancing.update_bias` between optimizer steps.
- ``'balance_stats'``: written in training (``deterministic=False``) and only when the caller makes
  the collection mutable; the statistics of this forward under the *same path and name* as the bias
  (``.../bias``), so ``balancing.update_balance(balance, stats, cfg.moe)`` pairs them by path.
- ``'losses'``: ``moe_aux`` (a scalar) is sown in training when ``balancing == "aux_loss"``.
Initialise with ``deterministic=True`` (init makes every collection mutable, so a training-mode
init would also return statistics and a sown loss).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.layers.ffn import GLUMLP
from k3jax.layers.norms import RMSNorm
from k3jax.layers.param import normal
from k3jax.ops.balancing import compute_stats
from k3jax.ops.moe_dispatch import ExpertWeights, GLUSpec, make_dispatch
from k3jax.ops.routing import aux_balance_loss, route, router_scores


class MoEBlock(nn.Module):
    """Routed experts (+ optional shared MLP) on the FFN pre-norm output. ``[B, T, d] -> [B, T, d]``.

    Latent form (``moe.latent_dim`` set): ``z = x W_down``; experts at latent width on ``z``;
    fp32 weighted combine; optional latent RMSNorm; ``y = u W_up + Shared(x)``.
    Plain form: experts at width ``d`` on ``x``; ``y = sum_j w_j Expert_j(x) + Shared(x)``.
    """

    cfg: object  # ModelConfig with cfg.moe set

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
        cfg = self.cfg
        mc = cfg.moe
        if mc is None:
            raise ValueError("MoEBlock: cfg.moe is None; the MoE block needs a MoEConfig")
        if x.ndim != 3 or x.shape[-1] != cfg.d_model:
            raise ValueError(f"MoEBlock: x must be [B, T, d_model={cfg.d_model}], got {x.shape}")
        dispatch = make_dispatch(mc)               # unknown dispatch: fails before any tracing work
        b, t, d = x.shape
        cdt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        width = mc.latent_dim if mc.is_latent else d
        width_axis = "latent" if mc.is_latent else "embed"
        init = lambda axes: normal(cfg.init_std, axes)  # noqa: E731

        w_router = self.param("router", init(("embed", "exp")), (d, mc.num_experts), pdt)
        bias = self.variable("balance", "bias", jnp.zeros, (mc.num_experts,), jnp.float32)
        experts = ExpertWeights(
            self.param("expert_gate", init(("exp", width_axis, "mlp")),
                       (mc.num_experts, width, mc.expert_intermediate), pdt).astype(cdt),
            self.param("expert_up", init(("exp", width_axis, "mlp")),
                       (mc.num_experts, width, mc.expert_intermediate), pdt).astype(cdt),
            self.param("expert_down", init(("exp", "mlp", width_axis)),
                       (mc.num_experts, mc.expert_intermediate, width), pdt).astype(cdt))

        xf = x.reshape(b * t, d).astype(cdt)
        scores = router_scores(xf, w_router)                       # [N, E] fp32
        ids, weights = route(scores, bias.value, mc.top_k, mc.routed_scaling_factor)

        if mc.is_latent:
            w_down = self.param("latent_down", init(("embed", "latent")), (d, width), pdt)
            w_up = self.param("latent_up", init(("latent", "embed")), (width, d), pdt)
            u = dispatch(xf @ w_down.astype(cdt), ids, weights, experts, GLUSpec.from_config(mc))
            if mc.latent_norm:
                u = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.param_dtype, name="latent_norm")(u)
            y = u.astype(cdt) @ w_up.astype(cdt)
        else:
            y = dispatch(xf, ids, weights, experts, GLUSpec.from_config(mc))

        if mc.shared_intermediate:
            y = y + GLUMLP(d, mc.shared_intermediate, mc.activation, mc.situ_beta_gate,
                           mc.situ_beta_up, cfg.init_std, cfg.dtype, cfg.param_dtype,
                           name="shared")(xf)

        if not deterministic and self.is_mutable_collection("balance_stats"):
            stats = compute_stats(scores, ids, bias.value, mc)
            self.variable("balance_stats", "bias", lambda: stats).value = stats
        if not deterministic and mc.balancing == "aux_loss":
            self.sow("losses", "moe_aux",
                     aux_balance_loss(scores.reshape(b, t, -1), ids.reshape(b, t, -1),
                                      mc.aux_loss_alpha, mc.aux_loss_per_sequence))
        return y.reshape(b, t, d).astype(cdt)


__all__ = ["MoEBlock"]
