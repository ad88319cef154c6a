"""Which mesh axes split a batch for the kernels' per-device runs (``k3jax/ops/per_device.py``);
the ops that run per device are tested with their kernels (test_short_conv.py,
test_depth_mix_norm.py, test_pallas_kda.py, test_ep_dispatch.py)."""

from __future__ import annotations

import jax
import pytest

import k3jax.parallel as kp
from k3jax.config.mesh import MeshConfig
from k3jax.ops.per_device import batch_axes, rows_per_device

AXES = ("data", "fsdp", "expert")  # the default rules' batch axes


@pytest.mark.parametrize("mesh_cfg,rows", [
    (MeshConfig(data=4, tensor=2), 2),
    (MeshConfig(data=2, fsdp=4), 1),
    (MeshConfig(data=1, tensor=8), 8),  # every device holds the whole batch
])
def test_the_batch_axes_split_the_rows_they_divide(mesh_cfg, rows):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    assert batch_axes(8) == () and rows_per_device(8) == 8  # no mesh: one device
    with kp.use_mesh(kp.make_mesh(mesh_cfg), mesh_cfg.rules):
        assert batch_axes(8) == AXES and rows_per_device(8) == rows
        if rows < 8:  # 6 rows do not split over 4 or 8 devices: XLA pads them, no per-device run
            assert batch_axes(6) == () and rows_per_device(6) == 6
