"""Expert-parallel implementations of the MoE dispatch interface (§8), inside one ``shard_map``.

Same inputs as :mod:`k3jax.ops.moe_dispatch` (``x [N, D]``, ``expert_ids [N, k]``, ``weights
[N, k]``, ``ExpertWeights``, ``GLUSpec``), returning ``(y [N, D], dropped [] int32)``; the MoE block
runs them as ``MoEConfig.dispatch`` ``"all_to_all"``, ``"ring"`` and ``"ragged_all_to_all"``.
Routing, the latent projections and norm and the shared MLP stay outside: only the routed tokens
cross devices.

Layout, read from the mesh and rules table made current by :func:`k3jax.parallel.mesh.use_mesh`:
the tokens ``N`` are split over the ``batch`` rule's mesh axes (which include the expert axes), the
experts over the ``exp`` rule's axes (``E_p`` shards of ``E_l = E / E_p`` experts), the experts'
hidden width over the ``mlp`` rule's remaining axes (tensor parallelism: partial sums, a ``psum``).
One ``shard_map`` with every mesh axis manual (a nested one broke lowering and autodiff for others).

Per device with ``n`` tokens, ``S = n k`` routed slots:

- ``all_to_all``: slots sorted by expert (hence by owning device) are packed into ``E_p`` send
  buffers of ``C`` rows, exchanged, run through the local experts as a grouped matmul, exchanged
  back, combined in fp32. Dropless: ``C = S`` (every slot of a device may go to one owner).
- ``ring``: the tokens are all-gathered over the expert axes, each device runs its local experts on
  the slots routed to them (at most ``C`` rows; dropless ``C = E_p S``), weights and sums per token
  in fp32, and a reduce-scatter returns each token's sum to its owner.
- ``ragged_all_to_all``: ``jax.lax.ragged_all_to_all`` sends exactly the routed rows (GPU only; no
  CPU lowering); the receive buffer is sized for the worst case, ``E_p S`` rows. Dropless only.

``capacity_factor`` (``all_to_all``, ``ring``): ``C = ceil(cf * S / E_p)`` rows per send buffer
(``all_to_all``) or ``C = ceil(cf * S)`` rows per expert device (``ring``): ``cf = 1`` is the load
of exactly balanced routing. Slots over capacity contribute nothing; their count (global over the
mesh, per forward) is returned beside ``y``; the MoE block sows it as
``diagnostics/dropped_slots``.

Precision: every per-device combine (a token's slots weighted and summed) is fp32, and what
crosses the expert axes is in the compute dtype (``x.dtype``). ``all_to_all`` and
``ragged_all_to_all`` send the expert outputs back in it and combine them after the exchange (the
tensor-parallel ``psum`` of the down projection before it is fp32). The ring combines before its
exchange, so its ``E_p``-way reduce-scatter adds the devices' fp32 partial sums rounded to the
compute dtype, and its tensor-parallel ``psum`` runs in that dtype too: in bf16, half the bytes of
fp32 on the wire, for one more rounding of each partial sum (held to math §10's bf16 output
tolerance against the single-device dispatch).

The balancing statistics need nothing here: routing runs outside on the global arrays, where XLA
sums ``load``/``hist`` over the devices that hold different tokens exactly once.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.config.base import ConfigError
from k3jax.config.mesh import rule_axes
from k3jax.ops.grouped_matmul import check_grouped_matmul
from k3jax.ops.moe_dispatch import (
    ExpertWeights,
    GLUSpec,
    check_dispatch_args,
    combine_slots,
    experts_on_slots,
    ragged_dispatch,
)

F32 = jnp.float32


@dataclass(frozen=True)
class EPLayout:
    """Mesh axes of the dispatch: tokens split over ``token_axes`` (``token_shards`` ways),
    experts over ``expert_axes`` (``expert_shards`` ways), their hidden width over ``mlp_axes``."""

    token_axes: tuple[str, ...]
    expert_axes: tuple[str, ...]
    mlp_axes: tuple[str, ...]
    token_shards: int
    expert_shards: int


def current_layout(num_experts: int, num_tokens: int) -> EPLayout | None:
    """The layout under the current mesh and rules (None when no mesh is current)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return None
    tokens, experts = rule_axes(rules, "batch"), rule_axes(rules, "exp")
    mlp = tuple(a for a in rule_axes(rules, "mlp") if a not in tokens + experts)
    if not set(experts) <= set(tokens):
        raise ConfigError(f"expert-parallel dispatch: the 'exp' axes {experts} must also split the "
                          f"tokens (the 'batch' rule is {tokens})")
    sizes = dict(mesh.shape)
    token_shards = math.prod(sizes[a] for a in tokens)
    expert_shards = math.prod(sizes[a] for a in experts)
    if num_experts % expert_shards:
        raise ConfigError(f"MoEConfig.num_experts={num_experts} is not divisible by the expert "
                          f"axis size {expert_shards} (mesh {sizes}, 'exp' -> {experts})")
    if num_tokens % token_shards:
        raise ConfigError(f"expert-parallel dispatch: {num_tokens} tokens (batch x length) do not "
                          f"split evenly over the batch axes {tokens} ({token_shards} shards)")
    return EPLayout(tokens, experts, mlp, token_shards, expert_shards)


# -- the local experts -----------------------------------------------------------------------------

def _run_local(xs: jax.Array, local_ids: jax.Array, e_local: int, experts, act, gmm, mlp_axes):
    """Rows in any order with local expert ids (``e_local``: padding) -> outputs ``[R, D]`` fp32,
    same order. With tensor parallelism each device holds a slice of the hidden width, so the down
    projection is a partial sum (``psum`` over it)."""
    ys, _ = experts_on_slots(xs, 1, local_ids, e_local, experts, act, gmm)
    return jax.lax.psum(ys, mlp_axes) if mlp_axes else ys


def _sort_slots(expert_ids: jax.Array, e_local: int, e_shards: int):
    """Slots in expert order: ``(order, sorted ids, owner device, send counts [E_p], offsets)``."""
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)                          # expert-major = owner-major
    sid = jnp.take(flat, order)
    owner = sid // e_local
    counts = jnp.bincount(owner, length=e_shards).astype(jnp.int32)
    offsets = jnp.cumsum(counts) - counts
    return order, sid, owner, counts, offsets


def _combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Slot outputs in sorted order -> per-token weighted sum in fp32: ``[S, D]`` -> ``[n, D]``."""
    y = jnp.zeros(y_sorted.shape, F32).at[order].set(y_sorted.astype(F32), unique_indices=True)
    return combine_slots(y, weights)


def _axis(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


# -- the three exchanges (bodies of the shard_map; shapes are per device) --------------------------

def _all_to_all_body(x, ids, w, experts, *, act, e_local, e_shards, cap, lay, gmm):
    n, k = ids.shape
    d = x.shape[1]
    ax = _axis(lay.expert_axes)
    order, sid, owner, _, offsets = _sort_slots(ids, e_local, e_shards)
    rank = jnp.arange(n * k) - offsets[owner]                      # position in the owner's buffer
    keep = rank < cap
    pos = jnp.where(keep, owner * cap + rank, e_shards * cap)      # out of range = dropped
    send_x = jnp.zeros((e_shards * cap, d), x.dtype).at[pos].set(
        jnp.take(x, order // k, axis=0), mode="drop", unique_indices=True)
    send_id = jnp.full((e_shards * cap,), e_local, jnp.int32).at[pos].set(
        sid % e_local, mode="drop", unique_indices=True)
    recv_x = jax.lax.all_to_all(send_x.reshape(e_shards, cap, d), ax, 0, 0, tiled=True)
    recv_id = jax.lax.all_to_all(send_id.reshape(e_shards, cap), ax, 0, 0, tiled=True)
    ys = _run_local(recv_x.reshape(-1, d), recv_id.reshape(-1), e_local, experts, act, gmm,
                    lay.mlp_axes).astype(x.dtype)
    back = jax.lax.all_to_all(ys.reshape(e_shards, cap, d), ax, 0, 0, tiled=True)
    y_sorted = jnp.take(back.reshape(-1, d), pos, axis=0, mode="fill", fill_value=0)
    dropped = jnp.sum(~keep).astype(jnp.int32)
    return _combine(y_sorted, order, w).astype(x.dtype), jax.lax.psum(dropped, lay.token_axes)


def _ring_body(x, ids, w, experts, *, act, e_local, e_shards, cap, lay, gmm):
    k = ids.shape[1]
    ax = _axis(lay.expert_axes)
    x_all = jax.lax.all_gather(x, ax, axis=0, tiled=True)          # [E_p n, D]
    ids_all = jax.lax.all_gather(ids, ax, axis=0, tiled=True)
    w_all = jax.lax.all_gather(w, ax, axis=0, tiled=True)
    me = jax.lax.axis_index(ax)
    flat = ids_all.reshape(-1)
    local = jnp.where(flat // e_local == me, flat - me * e_local, e_local)
    y_slots, kept = experts_on_slots(x_all, k, local, e_local, experts, act, gmm, keep=cap,
                                     out_dtype=x.dtype)
    if lay.mlp_axes:
        y_slots = jax.lax.psum(y_slots, lay.mlp_axes)
    partial = combine_slots(y_slots, w_all)
    # Each token's sum over the slots this device ran is fp32; the E_p-way reduce-scatter of those
    # partial sums runs in the compute dtype, half the bytes of fp32 in bf16 (the result is rounded
    # to it anyway; the partials' own rounding is the price).
    y = jax.lax.psum_scatter(partial.astype(x.dtype), ax, scatter_dimension=0, tiled=True)
    dropped = (jnp.sum(local < e_local) - kept).astype(jnp.int32)
    return y.astype(x.dtype), jax.lax.psum(dropped, lay.token_axes)


def _ragged_all_to_all_body(x, ids, w, experts, *, act, e_local, e_shards, cap, lay, gmm):
    n, k = ids.shape
    d = x.shape[1]
    ax = _axis(lay.expert_axes)
    order, sid, _, counts, offsets = _sort_slots(ids, e_local, e_shards)
    table = jax.lax.all_gather(counts, ax, axis=0, tiled=False)     # [src, dst] slot counts
    me = jax.lax.axis_index(ax)
    land = (jnp.cumsum(table, axis=0) - table)[me]                  # my chunk's offset at each dst
    recv_sizes = table[:, me]
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes              # each source's chunk here
    home = (jnp.cumsum(table, axis=1) - table)[:, me]               # where each source sent from
    rows = e_shards * n * k                                         # worst case: every slot here
    xs = jnp.take(x, order // k, axis=0)
    recv_x = jax.lax.ragged_all_to_all(xs, jnp.zeros((rows, d), x.dtype), offsets, counts, land,
                                       recv_sizes, axis_name=ax)
    recv_id = jax.lax.ragged_all_to_all((sid % e_local)[:, None],
                                        jnp.full((rows, 1), e_local, jnp.int32), offsets, counts,
                                        land, recv_sizes, axis_name=ax)[:, 0]
    ys = _run_local(recv_x, recv_id, e_local, experts, act, gmm, lay.mlp_axes).astype(x.dtype)
    y_sorted = jax.lax.ragged_all_to_all(ys, jnp.zeros((n * k, d), x.dtype), recv_offsets,
                                         recv_sizes, home, counts, axis_name=ax)
    return _combine(y_sorted, order, w).astype(x.dtype), jnp.zeros((), jnp.int32)


_BODIES = {"all_to_all": _all_to_all_body, "ring": _ring_body,
           "ragged_all_to_all": _ragged_all_to_all_body}
EP_DISPATCHES = tuple(_BODIES)


def capacity(kind: str, slots_per_device: int, e_shards: int, capacity_factor: float | None) -> int:
    """Rows of the per-device buffer (module docstring); dropless when the factor is None."""
    if kind == "all_to_all":        # one buffer per owner; balanced routing sends S / E_p to each
        worst, balanced = slots_per_device, slots_per_device / e_shards
    else:                           # one buffer per expert device; balanced routing brings it S
        worst, balanced = e_shards * slots_per_device, slots_per_device
    if capacity_factor is None:
        return worst
    return max(1, min(worst, math.ceil(capacity_factor * balanced)))


# -- the dispatch functions ------------------------------------------------------------------------

def ep_dispatch(kind: str, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                experts: ExpertWeights, act: GLUSpec, *, capacity_factor: float | None = None,
                gmm: str = "ragged_dot") -> tuple[jax.Array, jax.Array]:
    """Expert-parallel dispatch ``kind`` under the current mesh -> ``(y [N, D], dropped [] int32)``.

    Without a current mesh it is the single-device ``ragged`` dispatch (nothing dropped). The
    options are checked either way, so a call that works on one device works under a mesh.
    """
    _check_options(kind, capacity_factor, gmm)
    check_dispatch_args(x, expert_ids, weights, experts)
    num_experts = experts.w_gate.shape[0]
    lay = current_layout(num_experts, x.shape[0])
    if lay is None:
        return ragged_dispatch(x, expert_ids, weights, experts, act, gmm), jnp.zeros((), jnp.int32)
    n_local = x.shape[0] // lay.token_shards
    cap = capacity(kind, n_local * expert_ids.shape[1], lay.expert_shards, capacity_factor)
    body = _BODIES[kind]
    tok = P(_axis(lay.token_axes), None)
    mlp = _axis(lay.mlp_axes) if lay.mlp_axes else None
    w_in = P(_axis(lay.expert_axes), None, mlp)
    w_out = P(_axis(lay.expert_axes), mlp, None)

    def run(x, ids, w, wg, wu, wd):
        return body(x, ids, w, ExpertWeights(wg, wu, wd), act=act,
                    e_local=num_experts // lay.expert_shards, e_shards=lay.expert_shards,
                    cap=cap, lay=lay, gmm=gmm)

    # check_vma=False: the Mosaic grouped matmul's custom VJP cannot state the varying-axes types
    # of its cotangents; the collectives' transposes keep the gradients exact (tests compare them).
    return jax.shard_map(run, in_specs=(tok, tok, tok, w_in, w_in, w_out),
                         out_specs=(tok, P()), check_vma=False)(
        x, expert_ids.astype(jnp.int32), weights, *experts)


def _check_options(kind: str, capacity_factor: float | None, gmm: str) -> None:
    """ValueError (ConfigError for an option ``kind`` cannot take) naming the argument."""
    if kind not in EP_DISPATCHES:
        raise ValueError(f"ep_dispatch: kind={kind!r} is invalid: expected one of "
                         f"{', '.join(map(repr, EP_DISPATCHES))}")
    if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                        or not isinstance(capacity_factor, numbers.Real)
                                        or not 0 < capacity_factor < math.inf):
        raise ValueError(f"ep_dispatch: capacity_factor={capacity_factor!r} is invalid: expected "
                         "None (dropless) or a finite number > 0")
    check_grouped_matmul(gmm)
    if kind == "ragged_all_to_all" and capacity_factor is not None:
        raise ConfigError(f"capacity_factor={capacity_factor!r} is not supported by dispatch="
                          "'ragged_all_to_all' (dropless only); use 'all_to_all' or 'ring'")


def make_ep_dispatch(kind: str, capacity_factor: float | None = None, gmm: str = "ragged_dot"):
    """``fn(x, expert_ids, weights, experts, act) -> (y, dropped)``: :func:`ep_dispatch` of ``kind``
    with its options bound; a kind or option that cannot run is an error here, before tracing."""
    _check_options(kind, capacity_factor, gmm)
    # Only here: ep_dispatch itself must trace on CPU, where its offsets are checked through an
    # emulation of the collective.
    if kind == "ragged_all_to_all" and jax.default_backend() == "cpu":
        raise ConfigError("MoEConfig.dispatch='ragged_all_to_all' needs a GPU or TPU: "
                          "jax.lax.ragged_all_to_all has no CPU lowering; on CPU use "
                          "'all_to_all' or 'ring'")
    return functools.partial(ep_dispatch, kind, capacity_factor=capacity_factor, gmm=gmm)


__all__ = [
    "EP_DISPATCHES",
    "EPLayout",
    "capacity",
    "current_layout",
    "ep_dispatch",
    "make_ep_dispatch",
]
