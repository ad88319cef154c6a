"""MoE block, router and dispatch (§6): ragged vs dense oracle, routing rules, config errors."""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import host_module_variables

from k3jax.config import ConfigError, ModelConfig, MoEConfig
from k3jax.config.moe import Dispatch
from k3jax.layers.moe import DISPATCHES, MoEBlock, make_dispatch
from k3jax.ops.activations import GLUSpec
from k3jax.ops.moe_dispatch import ExpertWeights, dense_dispatch, ragged_dispatch
from k3jax.ops.routing import aux_balance_loss, route, router_scores
from k3jax.ops.tolerance import BF16_OUT_TOL, FP32_TOL, rel_rms

E, K, D, M = 6, 2, 16, 8


@functools.partial(jax.jit, static_argnames=("dtype", "e", "d", "m"))
def _experts(key, dtype=jnp.float32, e=E, d=D, m=M):
    kg, ku, kd = jax.random.split(key, 3)
    return ExpertWeights(0.3 * jax.random.normal(kg, (e, d, m), dtype),
                         0.3 * jax.random.normal(ku, (e, d, m), dtype),
                         0.3 * jax.random.normal(kd, (e, m, d), dtype))


def _skewed_ids(n):
    """Top-2 ids with distinct experts per token: expert 5 gets no token, expert 4 exactly one."""
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(4, size=2, replace=False) for _ in range(n)])
    ids[3, 1] = 4
    return jnp.asarray(ids, jnp.int32)


def _block_cfg(latent=True, **moe):
    base = dict(num_experts=8, top_k=2, expert_intermediate=16, shared_intermediate=24,
                latent_dim=16 if latent else None)
    base.update(moe)
    return ModelConfig(d_model=32, moe=MoEConfig(**base), dtype="float32", init_std=0.1)


def _init(cfg, x):
    return host_module_variables(MoEBlock(cfg), x, seed=1, deterministic=True)


# -- dispatch -----------------------------------------------------------------------------------

@pytest.mark.parametrize("act", [GLUSpec("situ_glu"), GLUSpec("swiglu")])
def test_ragged_matches_dense_values_and_grads(act):
    n = 20
    x = jax.random.normal(jax.random.key(0), (n, D))
    ids = _skewed_ids(n)
    w = jax.random.uniform(jax.random.key(2), (n, K), minval=0.1, maxval=1.0)
    ex = _experts(jax.random.key(3))
    ct = jax.random.normal(jax.random.key(4), (n, D))   # a random cotangent exercises every row

    def loss(fn):
        return lambda x, w, ex: jnp.sum(fn(x, ids, w, ex, act) * ct)

    out_r = jax.jit(lambda x, w, ex: ragged_dispatch(x, ids, w, ex, act))(x, w, ex)
    out_d = jax.jit(lambda x, w, ex: dense_dispatch(x, ids, w, ex, act))(x, w, ex)
    assert rel_rms(out_d, out_r) <= FP32_TOL
    g_r = jax.jit(jax.grad(loss(ragged_dispatch), argnums=(0, 1, 2)))(x, w, ex)
    g_d = jax.jit(jax.grad(loss(dense_dispatch), argnums=(0, 1, 2)))(x, w, ex)
    for name, a, b in zip(["x", "weights", "w_gate", "w_up", "w_down"],
                          jax.tree.leaves(g_d), jax.tree.leaves(g_r)):
        assert rel_rms(a, b) <= FP32_TOL, name
    # The expert with no token has zero gradient; the single-token expert a non-zero one.
    for g in map(np.asarray, g_r[2]):
        assert np.max(np.abs(g[5])) == 0.0
        assert np.max(np.abs(g[4])) > 0.0


def test_ragged_bf16_against_fp32_dense():
    n = 20
    x = jax.random.normal(jax.random.key(0), (n, D))
    ids = _skewed_ids(n)
    w = jax.random.uniform(jax.random.key(2), (n, K), minval=0.1, maxval=1.0)
    ex = _experts(jax.random.key(3))
    ref = jax.jit(lambda x, w, ex: dense_dispatch(x, ids, w, ex, GLUSpec()))(x, w, ex)
    out = jax.jit(lambda x, w, ex: ragged_dispatch(
        x.astype(jnp.bfloat16), ids, w, ExpertWeights(*(a.astype(jnp.bfloat16) for a in ex)),
        GLUSpec()))(x, w, ex)
    assert out.dtype == jnp.bfloat16
    assert rel_rms(ref, out) <= BF16_OUT_TOL


def test_dispatch_table_names_are_the_config_names_and_errors():
    from types import SimpleNamespace
    assert sorted(DISPATCHES) == sorted(typing.get_args(Dispatch))
    x, ids, w = jnp.ones((4, D)), _skewed_ids(4), jnp.ones((4, K))
    for name in ("ragged", "dense", "all_to_all", "ring"):   # every one returns (y, dropped)
        fn = make_dispatch(MoEConfig(num_experts=E, top_k=K, dispatch=name))
        y, dropped = jax.eval_shape(lambda *a, fn=fn: fn(*a, GLUSpec()), x, ids, w,
                                    _experts(jax.random.key(0)))
        assert (y.shape, y.dtype, dropped.shape, dropped.dtype) == (x.shape, x.dtype, (), jnp.int32)
    with pytest.raises(ValueError, match="'carrier_pigeon' is invalid: expected one of 'ragged'"):
        make_dispatch(SimpleNamespace(dispatch="carrier_pigeon"))
    with pytest.raises(ValueError, match="x must be"):
        ragged_dispatch(jnp.zeros((4, D + 1)), jnp.zeros((4, K), jnp.int32), jnp.zeros((4, K)),
                        _experts(jax.random.key(0)), GLUSpec())


# -- router -------------------------------------------------------------------------------------

def test_router_weights_renormalised_and_bias_only_selects():
    s = jax.jit(router_scores)(jax.random.normal(jax.random.key(0), (64, D)),
                               jax.random.normal(jax.random.key(1), (D, E)))
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 2.0], np.float32)  # expert 5 into every top-2
    routed = jax.jit(route, static_argnums=(2, 3))  # one compile per factor, not one per op
    ids, w = routed(s, bias, K, 2.5)
    np.testing.assert_allclose(np.sum(w, -1), 2.5, rtol=1e-6)
    assert np.all(np.any(np.asarray(ids) == 5, axis=-1))
    # Weights are the renormalised *unbiased* scores of the chosen experts.
    chosen = np.take_along_axis(np.asarray(s), np.asarray(ids), -1)
    np.testing.assert_allclose(w, chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-6)
    # Without the bias the selection is the plain top-k of the scores.
    ids0, _ = routed(s, np.zeros(E, np.float32), K, 1.0)
    np.testing.assert_array_equal(ids0, jax.jit(lambda s: jax.lax.top_k(s, K)[1])(s))
    # No gradient reaches the bias through the weights.
    gb = jax.jit(jax.grad(lambda b: jnp.sum(route(s, b, K, 1.0)[1] * jnp.arange(K))))(bias)
    assert np.max(np.abs(gb)) == 0.0


def test_block_bias_shift_keeps_output_and_large_bias_changes_selection():
    cfg = _block_cfg()
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    v = _init(cfg, x)
    f = jax.jit(lambda bias: MoEBlock(cfg).apply({**v, "balance": {"bias": bias}}, x,
                                                 deterministic=True))    # one compile, 3 runs
    y0 = f(np.zeros(8, np.float32))
    np.testing.assert_array_equal(f(np.full(8, 0.37, np.float32)), y0)  # common shift: same top-k
    forced = np.zeros(8, np.float32)
    forced[3] = 5.0
    assert rel_rms(y0, f(forced)) > 1e-2     # forced expert: other output


def _dense_twin(cfg):
    return cfg.replace(moe=MoEConfig(**{**cfg.moe.__dict__, "dispatch": "dense"}))


def test_block_ragged_matches_dense_latent_values_and_grads():
    cfg = _block_cfg(latent=True)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    v = _init(cfg, x)

    def loss(c):
        return lambda p, x: jnp.sum(jnp.sin(MoEBlock(c).apply({**v, "params": p}, x,
                                                              deterministic=True)))

    (lr, (gp_r, gx_r)) = jax.jit(jax.value_and_grad(loss(cfg), argnums=(0, 1)))(v["params"], x)
    (ld, (gp_d, gx_d)) = jax.jit(jax.value_and_grad(loss(_dense_twin(cfg)), argnums=(0, 1)))(
        v["params"], x)
    assert abs(float(lr - ld)) <= FP32_TOL * abs(float(ld))
    assert rel_rms(gx_d, gx_r) <= FP32_TOL
    for a, b in zip(jax.tree.leaves(gp_d), jax.tree.leaves(gp_r)):
        assert rel_rms(a, b) <= FP32_TOL


def test_block_ragged_matches_dense_plain_values():
    cfg = _block_cfg(latent=False)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    v = _init(cfg, x)
    assert "latent_down" not in v["params"]
    assert v["params"]["expert_gate"].shape == (8, 32, 16)
    apply = lambda c: jax.jit(lambda v, x: MoEBlock(c).apply(v, x, deterministic=True))  # noqa: E731
    assert rel_rms(apply(_dense_twin(cfg))(v, x), apply(cfg)(v, x)) <= FP32_TOL


def test_latent_norm_makes_routed_branch_invariant_to_scaling_factor():
    # eps tiny so the norm is exactly scale-invariant up to round-off (math §6).
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))

    def out(latent, rsf, **kw):
        cfg = _block_cfg(latent, routed_scaling_factor=rsf, shared_intermediate=0, **kw)
        cfg = cfg.replace(rms_eps=1e-12)
        v = _init(_block_cfg(latent, shared_intermediate=0, **kw).replace(rms_eps=1e-12), x)
        return MoEBlock(cfg).apply(v, x, deterministic=True)

    @jax.jit  # the six blocks in one compile
    def outputs(x):
        cases = ((True, {}), (False, {}), (True, {"latent_norm": False}))
        return [(out(latent, 1.0, **kw), out(latent, 2.446, **kw)) for latent, kw in cases]

    (normed, normed_scaled), *unnormed = outputs(x)
    assert rel_rms(normed, normed_scaled) <= FP32_TOL
    # Without the norm (plain MoE, or latent without norm) the factor scales the routed branch.
    for one, scaled in unnormed:
        assert rel_rms(2.446 * np.asarray(one), scaled) <= FP32_TOL


# -- balancing collections and aux loss -----------------------------------------------------------

def test_eval_leaves_bias_and_stats_untouched_training_writes_stats():
    cfg = _block_cfg()
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    v = _init(cfg, x)
    v = {**v, "balance": {"bias": np.linspace(-0.2, 0.2, 8, dtype=np.float32)}}
    apply = lambda det: jax.jit(lambda v, x: MoEBlock(cfg).apply(  # noqa: E731
        v, x, deterministic=det, mutable=["balance", "balance_stats"]))
    _, mut = apply(True)(v, x)
    np.testing.assert_array_equal(mut["balance"]["bias"], v["balance"]["bias"])
    assert "balance_stats" not in mut or not mut["balance_stats"]
    _, mut = apply(False)(v, x)
    np.testing.assert_array_equal(mut["balance"]["bias"], v["balance"]["bias"])
    stats = mut["balance_stats"]["bias"]
    assert int(stats["load"].sum()) == 16 * cfg.moe.top_k
    assert int(stats["hist"].sum()) == 16 * cfg.moe.num_experts


def test_aux_loss_batch_and_sequence_level():
    # Sequence 0 routes to experts {0, 1}, sequence 1 to {2, 3}; the scores agree with the routing.
    s0 = np.array([0.9, 0.9, 0.1, 0.1], np.float32)
    scores = np.stack([np.tile(s0, (5, 1)), np.tile(s0[::-1], (5, 1))])     # [2, 5, 4]
    ids = np.stack([np.tile(np.array([0, 1], np.int32), (5, 1)),
                    np.tile(np.array([2, 3], np.int32), (5, 1))])
    loss = jax.jit(aux_balance_loss, static_argnums=(2, 3))  # one compile each, not one per op
    # Batch level: every expert has f = 1/4 and P = 1/4 -> alpha * 4 * 4/16 = alpha.
    np.testing.assert_allclose(loss(scores, ids, 0.01, False), 0.01, rtol=1e-6)
    # Per sequence: f = (1/2, 1/2, 0, 0), P = (.45, .45, .05, .05) -> alpha * 4 * 0.45 = 1.8 alpha.
    np.testing.assert_allclose(loss(scores, ids, 0.01, True), 0.018, rtol=1e-6)


def test_block_sows_aux_loss_with_router_gradient():
    cfg = _block_cfg(balancing="aux_loss", aux_loss_alpha=0.1)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    v = _init(cfg, x)

    def aux(p):
        _, mut = MoEBlock(cfg).apply({**v, "params": p}, x, deterministic=False, mutable=["losses"])
        return mut["losses"]["moe_aux"][0]

    assert "losses" not in v                       # evaluation-mode init sows nothing
    _, mut = jax.jit(lambda v, x: MoEBlock(cfg).apply(v, x, deterministic=True,
                                                       mutable=["losses"]))(v, x)
    assert not mut.get("losses")                   # evaluation sows nothing either
    loss, g = jax.jit(jax.value_and_grad(aux))(v["params"])  # one compile for both
    assert float(loss) > 0.0
    assert np.max(np.abs(np.asarray(g["router"]))) > 0.0


# -- configuration errors --------------------------------------------------------------------------

def test_config_errors_before_compile():
    with pytest.raises(ConfigError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5)
    with pytest.raises(ConfigError, match="top_k"):
        MoEConfig(num_experts=4, top_k=4, balancing="quantile_hist")
    MoEConfig(num_experts=4, top_k=4, balancing="none")   # every expert chosen: allowed
    with pytest.raises(ConfigError, match="latent_dim"):
        ModelConfig(d_model=32, moe=MoEConfig(latent_dim=64))
    with pytest.raises(ConfigError, match="balancing"):
        MoEConfig(balancing="sinkhorn")
    with pytest.raises(ValueError, match="d_model=32"):
        MoEBlock(_block_cfg()).init(jax.random.key(0), jnp.zeros((1, 2, 16)), deterministic=True)
