"""Multi-process setup: ``jax.distributed.initialize`` from flags or environment, and batches
assembled from each process's own rows.

Every process runs the same program. Each loads only the rows of the global batch that its own
devices hold (:func:`local_batch_rows`) and :func:`make_global_batch` stitches them into global
arrays with ``jax.make_array_from_process_local_data``; nothing is gathered on one host.
"""

from __future__ import annotations

import os
from typing import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding

from k3jax.config.base import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# Launchers whose environment jax's own cluster detection understands.
CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def distributed_args(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None,
                     env: Mapping[str, str] = os.environ) -> dict | None:
    """Arguments for ``jax.distributed.initialize``: flags first, then ``JAX_COORDINATOR_ADDRESS`` /
    ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, then a launcher (SLURM, Open MPI, PMI) that jax
    detects itself (``{}``). ``None``: a single process, nothing to initialise."""
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = _int_env(env, ENV_NUM_PROCESSES)
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id = _int_env(env, ENV_PROCESS_ID)
    given = {"coordinator_address": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ConfigError(f"distributed setup: got {given} but {missing} missing; give all "
                              f"three (flags or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, "
                              f"{ENV_PROCESS_ID})")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"distributed setup: process_id={process_id} must be in "
                              f"[0, num_processes={num_processes})")
        return given if num_processes > 1 else None
    if any(int(env.get(k, "1") or 1) > 1 for k in CLUSTER_ENV):
        return {}
    return None


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"environment {key}={env[key]!r}: expected an integer") from None


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None,
                           local_device_ids: list[int] | None = None) -> bool:
    """Start ``jax.distributed`` when several processes are configured (see
    :func:`distributed_args`); must run before anything touches the devices. -> whether it did."""
    args = distributed_args(coordinator, num_processes, process_id)
    if args is None or jax.distributed.is_initialized():
        return False
    if local_device_ids is not None:
        args["local_device_ids"] = local_device_ids
    jax.distributed.initialize(**args)
    return True


def local_batch_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The rows of a ``[B, ...]`` global batch held by this process's devices (one contiguous
    block, which is what ``make_array_from_process_local_data`` expects)."""
    idx = sharding.addressable_devices_indices_map(tuple(global_shape))
    starts = sorted({s[0].indices(global_shape[0])[:2] for s in idx.values()})
    lo, hi = starts[0][0], starts[-1][1]
    covered = sum(b - a for a, b in starts)
    if covered != hi - lo:
        raise ValueError(f"local_batch_rows: this process holds non-contiguous rows {starts}")
    return slice(lo, hi)


def make_global_batch(local: Mapping[str, np.ndarray], sharding: NamedSharding,
                      global_batch: int) -> dict[str, jax.Array]:
    """This process's rows (``local_batch_rows``) of each ``[b, ...]`` array -> global ``[B, ...]``
    arrays sharded by ``sharding``."""
    out = {}
    for key, value in local.items():
        value = np.asarray(value)
        out[key] = jax.make_array_from_process_local_data(
            sharding, value, (global_batch,) + value.shape[1:])
    return out


__all__ = ["distributed_args", "initialize_distributed", "local_batch_rows", "make_global_batch"]
