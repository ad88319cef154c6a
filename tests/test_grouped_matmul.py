"""The grouped matmul's tile-aligned path on CPU: the row layout the dispatches build (and the
gathers in and out of it), the Mosaic GPU tile kernel (through the interpreter) and its custom VJP,
each against ``jax.lax.ragged_dot`` or JAX's own gather.

The VJP test runs the tile kernel in interpreter mode for the values and the input gradient (it
leaves the rows of padding tiles unwritten) and ``ragged_dot``'s VJP for the weight gradient (the
Mosaic kernel that takes its place on a GPU is held to it by ``test_grouped_matmul_gpu.py``). Its
padding tiles hold junk inputs and get a nonzero cotangent, so a leak from them would show.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.grouped_matmul import GMMKernels, kernel_gmm, tile_groups
from k3jax.ops.moe_dispatch import aligned_rows, group_rows, permute_rows
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms
from pallas_kernels import tiled_gmm as tiled
from pallas_kernels.row_tiles import COLUMNS, WIDE_COLUMNS, column_tile

BM = tiled.BLOCK_M


def _weight_grad_reference(x, g, sizes):
    w0 = jnp.zeros((sizes.shape[0], x.shape[1], g.shape[1]), jnp.float32)
    return jax.vjp(lambda w: jax.lax.ragged_dot(x.astype(jnp.float32), w, sizes), w0)[1](
        g.astype(jnp.float32))[0]


def _interpreted_tile_kernel(x, w, sizes, transpose_rhs):
    return tiled.tiled_gmm(x, w, tile_groups(sizes, x.shape[0]), transpose_rhs=transpose_rhs,
                           interpret=True)


INTERPRETED = GMMKernels(_interpreted_tile_kernel, _weight_grad_reference,
                         zero_padding_grad=False)


@pytest.mark.parametrize("align, keep", [(1, None), (4, None), (4, 9), (8, 30)])
def test_group_rows_lays_groups_out_aligned_in_order(align, keep):
    """Positions against a NumPy model: groups in order, each starting on a multiple of ``align``,
    slots of a group in their original order, ids past the groups and slots past ``keep`` out of
    range; sizes are the kept counts rounded up to ``align``."""
    rng = np.random.default_rng(align)
    groups, slots = 5, 40
    ids = rng.integers(0, groups + 2, slots)                      # ids >= groups live elsewhere
    ids[ids == 3] = 0                                            # group 3 is empty
    rows = aligned_rows(slots if keep is None else keep, groups, align)
    pos, sizes = jax.jit(group_rows, static_argnums=(1, 2, 3, 4))(  # one compile, not one per op
        ids.astype(np.int32), groups, rows, align, keep)
    expect_pos, expect_sizes, start, taken = np.full(slots, rows), [], 0, 0
    for g in range(groups):
        members = [s for s in range(slots) if ids[s] == g]
        members = members[:max(0, (keep if keep is not None else slots) - taken)]
        taken += len(members)
        expect_pos[members] = start + np.arange(len(members))
        size = -(-len(members) // align) * align
        expect_sizes.append(size)
        start += size
    np.testing.assert_array_equal(np.asarray(pos), expect_pos)
    np.testing.assert_array_equal(np.asarray(sizes), expect_sizes)
    assert start <= rows


@pytest.mark.parametrize("fan_out", [1, 3])
def test_permute_rows_gradient_is_the_gather_transpose(fan_out):
    """Values and the gather-only backward of a partial permutation of slots (``fan_out`` slots
    per row of ``x``) equal JAX's gather from the materialised slots and its scatter-add
    transpose: slots read once, slots never read, out-of-range sources reading zero."""
    rng = np.random.default_rng(fan_out)
    tokens, rows_out = 4, 10
    slots = tokens * fan_out
    src = np.full(rows_out, slots)                               # out of range: reads zero
    chosen = rng.choice(slots, min(7, slots), replace=False)
    src[rng.choice(rows_out, len(chosen), replace=False)] = chosen
    inv = np.full(slots, rows_out)
    inv[src[src < slots]] = np.nonzero(src < slots)[0]
    x = jax.random.normal(jax.random.key(0), (tokens, 5))
    cot = jax.random.normal(jax.random.key(1), (rows_out, 5))

    def ref(x):
        return jnp.take(jnp.repeat(x, fan_out, axis=0), src, axis=0, mode="fill", fill_value=0)

    def ours(x):
        return permute_rows(x, src, inv, fan_out)

    # each value and gradient in one compile, not one per op
    np.testing.assert_array_equal(np.asarray(jax.jit(ours)(x)), np.asarray(jax.jit(ref)(x)))
    grads = [jax.jit(jax.grad(lambda x, f=f: jnp.sum(f(x) * cot)))(x) for f in (ours, ref)]
    assert rel_rms(grads[1], grads[0]) <= FP32_TOL               # same sums, another order
    assert np.any(np.asarray(grads[1]) != 0)


def test_tile_groups_marks_padding_tiles():
    sizes = jnp.array([2 * BM, 0, BM, 0], jnp.int32)
    np.testing.assert_array_equal(np.asarray(tile_groups(sizes, 5 * BM)), [0, 0, 2, -1, -1])


@pytest.mark.parametrize("hopper", [True, False])
def test_mosaic_kernels_only_on_hopper_gpus(monkeypatch, hopper):
    """``impl="mosaic"`` takes the kernels where the hardware gate says Hopper GPUs, and
    ``ragged_dot`` anywhere else (an older GPU cannot compile their sm_90 WGMMAs)."""
    import k3jax.ops.grouped_matmul as gmm

    monkeypatch.setattr(gmm, "hopper_gpus", lambda: hopper)
    x = jax.ShapeDtypeStruct((2 * BM, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 128, 128), jnp.bfloat16)
    assert gmm.runs_on_tiles(x, w, "mosaic", aligned=True) is hopper
    text = str(jax.make_jaxpr(lambda x, w, s: gmm.grouped_matmul(x, w, s, "mosaic"))(
        x, w, jax.ShapeDtypeStruct((2,), jnp.int32)))
    assert ("ragged_dot" in text) is not hopper


@pytest.mark.parametrize("n", [256, 384], ids=["128_column_tiles", "192_column_tiles"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_tile_kernel_matches_reference(transpose_rhs, n):
    """bf16 operands, fp32 accumulation: the interpreted kernel equals the reference on every tile
    that has a group (math §10 bf16 output tolerance), in both widths of output tile."""
    assert column_tile(n) == {256: COLUMNS, 384: WIDE_COLUMNS}[n]
    k, groups = 128, 3
    tile_group = np.array([0, 2, 2, -1, 1], np.int32)
    shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    x, w = jax.jit(lambda kx, kw: (jax.random.normal(kx, (BM * 5, k)).astype(jnp.bfloat16),
                                   jax.random.normal(kw, shape).astype(jnp.bfloat16)))(
        jax.random.key(0), jax.random.key(1))
    # jitted: the interpreter is far slower op by op
    out = jax.jit(lambda x, w, t: tiled.tiled_gmm(x, w, t, transpose_rhs=transpose_rhs,
                                                  interpret=True))(x, w, tile_group)
    ref = jax.jit(lambda x, w, t: tiled.tiled_gmm_reference(x, w, t, transpose_rhs=transpose_rhs))(
        x, w, tile_group)
    real = np.repeat(np.asarray(tile_group) >= 0, BM)
    assert rel_rms(np.asarray(ref, np.float32)[real], np.asarray(out, np.float32)[real]) \
        <= BF16_OUT_TOL


@pytest.mark.parametrize("n", [512, 768], ids=["128_column_tiles", "192_column_tiles"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_tile_kernel_lowers_for_cuda(transpose_rhs, n):
    """The kernel passes Mosaic GPU's lowering for an sm_90 target at MoE sizes (layouts, WGMMA
    tiling) in both widths of output tile; the interpreter alone would accept layouts that do not
    lower."""
    x = jax.ShapeDtypeStruct((8 * BM, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32, n, 1024) if transpose_rhs else (32, 1024, n), jnp.bfloat16)
    groups = jax.ShapeDtypeStruct((8,), jnp.int32)
    jax.jit(lambda x, w, g: tiled.tiled_gmm(x, w, g, transpose_rhs=transpose_rhs)).trace(
        x, w, groups).lower(lowering_platforms=("cuda",))


def test_tile_kernel_rejects_bad_shapes():
    x = jnp.zeros((BM, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="tile_group must be"):
        tiled.tiled_gmm(x, jnp.zeros((2, 128, 128), jnp.bfloat16), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="multiples of"):
        tiled.tiled_gmm(x, jnp.zeros((2, 128, 100), jnp.bfloat16), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="has K="):
        tiled.tiled_gmm(x, jnp.zeros((2, 64, 128), jnp.bfloat16), jnp.zeros((1,), jnp.int32))


def test_tile_kernel_custom_vjp_equals_ragged_dot():
    """Values and both gradients on aligned rows (an empty group, a zero-padded group, two padding
    tiles past the groups) equal ``ragged_dot``'s within math §10's bf16 tolerances. The padding
    tiles hold junk inputs and get a nonzero cotangent: nothing from them may reach the real rows'
    values and input gradient (the tile kernel's), nor the weight gradient, which the custom VJP
    must ask for on ``x``, the cotangent and the groups as given (the weight-gradient kernel itself
    is ``ragged_dot``'s VJP here). The zero rows inside group 0 are the layout's promise."""
    k, n = 128, 128
    real = np.array([BM + 5, 0, 2 * BM])                     # group 0 padded to 2 tiles
    sizes = jnp.asarray(-(-real // BM) * BM, jnp.int32)
    rows = int(sizes.sum()) + 2 * BM
    present = np.zeros(rows, bool)
    present[:real[0]] = True
    present[2 * BM: 4 * BM] = True
    past_groups = np.arange(rows) >= int(sizes.sum())

    @jax.jit  # one compile, not one per op
    def inputs(key):
        kx, kw, kc, kj = jax.random.split(key, 4)
        x = jnp.where(present[:, None], jax.random.normal(kx, (rows, k)), 0)
        x = jnp.where(past_groups[:, None], 3.0 + jax.random.normal(kj, (rows, k)), x)
        w = (jax.random.normal(kw, (3, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
        return x.astype(jnp.bfloat16), w, jax.random.normal(kc, (rows, n))

    x, w, cot = inputs(jax.random.key(2))
    assert np.all(np.asarray(x, np.float32)[past_groups] != 0) and np.all(np.asarray(cot) != 0)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * cot)

    ours = lambda x, w: kernel_gmm(x, w, sizes, INTERPRETED)  # noqa: E731
    ref = lambda x, w: jax.lax.ragged_dot(  # noqa: E731
        x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    # each value and gradient in one compile (the interpreter is far slower op by op)
    y, y_ref = np.asarray(jax.jit(ours)(x, w)), np.asarray(jax.jit(ref)(x, w))
    assert rel_rms(y_ref[present], y[present]) <= BF16_OUT_TOL
    dx, dw = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, w)
    rx, rw = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(x, w)
    dx = np.asarray(dx, np.float32)
    assert np.all(np.isfinite(dx[present])) and np.all(np.isfinite(np.asarray(dw, np.float32)))
    assert rel_rms(np.asarray(rx)[present], dx[present]) <= BF16_GRAD_QKV_TOL
    assert rel_rms(rw, np.asarray(dw, np.float32)) <= BF16_GRAD_QKV_TOL
