"""Mosaic GPU decayed intra-chunk scores (SPEC 3.3) in the CPU interpreter against plain fp32.

Operands are bf16-representable and the reference (pairwise ``exp(G_r - G_j)`` in fp32) runs on the
same values, so the SPEC 10 bf16 tolerances measure the kernels' own error (bf16 WGMMA operands
``a E``, ``b E``, ``dS``; fp32 accumulation and diagonal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import bf16_rounded, kda_bf16_case
from k3jax.ops.tolerance import BF16_GRAD_GATE_TOL, BF16_GRAD_QKV_TOL, BF16_OUT_TOL, rel_rms
from pallas_kernels import kda_scores
from pallas_kernels.kda_prep import prepare
from pallas_kernels.kda_scores import qk_kk_scores, scores, scores_reference

C = 64


def _gate(f, gate):
    return -5.0 * jax.nn.sigmoid(f) if gate == "lower_bound" else -jnp.exp(1.5) * jax.nn.softplus(2.0 * f)


def _inputs(seed, b, h, tp, dk, gate):
    """bf16-grid ``a, b`` (unit rows, like KDA's normalised q, k), chunk-local cumulative gates.
    ``gate="mixed"``: the lower-bound gate, except head 0's second chunk (softplus) and head 1's
    second chunk (-4.9 at every token: 78 nats from a 32-row block's middle row to its first, at
    the edge of the bounded path, where a factor anchored anywhere else would overflow)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    a = bf16_rounded(unit(jax.random.normal(ks[0], (b, h, tp, dk))))
    bb = bf16_rounded(unit(jax.random.normal(ks[1], (b, h, tp, dk))))
    f = jax.random.normal(ks[2], (b, h, tp, dk))
    if gate == "mixed":
        g = _gate(f, "lower_bound").at[:, 0, C:2 * C].set(_gate(f[:, 0, C:2 * C], "softplus"))
        g = g.at[:, 1, C:2 * C].set(-4.9)
    else:
        g = _gate(f, gate)
    g_cum = jnp.cumsum(g.reshape(b, h, tp // C, C, dk), axis=-2).reshape(b, h, tp, dk)
    return a, bb, g, g_cum


def _cotangents(seed, shape, n):
    """Random cotangents, nonzero above the diagonal too (the kernel must ignore those)."""
    return tuple(jax.random.normal(k, shape) for k in jax.random.split(jax.random.PRNGKey(seed), n))


def _check_grads(ref_grads, ker_grads, names):
    for name, r, x in zip(names, ref_grads, ker_grads):
        tol = BF16_GRAD_GATE_TOL if name in ("g", "g_cum") else BF16_GRAD_QKV_TOL
        assert rel_rms(r, x) <= tol, (name, rel_rms(r, x))


def test_qk_kk_scores_values_and_gradients():
    """Aqk and Akk from one call (K = 64, two heads, two chunks): K3's lower-bound gate (the bounded
    path) in three chunks, a softplus gate past exp's fp32 range (the exact levels) in the fourth."""
    q, k, _, g_cum = _inputs(0, 1, 2, 2 * C, 64, "mixed")
    np.testing.assert_array_equal(kda_scores.bounded_chunks(g_cum), [[[1, 0], [1, 1]]])
    q = q * 0.125
    ker = lambda q, k, g: qk_kk_scores(q, k, g, interpret=True)  # noqa: E731
    ref = lambda q, k, g: (scores_reference(q, k, g), scores_reference(k, k, g))  # noqa: E731
    (rqk, rkk), ref_vjp = jax.vjp(ref, q, k, g_cum)
    (aqk, akk), ker_vjp = jax.vjp(ker, q, k, g_cum)
    assert aqk.dtype == jnp.float32 and aqk.shape == rqk.shape == akk.shape
    assert rel_rms(rqk, aqk) <= BF16_OUT_TOL and rel_rms(rkk, akk) <= BF16_OUT_TOL
    upper = np.triu(np.ones((C, C), bool), 1)
    assert np.all(np.asarray(aqk).reshape(-1, C, C)[:, upper] == 0.0)
    cts = _cotangents(1, rqk.shape, 2)
    _check_grads(ref_vjp(cts), ker_vjp(cts), ("q", "k", "g_cum"))


def test_scores_softplus_gate_past_fp32_exp_range_k128():
    """a != b, K = 128, a softplus gate whose 16-token decay passes exp's fp32 range (-88 nats):
    a split ``exp(G_r) exp(-G_j)`` over a 16-row block would overflow. Values (fp32 and bf16 out)
    and the gradients of a, b, g_cum."""
    a, b, g, g_cum = _inputs(2, 1, 1, C, 128, "softplus")
    assert float(jnp.min(jnp.sum(g[:, :, :16], axis=2))) < -88.0  # the overflow regime is exercised
    assert not kda_scores.bounded_chunks(g_cum).any()  # so the exact levels run
    ker = lambda a, b, g: scores(a, b, g, interpret=True)  # noqa: E731
    r, ref_vjp = jax.vjp(scores_reference, a, b, g_cum)
    s, ker_vjp = jax.vjp(ker, a, b, g_cum)
    assert rel_rms(r, s) <= BF16_OUT_TOL
    s16 = scores(a, b, g_cum, out_dtype=jnp.bfloat16, interpret=True)
    assert s16.dtype == jnp.bfloat16 and rel_rms(r, s16) <= BF16_OUT_TOL
    (ct,) = _cotangents(3, r.shape, 1)
    _check_grads(ref_vjp(ct), ker_vjp(ct), ("a", "b", "g_cum"))


def test_prepare_mosaic_scores_match_xla():
    """prepare(scores="mosaic") against the default XLA path: every output and the gradients of
    q, k, g through them (softplus gate past the fp32 exp range, packed segments, T padded)."""
    args, _, _ = kda_bf16_case(0, 1, 150, 2, 64, 64, "softplus")
    q, k, v, g, beta, _ = args
    assert float(jnp.min(jnp.sum(g[:, :16], axis=1))) < -88.0
    seg = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(9), 0.03, (1, 150)), axis=1)

    def run(mode):
        return lambda q, k, g: prepare(q, k, v, g, beta, scale=0.125, chunk_size=C, segment_ids=seg,
                                       scores=mode, interpret=True)

    ref, ref_vjp = jax.vjp(run("xla"), q, k, g)
    out, ker_vjp = jax.vjp(run("mosaic"), q, k, g)
    for name, r, x in zip(ref._fields, ref, out):
        assert rel_rms(r, x) <= BF16_OUT_TOL, (name, rel_rms(r, x))
    # A random cotangent per element (a constant one would only check the gradient of sums).
    keys = jax.random.split(jax.random.PRNGKey(4), len(ref))
    # Each in the dtype of the kernel path's output (Aqk is bf16 there), the same values for both.
    cts = type(ref)(*((jax.random.normal(key, r.shape) / np.sqrt(r.size)).astype(x.dtype)
                      for key, r, x in zip(keys, ref, out)))
    _check_grads(ref_vjp(type(ref)(*(c.astype(r.dtype) for c, r in zip(cts, ref)))), ker_vjp(cts),
                 ("q", "k", "g"))


@pytest.mark.parametrize("dk", [64, 128])
def test_kernels_lower_for_cuda(dk):
    """Both kernels pass Mosaic GPU's lowering (layouts, WGMMA operand tiling) for an sm_90 target;
    the interpreter alone would accept layouts that do not lower."""
    bf, f32 = (jax.ShapeDtypeStruct((1, 2, 2 * C, dk), d) for d in (jnp.bfloat16, jnp.float32))
    ds = jax.ShapeDtypeStruct((1, 2, 2 * C, C), jnp.float32)
    flags = jax.ShapeDtypeStruct((1, 2, 2), jnp.int32)
    fwd = jax.jit(kda_scores._fwd_call, static_argnames=("which", "out_dtypes", "interpret"))
    bwd = jax.jit(kda_scores._bwd_call, static_argnames=("which", "interpret"))
    for which in ((0, -1), (0,)):
        fwd.trace((bf,), bf, f32, flags, which=which, out_dtypes=(jnp.dtype(jnp.float32),) * len(which),
                  interpret=False).lower(lowering_platforms=("cuda",))
        bwd.trace((bf,), bf, f32, (ds,) * len(which), flags, which=which,
                  interpret=False).lower(lowering_platforms=("cuda",))


def test_bad_inputs_raise():
    x = jnp.zeros((1, 1, C, 64), jnp.float32)
    with pytest.raises(ValueError, match="scores must be one of"):
        prepare(x, x, x, x, jnp.zeros((1, C, 1)), scale=1.0, chunk_size=C, scores="pallas")
    with pytest.raises(ValueError, match="chunk_size=64"):
        prepare(x, x, x, x, jnp.zeros((1, C, 1)), scale=1.0, chunk_size=32, scores="mosaic")
    with pytest.raises(ValueError, match="K in"):
        scores(x[..., :32], x[..., :32], x[..., :32])
    with pytest.raises(ValueError, match="multiple of 64"):
        scores(x[:, :, :40], x[:, :, :40], x[:, :, :40])
    with pytest.raises(ValueError, match="g_cum must have"):
        qk_kk_scores(x, x, x[:, :, :, :1])
    with pytest.raises(ValueError, match="out_dtype"):
        scores(x, x, x, out_dtype=jnp.float16)
