"""Which mesh axes split a batch for the kernels' per-device runs (``k3jax/ops/per_device.py``);
the ops that run per device are tested with their kernels (test_short_conv.py,
test_depth_mix_norm.py, test_pallas_kda.py, test_ep_dispatch.py)."""

from __future__ import annotations

import dataclasses
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import k3jax.ops.attention
import k3jax.parallel as kp
from configs.k3_tiny import model_config
from k3jax import devices
from k3jax.config.mesh import DEFAULT_RULES, MeshConfig
from k3jax.model import K3Model, abstract_variables
from k3jax.ops.per_device import batch_axes, rows_per_device
from pallas_kernels.depth_mix_norm import TOKENS_MULTIPLE

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


def test_every_kernel_of_a_models_gradient_runs_on_its_devices_rows(monkeypatch):
    """The whole model, lowered for 8 abstract H200s (data 4 x fsdp 2; on the CPU, the kernels'
    hardware gate said yes): every Mosaic GPU and Triton call of its gradient takes one device's
    2 of the batch's 16 rows, so a kernel added without a per-device run (GSPMD would run it on
    the whole batch on every device) fails here. XLA's attention stands in for cuDNN's, whose
    lowering asks the library's version, and the MoE keeps its XLA grouped matmul; both run per
    device in their own tests (test_attention.py, test_ep_dispatch.py)."""
    # The gate says yes wherever it was imported, and to every module that imports it later
    # (put back below: a module imported meanwhile would keep the stand-in).
    gate, yes = devices.hopper_gpus, lambda count=1: True
    for name, module in [*sys.modules.items(), ("k3jax.devices", devices)]:
        if name.startswith(("k3jax", "pallas_kernels")) and getattr(module, "hopper_gpus",
                                                                    None) is gate:
            monkeypatch.setattr(module, "hopper_gpus", yes)
    monkeypatch.setattr(k3jax.ops.attention, "_implementation", lambda q: None)
    cfg = model_config()
    cfg = cfg.replace(kda=dataclasses.replace(cfg.kda, chunk_size=64))  # the kernels' chunk
    b, t = 16, TOKENS_MULTIPLE // 2  # 2 rows of t per device: the reads' kernels take them
    params = abstract_variables(cfg, (b, t))

    def loss(variables, tokens):
        logits = K3Model(cfg).apply(variables, tokens)
        return jnp.mean(logits.astype(jnp.float32))

    mesh = {"data": 4, "fsdp": 2, "expert": 1, "tensor": 1}
    try:
        with devices.hopper_target(mesh), nn.logical_axis_rules(DEFAULT_RULES):
            text = jax.jit(jax.grad(loss)).trace(
                params, jax.ShapeDtypeStruct((b, t), jnp.int32)).lower(
                lowering_platforms=("cuda",)).as_text()
    finally:
        for module in list(sys.modules.values()):
            if getattr(module, "hopper_gpus", None) is yes:
                module.hopper_gpus = gate
    kernel = re.compile(r"custom_call @(mosaic_gpu\w*|__gpu\$xla\.gpu\.triton)")
    calls = [line for line in text.splitlines() if kernel.search(line)]
    kinds = {kernel.search(line).group(1) for line in calls}
    # KDA's nine Mosaic kernels (each layer kind's function lowered once), the convolutions'
    # and the AttnRes reads' Triton kernels
    assert len(kinds) == 2 and len(calls) >= 18, (kinds, len(calls))
    whole = [line for line in calls
             if f"tensor<{b}x{t}" in line or f"tensor<{b * t}x" in line]
    assert not whole, whole[0][-400:]
