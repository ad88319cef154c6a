"""The training step over a mesh: sharded state, split batches, the mesh current while it runs.

The step itself (:func:`k3jax.train.step.make_train_step`) is sharding-agnostic; here it is jitted
with the state's shardings pinned on input and output (one layout from step to step, no
recompilation), the batch split over the batch axes, and run under :func:`use_mesh` so the
expert-parallel dispatch finds the mesh and the rules table.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, NamedTuple

import jax
from jax._src import config as jax_config  # the persistent cache's write threshold, per thread
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.config.base import ConfigError
from k3jax.parallel.distributed import local_batch_rows, make_global_batch
from k3jax.parallel.executable_cache import ExecutableCache, program_parts
from k3jax.parallel.kernel_precompile import compile_kernels_async
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
    """A train step (``step.gradients`` and ``step.update``, a
    :class:`~k3jax.train.step.TrainStep`) jitted over ``mesh`` as two programs: the state keeps the
    shardings it has now (``state`` may be abstract: :func:`sharded_state_shapes`), the gradients
    take the parameters' shardings, every batch array is split on axis 0 over the batch axes, the
    rest (the schedule's numbers, the step's sums) is replicated. :meth:`compile_async` compiles
    both on worker threads (:class:`CompiledStep`'s ``run`` is then called like the step).

    Two programs because XLA compiles them side by side: ``k3_small``'s whole step took 80 s to
    compile on an H200, its gradient part alone 50 s and the update 20 s, and the two at once
    55 s. The gradients cross in memory between them, as they did inside the one program.
    """

    def __init__(self, step, state: dict, mesh: Mesh, rules, donate: bool = False):
        state_sh = shardings_of(state)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        grads_sh = (state_sh["params"], self.replicated)
        # The state only: its buffers become the new state's. The gradients have no output left
        # to become (on one GPU, jax warned at each start, listing every one of them).
        self.parts = (
            jax.jit(step.gradients, in_shardings=(state_sh, batch_sharding(mesh, rules)),
                    out_shardings=grads_sh),
            jax.jit(step.update, in_shardings=(state_sh, *grads_sh, self.replicated),
                    out_shardings=(state_sh, None), donate_argnums=(0,) if donate else ()))
        self.mesh, self.rules, self.donate = mesh, rules, donate

    def lower(self, state, batch, data, compile_each=None
              ) -> tuple[list[jax.stages.Lowered], dict[str, float]]:
        """Both programs traced and lowered under the mesh for these (abstract) arguments, the
        gradients first; with the seconds of the two stages (``trace_s``, ``lower_s``).
        ``compile_each(lowered)``, when given, is called on each program as soon as it is
        lowered (the gradients' compile, the longer, then starts while the update is traced)."""
        gradients, update = self.parts
        seconds = {"trace_s": 0.0, "lower_s": 0.0}

        def stage(name, work):
            t0 = time.perf_counter()
            out = work()
            seconds[name] += time.perf_counter() - t0
            return out

        def lowered(traced):
            program = stage("lower_s", traced.lower)
            if compile_each is not None:
                compile_each(program)
            return program

        with use_mesh(self.mesh, self.rules):
            traced_grads = stage("trace_s", lambda: gradients.trace(state, batch))
            programs = [lowered(traced_grads)]
            programs.append(lowered(stage("trace_s", lambda: update.trace(
                state, *traced_grads.out_info, data))))
        return programs, seconds

    def compile_async(self, state, batch, data, cache: ExecutableCache | None = None,
                      description: object = None, store_after: Future | None = None) -> Future:
        """The step compiled for these (abstract) arguments: a future of :class:`CompiledStep`.

        Traced and lowered on this thread (lowering reads jax's global config, which the caller
        may change next, e.g. while initialising), then compiled by XLA on two worker threads, one
        per program, while the caller sets up the state. The gradient program, the longer to
        compile, starts compiling as soon as it is lowered, while the update is traced and
        lowered. Each program's Mosaic GPU kernels compile on a thread of their own meanwhile
        (:mod:`~k3jax.parallel.kernel_precompile`).

        With a ``cache``, the programs are stored there once compiled, under a key made of
        ``description`` (everything the step is built from besides the source: its configs), the
        arguments, the mesh and the process's environment
        (:func:`~k3jax.parallel.executable_cache.program_parts`); when the key is there already,
        they are loaded on a worker thread instead, with nothing traced. A stored file that does
        not load is traced, lowered and compiled again on that worker, so with jax's options as
        they are then (the sharded initialisation may have switched the GPU's threefry lowering
        on meanwhile, which gives the same bits), and replaced. Storing waits for ``store_after``
        when given: serialising the programs holds the interpreter lock for seconds (4.3 s for
        ``k3_small`` on an H200), which stalls a training loop running beside it. For the same
        reason jax's persistent compilation cache does not write the programs the executable
        cache stores: its write came between XLA's compile and the first step (2.7 s there).
        """
        done: Future = Future()
        args = (state, batch, data)
        key = program_parts((description, self.donate), args, self.mesh) if cache else None
        if cache is not None and cache.has(key):
            work, work_args = self._load, (cache, key, args, done)
        else:
            work, work_args = self._finish, (self._start_compiles(args, cache), cache, key, done,
                                             store_after)
        threading.Thread(target=_settle, args=(done, work, work_args),
                         name="compile-step").start()
        return done

    def _start_compiles(self, args, cache: ExecutableCache | None):
        """``(futures of the compiled programs, stage seconds, compile start)``: each program
        compiles on its own worker thread from the moment it is lowered. jax's persistent
        compilation cache (when on) writes them only where the executable ``cache`` will not."""
        pool = ThreadPoolExecutor(len(self.parts), thread_name_prefix="compile-step")
        futures, started = [], []

        def compile_each(lowered):
            if not started:
                started.append(time.perf_counter())
            compile_kernels_async(lowered)
            futures.append(pool.submit(_compile, lowered, cache is None))

        try:
            _, seconds = self.lower(*args, compile_each=compile_each)
        finally:
            pool.shutdown(wait=False)  # the workers finish what they were given
        return futures, seconds, started[0]

    def _finish(self, compiles, cache, key, done: Future, store_after: Future | None) -> None:
        futures, seconds, t0 = compiles
        # why nothing stored matched, read on this worker, off the trace's path
        differs = tuple(cache.differences(key)) if cache is not None else ()
        parts = tuple(f.result() for f in futures)
        stored: Future = Future()
        done.set_result(CompiledStep(parts, {**seconds, "compile_s": time.perf_counter() - t0},
                                     stored, differs))
        # Written after the result is out: the first step does not wait for the write.
        path = None
        if cache is not None:
            if store_after is not None:
                wait([store_after])
            try:
                path = cache.store(key, parts)
            except Exception as e:  # noqa: BLE001 - a step not stored is only compiled again
                warnings.warn(f"the compiled step was not stored in {cache.directory}: {e!r}")
        stored.set_result(path)

    def _load(self, cache, key, args, done: Future) -> None:
        t0 = time.perf_counter()
        try:
            parts = tuple(cache.load(key))
        except Exception as e:  # noqa: BLE001 - any unreadable file: compile as without it
            warnings.warn(f"the cached step {cache.path(key)} did not load ({e!r}); compiling it")
            return self._finish(self._start_compiles(args, cache), cache, key, done, None)
        stored: Future = Future()
        stored.set_result(cache.path(key))
        done.set_result(CompiledStep(parts, {"load_s": time.perf_counter() - t0}, stored))


def _compile(lowered: jax.stages.Lowered, jax_cache_writes: bool) -> jax.stages.Compiled:
    """``lowered.compile()``; without ``jax_cache_writes`` jax's persistent cache may still
    provide the program but does not write it (the threshold is per thread)."""
    if jax_cache_writes:
        return lowered.compile()
    with jax_config.persistent_cache_min_compile_time_secs(math.inf):
        return lowered.compile()


def _settle(done: Future, work, args) -> None:
    """``work(*args)`` (which sets ``done``'s result), or its exception into ``done``."""
    try:
        work(*args)
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the step
        if not done.done():
            done.set_exception(e)


class CompiledStep(NamedTuple):
    """:meth:`MeshStep.compile_async`'s result: the compiled gradient and update programs and
    ``seconds``: ``trace_s`` and ``lower_s`` (both programs, on the caller's thread) and
    ``compile_s`` (XLA, from the first worker's start until both are done: it overlaps the
    update's trace and lowering), or ``load_s`` alone when they came from the executable cache;
    ``stored``: a future of the cache file that holds them (None without a cache), done once it
    is written; ``differs``: when compiled with a cache, the parts of the key in which the most
    recently used stored step's differ (why it was compiled: ``ExecutableCache.differences``),
    else empty."""

    parts: tuple[jax.stages.Compiled, jax.stages.Compiled]
    seconds: dict[str, float]
    stored: Future | None = None
    differs: tuple[str, ...] = ()

    def run(self, state, batch, data):
        """One step: ``(state, batch, data) -> (state, metrics)``."""
        gradients, update = self.parts
        return update(state, *gradients(state, batch), data)

    def temp_bytes(self) -> int | None:
        """XLA's temporaries of the larger program (they run one after the other)."""
        sizes = [m.temp_size_in_bytes for m in (c.memory_analysis() for c in self.parts) if m]
        return max(sizes) if sizes else None

    def as_text(self) -> str:
        """Both compiled modules' HLO text."""
        return "\n".join(c.as_text() for c in self.parts)


def sharded_step(step, state: dict, mesh: Mesh, rules, donate: bool = False) -> MeshStep:
    """The training step (a :class:`~k3jax.train.step.TrainStep`) jitted over ``mesh``
    (:class:`MeshStep`)."""
    return MeshStep(step, state, mesh, rules, donate)


def compile_in_background(jitted, mesh: Mesh, rules, *args, after: Future | None = None) -> Future:
    """``jitted`` (a ``jax.jit`` function) traced and lowered for the (abstract) ``args`` under the
    mesh on this thread, then compiled by XLA on a worker thread (its Mosaic GPU kernels on another,
    :mod:`~k3jax.parallel.kernel_precompile`) once ``after``, when given, is done: a future of its
    ``jax.stages.Compiled``. jit keeps what it compiled, so a later call of ``jitted`` under the
    mesh with arguments like ``args`` runs it without compiling again.

    ``after`` orders compiles that would otherwise share the host's cores and jaxlib's one lock for
    Mosaic GPU kernels: a program needed later waits for one needed sooner."""
    with use_mesh(mesh, rules):
        lowered = jitted.lower(*args)
    done: Future = Future()

    def work():
        if after is not None:
            wait([after])  # its outcome is its waiter's business, not this compile's
        compile_kernels_async(lowered)
        done.set_result(lowered.compile())

    threading.Thread(target=_settle, args=(done, work, ()), name="compile").start()
    return done


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
