"""KDA's WY products ``(T X, T Y)``, ``T = (I + L)^-1``, as Mosaic GPU kernels
(``pallas_kernels.kda_solve.wy``) in the CPU interpreter, against a triangular solve and matmuls in
fp32: random chunks and the correlated-keys regime where inverses built from powers of ``L`` fail;
the backward kernel against autodiff of the reference; ``prepare`` and ``kda_pallas`` with
``solve="mosaic"``; lowering for sm_90.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import kda_bf16_case, kda_correlated_keys_case
from k3jax.ops.tolerance import FP32_TOL, rel_rms
from pallas_kernels.kda_prep import prepare
from pallas_kernels.kda_solve import CHUNK, unit_lower_inverse_reference, wy, wy_reference
from test_pallas_kda import _check_all

STRICT = np.tril(np.ones((CHUNK, CHUNK), bool), -1)


def _chunks(correlated: bool, n: int = 2, seed: int = 0):
    """``[1, 1, 64 n, 64]`` fp32: strictly lower ``beta_r k_r . k_j`` per chunk, plus entries on and
    above the diagonal that the op must ignore."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = rng.normal(size=(CHUNK, 64))
        if correlated:                     # nearly parallel keys, beta 0.99
            k = rng.normal(size=(1, 64)) + 0.3 * k
        k /= np.linalg.norm(k, axis=1, keepdims=True)
        beta = 0.99 if correlated else 1 / (1 + np.exp(-rng.normal(size=(CHUNK, 1))))
        out.append(np.where(STRICT, (k @ k.T) * beta, rng.normal(size=(CHUNK, CHUNK))))
    return jnp.asarray(np.concatenate(out)[None, None], jnp.float32)


def _strict(lower):
    return jnp.where(jnp.tile(jnp.asarray(STRICT), (lower.shape[2] // CHUNK, 1)), lower, 0.0)


def _identity_rows(lower):
    """``[1, 1, Tp, 64]``: the identity in every chunk, so that ``W = T`` itself."""
    return jnp.tile(jnp.eye(CHUNK, dtype=jnp.float32), (lower.shape[2] // CHUNK, 1))[None, None]


@pytest.mark.parametrize("correlated", [False, True])
def test_inverse_matches_triangular_solve(correlated):
    """``W`` with ``X = I`` is ``T``: exact elimination on the 16x16 blocks, split-bf16 merges, within
    SPEC 10's FP32_TOL of the fp32 solve, also where powers of ``L`` reach 1e16."""
    lower = _chunks(correlated)
    eye = _identity_rows(lower)
    t, _ = wy(lower, eye, eye, interpret=True)
    assert rel_rms(unit_lower_inverse_reference(_strict(lower)), t) <= FP32_TOL


@pytest.mark.parametrize("correlated", [False, True])
def test_wy_values_and_gradients_match_reference(correlated):
    """``W, U`` (K = 128, V = 64) and the gradients of ``L``, ``X``, ``Y`` against autodiff of the fp32
    reference, FP32_TOL; the gradient of ``L`` is exactly zero on and above the diagonal."""
    lower = _chunks(correlated, n=2, seed=1)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], lower.shape[:3] + (128,))
    y = jax.random.normal(keys[1], lower.shape[:3] + (64,))
    cts = (jax.random.normal(keys[2], x.shape), jax.random.normal(keys[3], y.shape))
    out, vjp = jax.vjp(lambda *a: wy(*a, interpret=True), lower, x, y)
    ref, ref_vjp = jax.vjp(lambda l, x, y: wy_reference(_strict(l), x, y), lower, x, y)
    for name, r, o in zip(("w", "u"), ref, out):
        assert rel_rms(r, o) <= FP32_TOL, (name, rel_rms(r, o))
    grads, ref_grads = vjp(cts), ref_vjp(cts)
    for name, r, g in zip(("lower", "x", "y"), ref_grads, grads):
        assert rel_rms(r, g) <= FP32_TOL, (name, rel_rms(r, g))
    assert float(jnp.max(jnp.abs(jnp.where(STRICT, 0.0, grads[0][0, 0].reshape(-1, CHUNK, CHUNK))))) == 0


def test_prepare_with_mosaic_solve_matches_xla():
    """Every output of the token-parallel part and its gradients, both ways of forming ``W, U``."""
    args, _, _ = kda_bf16_case(3, 1, 100, 2, 64, 64, "lower_bound")
    q, k, v, g, beta, _ = args

    def run(solve):
        f = lambda *a: prepare(*a, scale=0.125, chunk_size=64, solve=solve,  # noqa: E731
                               interpret=True)
        out, vjp = jax.vjp(f, q, k, v, g, beta)
        keys = jax.random.split(jax.random.key(5), len(out))
        cts = type(out)(*(jax.random.normal(key, o.shape) for key, o in zip(keys, out)))
        return out, vjp(cts)

    (out, grads), (ref, ref_grads) = run("mosaic"), run("xla")
    for name, a, b in zip(ref._fields, ref, out):
        assert rel_rms(a, b) <= FP32_TOL, name
    for name, a, b in zip("q k v g beta".split(), ref_grads, grads):
        assert rel_rms(a, b) <= FP32_TOL, name


def test_kda_pallas_with_mosaic_solve_on_correlated_keys():
    """End to end (interpreted kernels), values and all six gradients at SPEC 10's bf16
    tolerances, in the regime where power-based inverses fail."""
    args, do, dfin = kda_correlated_keys_case()
    _check_all(args, None, do, dfin)  # kda_pallas's defaults: Mosaic scores and solve


def test_wy_lowers_for_cuda_and_rejects_bad_shapes():
    lower = jax.ShapeDtypeStruct((2, 4, 8 * CHUNK, CHUNK), jnp.float32)
    x = jax.ShapeDtypeStruct((2, 4, 8 * CHUNK, 128), jnp.float32)
    y = jax.ShapeDtypeStruct((2, 4, 8 * CHUNK, 64), jnp.float32)
    fwd = jax.jit(lambda *a: jax.vjp(wy, *a))
    jax.jit(lambda l, x, y, dw, du: jax.vjp(wy, l, x, y)[1]((dw, du))).trace(
        lower, x, y, x, y).lower(lowering_platforms=("cuda",))
    fwd.trace(lower, x, y).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="lower must be \\[B, H, Tp, 64\\]"):
        wy(jnp.zeros((1, 1, 64, 32)), jnp.zeros((1, 1, 64, 64)), jnp.zeros((1, 1, 64, 64)))
    with pytest.raises(ValueError, match="y must be"):
        wy(jnp.zeros((1, 1, 64, 64)), jnp.zeros((1, 1, 64, 64)), jnp.zeros((1, 1, 64, 32)))
    with pytest.raises(ValueError, match="solve must be one of"):
        prepare(*(jnp.zeros((1, 64, 1, 64)),) * 4, jnp.zeros((1, 64, 1)), scale=1.0, chunk_size=64,
                solve="lapack")
