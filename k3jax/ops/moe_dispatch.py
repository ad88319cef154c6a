"""The MoE dispatch interface: routed tokens in, weighted expert outputs out (math §6 and 8).

Every dispatch takes the same arguments::

    fn(x [N, D], expert_ids [N, k] int32, weights [N, k] fp32, experts: ExpertWeights, act: GLUSpec)
        -> y [N, D] in x.dtype,    y_n = sum_j weights[n, j] * Expert_{expert_ids[n, j]}(x_n)

``D`` is the latent width for the Stable LatentMoE (x is then z = x W_down) and ``d`` for the plain
MoE. Each expert is ``act(x W_gate[e], x W_up[e]) W_down[e]``; the weighted sum is taken in fp32.

This module holds the single-device dispatches, both dropless: ``ragged`` (sort + grouped matmul,
:func:`ragged_dispatch`) and ``dense`` (every expert on every token, the test oracle), and the
pieces the expert-parallel ones (:mod:`k3jax.ops.ep_dispatch`, which also return the count of
dropped slots) share. The MoE block's table (:data:`k3jax.layers.moe.DISPATCHES`) maps each
``MoEConfig.dispatch`` name to one of them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.activations import GLUSpec
from k3jax.ops.grouped_matmul import grouped_matmul, row_alignment, runs_on_tiles
from k3jax.ops.tiled_glu import glu_on_tiles


class ExpertWeights(NamedTuple):
    """Stacked expert parameters, already in the compute dtype.

    ``w_gate``, ``w_up``: ``[E, D, m]``; ``w_down``: ``[E, m, D]``.
    """

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


def check_dispatch_args(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                        experts: ExpertWeights) -> None:
    """Shape checks shared by every implementation (raised at trace time, before compiling)."""
    e, d, m = experts.w_gate.shape
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"dispatch: x must be [N, {d}] (the experts' input width), got {x.shape}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"dispatch: expert_ids must be [N={x.shape[0]}, k], "
                         f"got {expert_ids.shape}")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"dispatch: weights must match expert_ids {expert_ids.shape}, "
                         f"got {weights.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"dispatch: expert_ids must be integer, got {expert_ids.dtype}")
    if experts.w_up.shape != (e, d, m) or experts.w_down.shape != (e, m, d):
        raise ValueError(f"dispatch: expert weights must be w_gate/w_up [E, D, m] and w_down "
                         f"[E, m, D]; got {experts.w_gate.shape}, {experts.w_up.shape}, "
                         f"{experts.w_down.shape}")


def aligned_rows(slots: int, num_groups: int, align: int) -> int:
    """Rows of a buffer that holds ``slots`` rows in ``num_groups`` groups, each group starting on a
    multiple of ``align`` (the rounding costs at most ``align - 1`` rows per group)."""
    return -(-(slots + num_groups * (align - 1)) // align) * align


def group_rows(group_ids: jax.Array, num_groups: int, rows: int, align: int = 1,
               keep: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Where each slot goes in a buffer of ``rows`` rows that holds the groups in order, each
    starting on a multiple of ``align``: ``group_ids [S]`` -> ``(position [S] int32, sizes [G])``.

    Ids ``>= num_groups`` belong elsewhere, and with ``keep`` only the first ``keep`` slots in group
    order stay: the others get position ``rows`` (out of range: scatters with ``mode="drop"`` skip
    them, gathers with ``mode="fill"`` read zero). ``sizes`` are the groups' row counts rounded up
    to ``align`` (the buffer's layout for :func:`~k3jax.ops.grouped_matmul.grouped_matmul`).
    """
    s = group_ids.shape[0]
    order = jnp.argsort(group_ids, stable=True)
    sorted_ids = jnp.take(group_ids, order)
    counts = jnp.bincount(group_ids, length=num_groups).astype(jnp.int32)
    if keep is not None:                          # the capacity cuts the last groups
        ends = jnp.minimum(jnp.cumsum(counts), keep)
        counts = ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = -(-counts // align) * align
    first, aligned_first = jnp.cumsum(counts) - counts, jnp.cumsum(sizes) - sizes
    g = jnp.minimum(sorted_ids, num_groups - 1)
    rank = jnp.arange(s, dtype=jnp.int32)
    here = (sorted_ids < num_groups) & (rank < first[g] + counts[g])
    sorted_pos = jnp.where(here, aligned_first[g] + rank - first[g], rows).astype(jnp.int32)
    return jnp.zeros((s,), jnp.int32).at[order].set(sorted_pos, unique_indices=True), sizes


def expert_ffn(xs: jax.Array, group_sizes: jax.Array, experts: ExpertWeights, act: GLUSpec,
               impl: str = "ragged_dot", aligned: bool = False) -> jax.Array:
    """The experts' GLU MLPs on rows in expert order: ``[R, D]``, ``group_sizes [E]`` -> ``[R, D]``
    (the grouped matmul's output dtype). Rows past ``sum(group_sizes)`` are unspecified (the
    Mosaic kernels leave them unwritten) and so are their gradients: callers never read either.
    ``aligned``: the rows are laid out by :func:`group_rows` with ``align=row_alignment(impl)``
    (padding rows inside a group are zero rows: zero outputs); on the Mosaic tile kernels nothing
    is then computed on the tiles past the last group."""
    gate = grouped_matmul(xs, experts.w_gate, group_sizes, impl, aligned)
    up = grouped_matmul(xs, experts.w_up, group_sizes, impl, aligned)
    # On tiles only when all three matmuls are: the others read every row of the activation.
    on_tiles = (runs_on_tiles(xs, experts.w_gate, impl, aligned)
                and runs_on_tiles(gate, experts.w_down, impl, aligned))
    h = glu_on_tiles(gate, up, group_sizes, act, on_tiles).astype(xs.dtype)   # fp32 inside
    return grouped_matmul(h, experts.w_down, group_sizes, impl, aligned)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_rows(x: jax.Array, src: jax.Array, inv: jax.Array, fan_out: int = 1) -> jax.Array:
    """Rows of ``x`` moved by a partial permutation of slots: row ``j`` of ``x`` is slots
    ``j * fan_out ... (j + 1) * fan_out - 1`` (a token's ``k`` routed copies), ``out[i]`` is slot
    ``src[i]`` (zero where ``src[i]`` is out of range), and ``inv[s]`` names the ``out`` row that
    holds slot ``s`` (out of range if none). ``x [T, D]``, ``src [R]``, ``inv [T * fan_out]`` ->
    ``[R, D]``.

    The gradient is then a gather too (``dx[j] = sum of dout[inv[s]]`` over row ``j``'s slots);
    JAX's own transpose of a gather is a scatter-add, which cannot know the indices are unique and
    pays for atomics -- the gathers in and out of expert order are a large share of a JAX MoE's
    time. The slots are never materialised (no ``[T * fan_out, D]`` copy of ``x``)."""
    row = jnp.where(src < inv.shape[0], src // fan_out, x.shape[0])
    return jnp.take(x, row, axis=0, mode="fill", fill_value=0)


def _permute_rows_fwd(x, src, inv, fan_out):
    return permute_rows(x, src, inv, fan_out), inv


def _permute_rows_bwd(fan_out, inv, g):
    g_slots = jnp.take(g, inv, axis=0, mode="fill", fill_value=0)           # [T * fan_out, D]
    if fan_out == 1:
        return g_slots, None, None
    dx = g_slots.reshape(-1, fan_out, g.shape[-1]).sum(1, dtype=jnp.float32)
    return dx.astype(g.dtype), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def experts_on_slots(x: jax.Array, per_row: int, group_ids: jax.Array, num_groups: int,
                     experts: ExpertWeights, act: GLUSpec, impl: str, keep: int | None = None,
                     out_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """The experts on slots: slot ``s`` reads row ``s // per_row`` of ``x [T, D]`` (a token's
    ``per_row = k`` slots are consecutive) and goes to group ``group_ids[s]`` (``>= num_groups``:
    not here) -> ``(outputs [S, D] in slot order, zero for slots not here or past ``keep``; the
    number of slots run)``. The slots are laid out for ``impl`` (:func:`group_rows`), run through
    :func:`expert_ffn` and read back in ``out_dtype`` (a narrower one halves the bytes of that
    read when many slots are not here, as in the ring dispatch)."""
    align = row_alignment(impl)
    s = group_ids.shape[0]
    rows = aligned_rows(s if keep is None else min(keep, s), num_groups, align)
    pos, sizes = group_rows(group_ids, num_groups, rows, align, keep)
    row_slot = jnp.full((rows,), s, jnp.int32).at[pos].set(
        jnp.arange(s, dtype=jnp.int32), mode="drop", unique_indices=True)
    buf = permute_rows(x, row_slot, pos, per_row)         # zero rows between groups and past them
    ys = expert_ffn(buf, sizes, experts, act, impl, aligned=align > 1)
    return permute_rows(ys.astype(out_dtype), pos, row_slot), jnp.sum(pos < rows)


def combine_slots(y_slots: jax.Array, weights: jax.Array) -> jax.Array:
    """Each token's gate-weighted sum of its slots, in fp32: outputs ``[n k, D]`` in slot order (a
    token's ``k`` slots consecutive, any float dtype) and ``weights [n, k]`` -> ``[n, D]`` fp32."""
    n, k = weights.shape
    return jnp.einsum("nkd,nk->nd", y_slots.reshape(n, k, -1), weights.astype(jnp.float32),
                      preferred_element_type=jnp.float32)


def ragged_dispatch(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                    experts: ExpertWeights, act: GLUSpec, impl: str = "ragged_dot") -> jax.Array:
    """Dropless single-device dispatch: lay the ``N*k`` (token, slot) pairs out by expert, run the
    experts as grouped matmuls (:func:`~k3jax.ops.grouped_matmul.grouped_matmul`, ``impl``
    ``"ragged_dot"`` or the Hopper ``"mosaic"`` kernels), read them back, combine in fp32.

    Experts that receive no token are empty groups (their weights get a zero gradient).
    """
    check_dispatch_args(x, expert_ids, weights, experts)
    k = expert_ids.shape[1]
    num_experts = experts.w_gate.shape[0]
    y, _ = experts_on_slots(x, k, expert_ids.reshape(-1), num_experts, experts, act, impl)
    return combine_slots(y, weights).astype(x.dtype)


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


__all__ = ["ExpertWeights", "aligned_rows", "check_dispatch_args", "combine_slots",
           "dense_dispatch", "expert_ffn", "experts_on_slots", "group_rows", "permute_rows",
           "ragged_dispatch"]
