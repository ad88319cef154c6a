"""The expert-parallel dispatches on two Hopper GPUs with the Mosaic kernels (skips otherwise).

``ragged_all_to_all`` has no CPU lowering, so the CPU suite checks its logic with an emulated
collective; here the real one runs. Each dispatch (bf16, Mosaic tile kernels, expert axis 2) is
compared with the single-device ``ragged_dot`` dispatch in fp32 on the same bf16-rounded inputs
(math §10: bf16 inputs against an fp32 reference), values and gradients, within math §10's bf16
tolerances. Run with
``JAX_PLATFORMS=cuda python -m pytest -q tests/test_ep_dispatch_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bf16_rounded

import k3jax.parallel as kp
from k3jax.config import MoEConfig
from k3jax.config.mesh import MeshConfig
from k3jax.devices import hopper_gpus
from k3jax.layers.moe import make_dispatch
from k3jax.ops.activations import GLUSpec
from k3jax.ops.moe_dispatch import ExpertWeights, ragged_dispatch
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, rel_rms

pytestmark = pytest.mark.skipif(not hopper_gpus(2), reason="needs two sm_90 (H100/H200) GPUs")

N, D, M, E, TOP = 4096, 1024, 768, 16, 4


@pytest.fixture(scope="module")
def problem():
    ks = jax.random.split(jax.random.key(4), 6)
    x = bf16_rounded(jax.random.normal(ks[0], (N, D)))
    # Skewed routing: most slots go to the first device's experts (a balanced-size buffer drops).
    logits = jax.random.normal(ks[1], (N, E)).at[: 3 * N // 4, : E // 4].add(3.0)
    ids = jax.lax.top_k(logits, TOP)[1].astype(jnp.int32)
    wts = jax.nn.softmax(jax.random.normal(ks[2], (N, TOP)), axis=-1)
    ew = ExpertWeights(*(bf16_rounded(jax.random.normal(k, s) / np.sqrt(s[1]))
                         for k, s in zip(ks[3:], [(E, D, M), (E, D, M), (E, M, D)])))
    return x, ids, wts, ew


def _run(dispatch, problem, dtype):
    x, ids, wts, ew = problem

    def loss(x, wts, ew):
        y = dispatch(x.astype(dtype), ids, wts, jax.tree.map(lambda a: a.astype(dtype), ew),
                     GLUSpec())
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))(x, wts, ew)


@pytest.fixture(scope="module")
def reference(problem):
    single = lambda *a: ragged_dispatch(*a, impl="ragged_dot")  # noqa: E731
    return _run(single, problem, jnp.float32)


@pytest.mark.parametrize("kind", ["ragged_all_to_all", "ring", "all_to_all"])
def test_dispatch_on_two_gpus_equals_single_device(problem, reference, kind):
    mesh_cfg = MeshConfig(data=1, expert=2)
    with kp.use_mesh(kp.make_mesh(mesh_cfg, jax.devices()[:2]), mesh_cfg.rules):
        dispatch = make_dispatch(MoEConfig(num_experts=E, top_k=TOP, dispatch=kind,
                                           grouped_matmul="mosaic"))
        (_, y), (dx, dew) = _run(lambda *a: dispatch(*a)[0], problem, jnp.bfloat16)
    (_, y_ref), (rx, rew) = reference
    assert rel_rms(y_ref, y.astype(jnp.float32)) <= BF16_OUT_TOL
    assert rel_rms(rx, dx.astype(jnp.float32)) <= BF16_GRAD_QKV_TOL
    for a, b in zip(jax.tree.leaves(rew), jax.tree.leaves(dew)):
        assert rel_rms(a, b.astype(jnp.float32)) <= BF16_GRAD_QKV_TOL
