"""Attention Residuals (SPEC 5): the op, the rule's bookkeeping, the two-phase form, the model wiring.

Model-level tests use MLA-only dense stacks: the residual rule does not depend on the mixer, and the
KDA path would dominate CPU compile time. ``num_layers=3`` with every layer MLA scans one layer per
iteration (3 repeats), and block size 3 sub-layers puts commits on both mixer (j = 0, 6) and FFN
(j = 3) sub-layers inside the scanned body, so the traced bookkeeping path is exercised.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import small_config
from k3jax.config import ResidualConfig
from k3jax.layers.attnres import AttnResFinalRead, AttnResidual, AttnResState, num_block_slots
from k3jax.model import K3Model, init_variables
from k3jax.ops.attnres import (attnres_reference, attnres_two_phase, depth_mix, depth_mix_reference,
                               full_attnres_reference)
from k3jax.ops.tolerance import BF16_OUT_TOL, FP32_TOL, rel_rms
from k3jax.stack import plan_stack, unroll_params

EPS = 1e-5
B, T, D = 2, 5, 16


def _normal(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


# -- the op --------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [0, 2, 4])
def test_masked_mix_equals_the_formula_on_the_valid_sources_values_and_gradients(count):
    blocks, partial = _normal(0, (4, B, T, D)), _normal(1, (B, T, D))
    w, g = _normal(2, (D,)), 1.0 + _normal(3, (D,), 0.3)
    probe = _normal(4, (B, T, D))

    def loss_op(blocks, partial, w, g):
        return jnp.sum(jnp.sin(depth_mix(blocks, count, partial, w, g, EPS)[0]) * probe)

    def loss_ref(blocks, partial, w, g):
        srcs = [blocks[i] for i in range(count)] + [partial]
        return jnp.sum(jnp.sin(depth_mix_reference(srcs, w, g, EPS)) * probe)

    args = (blocks, partial, w, g)
    h_ref = depth_mix_reference([blocks[i] for i in range(count)] + [partial], w, g, EPS)
    # the count may be static (unrolled layer) or traced (scanned stack)
    h = depth_mix(blocks, count, partial, w, g, EPS)[0]
    h_traced = jax.jit(lambda c: depth_mix(blocks, c, partial, w, g, EPS)[0])(count)
    for out in (h, h_traced):
        assert rel_rms(h_ref, out) <= FP32_TOL
    g_op = jax.jit(jax.grad(loss_op, argnums=(0, 1, 2, 3)))(*args)
    g_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2, 3)))(*args)
    for name, a, b in zip(("blocks", "partial", "w", "g"), g_ref, g_op):
        if count == 0 and name in ("blocks", "w", "g"):  # one source: weight 1, no gradient
            assert float(jnp.max(jnp.abs(b))) == 0.0, name
        else:
            assert rel_rms(a, b) <= FP32_TOL, name
    # slots beyond the count are not sources: exactly zero gradient
    assert float(jnp.max(jnp.abs(g_op[0][count:]), initial=0.0)) == 0.0


def test_zero_query_mixes_uniformly_and_bf16_stays_within_spec_tolerance():
    blocks, partial = _normal(0, (3, B, T, D)), _normal(1, (B, T, D))
    h, alpha = depth_mix(blocks, 2, partial, jnp.zeros(D), jnp.ones(D), EPS)
    assert rel_rms((blocks[0] + blocks[1] + partial) / 3, h) <= FP32_TOL
    np.testing.assert_allclose(alpha[:, 0, 0], [1 / 3, 1 / 3, 0.0, 1 / 3], rtol=1e-6)
    w, g = _normal(2, (D,)), 1.0 + _normal(3, (D,), 0.3)
    ref = depth_mix(blocks, 3, partial, w, g, EPS)[0]
    out = depth_mix(blocks.astype(jnp.bfloat16), 3, partial.astype(jnp.bfloat16), w, g, EPS)[0]
    assert out.dtype == jnp.bfloat16 and rel_rms(ref, out) <= BF16_OUT_TOL


def test_bad_shapes_are_rejected_with_the_argument_named():
    with pytest.raises(ValueError, match="partial"):
        depth_mix(jnp.zeros((2, B, T, D)), 1, jnp.zeros((B, T, D + 1)), jnp.zeros(D), jnp.ones(D), EPS)
    with pytest.raises(ValueError, match="query w"):
        depth_mix(jnp.zeros((2, B, T, D)), 1, jnp.zeros((B, T, D)), jnp.zeros(D + 1), jnp.ones(D), EPS)


# -- whole-stack drivers with toy sub-layers -------------------------------------------------------

L_SUB = 4  # toy stack = a 2-layer model's sub-layers


def _toy(seed=0, l_sub=L_SUB):
    """Embedding, sub-layer weights, queries and key-norm weights (one each + the final read)."""
    e = _normal(seed, (B, T, D))
    mats = _normal(seed + 1, (l_sub, D, D), 1.0 / math.sqrt(D))
    queries = _normal(seed + 2, (l_sub + 1, D))
    norms = 1.0 + _normal(seed + 3, (l_sub + 1, D), 0.3)
    return e, mats, queries, norms


def _fns(mats):
    return [lambda x, m=m: jnp.tanh(x @ m) for m in mats]


def _rule_cfg(block, num_layers=L_SUB // 2):
    return small_config(d_model=D, num_layers=num_layers, first_k_dense=num_layers, rms_eps=EPS,
                        residual=ResidualConfig(kind="attnres", block_size_sublayers=block))


def _rule_params(queries, norms, j):
    return {"params": {"query": queries[j], "key_norm": norms[j]}}


def _run_rule_unrolled(cfg, e, mats, queries, norms, n_slots=None, record=None):
    """The model's rule driven with static ``j``; ``record`` collects (h_j, state after write_j)."""
    rule = AttnResidual(cfg)
    n = num_block_slots(cfg) if n_slots is None else n_slots
    state = AttnResState(jnp.zeros((n,) + e.shape, e.dtype), e)
    for j, m in enumerate(mats):
        h = rule.apply(_rule_params(queries, norms, j), state, j, method=AttnResidual.read)
        state = rule.apply(_rule_params(queries, norms, j), state, jnp.tanh(h @ m), j,
                           method=AttnResidual.write)
        if record is not None:
            record.append((h, state))
    return AttnResFinalRead(cfg).apply(_rule_params(queries, norms, -1), state)


def _run_rule_scanned(cfg, e, mats, queries, norms):
    """The same rule with a traced ``j`` (the body of a ``lax.scan``), as in the scanned stack."""
    rule = AttnResidual(cfg)

    def body(state, xs):
        j, m, q, g = xs
        p = {"params": {"query": q, "key_norm": g}}
        h = rule.apply(p, state, j, method=AttnResidual.read)
        return rule.apply(p, state, jnp.tanh(h @ m), j, method=AttnResidual.write), None

    state = AttnResState(jnp.zeros((num_block_slots(cfg),) + e.shape, e.dtype), e)
    js = jnp.arange(len(mats), dtype=jnp.int32)
    state, _ = jax.lax.scan(body, state, (js, mats, queries[:-1], norms[:-1]))
    return AttnResFinalRead(cfg).apply(_rule_params(queries, norms, -1), state)


def _runners(block):
    """The four ways to run a toy stack, each jitted: ``(e, mats, queries, norms) -> h``."""
    cfg = _rule_cfg(block)
    return {
        "reference": lambda e, m, q, n: attnres_reference(e, _fns(m), q, n, block, EPS),
        "rule, static j": lambda *a: _run_rule_unrolled(cfg, *a),
        "rule, traced j": lambda *a: _run_rule_scanned(cfg, *a),
        "two-phase": lambda e, m, q, n: attnres_two_phase(e, _fns(m), q, n, block, EPS),
    }


@pytest.mark.parametrize("block", [1, 3])
def test_rule_static_and_traced_and_two_phase_equal_the_spec_bookkeeping(block):
    """Block 1 is Full AttnRes; block 3 does not divide the 4 sub-layers (a partial last block)."""
    args = _toy(block)
    runs = _runners(block)
    ref = jax.jit(runs.pop("reference"))(*args)
    for name, run in runs.items():
        assert rel_rms(ref, jax.jit(run)(*args)) <= FP32_TOL, name

    def grads(run):  # w.r.t. the embedding, sub-layer weights, queries and key-norm weights
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.cos(run(*a))), argnums=(0, 1, 2, 3)))(*args)
    for a, b in zip(grads(_runners(block)["reference"]), grads(runs["rule, traced j"])):
        assert rel_rms(a, b) <= FP32_TOL


def test_full_attnres_without_bookkeeping_equals_block_size_one():
    """(The rule and the two-phase form are held against block size 1 in the test above.)"""
    args = _toy(7)
    full = jax.jit(lambda e, m, q, n: full_attnres_reference(e, _fns(m), q, n, EPS))(*args)
    assert rel_rms(full, jax.jit(_runners(1)["reference"])(*args)) <= FP32_TOL


@pytest.mark.parametrize("block", [1, 2, 3])
def test_three_sublayers_by_hand_source_lists_of_spec5(block):
    """SPEC 5 written out for sub-layers 0, 1, 2 and the final read, one line per read."""
    e, mats, queries, norms = _toy(11, l_sub=3)
    f = _fns(mats)

    def mix(sources, j):
        return depth_mix_reference(sources, queries[j], norms[j], EPS)

    x0 = e                                               # j = 0: nothing committed, the embedding
    o0 = f[0](x0)
    x1 = mix([e, o0], 1)                                 # every S: blocks [e], partial o0
    o1 = f[1](x1)
    if block == 1:
        x2 = mix([e, o0, o1], 2)                         # blocks [e, o0], partial o1
        o2 = f[2](x2)
        want_h = mix([e, o0, o1, o2], 3)
        want_blocks = [[e], [e, o0], [e, o0, o1]]
        want_partial = [o0, o1, o2]
    elif block == 2:
        x2 = mix([e, o0 + o1], 2)                        # blocks [e], partial o0 + o1; j=2 commits it
        o2 = f[2](x2)
        want_h = mix([e, o0 + o1, o2], 3)
        want_blocks = [[e], [e], [e, o0 + o1]]
        want_partial = [o0, o0 + o1, o2]
    else:
        x2 = mix([e, o0 + o1], 2)                        # blocks [e], partial o0 + o1 (no commit)
        o2 = f[2](x2)
        want_h = mix([e, o0 + o1 + o2], 3)
        want_blocks = [[e], [e], [e]]
        want_partial = [o0, o0 + o1, o0 + o1 + o2]

    record = []
    n_slots = -(-3 // block)  # blocks committed by a three-sub-layer stack
    h = _run_rule_unrolled(_rule_cfg(block), e, mats, queries, norms, n_slots, record)
    assert rel_rms(want_h, h) <= FP32_TOL
    for j, ((x, state), want_x) in enumerate(zip(record, [x0, x1, x2])):
        assert rel_rms(want_x, x) <= FP32_TOL, j
        assert rel_rms(want_partial[j], state.partial) <= FP32_TOL, j
        for i, b in enumerate(want_blocks[j]):
            assert rel_rms(b, state.blocks[i]) <= FP32_TOL, (j, i)
        assert float(jnp.max(jnp.abs(state.blocks[len(want_blocks[j]):]), initial=0.0)) == 0.0, j


def test_block_size_in_layers_is_twice_in_sublayers_and_the_buffer_counts_blocks():
    k3 = small_config(num_layers=93, residual=ResidualConfig(kind="attnres", block_size_layers=12))
    assert k3.residual.block_sublayers == 24
    assert num_block_slots(k3) == 8          # ceil(186 / 24): embedding + 7 blocks + partial = 9 sources


# -- the model ------------------------------------------------------------------------------------

NUM_LAYERS, BLOCK = 3, 3
TOKENS = jax.random.randint(jax.random.key(5), (B, 12), 0, 64)


def _model_cfg(kind="attnres", **kw):
    residual = ResidualConfig(kind=kind, block_size_sublayers=BLOCK if kind == "attnres" else None)
    # eps tiny: see test_zero_queries_give_the_plain_residual_model's docstring.
    return small_config(num_layers=NUM_LAYERS, first_k_dense=NUM_LAYERS, rms_eps=1e-12,
                        mla_layers=tuple(range(NUM_LAYERS)), residual=residual, **kw)


def _forward(cfg, variables, mutable=False):
    return jax.jit(lambda v: K3Model(cfg).apply(v, TOKENS, mutable=mutable))(variables)


def _is_attnres(path) -> bool:
    return any(getattr(k, "key", None) in ("query", "key_norm") for k in path)


def _perturbed(params):
    """Move every pseudo-query (and key-norm weight) away from its init so the mix is not uniform."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for i, (path, x) in enumerate(leaves):
        if _is_attnres(path):
            x = x + _normal(100 + i, x.shape, 0.5 if path[-1].key == "query" else 0.2)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.fixture(scope="module")
def attnres_setup():
    cfg = _model_cfg()
    assert plan_stack(cfg).repeats >= 2
    v = jax.jit(init_variables, static_argnums=0)(cfg, jax.random.key(0))
    return cfg, v


def test_zero_queries_give_the_plain_residual_model(attnres_setup):
    """With w = 0 every mix is the mean of its n sources, which sum to the plain stream x: h = x / n.
    The pre-norms are scale-invariant except for eps: RMSNorm(x / n) = RMSNorm(x) with eps -> n^2 eps.
    With eps = 1e-12 and mean(x^2) >= ~1e-4 that shifts rsqrt by < n^2 eps / (2 mean x^2) ~ 1e-7, so
    FP32_TOL (SPEC 10, same math in another order: h sums the sources in a different order) holds.
    A boundary counted twice or a missing source changes the direction of h, not only its scale."""
    cfg, v = attnres_setup
    plain_cfg = _model_cfg("plain")
    plain_params = _drop_attnres(v["params"])
    want = _forward(plain_cfg, {"params": plain_params})
    assert rel_rms(want, _forward(cfg, v)) <= FP32_TOL
    # the same model with the queries moved is a different model (the test can fail)
    assert rel_rms(want, _forward(cfg, {"params": _perturbed(v["params"])})) > 1e-2


def _drop_attnres(tree):
    if not isinstance(tree, dict):
        return tree
    return {k: _drop_attnres(x) for k, x in tree.items()
            if not (k.startswith("residual_") or k == "final_residual")}


def _loss_and_grads(cfg, params):
    def loss(p):
        logits = K3Model(cfg).apply({"params": p}, TOKENS)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) - jnp.mean(logits[..., 3]), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.fixture(scope="module")
def scanned_grads(attnres_setup):
    cfg, v = attnres_setup
    params = _perturbed(v["params"])
    return params, _loss_and_grads(cfg, params)


def test_scanned_equals_unrolled_values_and_gradients(attnres_setup, scanned_grads):
    cfg, _ = attnres_setup
    params, ((_, logits), grads) = scanned_grads
    unrolled_cfg = cfg.replace(scan_layers=False)
    (_, logits_u), grads_u = _loss_and_grads(unrolled_cfg, unroll_params(cfg, params))
    assert rel_rms(logits_u, logits) <= FP32_TOL
    grads = unroll_params(cfg, grads)
    assert jax.tree.structure(grads) == jax.tree.structure(grads_u)
    for path, a in jax.tree_util.tree_leaves_with_path(grads_u):
        b = _at(grads, path)
        assert rel_rms(a, b) <= FP32_TOL, jax.tree_util.keystr(path)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_rematerialised_gives_the_same_values_and_gradients(attnres_setup, scanned_grads):
    cfg, _ = attnres_setup
    params, ((loss, logits), grads) = scanned_grads
    (loss_r, logits_r), grads_r = _loss_and_grads(cfg.replace(remat="full"), params)
    assert rel_rms(logits, logits_r) <= FP32_TOL
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r)):
        assert rel_rms(a, b) <= FP32_TOL


def test_gradients_reach_every_pseudo_query_and_key_norm_weight(attnres_setup, scanned_grads):
    cfg, _ = attnres_setup
    _, (_, grads) = scanned_grads
    flat = jax.tree_util.tree_leaves_with_path(unroll_params(cfg, grads))
    found = 0
    for path, g in flat:
        if not _is_attnres(path):
            continue
        found += 1
        name = jax.tree_util.keystr(path)
        if "layer_0" in name and "residual_mixer" in name:
            # j = 0 reads the embedding alone: a softmax over one source has no gradient.
            assert float(jnp.max(jnp.abs(g))) == 0.0, name
        else:
            assert float(jnp.min(jnp.abs(g))) > 0.0, name
    assert found == 2 * (2 * NUM_LAYERS + 1)


def test_diagnostics_show_which_blocks_each_sublayer_reads_and_block_rms(attnres_setup):
    cfg, v = attnres_setup
    _, diag = _forward(cfg, v, mutable=["diagnostics"])
    diag = unroll_params(cfg, diag["diagnostics"])
    n = num_block_slots(cfg)
    for j in range(2 * NUM_LAYERS + 1):
        if j < 2 * NUM_LAYERS:
            node = diag[f"layer_{j // 2}"]["residual_" + ("ffn" if j % 2 else "mixer")]
            count = -(-j // BLOCK)
        else:
            node, count = diag["final_residual"], n
        want = np.zeros(n + 1)
        want[:count] = want[-1] = 1.0 / (count + 1)       # zero queries: uniform over the sources
        np.testing.assert_allclose(node["depth_weights"], want, rtol=1e-5, err_msg=str(j))
    table = v["params"]["embedding"]
    rms = diag["final_residual"]["block_rms"]
    assert rms.shape == (n + 1,) and bool(jnp.all(rms > 0))
    np.testing.assert_allclose(rms[0], jnp.sqrt(jnp.mean(jnp.square(table[TOKENS]))), rtol=1e-5)
    # not sown unless asked for
    _, mut = _forward(cfg, v, mutable=["balance_stats"])
    assert "diagnostics" not in mut
