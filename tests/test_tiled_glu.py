"""The experts' gated activation on row tiles: its hand-written gradient against ``jax.vjp``, the
Mosaic GPU kernels (through the interpreter, and lowered for sm_90) against their reference, and
the custom VJP of :func:`k3jax.ops.tiled_glu.glu_on_tiles` against JAX's autodiff of ``glu``.

Tiles past the last group are unwritten by the kernels (unspecified), so every comparison is on the
real tiles' rows, and checks that nothing non-finite reaches them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.activations import GLUSpec, glu, glu_recomputed, glu_vjp
from k3jax.ops.tiled_glu import glu_on_tiles
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms
from pallas_kernels import tiled_glu as kernels

BM = kernels.BLOCK_M
ACTS = [GLUSpec("situ_glu", 4.0, 25.0), GLUSpec("situ_glu", 2.0, 8.0), GLUSpec("swiglu")]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))  # one compile, not one per op
def _operands(rows: int, cols: int, n: int, dtype=jnp.bfloat16):
    # Scale 6: both soft caps (beta_gate 2 to 4) and sigmoid's tails are exercised.
    keys = jax.random.split(jax.random.key(rows + cols), n)
    return [(6.0 * jax.random.normal(k, (rows, cols))).astype(dtype) for k in keys]


@pytest.mark.parametrize("act", ACTS)
def test_glu_vjp_equals_autodiff(act):
    """The written-out derivative equals ``jax.vjp`` of :func:`glu` in fp32 (math §10 FP32_TOL)."""
    gate, up, dh = _operands(64, 96, 3, jnp.float32)

    @jax.jit  # both derivatives in one compile, not one per op
    def derivatives(gate, up, dh):
        _, vjp = jax.vjp(lambda a, b: glu(a, b, act.name, act.beta_gate, act.beta_up), gate, up)
        return vjp(dh), glu_vjp(gate, up, dh, act.name, act.beta_gate, act.beta_up)

    for ref, ours in zip(*derivatives(gate, up, dh)):
        assert rel_rms(ref, ours) <= FP32_TOL


@pytest.mark.parametrize("act", ACTS)
def test_glu_recomputed_keeps_only_its_inputs(act):
    """:func:`glu_recomputed` is :func:`glu` (values equal, gradients within math §10 FP32_TOL
    of autodiff's in fp32), and its backward keeps nothing but the two bf16 inputs, where
    autodiff of ``glu`` keeps fp32 intermediates of the inputs' shape."""
    names = (act.name, act.beta_gate, act.beta_up)
    gate, up, dh = _operands(64, 96, 3, jnp.float32)

    @jax.jit
    def both(gate, up, dh):
        (y, vjp), (y_re, vjp_re) = (jax.vjp(lambda a, b: f(a, b, *names), gate, up)
                                    for f in (glu, glu_recomputed))
        return y, y_re, vjp(dh), vjp_re(dh)

    y, y_re, grads, grads_re = both(gate, up, dh)
    assert bool(jnp.array_equal(y, y_re))
    for ref, ours in zip(grads, grads_re):
        assert rel_rms(ref, ours) <= FP32_TOL
    kept = lambda f: [(x.dtype, x.shape) for x in jax.tree.leaves(  # noqa: E731
        jax.vjp(lambda a, b: f(a, b, *names), gate.astype(jnp.bfloat16),
                up.astype(jnp.bfloat16))[1]) if x.ndim]
    assert kept(glu_recomputed) == [(jnp.dtype(jnp.bfloat16), gate.shape)] * 2
    assert (jnp.dtype(jnp.float32), gate.shape) in kept(glu)


@pytest.mark.parametrize("act", ACTS)
def test_kernels_match_reference_on_real_tiles(act):
    """Forward and gradient kernels (interpreted) equal the fp32 reference cast to bf16 on the tiles
    that hold a group (math §10 bf16 output tolerance)."""
    gate, up, dh = _operands(4 * BM, 2 * kernels.BLOCK_N, 3)
    tile_group = np.array([0, -1, 2, -1], np.int32)
    real = np.repeat(tile_group >= 0, BM)
    # kernels and references jitted: one compile each (the interpreter is far slower op by op)
    outs = jax.jit(lambda gate, up, dh, t: (
        kernels.tiled_glu(gate, up, t, act=act, interpret=True),
        *kernels.tiled_glu_vjp(gate, up, dh, t, act=act, interpret=True)))(
        gate, up, dh, tile_group)
    refs = jax.jit(lambda gate, up, dh, t: (
        kernels.tiled_glu_reference(gate, up, t, act),
        *kernels.tiled_glu_reference(gate, up, t, act=act, dh=dh)))(gate, up, dh, tile_group)
    for ref, out in zip(refs, outs):
        assert rel_rms(np.asarray(ref, np.float32)[real], np.asarray(out, np.float32)[real]) \
            <= BF16_OUT_TOL


@pytest.mark.parametrize("act", [ACTS[0], ACTS[2]])
def test_kernels_lower_for_cuda(act):
    """Both kernels pass Mosaic GPU's lowering for an sm_90 target at MoE sizes (the interpreter
    accepts ops and layouts that do not lower)."""
    a = jax.ShapeDtypeStruct((8 * BM, 768), jnp.bfloat16)
    groups = jax.ShapeDtypeStruct((8,), jnp.int32)
    kw = {"act": act}
    jax.jit(lambda g, u, t: kernels.tiled_glu(g, u, t, **kw)).trace(a, a, groups).lower(
        lowering_platforms=("cuda",))
    jax.jit(lambda g, u, d, t: kernels.tiled_glu_vjp(g, u, d, t, **kw)).trace(
        a, a, a, groups).lower(lowering_platforms=("cuda",))


def test_kernels_reject_bad_shapes():
    a = jnp.zeros((BM, 128), jnp.bfloat16)
    kw = {"act": ACTS[0]}
    with pytest.raises(ValueError, match="tile_group must be"):
        kernels.tiled_glu(a, a, jnp.zeros((2,), jnp.int32), **kw)
    with pytest.raises(ValueError, match="multiples of"):
        kernels.tiled_glu(a[:, :100], a[:, :100], jnp.zeros((1,), jnp.int32), **kw)
    with pytest.raises(ValueError, match="up must match"):
        kernels.tiled_glu(a, a.astype(jnp.float32), jnp.zeros((1,), jnp.int32), **kw)
    with pytest.raises(ValueError, match="dh must match"):
        kernels.tiled_glu_vjp(a, a, a[:, :64], jnp.zeros((1,), jnp.int32), **kw)


@pytest.mark.parametrize("act", [ACTS[0], ACTS[2]])
def test_glu_on_tiles_custom_vjp_equals_autodiff(act):
    """Values and both input gradients of the tiled path (a zero-padded group, an empty group, a
    padding tile past the groups) equal JAX's autodiff of ``glu`` in fp32 on the groups' rows,
    within math §10's bf16 tolerances."""
    sizes = np.array([2 * BM, 0, BM], np.int32)
    rows = 4 * BM
    gate, up = _operands(rows, kernels.BLOCK_N, 2)
    cot = jax.random.normal(jax.random.key(7), (rows, kernels.BLOCK_N))
    real = np.arange(rows) < int(sizes.sum())
    mask = real[:, None]

    def run(on_tiles, dtype):
        def values_and_grads(gate, up, cot, sizes):  # jitted: one compile, not one per op
            f = lambda g, u: glu_on_tiles(g, u, sizes, act, on_tiles, interpret=True)  # noqa: E731
            h, vjp = jax.vjp(f, gate.astype(dtype), up.astype(dtype))
            return h, vjp(jnp.where(mask, cot, 0.0).astype(dtype))
        return jax.jit(values_and_grads)(gate, up, cot, sizes)

    (h, grads), (h_ref, refs) = run(True, jnp.bfloat16), run(False, jnp.float32)
    tols = (BF16_OUT_TOL, BF16_GRAD_QKV_TOL, BF16_GRAD_QKV_TOL)
    for ref, ours, tol in zip((h_ref, *refs), (h, *grads), tols):
        ours = np.asarray(ours, np.float32)[real]
        assert np.all(np.isfinite(ours))
        assert rel_rms(np.asarray(ref)[real], ours) <= tol


def test_glu_on_tiles_lowers_for_cuda():
    """The tiled path as the model runs it (jitted launchers, custom VJP, forward and backward)
    passes lowering for an sm_90 target; the tests above run the kernels in the interpreter."""
    a = jax.ShapeDtypeStruct((8 * BM, 768), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def loss(g, u, s):
        return jnp.sum(glu_on_tiles(g, u, s, ACTS[0], on_tiles=True).astype(jnp.float32))

    jax.jit(jax.grad(loss, argnums=(0, 1))).trace(a, a, sizes).lower(lowering_platforms=("cuda",))
