"""The training step over a mesh: sharded state, split batches, the mesh current while it runs.

The step itself (:func:`k3jax.train.step.make_train_step`) is sharding-agnostic; here it is jitted
with the state's shardings pinned on input and output (one layout from step to step, no
recompilation), the batch split over the batch axes, and run under :func:`use_mesh` so the
expert-parallel dispatch finds the mesh and the rules table.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.config.base import ConfigError
from k3jax.parallel.distributed import local_batch_rows, make_global_batch
from k3jax.parallel.mesh import use_mesh
from k3jax.parallel.sharding import (
    batch_sharding,
    batch_shards,
    init_sharded,
    like_params_shardings,
    shardings_of,
    variable_shardings,
)


def init_sharded_state(model_cfg, mesh: Mesh, rules, rng: jax.Array,
                       make_state: Callable[[dict, dict], dict],
                       batch_shape: tuple[int, int] = (1, 8), axes: dict | None = None) -> dict:
    """Sharded variables (:func:`init_sharded`; ``axes`` as there) -> ``make_state(params,
    balance)`` jitted with ``out_shardings`` that give every parameter-shaped part of the state
    (optimiser moments) the parameter's layout; the rest is replicated."""
    variables = init_sharded(model_cfg, mesh, rules, rng, batch_shape, axes)
    params, balance = variables["params"], variables.get("balance", {})
    out = shardings_of(_state_shapes(make_state, params, balance, shardings_of(params), mesh))
    with use_mesh(mesh, rules):
        return jax.jit(make_state, out_shardings=out)(params, balance)


def sharded_state_shapes(model_cfg, mesh: Mesh, rules, make_state: Callable[[dict, dict], dict],
                         variables: dict, axes: dict) -> dict:
    """The state :func:`init_sharded_state` makes, as ``jax.ShapeDtypeStruct`` with its shardings,
    without creating it (to compile the step while the state is being initialised). ``variables``
    and ``axes``: :func:`k3jax.model.abstract_variables_and_axes`."""
    params = variables["params"]
    param_shardings = variable_shardings(model_cfg, mesh, rules, axes)["params"]
    return _state_shapes(make_state, params, variables.get("balance", {}), param_shardings, mesh)


def _state_shapes(make_state, params, balance, param_shardings, mesh: Mesh) -> dict:
    abstract = jax.eval_shape(make_state, params, balance)
    shardings = like_params_shardings(abstract, params, param_shardings, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)


class MeshStep:
    """``step_fn(state, batch, *data) -> (state, metrics)`` jitted over ``mesh``: the state keeps
    the shardings it has now (``state`` may be abstract: :func:`sharded_state_shapes`), every batch
    array is split on axis 0 over the batch axes, the rest (the schedule's numbers) is replicated.
    :meth:`compile_async` compiles it on a worker thread (:class:`CompiledStep`'s ``run`` is then
    called like the step); :meth:`trace` gives the trace."""

    def __init__(self, step_fn: Callable, state: dict, mesh: Mesh, rules, donate: bool = False):
        state_sh = shardings_of(state)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.jitted = jax.jit(step_fn, in_shardings=(state_sh, batch_sharding(mesh, rules),
                                                     self.replicated),
                              out_shardings=(state_sh, None),
                              donate_argnums=(0,) if donate else ())
        self.mesh, self.rules = mesh, rules

    def trace(self, state, batch, data):
        """``jax.jit(...).trace`` under the mesh (``.lower().compile()`` from there)."""
        with use_mesh(self.mesh, self.rules):
            return self.jitted.trace(state, batch, data)

    def compile_async(self, state, batch, data) -> Future:
        """The step compiled for these (abstract) arguments: a future of :class:`CompiledStep`.

        Traced and lowered on this thread (lowering reads jax's global config, which the caller
        may change next, e.g. while initialising), then compiled by XLA on a worker thread: the
        program a call would compile, while the caller sets up the state.
        """
        t0 = time.perf_counter()
        traced = self.trace(state, batch, data)
        t1 = time.perf_counter()
        lowered = traced.lower()
        seconds = {"trace_s": t1 - t0, "lower_s": time.perf_counter() - t1}

        def compile_step() -> CompiledStep:
            t = time.perf_counter()
            run = lowered.compile()
            return CompiledStep(run, {**seconds, "compile_s": time.perf_counter() - t})

        pool = ThreadPoolExecutor(1, thread_name_prefix="compile-step")
        compiled = pool.submit(compile_step)
        pool.shutdown(wait=False)  # the worker ends with the compile; nothing else is queued
        return compiled


class CompiledStep(NamedTuple):
    """:meth:`MeshStep.compile_async`'s result: ``run(state, batch, data)`` is the compiled step;
    ``seconds`` its ``trace_s``, ``lower_s`` and (XLA, on the worker thread) ``compile_s``."""

    run: jax.stages.Compiled
    seconds: dict[str, float]


def sharded_step(step_fn: Callable, state: dict, mesh: Mesh, rules,
                 donate: bool = False) -> MeshStep:
    """The training step jitted over ``mesh`` (:class:`MeshStep`)."""
    return MeshStep(step_fn, state, mesh, rules, donate)


def under_mesh(fn: Callable, mesh: Mesh, rules) -> Callable:
    """``fn`` (e.g. a jitted evaluation step) called with the mesh and rules current."""
    def run(*args, **kwargs):
        with use_mesh(mesh, rules):
            return fn(*args, **kwargs)
    return run


def abstract_batch(mesh: Mesh, rules, host_batch: dict) -> dict:
    """``jax.ShapeDtypeStruct`` of the global batch that ``batch_placement``'s function makes of
    ``host_batch`` (the same global ``[B, ...]`` arrays every process passes)."""
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding(mesh, rules, v.ndim))
            for k, v in host_batch.items()}


def batch_placement(mesh: Mesh, rules, global_batch: int) -> Callable[[dict], dict]:
    """-> ``place(host_batch)``: this process's rows of each ``[B, ...]`` host array become one
    global array split over the batch axes (every process passes the same global batch)."""
    shards = batch_shards(mesh, rules)
    if global_batch % shards:
        raise ConfigError(f"data.batch_size={global_batch} must be divisible by the {shards} "
                          f"batch shards of the mesh {dict(mesh.shape)}")
    sharding = batch_sharding(mesh, rules)
    rows = local_batch_rows(sharding, (global_batch,))
    return lambda batch: make_global_batch({k: v[rows] for k, v in batch.items()}, sharding,
                                           global_batch)


__all__ = ["CompiledStep", "MeshStep", "abstract_batch", "batch_placement", "init_sharded_state",
           "sharded_state_shapes", "sharded_step", "under_mesh"]
