"""Grouped matmul's row pieces (the Mosaic path's way past a worst-case buffer's padding), on CPU.

``segmented_gmm`` is exercised with reference kernels built on ``jax.lax.ragged_dot`` that, like
jax's Mosaic kernel, leave rows past the groups unspecified (here: NaN), so the test sees whether
padding leaks into values or gradients and whether a piece past the real rows was skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.grouped_matmul import GMMKernels, row_segments, segmented_gmm
from k3jax.ops.tolerance import FP32_TOL, rel_rms

G, KD, ND, ROWS, EXPECTED = 4, 8, 12, 96, 40


def _nan_padding(y, sizes):
    real = jnp.arange(y.shape[0]) < jnp.sum(sizes)
    return jnp.where(real[:, None], y, jnp.nan).astype(y.dtype)


def _forward(x, w, sizes, transpose_rhs):
    w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    return _nan_padding(jax.lax.ragged_dot(x, w, sizes), sizes)


def _weight_grad(x, g, sizes):
    w0 = jnp.zeros((sizes.shape[0], x.shape[1], g.shape[1]), x.dtype)
    return jax.vjp(lambda w: jax.lax.ragged_dot(x, w, sizes), w0)[1](g)[0]


NAN_PADDING_KERNELS = GMMKernels(_forward, _weight_grad)


@pytest.mark.parametrize("rows, expected", [(8, 8), (16, 8), (64, 8), (10, 3), (5, 100), (800, 100),
                                            (262144, 131072), (1048576, 131072)])
def test_row_segments_cover_the_buffer_balanced_load_first(rows, expected):
    """The pieces a worst-case buffer runs in: contiguous, covering every row once, the usual load
    first, then two pieces of a sixteenth of it, then at most 8 pieces of one size (the last may be
    shorter), so that the kernels see few row counts and an overshoot wastes little."""
    segments = row_segments(rows, expected)
    assert segments[0] == (0, min(rows, expected))
    assert [a for a, _ in segments[1:]] == [b for _, b in segments[:-1]]
    assert segments[-1][1] == rows and all(b > a for a, b in segments)
    sizes = [b - a for a, b in segments[1:]]
    fine = -(-expected // 16)
    assert all(s <= fine for s in sizes[:2])
    coarse = sizes[2:]
    assert len(coarse) <= 8 and len(set(coarse[:-1])) <= 1 and all(s <= coarse[0] for s in coarse)
    assert len({b - a for a, b in segments}) <= 4
    if rows >= expected + 2 * fine + 8 * 2 * fine:       # the buffer's rows set the coarse size
        assert len(coarse) == 8
    elif coarse:
        assert coarse[0] == 2 * fine


@pytest.mark.parametrize("real", [0, 17, EXPECTED, EXPECTED + 2, EXPECTED + 7, 70, ROWS])
def test_segmented_gmm_equals_ragged_dot_on_real_rows(real):
    """Values and both gradients equal ``ragged_dot``'s on the real rows (SPEC 10, fp32: FP32_TOL),
    padding rows give exactly zero input gradient, nothing non-finite leaks from the kernels'
    unspecified padding, and a piece that starts past the real rows is skipped (its rows are the
    skip branch's zeros, not the kernel's NaN)."""
    segments = tuple(row_segments(ROWS, EXPECTED))
    assert len(segments) > 3
    rng = np.random.default_rng(real)
    cuts = np.sort(rng.integers(0, real + 1, G - 1))
    sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts, [real]])), jnp.int32)
    kx, kw, kg = jax.random.split(jax.random.key(real), 3)
    x = jax.random.normal(kx, (ROWS, KD), jnp.float32)
    w = jax.random.normal(kw, (G, KD, ND), jnp.float32)
    cot = jax.random.normal(kg, (ROWS, ND), jnp.float32)
    mask = (jnp.arange(ROWS) < real)[:, None]

    def loss(f):
        return lambda x, w: jnp.sum(jnp.where(mask, f(x, w), 0.0) * cot)

    ours = lambda x, w: segmented_gmm(x, w, sizes, segments, NAN_PADDING_KERNELS)  # noqa: E731
    ref = lambda x, w: jax.lax.ragged_dot(x, w, sizes)  # noqa: E731
    y = ours(x, w)
    assert rel_rms(np.asarray(ref(x, w))[:real], np.asarray(y)[:real]) <= FP32_TOL
    skipped = [a for a, _ in segments if a >= max(real, 1)]
    for a in skipped:
        assert np.all(np.asarray(y)[a:] == 0.0), f"piece at row {a} ran past {real} real rows"
    dx, dw = jax.grad(loss(ours), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(loss(ref), argnums=(0, 1))(x, w)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
    assert np.all(np.asarray(dx)[real:] == 0.0)
    if real:
        assert rel_rms(rx, dx) <= FP32_TOL and rel_rms(rw, dw) <= FP32_TOL
    else:
        assert np.all(np.asarray(dw) == 0.0)
