"""Logical axis names: parameter initialisers that carry them, and activation constraints by them.

Every parameter is created through :func:`param_init`, so a sharding rules table (MaxText style)
can map logical names like ``"embed"`` or ``"exp"`` onto mesh axes without touching the layers.
``model.init`` returns boxed values; :func:`k3jax.model.init_variables` unboxes them into plain
arrays.

Logical names used: ``vocab``, ``embed`` (d_model), ``heads``, ``kv`` (head dim), ``q_lora``,
``kv_lora``, ``mlp`` (FFN hidden), ``exp`` (expert index), ``latent`` (MoE latent width),
``rank`` (low-rank gate bottlenecks), ``conv`` (short-conv taps), ``norm`` (norm weights),
``layers`` (the scanned stack axis).
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax


def param_init(init: Callable, axes: Sequence[str | None]) -> Callable:
    """Wrap ``init`` so the created parameter records its logical axis names."""
    return nn.with_logical_partitioning(init, tuple(axes))


def normal(std: float, axes: Sequence[str | None]) -> Callable:
    return param_init(nn.initializers.normal(std), axes)


def ones(axes: Sequence[str | None]) -> Callable:
    return param_init(nn.initializers.ones, axes)


def zeros(axes: Sequence[str | None]) -> Callable:
    return param_init(nn.initializers.zeros, axes)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint on an activation by logical names, e.g. ``("batch", "length", None)``.

    Uses the mesh and rules made current by :func:`k3jax.parallel.mesh.use_mesh`; a no-op outside
    it, so layers may call it unconditionally.
    """
    if not nn.get_logical_axis_rules() or jax.sharding.get_abstract_mesh().empty:
        return x
    return nn.with_logical_constraint(x, names)


__all__ = ["constrain", "param_init", "normal", "ones", "zeros"]
