"""The experts' gated activation on tile-aligned rows, computed only where a group has rows.

``expert_ffn`` applies ``act(gate, up)`` between its grouped matmuls. When those run the tile kernel
(:func:`~k3jax.ops.grouped_matmul.runs_on_tiles`), the rows of tiles past the last group are
unwritten, and a dropless expert-parallel buffer is mostly such rows (it is sized for ``E_p`` times
its balanced load). :func:`glu_on_tiles` then runs :mod:`pallas_kernels.tiled_glu` forward and
backward, which compute (in fp32) and write only the tiles that hold a group; everywhere else it is
the plain activation (:func:`~k3jax.ops.activations.glu`, the kernels' reference) under JAX's
autodiff. The kernels take the activation itself (``act``, with its written-out gradient
``act.vjp``) as a static argument.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops.activations import glu_recomputed
from k3jax.ops.grouped_matmul import tile_groups
from k3jax.ops.kernel_launch import launcher


def glu_on_tiles(gate: jax.Array, up: jax.Array, group_sizes: jax.Array, act,
                 on_tiles: bool, interpret: bool = False) -> jax.Array:
    """``act(gate, up)`` in ``gate.dtype``: ``gate``, ``up`` ``[R, m]`` rows in group order,
    ``group_sizes [G]``; ``act`` a :class:`~k3jax.ops.moe_dispatch.GLUSpec`.

    ``on_tiles``: the rows are tile-aligned and come from (and go to) the tile matmul; rows of
    tiles past the last group are then unspecified, as theirs are. ``interpret``: run the kernels
    in the Mosaic GPU interpreter (CPU tests)."""
    if not on_tiles:
        return glu_recomputed(gate, up, act.name, act.beta_gate, act.beta_up)
    tile_group = tile_groups(group_sizes.astype(jnp.int32), gate.shape[0])
    return _tiled(gate, up, tile_group, act, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled(gate, up, tile_group, act, interpret: bool):
    return _launcher("tiled_glu")(gate, up, tile_group, act=act, interpret=interpret)


def _tiled_fwd(gate, up, tile_group, act, interpret):
    return _tiled(gate, up, tile_group, act, interpret), (gate, up, tile_group)


def _tiled_bwd(act, interpret, res, dh):
    gate, up, tile_group = res
    dgate, dup = _launcher("tiled_glu_vjp")(gate, up, dh.astype(gate.dtype), tile_group,
                                            act=act, interpret=interpret)
    return dgate, dup, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def _launcher(name: str):
    return launcher("tiled_glu", name, ("act",))


__all__ = ["glu_on_tiles"]
