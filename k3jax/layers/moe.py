"""The MoE feed-forward block: Stable LatentMoE (K3) and the plain MoE (K2 / Kimi Linear), math §6.

Collections besides ``params``:
- ``'balance'``: ``bias [E]`` fp32, non-trainable; chooses experts, never weighs them. Changed only
  by :func:`k3jax.ops.balancing.update_bias` between optimizer steps.
- ``'balance_stats'``: written in training (``deterministic=False``) and only when the caller makes
  the collection mutable; the statistics of this forward under the *same path and name* as the bias
  (``.../bias``), so ``balancing.update_balance(balance, stats, cfg.moe)`` pairs them by path.
- ``'losses'``: ``moe_aux`` (a scalar) is sown in training when ``balancing == "aux_loss"``.
- ``'diagnostics'``: ``dropped_slots`` (fp32 scalar, global over the mesh), the routed slots the
  dispatch dropped for want of capacity, sown when ``capacity_factor`` is set (zero for the
  dropless dispatches) and the collection is mutable.
Initialise with ``deterministic=True`` (init makes every collection mutable, so a training-mode
init would also return statistics and a sown loss).

The dispatch (math §8) is looked up by ``MoEConfig.dispatch`` in :data:`DISPATCHES`, whose names are
exactly the config's :data:`~k3jax.config.moe.Dispatch` values.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.config.moe import Dispatch
from k3jax.layers.ffn import GLUMLP
from k3jax.layers.norms import RMSNorm
from k3jax.layers.param import normal
from k3jax.ops.activations import GLUSpec
from k3jax.ops.balancing import compute_stats
from k3jax.ops.ep_dispatch import make_ep_dispatch
from k3jax.ops.moe_dispatch import ExpertWeights, dense_dispatch, ragged_dispatch
from k3jax.ops.per_device import on_own_rows
from k3jax.ops.routing import aux_balance_loss, route, router_scores

# (x, expert_ids, weights, experts, act) -> (y, dropped slots [] int32): k3jax.ops.moe_dispatch
DispatchFn = Callable[[jax.Array, jax.Array, jax.Array, ExpertWeights, GLUSpec],
                      tuple[jax.Array, jax.Array]]


def _dropless(fn) -> DispatchFn:
    """A single-device dispatch (it drops nothing) with the table's signature."""
    return lambda *args: (fn(*args), jnp.zeros((), jnp.int32))


def _ragged_on_own_tokens(impl: str) -> Callable:
    """:func:`ragged_dispatch` with each device on its own tokens under a mesh of several devices
    (:func:`~k3jax.ops.per_device.on_own_rows`; every device holds every expert): GSPMD would
    gather every token to every device for the grouped matmul kernels."""
    def dispatch(x, expert_ids, weights, experts, act):
        def on_rows(x, expert_ids, weights, experts):
            return ragged_dispatch(x, expert_ids, weights, experts, act, impl=impl)

        return on_own_rows(on_rows, x.shape[0], lambda rows: (P(rows), P(rows), P(rows), P()),
                           lambda rows: P(rows))(x, expert_ids, weights, experts)
    return dispatch


def _expert_parallel(kind: str):
    return lambda mc: make_ep_dispatch(kind, mc.capacity_factor, mc.grouped_matmul)


# MoEConfig.dispatch -> the factory of that dispatch for a config (binding the config's options).
DISPATCHES: dict[str, Callable[[object], DispatchFn]] = {
    "ragged": lambda mc: _dropless(_ragged_on_own_tokens(mc.grouped_matmul)),
    "dense": lambda mc: _dropless(dense_dispatch),
    "all_to_all": _expert_parallel("all_to_all"),
    "ring": _expert_parallel("ring"),
    "ragged_all_to_all": _expert_parallel("ragged_all_to_all"),
}


def make_dispatch(moe_cfg) -> DispatchFn:
    """The dispatch named by ``moe_cfg.dispatch`` with the config's options bound; an unknown name
    or an option the dispatch cannot take is an error here, before anything is traced."""
    name = moe_cfg.dispatch
    if name not in DISPATCHES:
        raise ValueError(f"MoEConfig.dispatch={name!r} is invalid: expected one of "
                         f"{', '.join(map(repr, typing.get_args(Dispatch)))}")
    return DISPATCHES[name](moe_cfg)


class MoEBlock(nn.Module):
    """Routed experts (+ optional shared MLP) on the FFN pre-norm output.
    ``[B, T, d] -> [B, T, d]``.

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
        z = xf @ w_down.astype(cdt) if mc.is_latent else xf
        with jax.named_scope("dispatch"):  # profiles (benchmarks/scale_out.py) find it by name
            y, dropped = dispatch(z, ids, weights, experts, GLUSpec.from_config(mc))
        if mc.is_latent:
            if mc.latent_norm:
                y = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.param_dtype, name="latent_norm")(y)
            y = y.astype(cdt) @ w_up.astype(cdt)

        if mc.shared_intermediate:
            y = y + GLUMLP(d, mc.shared_intermediate, mc.activation, mc.situ_beta_gate,
                           mc.situ_beta_up, cfg.init_std, cfg.dtype, cfg.param_dtype,
                           name="shared")(xf)

        if mc.capacity_factor is not None and self.is_mutable_collection("diagnostics"):
            # One value per forward, not flax's default tuple of appended values: a lifted scan
            # traces the block more than once and would leave a placeholder entry beside the count.
            self.sow("diagnostics", "dropped_slots", dropped.astype(jnp.float32),
                     reduce_fn=lambda _, x: x, init_fn=lambda: jnp.zeros((), jnp.float32))
        if not deterministic and self.is_mutable_collection("balance_stats"):
            stats = compute_stats(scores, ids, bias.value, mc)
            self.variable("balance_stats", "bias", lambda: stats).value = stats
        if not deterministic and mc.balancing == "aux_loss":
            self.sow("losses", "moe_aux",
                     aux_balance_loss(scores.reshape(b, t, -1), ids.reshape(b, t, -1),
                                      mc.aux_loss_alpha, mc.aux_loss_per_sequence))
        return y.reshape(b, t, d).astype(cdt)


__all__ = ["DISPATCHES", "DispatchFn", "MoEBlock", "make_dispatch"]
