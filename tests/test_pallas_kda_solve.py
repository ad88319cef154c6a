"""KDA's WY products ``(T X, T Y)``, ``T = (I + L)^-1``, ``L = beta tril(Akk, -1)``,
``X = beta xk``, ``Y = beta v``, as Mosaic GPU kernels (``pallas_kernels.kda_solve.wy``) in the CPU
interpreter, against a triangular solve and matmuls in fp32: random chunks and the correlated-keys
regime where inverses built from powers of ``L`` fail; every gradient of the backward kernel against
autodiff of the reference; bf16 operands; lowering for sm_90. (``kda_pallas`` end to end on
correlated keys: tests/test_pallas_kda.py.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_rows_within

from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms
from pallas_kernels._mgpu import CHUNK
from pallas_kernels.kda_solve import (
    scaled_inverse,
    scaled_inverse_reference,
    unit_lower_inverse_reference,
    wy,
    wy_reference,
)

STRICT = np.tri(CHUNK, k=-1, dtype=bool)
NAMES = ("akk", "beta", "xk", "v")


def _akk_and_beta(correlated: bool, b: int, h: int, n: int, seed: int):
    """``akk [b, h, 64 n, 64]`` (strictly lower ``k_r . k_j`` per chunk, junk on and above the
    diagonal that the op must ignore) and ``beta [b, h, 64 n]``, fp32."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(b, h, n, CHUNK, 64))
    if correlated:                     # nearly parallel keys, beta 0.99
        k = rng.normal(size=(b, h, n, 1, 64)) + 0.3 * k
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    akk = np.where(STRICT, k @ np.swapaxes(k, -1, -2), rng.normal(size=(b, h, n, CHUNK, CHUNK)))
    logits = np.full((b, h, n * CHUNK), 4.6) if correlated else rng.normal(size=(b, h, n * CHUNK))
    beta = 1 / (1 + np.exp(-logits))  # 0.99 where correlated
    return (jnp.asarray(akk.reshape(b, h, n * CHUNK, CHUNK), jnp.float32),
            jnp.asarray(beta, jnp.float32))


def _random_and_correlated(h: int, n: int, seed: int):
    """:func:`_akk_and_beta` of two batch rows: random chunks in row 0, correlated keys in row 1
    (one run of a kernel covers both regimes)."""
    rows = [_akk_and_beta(correlated, 1, h, n, seed) for correlated in (False, True)]
    return tuple(jnp.concatenate(parts, axis=0) for parts in zip(*rows))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normals(seed, shape_a, shape_b):
    """Two standard normal arrays drawn from ``key(seed)`` split in two (one compile)."""
    ka, kb = jax.random.split(jax.random.key(seed))
    return jax.random.normal(ka, shape_a), jax.random.normal(kb, shape_b)


def _case(akk, beta, dk: int, dv: int, seed: int):
    """``(akk, beta, xk [b, h, Tp, dk], v [b, Tp, h, dv] token-major)``, fp32."""
    b, h, tp = akk.shape[:3]
    return akk, beta, *_normals(seed, (b, h, tp, dk), (b, tp, h, dv))


def _cotangents(w_shape, u_shape, seed: int):
    return _normals(seed + 100, w_shape, u_shape)


def _run(args, cts, w_dtype):
    """Kernel outputs and gradients (jitted: the interpreter is far slower op by op), and the fp32
    reference's on the same (fp32-widened) values."""
    def kernel(args, cts):
        out, vjp = jax.vjp(lambda *a: wy(*a, w_dtype=w_dtype, interpret=True), *args)
        return out, vjp((cts[0].astype(w_dtype), cts[1]))

    def reference(args, cts):
        ref, ref_vjp = jax.vjp(wy_reference, *(a.astype(jnp.float32) for a in args))
        return ref, ref_vjp((cts[0].astype(w_dtype).astype(jnp.float32), cts[1]))

    out, grads = jax.jit(kernel)(args, cts)
    ref, ref_grads = jax.jit(reference)(args, cts)
    return out, grads, ref, ref_grads


def _assert_close(refs, outs, names, tol):
    for name, r, o in zip(names, refs, outs, strict=True):
        err = rel_rms(r, o)
        assert err <= tol, (name, err, tol)


def _assert_akk_grad_strict(dakk):
    """``dAkk`` is exactly zero on and above every chunk's diagonal."""
    chunks = np.asarray(dakk).reshape(-1, CHUNK, CHUNK)
    assert np.all(chunks[:, ~STRICT] == 0)
    assert np.any(chunks[:, STRICT] != 0)


def test_inverse_matches_triangular_solve():
    """``W`` with ``beta = 1``, ``xk = I`` is ``T``: exact elimination on the 16x16 blocks,
    split-bf16 merges, within §10's FP32_TOL of the fp32 solve, on random chunks (batch row 0)
    and where powers of ``L`` reach 1e16 (row 1)."""
    @jax.jit  # kernel and reference in one compile
    def inverse_and_reference(akk, beta):
        akk = akk * beta[..., None]                 # beta folded into Akk: L = akk
        eye = jnp.broadcast_to(jnp.tile(jnp.eye(CHUNK, dtype=jnp.float32), (2, 1)),
                               (2, 1, 2 * CHUNK, CHUNK))
        t, _ = wy(akk, jnp.ones_like(beta), eye, jnp.zeros((2, 2 * CHUNK, 1, CHUNK)),
                  interpret=True)
        return t, unit_lower_inverse_reference(jnp.where(np.tile(STRICT, (2, 1)), akk, 0.0))

    t, ref = inverse_and_reference(*_random_and_correlated(1, 2, seed=0))
    assert_rows_within(ref, t, FP32_TOL)


def test_scaled_inverse_matches_reference():
    """``T diag(beta)`` (for a state pass that applies it) within bf16 rounding (math §10's bf16
    output tolerance) of the fp32 solve, two chunks of random keys (batch row 0) and two where
    powers of ``L`` reach 1e16 (row 1)."""
    akk, beta = _random_and_correlated(1, 2, seed=3)
    tb = jax.jit(functools.partial(scaled_inverse, interpret=True))(akk, beta)
    ref = jax.jit(scaled_inverse_reference)(akk, beta)
    assert tb.dtype == jnp.bfloat16 and tb.shape == akk.shape
    assert_rows_within(ref, tb, BF16_OUT_TOL)


def test_wy_values_and_gradients_match_reference():
    """``W, U`` (K = 128, V = 64) and the gradients of ``akk``, ``beta``, ``xk``, ``v``
    (token-major) against autodiff of the fp32 reference, FP32_TOL, two chunks of random keys
    (batch row 0) and two of correlated keys (row 1); ``dAkk`` is exactly zero on and above the
    diagonal."""
    args = _case(*_random_and_correlated(1, 2, seed=1), 128, 64, seed=1)
    cts = _cotangents(args[2].shape, args[2].shape[:3] + (64,), seed=1)
    out, grads, ref, ref_grads = _run(args, cts, jnp.float32)
    assert [o.dtype for o in out] == [jnp.float32] * 2
    assert [g.shape for g in grads] == [a.shape for a in args]
    for name, r, x in zip(("w", "u", *NAMES), (*ref, *ref_grads), (*out, *grads), strict=True):
        assert_rows_within(r, x, FP32_TOL, name)
    _assert_akk_grad_strict(grads[0])


def test_wy_bf16_operands():
    """bf16 ``xk``, ``v`` and ``W`` against the fp32 reference on the same bf16 values (and the same
    bf16 cotangent of ``W``): what comes out in bf16 (``W``, ``dxk``, ``dv``) within math §10's bf16
    tolerances, what comes out in fp32 (``U``, ``dAkk``, ``dbeta``) within FP32_TOL; outputs and
    gradients in the promised dtypes. Two heads of two chunks."""
    akk, beta, xk, v = _case(*_akk_and_beta(False, 1, 2, 2, seed=2), 64, 128, seed=2)
    args = (akk, beta, xk.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    cts = _cotangents(xk.shape, xk.shape[:3] + (128,), seed=2)
    out, grads, ref, ref_grads = _run(args, cts, jnp.bfloat16)
    assert [o.dtype for o in out] == [jnp.bfloat16, jnp.float32]
    assert [g.dtype for g in grads] == [jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16]
    _assert_close(ref[:1], out[:1], ("w",), BF16_OUT_TOL)
    _assert_close(ref[1:], out[1:], ("u",), FP32_TOL)
    _assert_close(ref_grads[:2], grads[:2], NAMES[:2], FP32_TOL)
    _assert_close(ref_grads[2:], grads[2:], NAMES[2:], BF16_GRAD_QKV_TOL)
    _assert_akk_grad_strict(grads[0])


@pytest.mark.parametrize("width, dtype", [(128, jnp.bfloat16), (64, jnp.float32)])
def test_wy_lowers_for_cuda(width, dtype):
    """Forward and VJP lower to Mosaic GPU for sm_90 (layouts the interpreter does not check)."""
    b, h, tp = 2, 4, 8 * CHUNK
    sds = jax.ShapeDtypeStruct
    args = (sds((b, h, tp, CHUNK), jnp.float32), sds((b, h, tp), jnp.float32),
            sds((b, h, tp, width), dtype), sds((b, tp, h, width), dtype))
    cts = (sds((b, h, tp, width), dtype), sds((b, h, tp, width), jnp.float32))
    f = lambda *a: wy(*a, w_dtype=dtype)  # noqa: E731
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    jax.jit(lambda a, c: jax.vjp(f, *a)[1](c)).trace(args, cts).lower(lowering_platforms=("cuda",))
    jax.jit(scaled_inverse).trace(*args[:2]).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("name, changes", [
    ("akk", {"akk": jnp.zeros((1, 2, 128, 32))}),
    ("beta", {"beta": jnp.zeros((1, 128, 2))}),
    ("xk", {"xk": jnp.zeros((1, 2, 128, 96))}),
    ("v", {"v": jnp.zeros((1, 2, 128, 64))}),           # head-major: v must be token-major
    ("xk", {"xk": jnp.zeros((1, 2, 128, 64), jnp.float16)}),
    ("w_dtype", {"w_dtype": jnp.float16}),
])
def test_wy_rejects_bad_inputs(name, changes):
    args = {"akk": jnp.zeros((1, 2, 128, CHUNK)), "beta": jnp.zeros((1, 2, 128)),
            "xk": jnp.zeros((1, 2, 128, 64)), "v": jnp.zeros((1, 128, 2, 64)), **changes}
    with pytest.raises(ValueError, match=f"wy: {name} must be"):
        wy(args.pop("akk"), args.pop("beta"), args.pop("xk"), args.pop("v"), **args)


@pytest.mark.parametrize("name, akk, beta", [
    ("akk", jnp.zeros((1, 2, 128, 32)), jnp.zeros((1, 2, 128))),
    ("beta", jnp.zeros((1, 2, 128, CHUNK)), jnp.zeros((1, 128, 2))),   # token-major beta
    ("akk", jnp.zeros((1, 2, 128, CHUNK), jnp.int32), jnp.zeros((1, 2, 128))),
])
def test_scaled_inverse_rejects_bad_inputs(name, akk, beta):
    with pytest.raises(ValueError, match=f"scaled_inverse: {name} must be"):
        scaled_inverse(akk, beta)
