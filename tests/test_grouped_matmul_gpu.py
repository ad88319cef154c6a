"""The Mosaic grouped matmuls and tile activation compiled for an sm_90 GPU, at MoE sizes (skips
without one).

The CPU suite forces ``JAX_PLATFORMS=cpu``, so run it as
``JAX_PLATFORMS=cuda python -m pytest -q tests/test_grouped_matmul_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.devices import hopper_gpus
from k3jax.ops.activations import GLUSpec
from k3jax.ops.grouped_matmul import grouped_matmul, row_alignment
from k3jax.ops.moe_dispatch import ExpertWeights, ragged_dispatch
from k3jax.ops.tiled_glu import glu_on_tiles
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, rel_rms
from pallas_kernels import tiled_gmm as tiled

pytestmark = pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")


@pytest.mark.parametrize("aligned", [False, True])
def test_grouped_matmul_values_and_grads(aligned):
    """Both Mosaic paths (jax's ragged kernel; the tile kernel on aligned rows, with padding tiles
    past the groups) against fp32 ``ragged_dot`` on the real rows, math §10 bf16 tolerances."""
    groups, k, n = 16, 1024, 768
    rng = np.random.default_rng(0)
    real = rng.integers(0, 600, groups)
    real[3] = 0
    align = row_alignment("mosaic") if aligned else 1
    sizes = -(-real // align) * align
    rows = int(sizes.sum()) + 4 * 128
    present = np.zeros(rows, bool)
    starts = np.cumsum(sizes) - sizes
    for s, r in zip(starts, real):
        present[s:s + r] = True
    kx, kw, kc = jax.random.split(jax.random.key(1), 3)
    x = jnp.where(present[:, None], jax.random.normal(kx, (rows, k)), 0).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, (rows, n))
    mask = jnp.asarray(present)[:, None]
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(f):
        return jax.jit(jax.value_and_grad(
            lambda x, w: jnp.sum(jnp.where(mask, f(x, w), 0.0) * cot), argnums=(0, 1)))

    ours = loss(lambda x, w: grouped_matmul(x, w, gs, "mosaic", aligned))
    ref = loss(lambda x, w: jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs))
    (_, (dx, dw)), (_, (rx, rw)) = ours(x, w), ref(x, w)
    y = np.asarray(jax.jit(lambda x, w: grouped_matmul(x, w, gs, "mosaic", aligned))(x, w))
    y_ref = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs))
    assert rel_rms(y_ref[present], y[present]) <= BF16_OUT_TOL
    dx = np.asarray(dx, np.float32)
    # jax's kernels zero the padding's gradient; the tile kernel skips it
    if not aligned:
        assert np.all(dx[int(sizes.sum()):] == 0.0)
    assert rel_rms(np.asarray(rx)[present], dx[present]) <= BF16_GRAD_QKV_TOL
    assert rel_rms(rw, np.asarray(dw, np.float32)) <= BF16_GRAD_QKV_TOL


def _wrong_rows(ours, ref):
    """Rows (last axis) with an element further from the reference than two bf16 ulps of the row's
    largest reference value: bf16 rounding of the same fp32 sums stays within one."""
    return np.max(np.abs(ours - ref), axis=-1) > 2.0 ** -7 * np.max(np.abs(ref), axis=-1)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_tile_kernel_writes_every_row_right(transpose_rhs):
    """Row by row, at ``k3_small``'s expert products (16 experts of 8,192 rows, K = N = 384): every
    row of the tile kernel is within two bf16 ulps of the row's largest reference value (same bf16
    operands, fp32 accumulation). A relative RMS bound does not see a few wrong rows: with the
    pipeline refilling a slot its asynchronous product still read, 3% of the input-gradient
    product's rows were wrong (errors above 0.1 on values near 1) at a relative RMS of 4e-3."""
    groups, tiles_per_group, k, n = 16, 64, 384, 384
    tile_group = np.concatenate([np.repeat(np.arange(groups), tiles_per_group),
                                 np.full(16, -1)]).astype(np.int32)
    real = groups * tiles_per_group * tiled.BLOCK_M
    run = jax.jit(lambda x, w: tiled.tiled_gmm(x, w, tile_group, transpose_rhs=transpose_rhs))
    ref = jax.jit(lambda x, w: tiled.tiled_gmm_reference(x, w, tile_group,
                                                         transpose_rhs=transpose_rhs))
    for trial in range(3):
        kx, kw = jax.random.split(jax.random.key(trial))
        x = jax.random.normal(kx, (tile_group.size * tiled.BLOCK_M, k)).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (groups, n, k) if transpose_rhs else (groups, k, n))
             / np.sqrt(k)).astype(jnp.bfloat16)
        y = np.asarray(run(x, w)[:real], np.float32)
        r = np.asarray(ref(x, w)[:real], np.float32)
        wrong = _wrong_rows(y, r)
        assert not np.any(wrong), f"trial {trial}: {int(wrong.sum())} of {real} rows wrong"


def test_weight_gradient_writes_every_element_right():
    """Element by element, the grouped matmul's weight gradient (jax's transposed ragged kernel
    in output tiles of 128 rows by ``column_tile(N)``, 192 here) at ``k3_small``'s expert
    products, against the same products in fp32: within two bf16 ulps of the largest value of its
    row."""
    groups, rows_per_group, k, n = 16, 8192, 384, 384
    rows = groups * rows_per_group + 16 * 128
    sizes = jnp.full((groups,), rows_per_group, jnp.int32)
    kx, kc = jax.random.split(jax.random.key(4))
    x = jax.random.normal(kx, (rows, k)).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, (rows, n)).astype(jnp.bfloat16)
    w = jnp.zeros((groups, k, n), jnp.bfloat16)
    dw = jax.jit(lambda x, w, c: jax.vjp(
        lambda w: grouped_matmul(x, w, sizes, "mosaic", aligned=True), w)[1](c)[0])(x, w, cot)
    real = groups * rows_per_group
    ref = np.einsum("grk,grn->gkn",
                    np.asarray(x[:real], np.float32).reshape(groups, rows_per_group, k),
                    np.asarray(cot[:real], np.float32).reshape(groups, rows_per_group, n))
    dw = np.asarray(dw, np.float32)
    wrong = _wrong_rows(dw, ref)
    assert not np.any(wrong), f"{int(wrong.sum())} of {groups * k} rows of dw wrong"


def test_dispatch_with_mosaic_equals_reference():
    """The single-device dispatch on the Mosaic tile kernel equals the ``ragged_dot`` dispatch in
    fp32 (values and gradients) on 2,048 tokens, 16 experts, top-4 (the fp32 reference is XLA's
    dense ragged_dot fallback, slow at MoE sizes)."""
    n, d, m, e, top = 2048, 1024, 768, 16, 4
    ks = jax.random.split(jax.random.key(2), 6)
    x = jax.random.normal(ks[0], (n, d)).astype(jnp.bfloat16)
    ids = jax.lax.top_k(jax.random.normal(ks[1], (n, e)), top)[1].astype(jnp.int32)
    wts = jax.nn.softmax(jax.random.normal(ks[2], (n, top)), axis=-1)
    ew = ExpertWeights(*((jax.random.normal(k, s) / np.sqrt(s[1])).astype(jnp.bfloat16)
                         for k, s in zip(ks[3:], [(e, d, m), (e, d, m), (e, m, d)])))

    def run(impl, dtype):
        def loss(x, wts, ew):
            cast = lambda a: a.astype(dtype)  # noqa: E731
            y = ragged_dispatch(cast(x), ids, wts, jax.tree.map(cast, ew), GLUSpec(), impl)
            return jnp.sum(y.astype(jnp.float32) ** 2), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))(x, wts, ew)

    (_, y), (dx, dew) = run("mosaic", jnp.bfloat16)
    # XLA's GPU dots take fp32 operands at TF32 by default, which would put ~1e-3 of the
    # reference's own error into a bound of 5e-3: the reference runs at full fp32.
    with jax.default_matmul_precision("highest"):
        (_, y_ref), (rx, rew) = run("ragged_dot", jnp.float32)
    assert rel_rms(y_ref, y.astype(jnp.float32)) <= BF16_OUT_TOL
    assert rel_rms(rx, dx.astype(jnp.float32)) <= BF16_GRAD_QKV_TOL
    for a, b in zip(jax.tree.leaves(rew), jax.tree.leaves(dew)):
        assert rel_rms(a, b.astype(jnp.float32)) <= BF16_GRAD_QKV_TOL


@pytest.mark.parametrize("act", [GLUSpec("situ_glu"), GLUSpec("swiglu")])
def test_glu_on_tiles_values_and_grads(act):
    """The tile activation kernels compiled for sm_90, at MoE width (m = 768) with an empty group
    and padding tiles past the groups, against fp32 autodiff of ``glu`` on the groups' rows (§10
    bf16 tolerances)."""
    sizes = jnp.array([40 * 128, 0, 17 * 128, 7 * 128], jnp.int32)
    rows = int(sizes.sum()) + 30 * 128
    keys = jax.random.split(jax.random.key(3), 3)
    gate, up, cot = (4.0 * jax.random.normal(k, (rows, 768)) for k in keys)
    real = np.arange(rows) < int(sizes.sum())

    def run(on_tiles, dtype):
        f = lambda g, u: glu_on_tiles(g, u, sizes, act, on_tiles)  # noqa: E731
        h, vjp = jax.vjp(f, gate.astype(dtype), up.astype(dtype))
        return h, vjp(cot.astype(dtype))

    (h, grads), (h_ref, refs) = jax.jit(run, static_argnums=(0, 1))(True, jnp.bfloat16), \
        run(False, jnp.float32)
    tols = (BF16_OUT_TOL, BF16_GRAD_QKV_TOL, BF16_GRAD_QKV_TOL)
    for ref, ours, tol in zip((h_ref, *refs), (h, *grads), tols):
        assert rel_rms(np.asarray(ref)[real], np.asarray(ours, np.float32)[real]) <= tol
