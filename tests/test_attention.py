"""MLA's causal attention (k3jax/ops/attention.py) against the formula in fp32, values and
gradients, with packed segments: XLA's path on any backend; cuDNN's fused kernel on an sm_90 GPU
(skipped elsewhere; run ``JAX_PLATFORMS=cuda python -m pytest -q tests/test_attention.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from k3jax.devices import hopper_gpus
from k3jax.layers.mla import attention_mask
from k3jax.ops.attention import attention_reference, causal_attention
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms


@functools.partial(jax.jit, static_argnames=("dtype", "b", "t", "h", "dk", "dv"))
def _inputs(dtype, b=2, t=64, h=3, dk=48, dv=32):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(kk, (b, t, h, dk), jnp.float32).astype(dtype) for kk in keys[:2])
    v = jax.random.normal(keys[2], (b, t, h, dv), jnp.float32).astype(dtype)
    # row 0: one document; row 1: three packed documents (the mask must stop at their borders)
    seg = jnp.stack([jnp.zeros(t, jnp.int32),
                     jnp.repeat(jnp.arange(3, dtype=jnp.int32), jnp.array([20, 30, t - 50]),
                                total_repeat_length=t)])
    cot = jax.random.normal(keys[3], (b, t, h, dv), jnp.float32)
    return q, k, v, attention_mask(seg, b, t), cot


@functools.partial(jax.jit, static_argnums=0)  # one compile each, not one per op
def _values_and_grads(fn, q, k, v, mask, cot):
    out, vjp = jax.vjp(lambda a, b_, c: fn(a, b_, c, mask, 0.125).astype(jnp.float32), q, k, v)
    return out, vjp(cot)


def _check(dtype, out_tol, grad_tol):
    q, k, v, mask, cot = _inputs(dtype)
    f32 = jax.jit(lambda *x: [a.astype(jnp.float32) for a in x])(q, k, v)
    ref, ref_grads = _values_and_grads(attention_reference, *f32, mask, cot)
    out, grads = _values_and_grads(causal_attention, q, k, v, mask, cot)
    assert rel_rms(ref, out) <= out_tol, rel_rms(ref, out)
    for name, r, g in zip("qkv", ref_grads, grads):
        assert g.dtype == dtype
        assert rel_rms(r, g) <= grad_tol, (name, rel_rms(r, g))


def test_xla_path_matches_the_formula_fp32():
    _check(jnp.float32, FP32_TOL, FP32_TOL)


@pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
def test_cudnn_path_matches_the_formula_bf16():
    _check(jnp.bfloat16, BF16_OUT_TOL, BF16_GRAD_QKV_TOL)


def test_value_head_wider_than_query_is_refused():
    q, k, v, mask, _ = _inputs(jnp.float32, dk=16, dv=32)
    with pytest.raises(ValueError, match="value head dim 32"):
        causal_attention(q, k, v, mask, 0.25)
