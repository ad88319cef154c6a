"""What the default backend's devices can run: the one place the kernels' hardware gate is
written."""

from __future__ import annotations

import functools

import jax


@functools.cache
def hopper_gpus(count: int = 1) -> bool:
    """True when the default backend is a GPU with at least ``count`` devices, all of compute
    capability 9.x (H100/H200: the Mosaic GPU kernels here use sm_90 WGMMA and TMA)."""
    if jax.default_backend() != "gpu" or jax.device_count() < count:
        return False
    return all(str(getattr(d, "compute_capability", "")).startswith("9") for d in jax.devices())


def hopper_target(axes: dict[str, int] | None = None):
    """A context in which ``.lower(lowering_platforms=("cuda",))`` builds GPU kernels for H200s
    where there are none (a CPU): Triton's lowering asks the device for its compute capability,
    which an abstract device answers (Mosaic GPU kernels lower without it). ``axes``: the mesh's
    axis sizes by name (all automatic, as the training mesh's), or one device."""
    h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
    axes = {"_": 1} if axes is None else axes
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
        tuple(axes.values()), tuple(axes), abstract_device=h200,
        axis_types=(jax.sharding.AxisType.Auto,) * len(axes)))
