"""The chunk inverse ``(I + L)^-1`` as a Mosaic GPU kernel (``pallas_kernels.kda_solve``) in the CPU
interpreter, against a triangular solve in fp32: random chunks and the correlated-keys regime where
inverses built from powers of ``L`` fail; its VJP against autodiff of the solve; ``prepare`` and
``kda_pallas`` with ``solve="mosaic"``; lowering for sm_90.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import kda_bf16_case, kda_correlated_keys_case
from k3jax.ops.tolerance import FP32_TOL, rel_rms
from pallas_kernels.kda_prep import prepare
from pallas_kernels.kda_solve import CHUNK, unit_lower_inverse, unit_lower_inverse_reference
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


@pytest.mark.parametrize("correlated", [False, True])
def test_inverse_matches_triangular_solve(correlated):
    """Exact elimination on the 16x16 blocks, split-bf16 merges: within SPEC 10's FP32_TOL of the
    fp32 solve, also where powers of ``L`` reach 1e16."""
    lower = _chunks(correlated)
    ref = unit_lower_inverse_reference(_strict(lower))
    assert rel_rms(ref, unit_lower_inverse(lower, interpret=True)) <= FP32_TOL


def test_inverse_vjp_matches_autodiff_of_the_solve():
    lower = _chunks(False, n=1, seed=1)
    cot = jax.random.normal(jax.random.key(0), lower.shape)
    _, vjp = jax.vjp(lambda x: unit_lower_inverse(x, interpret=True), lower)
    _, ref_vjp = jax.vjp(lambda x: unit_lower_inverse_reference(_strict(x)), lower)
    (grad,), (ref,) = vjp(cot), ref_vjp(cot)
    assert rel_rms(ref, grad) <= FP32_TOL
    assert float(jnp.max(jnp.abs(jnp.where(STRICT, 0.0, grad[0, 0].reshape(-1, CHUNK, CHUNK))))) == 0


def test_prepare_with_mosaic_solve_matches_xla():
    """Every output of the token-parallel part and its gradients, both ways of forming ``T``."""
    args, _, _ = kda_bf16_case(3, 1, 100, 2, 64, 64, "lower_bound")
    q, k, v, g, beta, _ = args

    def run(solve):
        f = lambda *a: prepare(*a, scale=0.125, chunk_size=64, solve=solve,  # noqa: E731
                               interpret=True)
        out, vjp = jax.vjp(f, q, k, v, g, beta)
        return out, vjp(jax.tree.map(jnp.ones_like, out))

    (out, grads), (ref, ref_grads) = run("mosaic"), run("xla")
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        assert rel_rms(a, b) <= FP32_TOL
    for a, b in zip(ref_grads, grads):
        assert rel_rms(a, b) <= FP32_TOL


def test_kda_pallas_with_mosaic_solve_on_correlated_keys():
    """End to end (interpreted kernels), values and all six gradients at SPEC 10's bf16
    tolerances, in the regime where power-based inverses fail."""
    args, do, dfin = kda_correlated_keys_case()
    _check_all(args, None, do, dfin)  # kda_pallas's defaults: Mosaic scores and solve


def test_inverse_lowers_for_cuda_and_rejects_bad_shapes():
    a = jax.ShapeDtypeStruct((2, 4, 8 * CHUNK, CHUNK), jnp.float32)
    jax.jit(lambda x: unit_lower_inverse(x)).trace(a).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="must be \\[B, H, Tp, 64\\]"):
        unit_lower_inverse(jnp.zeros((1, 1, 64, 32)))
    with pytest.raises(ValueError, match="solve must be one of"):
        prepare(*(jnp.zeros((1, 64, 1, 64)),) * 4, jnp.zeros((1, 64, 1)), scale=1.0, chunk_size=64,
                solve="lapack")
