"""The fp32 projections of bf16 activations (router logits, KDA gate inputs) against fp64 math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.fp32_projection import bf16_parts, fp32_projection
from k3jax.ops.tolerance import rel_rms

# Every product of a bf16 activation and an fp32 weight is exact, so only the fp32 sums round
# (~1e-7 here, as Precision.HIGHEST). Far tighter than math §10's 1e-4 on purpose: a weight kept
# to two bf16 parts instead of three is 2e-6 off, which 1e-4 would let through.
EXACT_PRODUCTS_TOL = 1e-6
# dx comes out in bf16: against the exact value rounded to bf16 only the values within ~2^-16 of a
# rounding boundary differ (1.2e-4 here); dx from the weight's first part alone is 3e-3 off.
BF16_ROUNDED_TOL = 1e-3


def _case(dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (2, 300, 96)).astype(dtype)
    w = jax.random.normal(k[1], (96, 20)) * 0.05
    r = jax.random.normal(k[2], (2, 300, 20))
    return x, w, r


def _fp64_values_and_grads(x, w, r):
    """``sum(sigmoid(x w) r)``'s projection and gradients in fp64 numpy."""
    x64, w64, r64 = (np.asarray(a, np.float64) for a in (x, w, r))
    y = x64 @ w64
    s = 1.0 / (1.0 + np.exp(-y))
    dy = r64 * s * (1.0 - s)
    return y, dy @ w64.T, np.einsum("btd,btn->dn", x64, dy)


def _values_and_grads(x, w, r):
    def loss(x, w):
        return jnp.sum(jax.nn.sigmoid(fp32_projection(x, w)) * r)

    return jax.jit(fp32_projection)(x, w), *jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


def test_bf16_activations_times_fp32_weights_are_fp32_exact():
    x, w, r = _case()
    y, dx, dw = _values_and_grads(x, w, r)
    want_y, want_dx, want_dw = _fp64_values_and_grads(x, w, r)
    assert y.dtype == jnp.float32 and dw.dtype == jnp.float32 and dx.dtype == jnp.bfloat16
    assert rel_rms(want_y, y) < EXACT_PRODUCTS_TOL
    assert rel_rms(want_dw, dw) < EXACT_PRODUCTS_TOL
    rounded = np.asarray(jnp.asarray(want_dx, jnp.float32).astype(jnp.bfloat16), np.float64)
    assert rel_rms(rounded, dx) < BF16_ROUNDED_TOL


def test_bf16_parts_sum_to_the_fp32_value():
    """Compiled, as the model runs it; the roundings are reduce_precision, which no compiler
    drops (a GPU compiler removes an f32 -> bf16 -> f32 cast pair as excess precision, which
    would make the second and third parts zero: a CPU keeps the pair, so the lowered program is
    checked for what it rounds with)."""
    w = jax.random.normal(jax.random.key(1), (4096,)) * 0.05
    hi, mid, lo = jax.jit(bf16_parts)(w)
    total = hi.astype(jnp.float32) + mid.astype(jnp.float32) + lo.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(w))
    assert np.count_nonzero(np.asarray(lo)) > len(w) // 2
    assert jax.jit(bf16_parts).lower(w).as_text().count("reduce_precision") == 2


def test_fp32_activations_take_the_fp32_product():
    x, w, r = _case(jnp.float32)
    y, dx, dw = _values_and_grads(x, w, r)
    want_y, want_dx, want_dw = _fp64_values_and_grads(x, w, r)
    assert dx.dtype == jnp.float32
    for want, got in ((want_y, y), (want_dx, dx), (want_dw, dw)):
        assert rel_rms(want, got) < EXACT_PRODUCTS_TOL


def test_a_weight_of_the_wrong_width_names_it():
    x, w, _ = _case()
    with pytest.raises(ValueError, match=r"w must be \[d=96, n\]"):
        fp32_projection(x, w[:50])
