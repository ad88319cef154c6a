"""The gated activation of one gate|up product (:func:`k3jax.ops.glu_pair.glu_of_pair`): its value
and gradient against JAX's autodiff of the fp32 formula on the two halves, the Triton backward
kernel (in Pallas's interpreter, lowered for an H200, and on a Hopper GPU where there is one)
against the formula, and the errors that name a bad argument."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import k3jax.parallel as kp
from k3jax.config.mesh import MeshConfig
from k3jax.devices import hopper_gpus, hopper_target
from k3jax.ops.activations import GLUSpec, glu
from k3jax.ops.glu_pair import glu_of_pair, glu_pair_reference
from k3jax.ops.tolerance import BF16_OUT_TOL, FP32_TOL, rel_rms
from pallas_kernels import glu_pair as kernels

ACTS = [GLUSpec("situ_glu", 4.0, 25.0), GLUSpec("situ_glu", 2.0, 8.0), GLUSpec("swiglu")]
ROWS, COLS = 2 * kernels.BLOCK_ROWS, 2 * kernels.BLOCK_COLS


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _operands(lead: tuple[int, ...], cols: int, dtype=jnp.bfloat16):
    """``(pair [*lead, 2, cols], dh [*lead, cols])``; scale 6 reaches both soft caps and sigmoid's
    tails."""
    kp, kd = jax.random.split(jax.random.key(cols))
    return ((6.0 * jax.random.normal(kp, (*lead, 2, cols))).astype(dtype),
            (6.0 * jax.random.normal(kd, (*lead, cols))).astype(dtype))


def _value_and_grad(act, impl, interpret=False):
    """``(h, d_pair)`` of :func:`glu_of_pair` for the output gradient ``dh``, jitted."""
    def run(pair, dh):
        h, vjp = jax.vjp(lambda p: glu_of_pair(p, act, impl, interpret), pair)
        return h, vjp(dh)[0]
    return jax.jit(run)


@pytest.mark.parametrize("act", ACTS)
def test_formula_path_is_glu_of_the_halves(act):
    """In fp32 the value equals :func:`glu` of the two halves and each half's gradient is within
    math §10 FP32_TOL of autodiff's; in bf16 the backward keeps the pair alone (no fp32
    intermediates) and returns one gradient of its shape and dtype."""
    pair, dh = _operands((ROWS,), COLS, jnp.float32)
    names = (act.name, act.beta_gate, act.beta_up)

    @jax.jit  # both in one program: the values are then the same ops on the same inputs
    def both(pair, dh):
        want, vjp = jax.vjp(lambda a, b: glu(a, b, *names), pair[:, 0], pair[:, 1])
        return want, vjp(dh), _value_and_grad(act, "reference")(pair, dh)

    want, grads, (h, d_pair) = both(pair, dh)
    assert bool(jnp.array_equal(h, want))
    for half, ref in enumerate(grads):
        assert rel_rms(ref, d_pair[:, half]) <= FP32_TOL

    pair = pair.astype(jnp.bfloat16)
    _, vjp = jax.vjp(lambda p: glu_of_pair(p, act, "reference"), pair)
    assert [(x.dtype, x.shape) for x in jax.tree.leaves(vjp) if x.ndim] == [(pair.dtype,
                                                                               pair.shape)]
    (grad,) = vjp(dh.astype(jnp.bfloat16))
    assert (grad.dtype, grad.shape) == (pair.dtype, pair.shape)


@pytest.mark.parametrize("act", ACTS)
def test_kernel_matches_reference(act):
    """The interpreted kernel equals the fp32 formula rounded once to bf16 (math §10 bf16 output
    tolerance), on rows and columns of two blocks each."""
    pair, dh = _operands((ROWS,), COLS)
    ours = jax.jit(lambda p, g: kernels.glu_pair_vjp(p, g, act=act, interpret=True))(pair, dh)
    ref = jax.jit(lambda p, g: glu_pair_reference(p, g, act))(pair, dh)
    assert ours.dtype == ref.dtype == pair.dtype
    assert rel_rms(ref.astype(jnp.float32), ours.astype(jnp.float32)) <= BF16_OUT_TOL


def test_kernel_path_matches_formula_path_on_a_batch():
    """Through the custom VJP on a ``[B, T, 2, m]`` product (rows flattened for the kernel), the
    kernel path's value and gradient equal the formula path's (math §10 bf16 output tolerance)."""
    pair, dh = _operands((2, ROWS // 2), COLS)
    kernel = _value_and_grad(ACTS[0], "pallas", interpret=True)(pair, dh)
    formula = _value_and_grad(ACTS[0], "reference")(pair, dh)
    for ours, ref in zip(kernel, formula):
        assert ours.shape == ref.shape
        assert rel_rms(ref.astype(jnp.float32), ours.astype(jnp.float32)) <= BF16_OUT_TOL


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=4, tensor=2), MeshConfig(data=2, fsdp=4)],
                         ids=["data4_tensor2", "data2_fsdp4"])
def test_each_device_runs_the_kernel_on_its_own_rows(mesh_cfg):
    """Under a mesh of 8 devices the kernel runs per device (``shard_map`` over the batch axes) and
    gives the one device's value and gradient, to fp32 round-off (FP32_TOL)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    pair, dh = _operands((8, kernels.BLOCK_ROWS), COLS, jnp.float32)
    run = _value_and_grad(ACTS[0], "pallas", interpret=not hopper_gpus())
    one = run(pair, dh)
    with kp.use_mesh(kp.make_mesh(mesh_cfg), mesh_cfg.rules):
        lowered = jax.jit(run).lower(pair, dh)
        many = lowered.compile()(pair, dh)
    assert "sdy.manual_computation" in lowered.as_text()  # it did run per device
    for a, b in zip(one, many):
        assert rel_rms(a, b) <= FP32_TOL


def test_kernel_lowers_for_an_h200():
    """The kernel path as the model runs it (custom VJP, jitted launcher) passes Triton's lowering
    for an H200 at the shared expert's shape; the tests above run it in the interpreter."""
    pair = jax.ShapeDtypeStruct((2, 2048, 2, 768), jnp.bfloat16)

    def loss(pair):
        return jnp.sum(glu_of_pair(pair, ACTS[0], "pallas").astype(jnp.float32) ** 2)

    with hopper_target():
        text = jax.jit(jax.grad(loss)).trace(pair).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_bad_arguments_are_named():
    act = ACTS[0]
    with pytest.raises(ValueError, match=r"pair must be \[\.\.\., 2, m\]"):
        glu_of_pair(jnp.zeros((4, 3, 8)), act)
    with pytest.raises(ValueError, match="impl must be one of"):
        glu_of_pair(jnp.zeros((4, 2, 8)), act, impl="fast")
    with pytest.raises(ValueError, match=r"m % 128 == 0"):  # at the call, before any backward
        glu_of_pair(jnp.zeros((ROWS, 2, 64)), act, impl="pallas")
    pair = jnp.zeros((ROWS, 2, COLS), jnp.bfloat16)
    with pytest.raises(ValueError, match="dh must be"):
        kernels.glu_pair_vjp(pair, jnp.zeros((ROWS, COLS), jnp.float32), act=act)
    with pytest.raises(ValueError, match="m % 128 == 0"):
        kernels.glu_pair_vjp(pair[..., :64], jnp.zeros((ROWS, 64), jnp.bfloat16), act=act)
    with pytest.raises(ValueError, match="pair must be"):
        kernels.glu_pair_vjp(pair[:, :1], pair[:, 0], act=act)


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
@pytest.mark.parametrize("act", [ACTS[0], ACTS[2]])
def test_kernel_on_gpu(act):
    """On a Hopper GPU ``"auto"`` takes the kernel at the shared expert's width, and its value and
    gradient equal the formula path's (math §10 bf16 output tolerance)."""
    pair, dh = _operands((4, 2048), 768)
    text = jax.jit(jax.grad(lambda p: jnp.sum(glu_of_pair(p, act).astype(jnp.float32)))).lower(
        pair).as_text()
    assert "__gpu$xla.gpu.triton" in text
    kernel = _value_and_grad(act, "auto")(pair, dh)
    formula = _value_and_grad(act, "reference")(pair, dh)
    for ours, ref in zip(kernel, formula):
        assert rel_rms(ref.astype(jnp.float32), ours.astype(jnp.float32)) <= BF16_OUT_TOL
