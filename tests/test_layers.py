"""Layer-level numerics: short conv, KDA layer, MLA (absorbed vs expanded, decode vs full), norms.

Tolerances follow math §10: the same math in another order, fp32, within FP32_TOL.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import documents_of, host_module_variables, small_config

from k3jax.layers.cache_context import CacheContext
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.ops.kda_gate import kda_gate
from k3jax.ops.rms_norm import rms_norm
from k3jax.ops.short_conv import conv_silu, conv_silu_step
from k3jax.ops.tolerance import FP32_TOL, rel_rms

B, T = 2, 24


def _x(key, d, t=T):
    """``[B, t, d]`` fp32 normals on the host: slicing them compiles nothing."""
    return np.asarray(jax.random.normal(jax.random.key(key), (B, t, d), jnp.float32))


def _segments():
    # Two packed documents in row 0 (boundary at 10), three in row 1, the last under the first's
    # id again (a new run is a new document).
    seg = np.zeros((B, T), np.int32)
    seg[0, 10:] = 1
    seg[1, 5:] = 1
    seg[1, 17:] = 0
    return seg


def test_rms_norm_matches_formula():
    x = np.asarray(jax.random.normal(jax.random.key(0), (3, 7)))
    w = np.linspace(0.5, 1.5, 7, dtype=np.float32)
    want = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(jax.jit(rms_norm)(x, w, 1e-5), want, rtol=1e-6)


def test_conv_taps_never_cross_a_segment():
    x = _x(1, 6)
    w = jax.random.normal(jax.random.key(2), (4, 6))
    seg = _segments()
    conv = jax.jit(conv_silu)  # one compile per document length, not one per op
    y = np.asarray(conv(x, w, seg)[0])
    for b in range(B):
        for idx in documents_of(seg[b]):
            alone, _ = conv(x[b:b + 1, idx], w)
            np.testing.assert_allclose(y[b, idx], alone[0], rtol=1e-6, atol=1e-6)


def test_conv_decode_steps_equal_full_conv():
    x = _x(3, 5)
    w = jax.random.normal(jax.random.key(4), (4, 5))
    full, final = jax.jit(conv_silu)(x, w)
    full = np.asarray(full)
    state = np.zeros((B, 3, 5), np.float32)
    step = jax.jit(conv_silu_step)
    for t in range(T):
        y, state = step(x[:, t], w, state)
        np.testing.assert_allclose(y, full[:, t], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, final)


def _jit(layer, **kw):
    """``layer.apply`` with ``kw`` fixed, jitted: the layers run several times slower op by op.
    Build it once for a loop of same-shaped calls (one compile)."""
    return jax.jit(functools.partial(layer.apply, **kw))


@pytest.mark.parametrize("gate,out_gate", [("lower_bound", "full"), ("softplus", "low_rank")])
def test_kda_layer_split_in_two_equals_one_run(gate, out_gate):
    cfg = small_config(kda=dataclasses.replace(small_config().kda, gate=gate, output_gate=out_gate))
    layer, x = KDALayer(cfg), _x(5, cfg.d_model)
    v = host_module_variables(layer, x)
    full = _jit(layer)(v, x)
    h1, cache = _jit(layer, return_cache=True)(v, x[:, :11])
    h2 = _jit(layer)(v, x[:, 11:], cache=cache)
    assert rel_rms(full, np.concatenate([h1, h2], 1)) < FP32_TOL


def test_kda_layer_decode_equals_full():
    cfg = small_config()
    layer, x = KDALayer(cfg), _x(6, cfg.d_model, 9)
    v = host_module_variables(layer, x)
    full = _jit(layer)(v, x)
    cache = KDALayer.empty_cache(cfg, B)
    outs, step = [], _jit(layer, method=KDALayer.decode_step)
    for t in range(x.shape[1]):
        y, cache = step(v, x[:, t], cache)
        outs.append(y)
    assert rel_rms(full, np.stack(outs, 1)) < FP32_TOL


def test_kda_layer_segments_are_independent():
    cfg = small_config()
    layer, x, seg = KDALayer(cfg), _x(7, cfg.d_model), _segments()
    v = host_module_variables(layer, x)
    packed = np.asarray(_jit(layer)(v, x, segment_ids=seg))
    for b in range(B):  # each document alone must match its packed slice
        for idx in documents_of(seg[b]):
            alone = _jit(layer)(v, x[b:b + 1, idx])
            assert rel_rms(alone[0], packed[b, idx]) < FP32_TOL, (b, idx[0])


def test_kda_layer_negative_eigenvalues_match_the_recurrence():
    """``allow_neg_eigval``: beta in (0, 2), so the transition ``I - beta k k^T`` can have a
    negative eigenvalue; the chunked op still equals the token-by-token recurrence, and the
    output differs from the plain rule's."""
    x = _x(8, small_config().d_model)

    def layer(neg, impl):
        kda = dataclasses.replace(small_config().kda, allow_neg_eigval=neg, impl=impl)
        return KDALayer(small_config(kda=kda))

    v = host_module_variables(layer(True, "chunked"), x)  # neither option changes the parameters
    outs = {(neg, impl): _jit(layer(neg, impl))(v, x)
            for neg, impl in ((True, "reference"), (True, "chunked"), (False, "chunked"))}
    assert rel_rms(outs[True, "reference"], outs[True, "chunked"]) < FP32_TOL
    assert rel_rms(outs[False, "chunked"], outs[True, "chunked"]) > 1e-2


def test_kda_gates_stay_in_range():
    # host inputs as arguments of one compiled function (no constant folding at compile time)
    gate = jax.jit(kda_gate, static_argnums=(2, 3))
    f = np.linspace(-8, 8, 64, dtype=np.float32).reshape(1, 1, 2, 32)
    lb = np.asarray(gate(f, np.zeros(2, np.float32), "lower_bound", -5.0))
    assert np.all((lb < 0) & (lb > -5.0))
    saturated = np.asarray(gate(np.array([-1e4, 1e4], np.float32), np.zeros(1, np.float32),
                                "lower_bound", -5.0))
    assert np.all((saturated <= 0) & (saturated >= -5.0))  # fp32 reaches the ends
    f = np.broadcast_to(np.linspace(-8, 8, 32, dtype=np.float32), (1, 1, 2, 32))
    sp = np.asarray(gate(f, np.log(np.array([1.0, 16.0], np.float32)), "softplus", -5.0))
    assert np.all(sp <= 0)
    np.testing.assert_allclose(sp[..., 1, :], 16 * sp[..., 0, :], rtol=1e-5)


# The gate's down-projection is exact (bf16 x by the fp32 weight's bf16 parts) and its rank-r
# up-projection three bf16 products of fp32 operands' parts (~4e-6 off on a GPU, fp32 on a CPU).
# Far under math §10's 1e-4 on purpose: that product with its operands rounded to TF32's 10
# significand bits (a GPU's default fp32 product) is 2e-5 (lower-bound form) and 9e-5 (softplus)
# off here.
FP32_GATE_TOL = 1e-5


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_kda_gate_is_computed_in_fp32(gate):
    """Math 3.1 step 4: ``f = W_fb(W_fa x) + dt_bias`` in fp32 from bf16 ``x``, then the gate
    (the lower-bound form hands the op its logits ``exp(A_log) f``, bias apart), against the
    formula in fp64. It runs on jax's default backend: on a GPU with ``JAX_PLATFORMS=cuda``."""
    cfg = small_config()
    cfg = cfg.replace(kda=dataclasses.replace(cfg.kda, gate=gate))
    layer, x = KDALayer(cfg), jnp.asarray(_x(11, cfg.d_model), jnp.bfloat16)
    v = host_module_variables(layer, x)
    h = cfg.kda.num_heads
    v["params"]["A_log"] = jnp.linspace(-0.5, 0.5, h, dtype=jnp.float32)  # exp(A_log) != 1
    # A trained gate's scale: the product, not dt_bias, sets f (at init it is ~100x smaller).
    r = cfg.kda.gate_rank
    v["params"]["w_fb"] = jax.random.normal(jax.random.key(12), (r, v["params"]["w_fb"].shape[1]))
    got, bias, _ = jax.jit(functools.partial(layer.apply, method=KDALayer._gates))(v, x)
    p = {k: np.asarray(w, np.float64) for k, w in v["params"].items()
         if k in ("w_fa", "w_fb", "dt_bias", "A_log")}
    f = (np.asarray(x, np.float64) @ p["w_fa"] @ p["w_fb"] + p["dt_bias"]).reshape(
        *x.shape[:-1], h, -1)
    scale = np.exp(p["A_log"])[:, None]
    if gate == "softplus":
        want = -scale * np.logaddexp(0.0, f)
    else:
        want, got = scale * f, got + bias
    assert rel_rms(want, got) < FP32_GATE_TOL, rel_rms(want, got)


@pytest.mark.parametrize("q_lora,rope,gate", [(16, False, True), (None, True, False)])
def test_mla_absorbed_equals_expanded(q_lora, rope, gate):
    cfg = small_config()
    cfg = cfg.replace(mla=dataclasses.replace(cfg.mla, q_lora_rank=q_lora, rope=rope,
                                              output_gate=gate))
    layer, x, seg = MLALayer(cfg), _x(8, cfg.d_model), _segments()
    v = host_module_variables(layer, x)
    expanded = _jit(layer)(v, x, segment_ids=seg)
    absorbed = _jit(layer, method=MLALayer.absorbed)(v, x, segment_ids=seg)
    assert rel_rms(expanded, absorbed) < FP32_TOL


@pytest.mark.parametrize("rope", [False, True])
def test_mla_decode_equals_full(rope):
    cfg = small_config()
    cfg = cfg.replace(mla=dataclasses.replace(cfg.mla, rope=rope))
    layer, x = MLALayer(cfg), _x(9, cfg.d_model, 7)
    v = host_module_variables(layer, x)
    full = _jit(layer)(v, x)
    cache = MLALayer.empty_cache(cfg, B, max_len=10)
    outs, step = [], _jit(layer, method=MLALayer.cached)
    for t in range(x.shape[1]):  # one document a row: token t sees the cache up to itself
        mask = np.broadcast_to(np.arange(10) <= t, (B, 1, 1, 10))
        context = CacheContext(np.ones((B, 1), np.int32), np.full((B, 1), t, np.int32), mask,
                               np.ones((B, cfg.kda.conv_size - 1), bool), np.ones(B, bool))
        y, cache = step(v, x[:, t:t + 1], cache, context)
        outs.append(y[:, 0])
    assert rel_rms(full, np.stack(outs, 1)) < FP32_TOL
    m = cfg.mla
    assert cache.c.shape[-1] + cache.k_rope.shape[-1] == m.kv_lora_rank + m.qk_rope_head_dim


def test_mla_segments_are_independent():
    cfg = small_config()
    layer, x, seg = MLALayer(cfg), _x(10, cfg.d_model), _segments()
    v = host_module_variables(layer, x)
    packed = np.asarray(_jit(layer)(v, x, segment_ids=seg))
    for b in range(B):
        for idx in documents_of(seg[b]):
            assert rel_rms(_jit(layer)(v, x[b:b + 1, idx])[0], packed[b, idx]) < FP32_TOL
