"""KDA's gated head-wise output norm (:func:`k3jax.ops.gated_head_norm.gated_head_norm`): the
Triton backward kernel (in Pallas's interpreter, on meshes of 8 devices, lowered for an H200, and
on a Hopper GPU where there is one) against JAX's autodiff of the formula, and the errors that name
a bad argument."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import k3jax.parallel as kp
from k3jax.config.mesh import MeshConfig
from k3jax.devices import hopper_gpus, hopper_target
from k3jax.ops.gated_head_norm import gated_head_norm
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms
from pallas_kernels import gated_head_norm as kernels

EPS = 1e-5
ROWS = 2 * kernels.BLOCK_ROWS


@functools.partial(jax.jit, static_argnums=(0, 1))
def _operands(lead: tuple[int, ...], dtype=jnp.bfloat16):
    """``(o, g, w, dy)``: two heads of 128 channels; the gate at scale 3 reaches sigmoid's tails,
    the weight away from 1 so its gradient and its use both count."""
    ko, kg, kw, kd = jax.random.split(jax.random.key(len(lead)), 4)
    shape = (*lead, 2, 128)
    return (jax.random.normal(ko, shape).astype(dtype),
            (3.0 * jax.random.normal(kg, shape)).astype(dtype),
            1.0 + 0.5 * jax.random.normal(kw, (128,)),
            jax.random.normal(kd, shape).astype(dtype))


def _value_and_grads(impl, interpret=False):
    """``(y, (do, dg, dw))`` of :func:`gated_head_norm` for the output gradient ``dy``, jitted."""
    def run(o, g, w, dy):
        y, vjp = jax.vjp(lambda o, g, w: gated_head_norm(o, g, w, EPS, o.dtype, impl, interpret),
                         o, g, w)
        return y, vjp(dy)
    return jax.jit(run)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_autodiff_of_the_formula(dtype):
    """The kernel path's value and its three gradients against autodiff of the formula (math §10:
    FP32_TOL for fp32 inputs; BF16_OUT_TOL for the bf16 value and gradients of ``o`` and ``g``,
    BF16_GRAD_QKV_TOL for the weight's, a sum over every token of bf16-rounded inputs' products),
    over two row blocks of two batch rows."""
    o, g, w, dy = _operands((2, ROWS // 2), dtype)
    y, grads = _value_and_grads("pallas", interpret=not hopper_gpus())(o, g, w, dy)
    y_ref, grads_ref = _value_and_grads("reference")(o, g, w, dy)
    # One formula forward on both paths, but in two programs: on a GPU XLA fuses it differently
    # in each (fp32 results differed in the last bits), so round-off, not bits, is the contract.
    tols = (FP32_TOL,) * 4 if dtype == jnp.float32 else (BF16_OUT_TOL,) * 3 + (BF16_GRAD_QKV_TOL,)
    for name, ours, ref, tol in zip(("y", "do", "dg", "dw"), (y, *grads), (y_ref, *grads_ref),
                                    tols):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, name
        err = rel_rms(ref.astype(jnp.float32), ours.astype(jnp.float32))
        assert err <= tol, f"{name}: relative RMS {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=4, tensor=2), MeshConfig(data=2, fsdp=4)],
                         ids=["data4_tensor2", "data2_fsdp4"])
def test_each_device_runs_the_kernel_on_its_own_rows(mesh_cfg):
    """Under a mesh of 8 devices the kernel runs per device (``shard_map`` over the batch axes),
    the weight's gradient summed over them: one device's values, to fp32 round-off (FP32_TOL)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    o, g, w, dy = _operands((8, kernels.BLOCK_ROWS), jnp.float32)
    run = _value_and_grads("pallas", interpret=not hopper_gpus())
    one = run(o, g, w, dy)
    with kp.use_mesh(kp.make_mesh(mesh_cfg), mesh_cfg.rules):
        lowered = jax.jit(run).lower(o, g, w, dy)
        many = lowered.compile()(o, g, w, dy)
    assert "sdy.manual_computation" in lowered.as_text()  # it did run per device
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        assert rel_rms(a, b) <= FP32_TOL


def test_kernel_lowers_for_an_h200():
    """The kernel path as the KDA layer runs it passes Triton's lowering for an H200 at
    k3_small's shape; the tests above run it in the interpreter."""
    o = jax.ShapeDtypeStruct((2, 2048, 6, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128,), jnp.float32)

    def loss(o, g, w):
        y = gated_head_norm(o, g, w, EPS, jnp.bfloat16, "pallas")
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with hopper_target():
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(o, o, w).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_bad_arguments_are_named():
    o, g, w, dy = _operands((ROWS,))
    with pytest.raises(ValueError, match="one shape"):
        gated_head_norm(o, g[:, :1], w, EPS, o.dtype)
    with pytest.raises(ValueError, match="impl must be one of"):
        gated_head_norm(o, g, w, EPS, o.dtype, impl="fast")
    with pytest.raises(ValueError, match=r"N % 16 == 0"):  # at the call, before any backward
        gated_head_norm(o[:8], g[:8], w, EPS, o.dtype, impl="pallas")
    with pytest.raises(ValueError, match="V in"):
        kernels.check_args(o[..., :96], g[..., :96], w[:96], dy[..., :96])
    with pytest.raises(ValueError, match="dy must be"):
        kernels.check_args(o, g, w, dy[:, :1])


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_kernel_on_gpu():
    """On a Hopper GPU ``"auto"`` takes the kernel at k3_small's shape, within math §10's bf16
    tolerances of the formula's autodiff."""
    o, g, w, dy = _operands((4, 2048))
    text = jax.jit(jax.grad(lambda o: jnp.sum(gated_head_norm(o, g, w, EPS, o.dtype).astype(
        jnp.float32)))).lower(o).as_text()
    assert "__gpu$xla.gpu.triton" in text
    _, grads = _value_and_grads("auto")(o, g, w, dy)
    _, grads_ref = _value_and_grads("reference")(o, g, w, dy)
    for ours, ref, tol in zip(grads, grads_ref, (BF16_OUT_TOL, BF16_OUT_TOL, BF16_GRAD_QKV_TOL)):
        assert rel_rms(ref.astype(jnp.float32), ours.astype(jnp.float32)) <= tol
