"""Test configuration shared by the suite.

Eight simulated CPU devices are requested before jax is imported so the expert-parallel tests can
build real meshes; single-device tests simply use device 0.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402  (after the flags above)

jax.config.update("jax_default_matmul_precision", "highest")
