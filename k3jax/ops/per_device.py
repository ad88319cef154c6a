"""Kernels on each device's own rows of the batch.

GSPMD cannot split a custom call it knows nothing about (the Pallas kernels here): it gathers the
call's operands and runs the whole batch on every device. Under a mesh of several devices an op's
kernel path therefore runs inside a ``shard_map`` over the mesh, split by the axes that split the
batch (the rules table's ``"batch"``) and replicated over the others, as XLA would replicate the
call over those anyway; every axis is manual, which the kernels' interpreters (their host
callbacks) also need. Parameters enter replicated and their gradients leave summed over the
devices' rows; ``check_vma=False``, because ``pallas_call`` cannot say how its outputs vary over
the mesh.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax

from k3jax.config.mesh import rule_axes


def batch_axes(batch: int) -> tuple[str, ...]:
    """The current mesh's axes that split a batch of ``batch`` rows (the rules' ``"batch"``), or
    ``()``: one device, no mesh or rules, or rows those axes do not divide (XLA pads those)."""
    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    sizes = {} if mesh.empty else dict(mesh.shape)
    rows = tuple(a for a in (rule_axes(rules, "batch") if rules else ()) if a in sizes)
    if math.prod(sizes.values()) <= 1 or not rows or batch % math.prod(sizes[a] for a in rows):
        return ()
    return rows


def rows_per_device(batch: int) -> int:
    """The rows of a batch of ``batch`` that each device holds under :func:`on_own_rows`."""
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    return batch // math.prod(sizes[a] for a in batch_axes(batch))


def on_own_rows(fn: Callable, batch: int, in_specs: Callable, out_specs: Callable) -> Callable:
    """``fn`` run by each device on its own rows of the batch (``batch`` rows in all), or ``fn``
    itself where :func:`batch_axes` is empty. ``in_specs`` and ``out_specs`` map the batch's mesh
    axes ``rows`` to ``fn``'s partition specs (``P(rows)`` for an array split by rows, ``P()``
    for a replicated one)."""
    rows = batch_axes(batch)
    if not rows:
        return fn
    return jax.shard_map(fn, in_specs=in_specs(rows), out_specs=out_specs(rows), check_vma=False)


__all__ = ["batch_axes", "on_own_rows", "rows_per_device"]
