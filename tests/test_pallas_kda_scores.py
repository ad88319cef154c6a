"""Mosaic GPU decayed intra-chunk scores (math §3.3) in the CPU interpreter against plain fp32.

Operands are bf16-representable and the reference (pairwise ``exp(G_r - G_j)`` in fp32) runs on the
same values, so the math §10 bf16 tolerances measure the kernels' own error (bf16 WGMMA operands
``a E``, ``b E``, ``dS``; fp32 accumulation and diagonal).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.tolerance import BF16_GRAD_GATE_TOL, BF16_GRAD_QKV_TOL, BF16_OUT_TOL, rel_rms
from pallas_kernels import kda_scores
from pallas_kernels._mgpu import CHUNK as C
from pallas_kernels.kda_gates import SegmentMasks
from pallas_kernels.kda_prep import prepare, segment_masks
from pallas_kernels.kda_scores import gated_scores, gated_scores_reference


def _gate(f, gate):
    return (-5.0 * jax.nn.sigmoid(f) if gate == "lower_bound"
            else -jnp.exp(1.5) * jax.nn.softplus(2.0 * f))


@functools.partial(jax.jit, static_argnums=range(6))  # one compile, not one per op
def _inputs(seed, b, h, tp, dk, gate):
    """bf16 ``q, k`` ``[B, Tp, H, K]`` (unit rows, like KDA's normalised q, k), chunk-local
    cumulative gates ``[B, H, Tp, K]``. ``gate="mixed"``: the lower-bound gate, except head 0's
    second chunk (softplus) and its fourth (-4.9 at every token: 78 nats from a 32-row block's
    middle row to its first, at the edge of the bounded path, where a factor anchored anywhere
    else would overflow)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (b, tp, h, dk))).astype(jnp.bfloat16)
    k = unit(jax.random.normal(ks[1], (b, tp, h, dk))).astype(jnp.bfloat16)
    f = jax.random.normal(ks[2], (b, h, tp, dk))
    if gate == "mixed":
        g = _gate(f, "lower_bound").at[:, 0, C:2 * C].set(_gate(f[:, 0, C:2 * C], "softplus"))
        g = g.at[:, 0, 3 * C:4 * C].set(-4.9)
    else:
        g = _gate(f, gate)
    g_cum = jnp.cumsum(g.reshape(b, h, tp // C, C, dk), axis=-2).reshape(b, h, tp, dk)
    return q, k, g, g_cum


@functools.partial(jax.jit, static_argnums=range(3))
def _masks(seed, b, tp):
    """Segment masks of random packed documents (a start every ~20 tokens), as ``prepare`` makes
    them."""
    seg = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(seed), 0.05, (b, tp)), axis=1)
    return segment_masks(seg, C)


def _check_gated(q, k, g, masks, seed):
    """Every output of the kernels and the gradients of q, k, g (``g`` head-major here, given to the
    op in the caller's layout) against the fp32 reference on the same (bf16-grid) values, one
    random cotangent per output."""
    g = np.swapaxes(g, 1, 2)
    scale = q.shape[-1] ** -0.5
    ker = lambda q, k, g, masks: gated_scores(q, k, g, scale=scale, masks=masks,  # noqa: E731
                                              interpret=True)
    out_types = jax.eval_shape(ker, q, k, g, masks)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    @jax.jit  # the reference's values, the cotangents and its gradients in one compile
    def reference(q, k, g, masks):
        ref = lambda q, k, g: gated_scores_reference(q, k, g, scale=scale, masks=masks)  # noqa: E731
        r, ref_vjp = jax.vjp(ref, f32(q), f32(k), g)
        keys = jax.random.split(jax.random.PRNGKey(seed), len(r))
        # Nonzero above the diagonal too (the kernel must ignore those), in each output's dtype.
        cts = type(r)(*(jax.random.normal(key, y.shape).astype(y.dtype)
                        for key, y in zip(keys, out_types)))
        return r, cts, ref_vjp(type(r)(*map(f32, cts)))

    r, cts, ref_grads = reference(q, k, g, masks)

    def kernel(args, masks, cts):  # jitted: the interpreter is far slower op by op
        out, vjp = jax.vjp(lambda q, k, g: ker(q, k, g, masks), *args)
        return out, vjp(cts)

    out, ker_grads = jax.jit(kernel)((q, k, g), masks, cts)
    for name, x, y in zip(r._fields, r, out):
        assert x.shape == y.shape, (name, x.shape, y.shape)
        assert rel_rms(x, y) <= BF16_OUT_TOL, (name, rel_rms(x, y))
    assert out.aqk.dtype == jnp.bfloat16 and out.akk.dtype == jnp.float32
    assert out.qg.dtype == jnp.bfloat16
    upper = np.triu(np.ones((C, C), bool), 1)
    assert np.all(np.asarray(out.aqk, np.float32).reshape(-1, C, C)[:, upper] == 0.0)
    _check_grads(ref_grads, ker_grads, ("q", "k", "g"))


def _check_grads(ref_grads, ker_grads, names):
    for name, r, x in zip(names, ref_grads, ker_grads):
        tol = BF16_GRAD_GATE_TOL if name in ("g", "g_cum") else BF16_GRAD_QKV_TOL
        assert rel_rms(r, x) <= tol, (name, rel_rms(r, x))


def test_chunks_per_cta_fills_the_gpu_first():
    sms = kda_scores.SMS
    assert kda_scores.chunks_per_cta(64, 128) == 4  # (8, 4096, 16): 2048 CTAs of four chunks
    assert kda_scores.chunks_per_cta(6, 2 * sms) == 2
    assert kda_scores.chunks_per_cta(32, 6) == 1  # one 2048-token prompt of k3_small's 6 heads
    assert kda_scores.chunks_per_cta(8, sms // 4) == 2  # four chunks a CTA would idle half the SMs
    assert kda_scores.chunks_per_cta(1, 4 * sms) == 1


def test_gated_scores_mixed_chunks_with_segments(monkeypatch):
    """K = 64, one head, four chunks: K3's lower-bound gate (the bounded path) in two chunks and
    at the bounded path's edge in a third, a softplus gate past exp's fp32 range (the exact
    levels) in the second; packed documents. With a one-SM GPU assumed, one CTA of the forward
    takes the four chunks in turn (switching between the paths), so each of its two input slots
    serves twice."""
    monkeypatch.setattr(kda_scores, "SMS", 1)
    q, k, g, g_cum = _inputs(0, 1, 1, 4 * C, 64, "mixed")
    assert kda_scores.chunks_per_cta(4, 1) == 4
    np.testing.assert_array_equal(jax.jit(kda_scores.bounded_chunks)(g_cum), [[[1, 0, 1, 1]]])
    masks = _masks(5, 1, 4 * C)
    assert 0 < np.mean(masks.enter) < 1 and 0 < np.mean(masks.leave) < 1
    _check_gated(q, k, g, masks, seed=1)


def test_gated_scores_softplus_gate_past_fp32_exp_range_k128():
    """K = 128, two batch rows (the caller's layout indexed by batch and head), a softplus gate
    whose 16-token decay passes exp's fp32 range (-88 nats): a split ``exp(G_r) exp(-G_j)`` over a
    16-row block would overflow."""
    q, k, g, g_cum = _inputs(2, 2, 1, C, 128, "softplus")
    assert np.min(np.sum(np.asarray(g)[:, :, :16], axis=2)) < -88.0  # the overflow regime is hit
    assert not jax.jit(kda_scores.bounded_chunks)(g_cum).any()  # so the exact levels run
    _check_gated(q, k, g, None, seed=3)


@pytest.mark.parametrize("dk", [64, 128])
def test_kernels_lower_for_cuda(dk):
    """Both kernels (with and without segment masks) pass Mosaic GPU's lowering (layouts, WGMMA
    operand tiling) for an sm_90 target; the interpreter alone would accept layouts that do not
    lower."""
    bf = jax.ShapeDtypeStruct((2, 2 * C, 2, dk), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((2, 2 * C, 2, dk), jnp.float32)
    tok = lambda dt: jax.ShapeDtypeStruct((2, 2 * C), dt)  # noqa: E731
    for masks in (None, SegmentMasks(tok(jnp.int32), tok(jnp.float32), tok(jnp.float32))):
        def fwd_bwd(q, k, g, masks):
            out, vjp = jax.vjp(lambda q, k, g: gated_scores(q, k, g, scale=0.1, masks=masks),
                               q, k, g)
            return vjp(out)
        jax.jit(fwd_bwd).trace(bf, bf, g, masks).lower(lowering_platforms=("cuda",))


def test_bad_inputs_raise():
    x = jnp.zeros((1, 1, C, 64), jnp.float32)
    with pytest.raises(ValueError, match="chunk_size must be 64"):
        prepare(x, x, x, x, jnp.zeros((1, C, 1)), scale=1.0, chunk_size=32)
    q = jnp.zeros((1, C, 1, 64), jnp.bfloat16)
    g = jnp.zeros((1, C, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="K in"):
        gated_scores(q[..., :32], q[..., :32], g[..., :32], scale=1.0)
    with pytest.raises(ValueError, match="multiple of 64"):
        gated_scores(q[:, :40], q[:, :40], g[:, :40], scale=1.0)
    with pytest.raises(ValueError, match="g must have q's shape"):
        gated_scores(q, q, g[..., :1], scale=1.0)
    with pytest.raises(ValueError, match="g must be float32"):
        gated_scores(q, q, g.astype(jnp.bfloat16), scale=1.0)
    with pytest.raises(ValueError, match="q must be bfloat16"):
        gated_scores(q.astype(jnp.float32), q, g, scale=1.0)
    with pytest.raises(ValueError, match="masks.enter must be"):
        gated_scores(q, q, g, scale=1.0,
                     masks=SegmentMasks(jnp.zeros((1, C), jnp.int32), jnp.zeros((1, 3)),
                                        jnp.zeros((1, C))))
