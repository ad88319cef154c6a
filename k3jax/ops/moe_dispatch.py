"""The MoE dispatch interface: routed tokens in, weighted expert outputs out (SPEC 6 and 8).

One signature, several implementations, chosen by ``MoEConfig.dispatch``::

    fn(x [N, D], expert_ids [N, k] int32, weights [N, k] fp32, experts: ExpertWeights, act: GLUSpec)
        -> y [N, D] in x.dtype,    y_n = sum_j weights[n, j] * Expert_{expert_ids[n, j]}(x_n)

``D`` is the latent width for the Stable LatentMoE (x is then z = x W_down) and ``d`` for the plain
MoE. Each expert is ``act(x W_gate[e], x W_up[e]) W_down[e]``; the weighted sum is taken in fp32.

The registry holds *factories* ``MoEConfig -> fn`` so an implementation can bind config-specific
options (capacity factor, mesh axes) once, while the call signature above stays the same. The
expert-parallel code registers ``"all_to_all"``, ``"ring"`` and ``"ragged_all_to_all"`` with
:func:`register_dispatch`; single-device ``"ragged"`` (sort + ``jax.lax.ragged_dot``) and
``"dense"`` (every expert on every token, the test oracle) live here.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.activations import glu
from k3jax.ops.grouped_matmul import grouped_matmul


class ExpertWeights(NamedTuple):
    """Stacked expert parameters, already in the compute dtype.

    ``w_gate``, ``w_up``: ``[E, D, m]``; ``w_down``: ``[E, m, D]``.
    """

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


class GLUSpec(NamedTuple):
    """The experts' gated activation: ``"swiglu"`` or ``"situ_glu"`` with its two soft caps."""

    name: str = "situ_glu"
    beta_gate: float = 4.0
    beta_up: float = 25.0

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return glu(gate, up, self.name, self.beta_gate, self.beta_up)

    @classmethod
    def from_config(cls, moe_cfg) -> "GLUSpec":
        return cls(moe_cfg.activation, moe_cfg.situ_beta_gate, moe_cfg.situ_beta_up)


DispatchFn = Callable[[jax.Array, jax.Array, jax.Array, ExpertWeights, GLUSpec], jax.Array]
DispatchFactory = Callable[[object], DispatchFn]

_REGISTRY: dict[str, DispatchFactory] = {}
# Registered by k3jax.parallel.ep_dispatch, imported on first use so configs need no extra import.
EXPERT_PARALLEL = ("all_to_all", "ring", "ragged_all_to_all")


def register_dispatch(name: str, factory: DispatchFactory, *, overwrite: bool = False) -> None:
    """Register ``factory(moe_cfg) -> DispatchFn`` under ``name`` (a ``MoEConfig.dispatch`` value)."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"register_dispatch: name={name!r} is already registered "
                         "(pass overwrite=True to replace it)")
    _REGISTRY[name] = factory


def registered_dispatches() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def make_dispatch(moe_cfg) -> DispatchFn:
    """The dispatch function named by ``moe_cfg.dispatch``; an unregistered name is a clear error."""
    name = moe_cfg.dispatch
    if name in EXPERT_PARALLEL and name not in _REGISTRY:
        import k3jax.parallel.ep_dispatch  # noqa: F401  (registers the shard_map dispatches)
    if name not in _REGISTRY:
        raise ValueError(
            f"MoEConfig.dispatch={name!r} has no registered implementation; registered: "
            f"{', '.join(registered_dispatches())}. Expert-parallel dispatches register themselves "
            "when their module is imported.")
    return _REGISTRY[name](moe_cfg)


def check_dispatch_args(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                        experts: ExpertWeights) -> None:
    """Shape checks shared by every implementation (raised at trace time, before compiling)."""
    e, d, m = experts.w_gate.shape
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"dispatch: x must be [N, {d}] (the experts' input width), got {x.shape}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"dispatch: expert_ids must be [N={x.shape[0]}, k], got {expert_ids.shape}")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"dispatch: weights must match expert_ids {expert_ids.shape}, "
                         f"got {weights.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"dispatch: expert_ids must be integer, got {expert_ids.dtype}")
    if experts.w_up.shape != (e, d, m) or experts.w_down.shape != (e, m, d):
        raise ValueError(f"dispatch: expert weights must be w_gate/w_up [E, D, m] and w_down "
                         f"[E, m, D]; got {experts.w_gate.shape}, {experts.w_up.shape}, "
                         f"{experts.w_down.shape}")


def expert_ffn(xs: jax.Array, group_sizes: jax.Array, experts: ExpertWeights, act: GLUSpec,
               impl: str = "ragged_dot", expected_rows: int | None = None) -> jax.Array:
    """The experts' GLU MLPs on rows in expert order: ``[R, D]``, ``group_sizes [E]`` -> ``[R, D]``
    fp32; rows past ``sum(group_sizes)`` are padding and come out zero. ``expected_rows``: see
    :func:`~k3jax.ops.grouped_matmul.grouped_matmul` (a worst-case buffer's usual load)."""
    gate = grouped_matmul(xs, experts.w_gate, group_sizes, impl, expected_rows)
    up = grouped_matmul(xs, experts.w_up, group_sizes, impl, expected_rows)
    h = act(gate, up).astype(xs.dtype)
    ys = grouped_matmul(h, experts.w_down, group_sizes, impl, expected_rows)
    valid = jnp.arange(xs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], ys, 0.0)


def ragged_dispatch(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                    experts: ExpertWeights, act: GLUSpec, impl: str = "ragged_dot") -> jax.Array:
    """Dropless single-device dispatch: sort the ``N*k`` (token, slot) pairs by expert, run the
    experts as grouped matmuls (:func:`~k3jax.ops.grouped_matmul.grouped_matmul`, ``impl``
    ``"ragged_dot"`` or the Hopper ``"mosaic"`` kernels), unsort, combine in fp32.

    Experts that receive no token are empty groups (their weights get a zero gradient).
    """
    check_dispatch_args(x, expert_ids, weights, experts)
    n, k = expert_ids.shape
    num_experts = experts.w_gate.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)                         # expert-major slot order
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)                               # [N*k, D]
    ys = expert_ffn(xs, group_sizes, experts, act, impl)
    # Inverse permutation by scatter (no second sort); gathering with it keeps the backward a scatter.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    y = jnp.take(ys, inverse, axis=0).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(jnp.float32)).astype(x.dtype)


def dense_dispatch(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                   experts: ExpertWeights, act: GLUSpec) -> jax.Array:
    """Test oracle: every expert on every token, outputs weighted by a dense ``[N, E]`` mask.

    ``E`` times the routed FLOPs; only for small tests.
    """
    check_dispatch_args(x, expert_ids, weights, experts)
    num_experts = experts.w_gate.shape[0]
    f32 = jnp.float32
    gate = jnp.einsum("nd,edm->enm", x, experts.w_gate, preferred_element_type=f32)
    up = jnp.einsum("nd,edm->enm", x, experts.w_up, preferred_element_type=f32)
    h = act(gate, up).astype(x.dtype)
    ys = jnp.einsum("enm,emd->end", h, experts.w_down, preferred_element_type=f32)
    dense_w = jnp.einsum("nk,nke->ne", weights.astype(f32),
                         jax.nn.one_hot(expert_ids, num_experts, dtype=f32))
    return jnp.einsum("end,ne->nd", ys, dense_w).astype(x.dtype)


register_dispatch("ragged", lambda cfg: functools.partial(ragged_dispatch,
                                                          impl=cfg.grouped_matmul))
register_dispatch("dense", lambda cfg: dense_dispatch)

__all__ = ["DispatchFn", "ExpertWeights", "GLUSpec", "check_dispatch_args", "dense_dispatch",
           "expert_ffn",
           "make_dispatch", "ragged_dispatch", "register_dispatch", "registered_dispatches"]
