"""Pallas (Mosaic GPU) KDA kernels compiled for an sm_90 GPU, at real sizes (skips without one).

Same checks as tests/test_pallas_kda.py (values and all gradients against the fp32 recurrence with
the math §10 bf16 tolerances), compiled for the GPU instead of interpreted. tests/conftest.py
defaults ``JAX_PLATFORMS`` to ``cpu``, so run it as
``JAX_PLATFORMS=cuda python -m pytest -q -s tests/test_pallas_kda_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bf16_rounded, gate_bias_grad_error, kda_bf16_case, kda_fp32_case

from k3jax.devices import hopper_gpus
from k3jax.ops.kda_gate import bounded_gate
from k3jax.ops.kda_reference import kda_reference
from k3jax.ops.tolerance import (
    BF16_GRAD_GATE_TOL,
    BF16_GRAD_QKV_TOL,
    BF16_OUT_TOL,
    FP32_TOL,
    rel_rms,
)
from pallas_kernels.kda import kda_pallas, supports

pytestmark = pytest.mark.skipif(not hopper_gpus(), reason="needs an sm_90 (H100/H200) GPU")
NAMES = ("q", "k", "v", "g", "beta", "h0")


def _bf16(x):
    return x.astype(jnp.bfloat16)


def _check_on_gpu(label, args, do, dfin, seg=None, inputs=_bf16):
    """``kda_pallas`` on ``inputs`` of q, k, v (bf16 unless given) against the fp32 recurrence, both
    jitted: values and all six gradients within math §10's bf16 tolerances, o in the inputs' dtype,
    every gradient in its argument's; prints the errors under ``label``."""
    scale = args[0].shape[-1] ** -0.5

    def ref(q, k, v, g, beta, h0):
        return kda_reference(q, k, v, g, beta, scale=scale, initial_state=h0, segment_ids=seg)

    def ker(q, k, v, g, beta, h0):
        return kda_pallas(inputs(q), inputs(k), inputs(v), g, beta, scale=scale, initial_state=h0,
                          segment_ids=seg, output_final_state=True)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * do) + jnp.sum(fn(*a)[1] * dfin)

    ro, rf = jax.jit(ref)(*args)
    o, f = jax.jit(ker)(*args)
    rg = jax.jit(jax.grad(loss(ref), argnums=tuple(range(6))))(*args)
    kg = jax.jit(jax.grad(loss(ker), argnums=tuple(range(6))))(*args)
    errs = {n: rel_rms(r, x) for n, r, x in zip(NAMES, rg, kg)}
    print(label, "o", rel_rms(ro, o), "final", rel_rms(rf, f), errs)
    assert o.dtype == inputs(args[0]).dtype
    assert rel_rms(ro, o) <= BF16_OUT_TOL, rel_rms(ro, o)
    assert rel_rms(rf, f) <= BF16_OUT_TOL, rel_rms(rf, f)
    for n, a, x in zip(NAMES, args, kg):
        assert x.dtype == a.dtype, n
        bound = BF16_GRAD_GATE_TOL if n in ("g", "beta") else BF16_GRAD_QKV_TOL
        assert errs[n] <= bound, (n, errs[n])


@pytest.mark.parametrize("b,h,d,t,gate,segments", [
    (2, 4, 128, 2048, "softplus", True),
    (2, 4, 128, 2048, "lower_bound", False),
    (1, 12, 64, 777, "lower_bound", True),
    (2, 12, 128, 1024, "softplus", True),
    (4, 12, 128, 1024, "lower_bound", True)])
def test_values_and_gradients_on_gpu(b, h, d, t, gate, segments):
    """2 x 4 and 1 x 12 chains take the state kernels' 32-wide value tiles, 2 x 12 the 64-wide
    ones and 4 x 12 the 128-wide one. Above ``INVERSE_CHAINS`` (8) chains the forward alone
    applies the chunk inverse in its state pass (the values here); the gradients always go
    through ``W`` and ``U``. So 1 x 12 (K = 64, a padded T) takes both paths at 32-wide tiles."""
    args, do, dfin = kda_bf16_case(d + t + h, b, t, h, d, d, gate)
    seg = (jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(7), 0.004, (b, t)), axis=1)
           if segments else None)
    assert supports(_bf16(args[0]), _bf16(args[1]), _bf16(args[2]), args[3], args[4],
                    initial_state=args[5], segment_ids=seg)
    _check_on_gpu((b, h, d, t, gate, segments), args, do, dfin, seg)


def test_fp32_inputs_on_gpu():
    """fp32 q, k, v off the bf16 grid through the kernels as they are (K = 128, T = 1000, 2 x 4
    heads): o and every gradient in fp32, within math §10's bf16 tolerances (bf16 operands)."""
    args, do, dfin = kda_fp32_case(11, 2, 1000, 4, 128, 128)
    assert not any(np.all(bf16_rounded(x) == x) for x in args[:3])  # off the bf16 grid
    _check_on_gpu("fp32 inputs", args, do, dfin, inputs=lambda x: x)


@pytest.mark.parametrize("b", [1, 8])
def test_repeatable_on_gpu(b):
    """Two runs on the same inputs agree bit for bit (a race would move the result), with few
    chains and with many (the forward's 128-wide tile, one chunk in flight)."""
    args, _, _ = kda_bf16_case(3, b, 4096, 8, 128, 128, "lower_bound")
    fn = jax.jit(lambda q, k, v, g, beta: kda_pallas(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                                     v.astype(jnp.bfloat16), g, beta,
                                                     scale=128**-0.5)[0])
    a, b = fn(*args[:5]), fn(*args[:5])
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
    assert bool(jnp.array_equal(a, b))


@pytest.mark.parametrize("b,h,bound", [(2, 4, None), (2, 12, None), (2, 12, -5.0)])
def test_without_initial_or_final_state_on_gpu(b, h, bound):
    """The training call: no initial state, no final state returned (the state kernels read
    neither, and write no initial-state gradient), at 32-wide value tiles and at 64-wide ones with
    the forward alone applying the inverse, and with K3's gate logits and their bias
    (``gate_lower_bound``, ``gate_bias``: the cumsum kernels form the log-decay and return the
    gradients of both): values and the gradients against the fp32 recurrence within math §10's
    bf16 tolerances, the bias's as the sum of the logits' (:func:`helpers.gate_bias_grad_error`)."""
    args, do, _ = kda_bf16_case(21 + h, b, 1024, h, 128, 128, "lower_bound")
    bias = None
    if bound is not None:  # logits in place of the log-decay, spread as the case's own
        key = jax.random.PRNGKey(h)
        args = (*args[:3], jax.random.normal(key, args[3].shape), *args[4:])
        bias = 0.5 * jax.random.normal(key, args[3].shape[2:])
    args = (*args[:5], bias)
    scale = 128**-0.5
    ker = lambda q, k, v, g, beta, bias: kda_pallas(  # noqa: E731
        _bf16(q), _bf16(k), _bf16(v), g, beta, scale=scale, gate_lower_bound=bound,
        gate_bias=bias)[0]
    gate = (lambda g, b: g) if bound is None else (lambda z, b: bounded_gate(z + b, bound))  # noqa: E731
    ref = lambda q, k, v, g, beta, bias: kda_reference(  # noqa: E731
        q, k, v, gate(g, bias), beta, scale=scale)[0]
    loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * do)  # noqa: E731
    ro, o = jax.jit(ref)(*args), jax.jit(ker)(*args)
    rg = jax.jit(jax.grad(loss(ref), argnums=tuple(range(6))))(*args)
    kg = jax.jit(jax.grad(loss(ker), argnums=tuple(range(6))))(*args)
    assert rel_rms(ro, o) <= BF16_OUT_TOL, rel_rms(ro, o)
    for n, r, x in zip(NAMES[:5], rg, kg):
        tol = BF16_GRAD_GATE_TOL if n in ("g", "beta") else BF16_GRAD_QKV_TOL
        assert rel_rms(r, x) <= tol, (n, rel_rms(r, x))
    if bias is not None:
        assert gate_bias_grad_error(kg[3], kg[5]) <= FP32_TOL, gate_bias_grad_error(kg[3], kg[5])
