"""Attention Residuals (math §5): the op, the rule's bookkeeping, the two-phase form, the model
wiring, and the memory it adds.

Model-level tests use MLA-only dense stacks: the residual rule does not depend on the mixer, and the
KDA path would dominate CPU compile time. ``num_layers=3`` with block size 4 sub-layers runs block
by block: block [0, 2) is a scan of two layers (traced ``j``: the first iteration masks the partial
sum, the block is committed after the scan), block [2, 3) is one unrolled layer that reads the
committed block and ends the stack mid-block (the final read has a partial sum). The toy-stack
tests cover odd block sizes (Full AttnRes, and commits on FFN sub-layers), scans that start
mid-block and scans whose loop-invariant input holds committed blocks.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import host_variables, small_config

from k3jax.config import ModelConfig, ResidualConfig
from k3jax.layers.attnres import (
    AttnResFinalRead,
    AttnResidual,
    block_size,
    initial_state,
    join_state,
    num_block_slots,
    settle,
    split_state,
)
from k3jax.layers.norms import RMSNorm
from k3jax.model import K3Model, abstract_variables
from k3jax.ops.attnres import (
    attnres_reference,
    attnres_two_phase,
    depth_mix,
    depth_mix_reference,
    full_attnres_reference,
)
from k3jax.ops.rms_norm import rms_norm
from k3jax.ops.tolerance import BF16_OUT_TOL, FP32_TOL, rel_rms
from k3jax.stack import plan_segments, unroll_params

EPS = 1e-5
B, T, D = 2, 5, 16


def _normal(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


# -- the op --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_blocks", [1, 3])
@pytest.mark.parametrize("partial_mode", ["source", "masked", "none"])
def test_mix_equals_the_formula_on_its_sources_values_and_gradients(n_blocks, partial_mode):
    """``partial_mode``: the partial sum is a source, is masked by a (traced) flag, or is absent."""
    blocks = tuple(_normal(i, (B, T, D)) for i in range(n_blocks))
    partial = _normal(10, (B, T, D))
    w, g = _normal(11, (D,)), 1.0 + _normal(12, (D,), 0.3)
    probe = _normal(13, (B, T, D))
    srcs = list(blocks) + ([partial] if partial_mode == "source" else [])

    def mix(blocks, partial, w, g, valid):
        return depth_mix(blocks, None if partial_mode == "none" else partial, w, g, EPS, valid)[0]

    def loss_op(blocks, partial, w, g):  # the flag traced, as in a scanned sub-layer
        return jnp.sum(jnp.sin(mix(blocks, partial, w, g, jnp.asarray(partial_mode == "source")))
                       * probe)

    def loss_ref(blocks, partial, w, g):
        own = list(blocks) + ([partial] if partial_mode == "source" else [])
        return jnp.sum(jnp.sin(depth_mix_reference(own, w, g, EPS)) * probe)

    @jax.jit  # one program for the values and gradients of both forms
    def run(blocks, partial, w, g, valid):
        h_static = mix(blocks, partial, w, g, partial_mode == "source")
        h_traced = mix(blocks, partial, w, g, valid)
        grads = [jax.grad(f, argnums=(0, 1, 2, 3))(blocks, partial, w, g)
                 for f in (loss_op, loss_ref)]
        return depth_mix_reference(srcs, w, g, EPS), (h_static, h_traced), grads

    h_ref, outs, (g_op, g_ref) = run(blocks, partial, w, g, partial_mode == "source")
    for out in outs:
        assert rel_rms(h_ref, out) <= FP32_TOL
    for name, a, b in zip(("blocks", "partial", "w", "g"), g_ref, g_op):
        if len(srcs) == 1 and name != "blocks":  # one source: weight 1, no gradient to w, g
            assert float(jnp.max(jnp.abs(jnp.asarray(b)))) == 0.0, name
        else:
            assert all(rel_rms(x, y) <= FP32_TOL for x, y in zip(jax.tree.leaves(a),
                                                                 jax.tree.leaves(b))), name
    if partial_mode != "source":  # a masked or absent partial sum is not a source
        assert float(jnp.max(jnp.abs(g_op[1]))) == 0.0


@pytest.mark.parametrize("partial_valid", [True, False])
def test_gradients_through_the_returned_weights_equal_the_formula(partial_valid):
    """A loss on both outputs, the read ``h`` and the depth weights ``alpha`` (which the
    diagnostics average): gradients w.r.t. the blocks, the partial sum, the query and the key-norm
    weight equal autodiff of math §5's formula, with the partial sum a source or masked out."""
    blocks = tuple(_normal(i, (B, T, D)) for i in range(2))
    partial = _normal(10, (B, T, D))
    w, g = _normal(11, (D,)), 1.0 + _normal(12, (D,), 0.3)
    probe_h, probe_alpha = _normal(13, (B, T, D)), _normal(14, (3, B, T))

    def formula(blocks, partial, w, g):
        sources = list(blocks) + ([partial] if partial_valid else [])
        scores = jnp.stack([rms_norm(v, g, EPS) @ w for v in sources])
        alpha = jax.nn.softmax(scores, axis=0)
        if not partial_valid:                         # a masked source gets weight 0
            alpha = jnp.concatenate([alpha, jnp.zeros_like(alpha[:1])])
        return depth_mix_reference(sources, w, g, EPS), alpha

    def op(blocks, partial, w, g):
        return depth_mix(blocks, partial, w, g, EPS, jnp.asarray(partial_valid))

    def loss(f):
        def value(*args):
            h, alpha = f(*args)
            return jnp.sum(h * probe_h) + jnp.sum(alpha * probe_alpha)
        return jax.grad(value, argnums=(0, 1, 2, 3))

    # one program for both gradients
    ours, ref = jax.jit(lambda *a: (loss(op)(*a), loss(formula)(*a)))(blocks, partial, w, g)
    for name, a, b in zip(("blocks", "partial", "w", "g"), ref, ours):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert rel_rms(x, y) <= FP32_TOL, (name, rel_rms(x, y))
    if not partial_valid:
        assert float(jnp.max(jnp.abs(ours[1]))) == 0.0


def test_zero_query_mixes_uniformly_and_bf16_stays_within_spec_tolerance():
    blocks, partial = tuple(_normal(i, (B, T, D)) for i in range(2)), _normal(5, (B, T, D))
    h, alpha = depth_mix(blocks, partial, jnp.zeros(D), jnp.ones(D), EPS)
    assert rel_rms((blocks[0] + blocks[1] + partial) / 3, h) <= FP32_TOL
    np.testing.assert_allclose(alpha[:, 0, 0], [1 / 3, 1 / 3, 1 / 3], rtol=1e-6)
    _, alpha = depth_mix(blocks, partial, jnp.zeros(D), jnp.ones(D), EPS, jnp.asarray(False))
    np.testing.assert_allclose(alpha[:, 0, 0], [1 / 2, 1 / 2, 0.0], rtol=1e-6)
    w, g = _normal(2, (D,)), 1.0 + _normal(3, (D,), 0.3)
    ref = depth_mix(blocks, partial, w, g, EPS)[0]
    bf = lambda x: x.astype(jnp.bfloat16)
    out = depth_mix(tuple(map(bf, blocks)), bf(partial), w, g, EPS)[0]
    assert out.dtype == jnp.bfloat16 and rel_rms(ref, out) <= BF16_OUT_TOL


def test_bad_shapes_are_rejected_with_the_argument_named():
    with pytest.raises(ValueError, match="partial"):
        depth_mix((jnp.zeros((B, T, D)),), jnp.zeros((B, T, D + 1)), jnp.zeros(D), jnp.ones(D), EPS)
    with pytest.raises(ValueError, match="query w"):
        depth_mix((jnp.zeros((B, T, D)),), jnp.zeros((B, T, D)), jnp.zeros(D + 1), jnp.ones(D), EPS)
    with pytest.raises(ValueError, match="at least one source"):
        depth_mix((), None, jnp.zeros(D), jnp.ones(D), EPS)


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
    """The toy sub-layers on a raw read: each normalises it first, as the rule's read does."""
    return [lambda h, m=m: _toy_sublayer(_norm(h), m) for m in mats]


def _toy_sublayer(x, m):
    return jnp.tanh(x @ m)


def _norm(h):
    """The pre-norm of the rule tests: weight 1, the rule's epsilon."""
    return rms_norm(h, None, EPS)


class _Wired(nn.Module):
    """A rule and the pre-norm after its read (weight 1), wired as the decoder wires them: the
    sub-layer ``j``'s read, or with ``j`` None the final read."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, state, j=None):
        norm = RMSNorm(EPS, name="norm")
        if j is None:
            return AttnResFinalRead(self.cfg, name="rule")(state, norm)
        return AttnResidual(self.cfg, name="rule").read(state, j, norm)[0]


def _rule_cfg(block, num_layers=L_SUB // 2):
    return small_config(d_model=D, num_layers=num_layers, first_k_dense=num_layers, rms_eps=EPS,
                        residual=ResidualConfig(kind="attnres", block_size_sublayers=block))


def _rule_params(query, key_norm):
    return {"params": {"rule": {"query": query, "key_norm": key_norm},
                       "norm": {"scale": jnp.ones(D)}}}


def _read(cfg, j, query, key_norm, state):
    return _Wired(cfg).apply(_rule_params(query, key_norm), state, j)


def _write(cfg, j, state, out):
    """The rule's bookkeeping (its parameters unused)."""
    unused = {"params": {"query": jnp.zeros(D), "key_norm": jnp.ones(D)}}
    return AttnResidual(cfg).apply(unused, state, out, j, method=AttnResidual.write)


def _apply_rule(cfg, j, queries, norms, state, m):
    """Sub-layer ``j`` through the model's rule: read (with its norm), the toy sub-layer, write."""
    x = _read(cfg, j, queries[j], norms[j], state)
    return x, _write(cfg, j, state, _toy_sublayer(x, m))


def _run_rule_unrolled(cfg, e, mats, queries, norms, record=None):
    """The model's rule driven with static ``j``; ``record`` collects (h_j, state after write_j)."""
    state = initial_state(cfg, e)
    for j, m in enumerate(mats):
        h, state = _apply_rule(cfg, j, queries, norms, state, m)
        if record is not None:
            record.append((h, state))
    return _read(cfg, None, queries[-1], norms[-1], state)


def _run_rule_scanned(cfg, e, mats, queries, norms, static_head=0):
    """As the model runs it: block by block; in each block ``static_head`` sub-layers with static
    ``j``, the rest a ``lax.scan`` with traced ``j`` carrying only the partial sum (zeros at a block
    start), the completed blocks a loop-invariant input; settle after the scan."""
    s = block_size(cfg)
    state = initial_state(cfg, e)
    for lo in range(0, len(mats), s):
        hi = min(lo + s, len(mats))
        for j in range(lo, min(lo + static_head, hi)):
            _, state = _apply_rule(cfg, j, queries, norms, state, mats[j])
        first = min(lo + static_head, hi)
        if first == hi:
            continue
        partial, blocks = split_state(state)

        def body(partial, xs, blocks=blocks):
            j, m, q, g = xs
            st = join_state(partial, blocks)
            return _write(cfg, j, st, _toy_sublayer(_read(cfg, j, q, g, st), m)).partial, None

        xs = (jnp.arange(first, hi, dtype=jnp.int32), mats[first:hi], queries[first:hi],
              norms[first:hi])
        partial, _ = jax.lax.scan(body, partial, xs)
        state = settle(cfg, join_state(partial, blocks), hi)
    return _read(cfg, None, queries[-1], norms[-1], state)


def _runners(block):
    """The ways to run a toy stack: ``(e, mats, queries, norms) -> the final norm's output``."""
    cfg = _rule_cfg(block)
    return {
        "reference": lambda e, m, q, n: _norm(attnres_reference(e, _fns(m), q, n, block, EPS)),
        "rule, static j": lambda *a: _run_rule_unrolled(cfg, *a),
        "rule, traced j": lambda *a: _run_rule_scanned(cfg, *a),
        "rule, static head + traced j": lambda *a: _run_rule_scanned(cfg, *a, static_head=1),
        "two-phase": lambda e, m, q, n: _norm(attnres_two_phase(e, _fns(m), q, n, block, EPS)),
    }


@pytest.mark.parametrize("block", [1, 3])
def test_rule_static_and_traced_and_two_phase_equal_the_spec_bookkeeping(block):
    """Block 1 is Full AttnRes; block 3 does not divide the 4 sub-layers (a partial last block)."""
    runs = _runners(block)
    traced = ("rule, traced j", "rule, static head + traced j")

    def value_and_grads(run, *args):
        """The form's output and the gradient of ``sum(cos(output))`` w.r.t. the embedding,
        sub-layer weights, queries and key-norm weights (one forward serves both)."""
        out, pull = jax.vjp(run, *args)
        return out, pull(-jnp.sin(out))

    def forms(*args):
        with_grads = {name: value_and_grads(runs[name], *args) for name in ("reference", *traced)}
        values = {name: with_grads[name][0] if name in with_grads else run(*args)
                  for name, run in runs.items()}
        return values, {name: g for name, (_, g) in with_grads.items()}

    # One program for every form's value and the gradients of the reference and the scans.
    values, grad_of = jax.jit(forms)(*_toy(block))
    ref = values.pop("reference")
    for name, out in values.items():
        assert rel_rms(ref, out) <= FP32_TOL, name
    for name in traced:
        for a, b in zip(grad_of["reference"], grad_of[name]):
            assert rel_rms(a, b) <= FP32_TOL, name


def test_full_attnres_without_bookkeeping_equals_block_size_one():
    """(The rule and the two-phase form are held against block size 1 in the test above.)"""
    args = _toy(7)
    full = jax.jit(lambda e, m, q, n: _norm(full_attnres_reference(e, _fns(m), q, n, EPS)))(*args)
    assert rel_rms(full, jax.jit(_runners(1)["reference"])(*args)) <= FP32_TOL


@pytest.mark.parametrize("block", [1, 2, 3])
def test_three_sublayers_by_hand_source_lists_of_spec5(block):
    """math §5 written out for sub-layers 0, 1, 2 and the final read, one line per read."""
    e, mats, queries, norms = _toy(11, l_sub=3)
    f = _fns(mats)

    def mix(sources, j):
        return depth_mix_reference(sources, queries[j], norms[j], EPS)

    x0 = e                                               # j = 0: nothing committed, the embedding
    o0 = f[0](x0)
    x1 = mix([e, o0], 1)                                 # every S: blocks [e], partial o0
    o1 = f[1](x1)
    # after write j: the completed blocks and the partial sum (None right after a commit)
    if block == 1:
        x2 = mix([e, o0, o1], 2)                         # blocks [e, o0], partial o1
        o2 = f[2](x2)
        want_h = mix([e, o0, o1, o2], 3)
        want_blocks = [[e, o0], [e, o0, o1], [e, o0, o1, o2]]
        want_partial = [None, None, None]
    elif block == 2:
        x2 = mix([e, o0 + o1], 2)                        # blocks [e, o0 + o1], no partial
        o2 = f[2](x2)
        want_h = mix([e, o0 + o1, o2], 3)
        want_blocks = [[e], [e, o0 + o1], [e, o0 + o1]]
        want_partial = [o0, None, o2]
    else:
        x2 = mix([e, o0 + o1], 2)                        # blocks [e], partial o0 + o1 (no commit)
        o2 = f[2](x2)
        want_h = mix([e, o0 + o1 + o2], 3)
        want_blocks = [[e], [e], [e, o0 + o1 + o2]]
        want_partial = [o0, o0 + o1, None]

    record = []
    cfg = _rule_cfg(block)
    h = _run_rule_unrolled(cfg, e, mats, queries, norms, record)
    assert rel_rms(_norm(want_h), h) <= FP32_TOL
    for j, ((x, state), want_x) in enumerate(zip(record, [x0, x1, x2])):
        assert rel_rms(_norm(want_x), x) <= FP32_TOL, j
        assert (state.partial is None) == (want_partial[j] is None), j
        if want_partial[j] is not None:
            assert rel_rms(want_partial[j], state.partial) <= FP32_TOL, j
        assert len(state.blocks) == len(want_blocks[j]), j
        for i, b in enumerate(want_blocks[j]):
            assert rel_rms(b, state.blocks[i]) <= FP32_TOL, (j, i)


def test_block_size_in_layers_is_twice_in_sublayers_and_the_buffer_counts_blocks():
    k3 = small_config(num_layers=93, residual=ResidualConfig(kind="attnres", block_size_layers=12))
    assert k3.residual.block_sublayers == 24
    # ceil(186 / 24): embedding + 7 blocks + partial = 9 sources
    assert num_block_slots(k3) == 8


# -- the model ------------------------------------------------------------------------------------

NUM_LAYERS, BLOCK = 3, 4
TOKENS = jax.random.randint(jax.random.key(5), (B, 12), 0, 64)


def _model_cfg(kind="attnres", **kw):
    residual = ResidualConfig(kind=kind, block_size_sublayers=BLOCK if kind == "attnres" else None)
    # eps tiny: see test_zero_queries_give_the_plain_residual_model's docstring.
    return small_config(num_layers=NUM_LAYERS, first_k_dense=NUM_LAYERS, rms_eps=1e-12,
                        mla_layers=tuple(range(NUM_LAYERS)), residual=residual, **kw)


def _forward(cfg, variables):
    """``(logits, {"diagnostics": ...})``: one compiled forward per config, shared by the tests
    (the diagnostics are sown into a mutable collection; the logits are the same)."""
    return _jitted_forward(cfg)(variables)


@functools.lru_cache(maxsize=None)
def _jitted_forward(cfg):
    return jax.jit(lambda v: K3Model(cfg).apply(v, TOKENS, mutable=["diagnostics"]))


def _is_attnres(path) -> bool:
    return any(getattr(k, "key", None) in ("query", "key_norm") for k in path)


def _perturbed(params):
    """Move every pseudo-query (and key-norm weight) away from its init so the mix is not
    uniform (drawn on the host: a jitted draw per leaf would compile a program of its own)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(100)
    out = []
    for path, x in leaves:
        if _is_attnres(path):
            scale = 0.5 if path[-1].key == "query" else 0.2
            x = x + jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.fixture(scope="module")
def attnres_setup():
    cfg = _model_cfg()
    # block [0, 2) scanned (two iterations: the first masks the partial sum and the block is
    # committed after the scan), block [2, 3) an unrolled layer ending mid-block
    assert [p.repeats for p in plan_segments(cfg)] == [2, 0]
    # Drawn on the host, the AttnRes parameters as the initialiser sets them: zero queries (every
    # read the mean of its sources) and unit key-norm weights.
    as_initialised = {"query": jnp.zeros_like, "key_norm": jnp.ones_like}
    v = jax.tree_util.tree_map_with_path(
        lambda path, x: as_initialised.get(path[-1].key, lambda x: x)(x), host_variables(cfg, 0))
    return cfg, v


def test_zero_queries_give_the_plain_residual_model(attnres_setup):
    """With w = 0 every mix is the mean of its n sources, which sum to the plain stream x: h = x /
    n. The pre-norms are scale-invariant except for eps: RMSNorm(x / n) = RMSNorm(x) with eps -> n^2
    eps. With eps = 1e-12 and mean(x^2) >= ~1e-4 that shifts rsqrt by < n^2 eps / (2 mean x^2) ~
    1e-7, so FP32_TOL (§10, same math in another order: h sums the sources in a different order)
    holds. A boundary counted twice or a missing source changes the direction of h, not only its
    scale."""
    cfg, v = attnres_setup
    plain_cfg = _model_cfg("plain", scan_layers=False)
    plain_params = _drop_attnres(unroll_params(cfg, v["params"]))
    want = _forward(plain_cfg, {"params": plain_params})[0]
    assert rel_rms(want, _forward(cfg, v)[0]) <= FP32_TOL
    # the same model with the queries moved is a different model (the test can fail)
    assert rel_rms(want, _forward(cfg, {"params": _perturbed(v["params"])})[0]) > 1e-2


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
    """Rematerialised layers in both forms at once: the scanned block (traced layer index, the
    partial sum carried, the embedding loop-invariant) and the unrolled last layer (static index,
    reading the committed block, ending the stack mid-block). Plain-residual KDA/MLA stacks under
    both policies: test_model.py."""
    cfg, _ = attnres_setup
    params, ((_, logits), grads) = scanned_grads
    (_, logits_r), grads_r = _loss_and_grads(cfg.replace(remat="full"), params)
    assert rel_rms(logits, logits_r) <= FP32_TOL
    assert jax.tree.structure(grads) == jax.tree.structure(grads_r)
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
    _, diag = _forward(cfg, v)
    diag = unroll_params(cfg, diag["diagnostics"])
    n = num_block_slots(cfg)
    for j in range(2 * NUM_LAYERS + 1):
        if j < 2 * NUM_LAYERS:
            node = diag[f"layer_{j // 2}"]["residual_" + ("ffn" if j % 2 else "mixer")]
        else:
            node = diag["final_residual"]
        # sources of sub-layer j: the embedding and blocks 1..ceil(j / S) (the last one partial)
        count = 1 + -(-j // BLOCK)
        want = np.zeros(n + 1)
        want[:count] = 1.0 / count                          # zero queries: uniform over the sources
        np.testing.assert_allclose(node["depth_weights"], want, rtol=1e-5, err_msg=str(j))
    table = v["params"]["embedding"]
    rms = diag["final_residual"]["block_rms"]
    assert rms.shape == (n + 1,) and bool(jnp.all(rms > 0))
    np.testing.assert_allclose(rms[0], jnp.sqrt(jnp.mean(jnp.square(table[TOKENS]))), rtol=1e-5)
    # not sown unless asked for (the structure alone: traced, not compiled)
    _, mut = jax.eval_shape(lambda v: K3Model(cfg).apply(v, TOKENS, mutable=["balance_stats"]), v)
    assert "diagnostics" not in mut


# -- memory: no O(L^2 d) term ---------------------------------------------------------------------

MEM_B, MEM_T, MEM_D, MEM_BLOCK = 1, 32, 256, 4  # wide and short: [B, T, d] arrays dominate
MEM_DEPTHS = (4, 8)
# AttnRes keeps, per decoder layer, a few [B, T, d] arrays more than the plain residual (each
# sub-layer's mixed input h, the partial-sum carry, a share of a block and of its cotangent): a
# linear term, measured 2-6 units of B*T*d per layer at depths 4..16, on top of a few tens of
# units that XLA's scheduling of block-wise vs whole-stack scans moves either way. The previous
# design (a buffer of completed blocks carried through the layers) kept one [N, B, T, d] buffer per
# sub-layer: L_sub * N = L^2 units at S = 4, 48 more from L = 4 to 8 (12 per added layer) in the
# buffers alone, measured +122 (30 per layer). 8 units per added layer separates the two.
MEM_UNITS_PER_LAYER = 8.0


def _step_temp_units(num_layers, kind):
    """Compiled temp memory of value_and_grad of an MLA-only dense fp32 stack, in units of B*T*d."""
    res = ResidualConfig(kind=kind, block_size_sublayers=MEM_BLOCK if kind == "attnres" else None)
    cfg = small_config(num_layers=num_layers, first_k_dense=num_layers, d_model=MEM_D,
                       mla_layers=tuple(range(num_layers)), residual=res)
    params = abstract_variables(cfg)["params"]
    tokens = jax.ShapeDtypeStruct((MEM_B, MEM_T), jnp.int32)
    step = jax.jit(jax.value_and_grad(lambda p, t: jnp.mean(K3Model(cfg).apply({"params": p}, t))))
    temp = step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
    return temp / (MEM_B * MEM_T * MEM_D * 4)


def test_attnres_adds_memory_linear_in_depth_not_quadratic():
    """extra(L) = temp(AttnRes) - temp(plain), scanned stacks. The increment from L to 2L must stay
    below a linear budget per added layer. (A ratio test extra(2L) <= 2.5 extra(L) does not work:
    extra(L) can be negative, since AttnRes scans block by block and XLA then schedules the loop
    buffers differently from the plain stack's single scan.) Without remat the backward keeps every
    intermediate, the layer inputs (the residual state) among them, which is all that full remat
    keeps: an O(L^2) array kept under either setting shows here."""
    extra = {}
    for num_layers in MEM_DEPTHS:
        extra[num_layers] = (_step_temp_units(num_layers, "attnres")
                             - _step_temp_units(num_layers, "plain"))
    short, deep = MEM_DEPTHS
    assert extra[deep] - extra[short] <= MEM_UNITS_PER_LAYER * (deep - short), extra
