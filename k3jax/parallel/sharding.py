"""Logical axis names -> ``NamedSharding`` through the rules table; sharded initialisation; batch
and activation shardings.

Every parameter carries logical names (``k3jax.layers.param``); :func:`variable_shardings` maps them
through the rules table of :class:`~k3jax.config.mesh.MeshConfig`, and :func:`init_sharded` jits the
initialiser with those ``out_shardings``, so each device materialises only its own shards (no full
copy of the model on one device at any point).
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.config.mesh import rule_axes
from k3jax.layers.param import constrain  # noqa: F401  (re-exported)
from k3jax.model import init_variables, logical_axes


def _is_spec(x) -> bool:
    return x is None or isinstance(x, P)


def logical_to_sharding(specs, mesh: Mesh, rules):
    """A tree of logical ``PartitionSpec`` (or None: replicated) -> a tree of ``NamedSharding``."""
    def one(spec):
        if spec is None:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(spec), tuple(rules)))
    return jax.tree.map(one, specs, is_leaf=_is_spec)


def variable_shardings(model_cfg, mesh: Mesh, rules, axes: dict | None = None) -> dict:
    """``NamedSharding`` of every model variable (``params`` by logical names; ``balance`` and any
    unnamed variable replicated). ``axes``: :func:`k3jax.model.logical_axes` of the config when the
    caller has it already (each trace of a full-size model takes seconds)."""
    return logical_to_sharding(logical_axes(model_cfg) if axes is None else axes, mesh, rules)


def init_sharded(model_cfg, mesh: Mesh, rules, rng: jax.Array,
                 batch_shape: tuple[int, int] = (1, 8), axes: dict | None = None) -> dict:
    """``init_variables`` jitted with ``out_shardings`` from the rules: parameters are created
    already sharded over ``mesh``. ``axes`` as in :func:`variable_shardings`."""
    shardings = variable_shardings(model_cfg, mesh, rules, axes)
    with jax.set_mesh(mesh), _threefry_as_one_kernel(mesh.size == 1):
        return jax.jit(lambda r: init_variables(model_cfg, r, batch_shape),
                       out_shardings=shardings)(rng)


def init_on_one_device(model_cfg, rng: jax.Array, batch_shape: tuple[int, int] = (1, 8)) -> dict:
    """``init_variables`` jitted on the default device, drawing as :func:`init_sharded` does on
    one device (a plain jit of it compiles threefry inline per weight shape: 99 s for
    ``k3_small``'s hybrid on an H200)."""
    with _threefry_as_one_kernel(True):
        return jax.jit(lambda r: init_variables(model_cfg, r, batch_shape))(rng)


@contextlib.contextmanager
def _threefry_as_one_kernel(enable: bool):
    """On one GPU, lower the random-number generator to its CUDA kernel while initialising: the
    same bits, but XLA otherwise expands threefry inline for every distinct weight shape and the
    init compiles for over a minute (k3_small on an H200). Over several devices the inline form
    stays: it is what lets each device draw only its own shards."""
    old = jax.config.jax_threefry_gpu_kernel_lowering
    jax.config.update("jax_threefry_gpu_kernel_lowering", enable or old)
    try:
        yield
    finally:
        jax.config.update("jax_threefry_gpu_kernel_lowering", old)


def _path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def like_params_shardings(tree, params, param_shardings, mesh: Mesh):
    """Shardings for a tree that embeds copies of the parameter tree (a training state: params,
    optimiser moments, ...): a leaf whose path ends with a parameter's path and has its shape gets
    that parameter's sharding; every other leaf (counters, RNG, router biases) is replicated.

    Needed because XLA's propagation leaves freshly created optimiser zeros replicated.
    """
    table = {}
    for (path, p), sh in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                             jax.tree.leaves(param_shardings)):
        table[_path_keys(path)] = (tuple(p.shape), sh)
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        keys = _path_keys(path)
        for i in range(len(keys)):
            hit = table.get(keys[i:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def batch_axes(rules) -> tuple[str, ...]:
    """Mesh axes that split the batch (the ``batch`` rule: every axis holding different tokens)."""
    return rule_axes(rules, "batch")


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a ``[B, ...]`` batch: rows split over :func:`batch_axes`, the rest replicated."""
    axes = batch_axes(rules)
    first = axes[0] if len(axes) == 1 else (axes or None)
    return NamedSharding(mesh, P(first, *([None] * (ndim - 1))))


def batch_shards(mesh: Mesh, rules) -> int:
    """How many ways the batch is split (a global batch size must be a multiple of it)."""
    n = 1
    for a in batch_axes(rules):
        n *= mesh.shape[a]
    return n


def shardings_of(tree):
    """The current ``sharding`` of every array of a tree (to pin a jitted step's outputs to the
    same layout as its inputs, so the state keeps one layout from step to step)."""
    return jax.tree.map(lambda x: x.sharding, tree)


__all__ = ["batch_axes", "batch_shards", "batch_sharding", "constrain", "init_on_one_device",
           "init_sharded", "like_params_shardings", "logical_to_sharding", "shardings_of",
           "variable_shardings"]
