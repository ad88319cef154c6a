"""The output head's fast backward (k3jax/ops/head.py) against the product in fp64.

Forward: exactly the plain fp32-accumulated product rounded to the operands' dtype. Backward: both
products in bf16 with fp32 accumulation (no TF32 product against a widened cotangent), within
math §10's bf16 gradient tolerance of the fp32 reference; ``dW`` is returned in the weight's
dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.cross_entropy import token_nats
from k3jax.ops.head import head_logits
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, rel_rms


@functools.partial(jax.jit, static_argnames=("b", "t", "d", "v"))  # one compile, not one per op
def _inputs(seed: int, b=2, t=8, d=32, v=48):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k1, (b, t, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (d, v), jnp.float32) * 0.2).astype(jnp.bfloat16)
    targets = jax.random.randint(k3, (b, t), 0, v)
    return h, w, targets


def _loss(logits, targets):
    return jnp.mean(token_nats(logits, targets))  # fp32 inside, as the training loss


def test_forward_is_the_plain_product():
    h, w, _ = _inputs(0)
    plain = jax.jit(lambda h, w: jnp.einsum("btd,dv->btv", h, w,
                                            preferred_element_type=jnp.float32))(h, w)
    out = jax.jit(head_logits)(h, w)
    assert out.dtype == jnp.bfloat16
    plain = plain.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))


def test_gradients_match_fp64_within_bf16_tolerance():
    h, w, targets = _inputs(1)
    with jax.enable_x64(True):
        grad = jax.grad(lambda a, b: _loss(jnp.einsum("btd,dv->btv", a, b), targets),
                        argnums=(0, 1))
        ref = jax.jit(lambda h, w: grad(h.astype(jnp.float64), w.astype(jnp.float64)))(h, w)
    assert ref[0].dtype == ref[1].dtype == np.float64
    dh, dw = jax.jit(jax.grad(lambda a, b: _loss(head_logits(a, b), targets),
                              argnums=(0, 1)))(h, w)
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    assert rel_rms(ref[0], dh) <= BF16_GRAD_QKV_TOL, rel_rms(ref[0], dh)
    assert rel_rms(ref[1], dw) <= BF16_GRAD_QKV_TOL, rel_rms(ref[1], dw)


def test_backward_products_take_bf16_operands():
    """Plain autodiff of the rounded product would widen the cotangent to fp32 and run both
    backward products with an fp32 operand (TF32 on a GPU)."""
    h, w, targets = _inputs(3)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: _loss(head_logits(a, b), targets),
                                    argnums=(0, 1)))(h, w)
    dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # the forward's and the two backward products
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def _equations(jaxpr):
    """Every equation of ``jaxpr``, those of the jaxprs inside its equations too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr holds its Jaxpr
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


def test_fp32_weights_cast_in_the_call_get_the_formulas_gradient():
    """As the model calls it: fp32 weights cast to bf16 for the call get an fp32 gradient (the
    cast's transpose widens the bf16 one) within math §10's bf16 gradient tolerance of autodiff of
    the fp32 formula."""
    h, w, targets = _inputs(2)
    w32 = jnp.asarray(w, jnp.float32)
    dw = jax.jit(jax.grad(lambda b: _loss(head_logits(h, b.astype(h.dtype)), targets)))(w32)
    ref = jax.jit(jax.grad(lambda b: _loss(
        jnp.einsum("btd,dv->btv", h.astype(jnp.float32), b,
                   precision=jax.lax.Precision.HIGHEST), targets)))(w32)
    assert dw.dtype == jnp.float32
    assert rel_rms(ref, dw) <= BF16_GRAD_QKV_TOL, rel_rms(ref, dw)
