"""The per-token cross-entropy with its one-pass backward (k3jax/ops/cross_entropy.py) against the
formula token by token in fp64 (values and gradients within math §10's fp32 tolerance), and
against optax's form (autodiff through a gather and its scatter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.ops.cross_entropy import token_nats
from k3jax.ops.tolerance import FP32_TOL, rel_rms


def _reference(logits: np.ndarray, targets: np.ndarray, g: np.ndarray):
    """nats and d(sum(g * nats))/dlogits, a token at a time in fp64."""
    logits = logits.astype(np.float64)
    nats, grad = np.zeros(targets.shape), np.zeros(logits.shape)
    for idx in np.ndindex(*targets.shape):
        row = logits[idx]
        lse = row.max() + np.log(np.sum(np.exp(row - row.max())))
        nats[idx] = lse - row[targets[idx]]
        grad[idx] = g[idx] * (np.exp(row - lse) - np.eye(len(row))[targets[idx]])
    return nats, grad


@pytest.mark.parametrize("scale", [1.0, 300.0], ids=["unit", "large"])  # large: exp overflows
def test_values_and_gradient_match_the_formula(scale):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(k1, (3, 5, 37), jnp.float32) * scale
    targets = jax.random.randint(k2, (3, 5), 0, 37)
    g = jax.random.uniform(k3, (3, 5), jnp.float32)
    nats, vjp = jax.vjp(lambda x: token_nats(x, targets), logits)
    (grad,) = vjp(g)
    want_nats, want_grad = _reference(*map(np.asarray, (logits, targets, g)))
    assert rel_rms(want_nats, nats) <= FP32_TOL, rel_rms(want_nats, nats)
    assert rel_rms(want_grad, grad) <= FP32_TOL, rel_rms(want_grad, grad)
    # The same as optax's form to fp32 round-off, values and gradients.
    ref_nats, ref_vjp = jax.vjp(
        lambda x: optax.softmax_cross_entropy_with_integer_labels(x, targets), logits)
    assert rel_rms(ref_nats, nats) <= FP32_TOL
    assert rel_rms(ref_vjp(g)[0], grad) <= FP32_TOL


def test_backward_has_no_scatter():
    """The point of the custom backward: no scatter into the logits' cotangent."""
    logits = jnp.zeros((2, 4, 16), jnp.float32)
    targets = jnp.zeros((2, 4), jnp.int32)
    grad = jax.grad(lambda x: jnp.sum(token_nats(x, targets)))
    assert "scatter" not in str(jax.make_jaxpr(grad)(logits))
    plain = jax.grad(lambda x: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, targets)))
    assert "scatter" in str(jax.make_jaxpr(plain)(logits))  # the test can fail


def test_bf16_logits_are_read_in_fp32():
    """The bf16 head's logits: the same nats as their fp32 widening (computed in fp32), and the
    gradient in bf16, the fp32 one rounded once."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    logits = (jax.random.normal(k1, (3, 5, 37), jnp.float32) * 4).astype(jnp.bfloat16)
    targets = jax.random.randint(k2, (3, 5), 0, 37)
    g = jax.random.uniform(k3, (3, 5), jnp.float32)
    nats, vjp = jax.vjp(lambda x: token_nats(x, targets), logits)
    wide, wide_vjp = jax.vjp(lambda x: token_nats(x, targets), logits.astype(jnp.float32))
    assert nats.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(nats), np.asarray(wide))
    (grad,) = vjp(g)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(grad),
                                  np.asarray(wide_vjp(g)[0].astype(jnp.bfloat16)))
