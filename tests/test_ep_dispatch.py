"""Expert-parallel dispatches (math §8) on 8 simulated CPU devices against the single-device MoE.

Each dispatch must equal the dense oracle (every expert on every token) in values and gradients, on
skewed routing that sends most slots to one device (so a buffer sized for the average would drop)
and leaves one expert without tokens; with a capacity factor, exactly the slots an independent
NumPy model of the buffers drops are missing, and their count is reported. The balancing
statistics of an MoE block under a mesh with a tensor axis equal the single-device ones (no count
is doubled over tensor replicas).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import host_module_variables

import k3jax.parallel as kp
from k3jax.config import ConfigError, ModelConfig, MoEConfig
from k3jax.config.mesh import MeshConfig
from k3jax.layers.moe import MoEBlock, make_dispatch
from k3jax.ops.activations import GLUSpec
from k3jax.ops.ep_dispatch import capacity, ep_dispatch
from k3jax.ops.moe_dispatch import ExpertWeights, dense_dispatch, ragged_dispatch
from k3jax.ops.routing import route, router_scores
from k3jax.ops.tolerance import BF16_GRAD_QKV_TOL, BF16_OUT_TOL, FP32_TOL, rel_rms

E, D, M, N, K = 8, 16, 24, 64, 2
EMPTY_EXPERT = 5
ACT = GLUSpec()


@pytest.fixture(scope="module")
def problem():
    @jax.jit  # one compile, not one per op
    def build(key):
        ks = jax.random.split(key, 7)
        x = jax.random.normal(ks[0], (N, D), jnp.float32)
        logits = jax.random.normal(ks[1], (N, E))
        # Skew: three quarters of the tokens prefer experts 0 and 1 (both on expert device 0 of 4).
        logits = logits.at[: 3 * N // 4, :2].add(4.0).at[:, EMPTY_EXPERT].add(-100.0)
        ids = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
        w = jax.random.uniform(ks[2], (N, K), minval=0.1, maxval=1.0)
        ew = ExpertWeights(*(0.2 * jax.random.normal(k, s) for k, s in
                             zip(ks[3:6], [(E, D, M), (E, D, M), (E, M, D)])))
        probe = jax.random.normal(ks[6], (N, D))
        return x, ids, w, ew, probe
    return build(jax.random.key(0))


def _value_and_grads(dispatch, problem):
    x, ids, w, ew, probe = problem

    def loss(x, w, ew):
        y = dispatch(x, ids, w, ew, ACT)
        return jnp.sum(y * probe), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, ew)
    return y, grads


@pytest.fixture(scope="module")
def reference(problem):
    return _value_and_grads(dense_dispatch, problem)


def _mesh(**sizes):
    cfg = MeshConfig(**sizes)
    return kp.make_mesh(cfg), cfg.rules


@pytest.mark.parametrize("kind, sizes, gmm", [
    ("all_to_all", dict(data=2, expert=4), "ragged_dot"),
    ("ring", dict(data=2, expert=4), "ragged_dot"),
    ("all_to_all", dict(data=1, fsdp=2, expert=2, tensor=2), "ragged_dot"),
    ("ring", dict(data=1, fsdp=2, expert=2, tensor=2), "ragged_dot"),
    # "mosaic" on CPU: the kernels' tile-aligned row layout, computed by the reference matmul
    ("ragged", dict(data=8), "mosaic"),
    ("all_to_all", dict(data=2, expert=4), "mosaic"),
    ("ring", dict(data=1, fsdp=2, expert=2, tensor=2), "mosaic"),
])
def test_dropless_dispatch_equals_single_device(problem, reference, kind, sizes, gmm):
    mesh, rules = _mesh(**sizes)
    ids = problem[1]
    assert not np.any(np.asarray(ids) == EMPTY_EXPERT)          # an expert with no token
    dispatch = make_dispatch(MoEConfig(dispatch=kind, grouped_matmul=gmm))
    with kp.use_mesh(mesh, rules):
        y, grads = _value_and_grads(lambda *a: dispatch(*a)[0], problem)
        x, ids, w, ew, _ = problem
        lowered = jax.jit(lambda *a: dispatch(*a, ACT)[0]).lower(x, ids, w, ew).as_text()
    assert "sdy.manual_computation" in lowered  # each device on its own tokens
    y_ref, grads_ref = reference
    assert rel_rms(y_ref, y) <= FP32_TOL
    for name, g_ref, g in zip(("x", "weights", "expert weights"), grads_ref, grads):
        for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g)):
            assert rel_rms(a, b) <= FP32_TOL, name
    # The empty expert's weights get exactly zero gradient.
    assert np.max(np.abs(np.asarray(grads[2].w_gate)[EMPTY_EXPERT])) == 0.0


@pytest.mark.parametrize("sizes", [dict(data=2, expert=4),
                                   dict(data=1, fsdp=2, expert=2, tensor=2)])
def test_ring_in_bf16_equals_single_device_within_bf16_tolerance(problem, sizes):
    """bf16 tokens and expert weights through the ring, whose cross-device sums (the reduce-scatter
    over the expert axes, the tensor axis's ``psum``) run in bf16, against the single-device ragged
    dispatch in fp32 on the same values: outputs and gradients within math §10's bf16 bounds."""
    x, ids, w, ew, probe = problem
    bf16 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.bfloat16))
    f32 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.float32))
    x16, ew16 = bf16((x, ew))
    x32, ew32 = f32((x16, ew16))
    y_ref, grads_ref = _value_and_grads(ragged_dispatch, (x32, ids, w, ew32, probe))
    mesh, rules = _mesh(**sizes)
    with kp.use_mesh(mesh, rules):
        y, grads = _value_and_grads(lambda *a: ep_dispatch("ring", *a)[0],
                                    (x16, ids, w, ew16, probe))
    assert y.dtype == jnp.bfloat16
    assert rel_rms(y_ref, y) <= BF16_OUT_TOL, rel_rms(y_ref, y)
    for name, g_ref, g in zip(("x", "weights", "expert weights"), grads_ref, grads):
        for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g)):
            assert rel_rms(a, b) <= BF16_GRAD_QKV_TOL, (name, rel_rms(a, b))


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s documented semantics from all-gathers (it has no CPU
    lowering): every source's slice for this device lands at the source's ``output_offsets``."""
    me = jax.lax.axis_index(axis_name)
    sources = jax.lax.axis_size(axis_name)
    gather = lambda a: jax.lax.all_gather(a, axis_name)  # noqa: E731
    ops = gather(operand)
    in_off, sizes, out_off = (gather(a)[:, me] for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(operand.shape[0])
    for s in range(sources):
        valid = rows < sizes[s]
        dst = jnp.where(valid, out_off[s] + rows, output.shape[0])      # out of range: skipped
        src = jnp.take(ops[s], jnp.clip(in_off[s] + rows, 0, operand.shape[0] - 1), axis=0)
        output = output.at[dst].set(src, mode="drop")
    return output


def test_ragged_all_to_all_offsets_with_emulated_collective(problem, reference, monkeypatch):
    """The offsets and sizes the ragged_all_to_all dispatch computes, run through an emulation of
    the collective (the real one is GPU-only and is checked by benchmarks/moe.py)."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    mesh, rules = _mesh(data=2, expert=4)
    with kp.use_mesh(mesh, rules):
        y, grads = _value_and_grads(
            lambda *a: ep_dispatch("ragged_all_to_all", *a)[0], problem)
    y_ref, grads_ref = reference
    assert rel_rms(y_ref, y) <= FP32_TOL
    for a, b in zip(jax.tree.leaves(grads_ref), jax.tree.leaves(grads)):
        assert rel_rms(a, b) <= FP32_TOL


def _kept_slots(ids: np.ndarray, kind: str, token_shards: int, e_shards: int, cap: int):
    """NumPy model of the capacity buffers: which (token, slot) pairs survive. -> bool ``[N, k]``.

    Token shards are contiguous blocks of rows; the expert axis is the innermost batch axis, so a
    ring all-gathers ``e_shards`` consecutive shards. Within a buffer, slots queue in (expert, row,
    slot) order and the first ``cap`` are kept.
    """
    n_all, k = ids.shape
    e_local = E // e_shards
    keep = np.zeros_like(ids, dtype=bool)
    n = n_all // token_shards
    group = n if kind == "all_to_all" else n * e_shards         # rows that share the buffers
    for start in range(0, n_all, group):
        block = ids[start:start + group]
        slots = sorted((int(block[t, j]), t, j) for t in range(block.shape[0]) for j in range(k))
        used = {}
        for e, t, j in slots:
            owner = e // e_local
            if used.get(owner, 0) < cap:
                used[owner] = used.get(owner, 0) + 1
                keep[start + t, j] = True
    return keep


@pytest.mark.parametrize("kind, gmm", [("all_to_all", "ragged_dot"), ("ring", "ragged_dot"),
                                       ("ring", "mosaic")])
def test_capacity_drops_exactly_the_overflow(problem, kind, gmm):
    x, ids, w, ew, _ = problem
    mesh, rules = _mesh(data=2, expert=4)
    with kp.use_mesh(mesh, rules):
        y, dropped = jax.jit(lambda x, w: ep_dispatch(kind, x, ids, w, ew, ACT,
                                                      capacity_factor=1.0, gmm=gmm))(x, w)
    cap = capacity(kind, (N // 8) * K, 4, 1.0)
    keep = _kept_slots(np.asarray(ids), kind, token_shards=8, e_shards=4, cap=cap)
    assert int(dropped) == int((~keep).sum()) > 0               # the skew overflows capacity 1.0
    expected = jax.jit(lambda x, w: dense_dispatch(x, ids, w * keep, ew, ACT))(x, w)
    assert rel_rms(expected, y) <= FP32_TOL


def _moe_cfg(**moe) -> ModelConfig:
    base = dict(num_experts=E, top_k=K, expert_intermediate=M, latent_dim=D, shared_intermediate=16,
                balancing="quantile_hist", qb_bins=50)
    return ModelConfig(d_model=32, moe=MoEConfig(**{**base, **moe}), dtype="float32", init_std=0.1)


def test_block_statistics_and_dropped_count_under_mesh():
    """MoE block on (fsdp 2, expert 2, tensor 2): outputs and balance statistics equal one device;
    with a capacity factor the sown count equals the NumPy buffer model's."""
    x = jax.random.normal(jax.random.key(4), (4, 16, 32))
    single = _moe_cfg(dispatch="ragged")
    variables = host_module_variables(MoEBlock(single), x, seed=3, deterministic=True)
    # A bias that pulls every token to experts 0 and 1 (expert device 0): half the slots overflow.
    bias = np.zeros(E, np.float32)
    bias[:2] = 2.0
    variables = {**variables, "balance": {"bias": jnp.asarray(bias)}}
    apply = lambda cfg: jax.jit(lambda v, x: MoEBlock(cfg).apply(  # noqa: E731
        v, x, deterministic=False, mutable=["balance_stats", "diagnostics"]))
    y_ref, mut_ref = apply(single)(variables, x)

    mesh, rules = _mesh(data=1, fsdp=2, expert=2, tensor=2)
    with kp.use_mesh(mesh, rules):
        y, mut = apply(_moe_cfg(dispatch="ring"))(variables, x)
        y_cap, mut_cap = apply(_moe_cfg(dispatch="all_to_all", capacity_factor=1.0))(variables, x)
    assert rel_rms(y_ref, y) <= FP32_TOL
    stats, stats_ref = mut["balance_stats"]["bias"], mut_ref["balance_stats"]["bias"]
    assert int(stats["load"].sum()) == x.shape[0] * x.shape[1] * K     # each slot counted once
    for key in stats_ref:
        np.testing.assert_array_equal(np.asarray(stats[key]), np.asarray(stats_ref[key]))
    assert "diagnostics" not in mut or not mut["diagnostics"]          # dropless: nothing sown

    p = variables["params"]
    routed = jax.jit(lambda x, router, bias: route(router_scores(x.reshape(-1, 32), router),
                                                   bias, K, 1.0)[0])
    ids = routed(x, p["router"], variables["balance"]["bias"])
    cap = capacity("all_to_all", x.shape[0] * x.shape[1] // 4 * K, 2, 1.0)
    keep = _kept_slots(np.asarray(ids), "all_to_all", token_shards=4, e_shards=2, cap=cap)
    sown = mut_cap["diagnostics"]["dropped_slots"]
    assert int(sown) == int((~keep).sum()) > 0
    assert rel_rms(y_ref, y_cap) > 10 * FP32_TOL                    # dropped slots change outputs


def test_errors_before_tracing():
    mesh, rules = _mesh(data=2, expert=4)
    x = jnp.zeros((8, D))
    ew6 = ExpertWeights(jnp.zeros((6, D, M)), jnp.zeros((6, D, M)), jnp.zeros((6, M, D)))
    ids = jnp.zeros((8, K), jnp.int32)
    with kp.use_mesh(mesh, rules), pytest.raises(ConfigError, match=r"num_experts=6.*axis size 4"):
        ep_dispatch("all_to_all", x, ids, jnp.ones((8, K)), ew6, ACT)
    with pytest.raises(ConfigError, match="capacity_factor.*ragged_all_to_all"):
        make_dispatch(MoEConfig(dispatch="ragged_all_to_all", capacity_factor=1.5))
    if jax.default_backend() == "cpu":
        with pytest.raises(ConfigError, match="no CPU lowering"):
            make_dispatch(MoEConfig(dispatch="ragged_all_to_all"))


@pytest.mark.parametrize("with_mesh", [False, True])
@pytest.mark.parametrize("kind, options, error, message", [
    ("ragged_all_to_all_v2", {}, ValueError, r"kind='ragged_all_to_all_v2' is invalid"),
    ("ring", dict(capacity_factor=0.0), ValueError, r"capacity_factor=0.0 is invalid"),
    ("all_to_all", dict(capacity_factor=-1), ValueError, r"capacity_factor=-1 is invalid"),
    ("ring", dict(gmm="cutlass"), ValueError, r"grouped_matmul='cutlass'"),
    ("ragged_all_to_all", dict(capacity_factor=1.5), ConfigError,
     r"capacity_factor=1.5 is not supported by dispatch='ragged_all_to_all'"),
])
def test_bad_options_are_rejected_with_or_without_a_mesh(with_mesh, kind, options, error, message):
    """ep_dispatch checks its options itself, also where no mesh makes it the ragged dispatch."""
    x, ids, w = jnp.zeros((8, D)), jnp.zeros((8, K), jnp.int32), jnp.ones((8, K))
    ew = ExpertWeights(jnp.zeros((E, D, M)), jnp.zeros((E, D, M)), jnp.zeros((E, M, D)))
    mesh, rules = _mesh(data=2, expert=4)
    with kp.use_mesh(mesh, rules) if with_mesh else contextlib.nullcontext():
        with pytest.raises(error, match=message):
            ep_dispatch(kind, x, ids, w, ew, ACT, **options)
