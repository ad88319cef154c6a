"""The environment of every test process and of the subprocesses the tests start.

No jax import here: ``conftest.py`` applies it before jax loads.
"""

from __future__ import annotations

import os

SIMULATED_DEVICES = 8  # the expert-parallel tests build real meshes of up to 8 CPU devices

# The suite's time is mostly XLA compiling small programs. LLVM's optimisation passes take half of
# each CPU compile and change no number: XLA builds CPU code without fast-math, so every
# floating-point operation is the same at any level (same losses to the bit).
COMPILE_FLAGS = ("--xla_backend_optimization_level=0",)


def xla_flags(devices: int | None) -> str:
    """``XLA_FLAGS`` for a process of the suite with ``devices`` simulated CPU devices (None: the
    default, one)."""
    flags = list(COMPILE_FLAGS)
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def subprocess_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """``os.environ`` for a subprocess on the CPU: ``devices`` simulated devices (None: one), the
    suite's compile flags and ``extra`` on top."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices), **extra}

