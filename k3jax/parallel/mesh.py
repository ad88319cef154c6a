"""The device mesh built from a :class:`~k3jax.config.mesh.MeshConfig`, and the context that makes
it current (for ``jax.shard_map``, sharding constraints and the rules table)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from k3jax.config.base import ConfigError
from k3jax.config.mesh import MESH_AXES, MeshConfig, rule_axes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ``(data, fsdp, expert, tensor)`` over ``devices`` (default: all devices
    of all processes). Axis sizes that do not tile the devices are an error naming both."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        sizes = cfg.resolve(len(devices))
    except ConfigError as e:
        kinds = sorted({d.device_kind for d in devices})
        raise ConfigError(f"{e} ({', '.join(kinds)}; {jax.process_count()} process(es))") from None
    shape = tuple(sizes[a] for a in MESH_AXES)
    # Auto axes: XLA propagates shardings outside shard_map; tensor is innermost (fastest links).
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def start_devices(mesh: Mesh) -> threading.Thread:
    """Sets up this process's devices of ``mesh`` on a thread of its own, and returns it.

    A GPU's first transfer sets up its allocator, which reserves most of the GPU's memory (1.7 s
    on an H200; nothing with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``), and otherwise
    comes in the middle of the host's work before the train step compiles (whatever first
    touches the device): on a thread it can overlap the host's tracing, as far as jaxlib lets go
    of the interpreter lock meanwhile. Later transfers wait for it as they would have anyway."""
    def put_one_byte():
        # all devices at once, then wait: set up one after another, 8 GPUs would take 8 times
        # as long as the host's work this is to overlap
        jax.block_until_ready([jax.device_put(np.zeros((), np.int8), device)
                               for device in mesh.local_devices])

    thread = threading.Thread(target=put_one_byte, name="start-devices", daemon=True)
    thread.start()
    return thread


def expert_axis_size(mesh: Mesh, rules) -> int:
    """Number of expert-parallel shards (product of the mesh axes the ``exp`` rule names)."""
    size = 1
    for a in rule_axes(rules, "exp"):
        size *= mesh.shape[a]
    return size


def check_experts_fit(mesh: Mesh, rules, num_experts: int) -> None:
    """An expert count not divisible by the expert-parallel size is an error naming both."""
    ep = expert_axis_size(mesh, rules)
    if num_experts % ep:
        raise ConfigError(f"MoEConfig.num_experts={num_experts} is not divisible by the expert "
                          f"axis size {ep} (mesh {dict(mesh.shape)})")


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules) -> Iterator[Mesh]:
    """Make ``mesh`` and the rules table current: ``jax.shard_map`` without an explicit mesh,
    :func:`k3jax.parallel.sharding.constrain` and the expert-parallel dispatches read them."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(tuple(rules)):
        yield mesh


__all__ = ["check_experts_fit", "expert_axis_size", "make_mesh", "use_mesh"]
