"""Model-level contract: shapes, causality, packing, scan vs unrolled, remat, presets by
eval_shape.

Each config is run through one compiled forward per input signature, shared by the tests, so the
module compiles few programs. The tests that compare two computations on the same variables draw
them on the host (:func:`helpers.host_variables`): a compiled initialiser costs more than the
forward it feeds.
"""

import collections
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GENERATION_CASES, host_variables, init, small_config
from jax.sharding import PartitionSpec as P

from k3jax.model import K3Model, abstract_variables, abstract_variables_and_axes
from k3jax.ops.tolerance import FP32_TOL, rel_rms
from k3jax.stack import plan_stack, unroll_params

B, T = 2, 20


def _tokens(key=0, t=T, vocab=64):
    return jax.random.randint(jax.random.key(key), (B, t), 0, vocab)


def _apply(cfg, variables, tokens, **kw):
    return K3Model(cfg).apply(variables, tokens, **kw)


@functools.lru_cache(maxsize=None)
def _jitted_forward(cfg):
    return jax.jit(lambda v, t, s: K3Model(cfg).apply(v, t, segment_ids=s))


def _forward(cfg, variables, tokens, segment_ids=None):
    """The model's logits, from one compiled forward per config and input signature."""
    return _jitted_forward(cfg)(variables, tokens, segment_ids)


def test_logits_shape_dtype_and_finite():
    cfg = small_config()
    v = host_variables(cfg, 0)
    logits = _forward(cfg, v, _tokens())
    assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_changing_a_future_token_never_changes_an_earlier_output():
    cfg = small_config()
    v = host_variables(cfg, 1)
    tokens = _tokens(1)
    base = _forward(cfg, v, tokens)
    for t in (3, 11, T - 1):
        changed = _forward(cfg, v, tokens.at[:, t].set((tokens[:, t] + 7) % cfg.vocab_size))
        np.testing.assert_array_equal(np.asarray(base[:, :t]), np.asarray(changed[:, :t]))
        assert not np.allclose(base[:, t], changed[:, t])


def test_packed_documents_equal_documents_run_alone():
    """Each document alone starts a row of the packed row's length, the rest of that row filler
    tokens: the causality test above shows later tokens never reach its outputs, so one compiled
    forward runs every document alone, from position 0 and with no segment ids."""
    cfg = small_config()
    v = host_variables(cfg, 2)
    tokens = _tokens(2)
    seg = jnp.asarray(np.repeat(np.array([[0] * 7 + [1] * 9 + [2] * 4]), B, 0), jnp.int32)
    packed = _forward(cfg, v, tokens, seg)
    filler = _tokens(20)
    for s in range(3):
        idx = np.where(np.asarray(seg[0]) == s)[0]
        row = jnp.concatenate([tokens[:, idx], filler[:, len(idx):]], axis=1)
        alone = _forward(cfg, v, row)[:, :len(idx)]
        assert rel_rms(alone, packed[:, idx]) < FP32_TOL


def test_bf16_parameters_compute_what_fp32_parameters_of_the_same_values_do():
    """``param_dtype="bfloat16"`` (weights stored in bf16, e.g. to serve a large checkpoint in half
    the memory) changes where the weights live, not the math. Hybrid stack with MoE and AttnRes,
    bf16 compute: every weight of the bf16 model is bf16 but the ones the spec keeps in fp32 (the
    KDA gate's ``A_log`` and ``dt_bias``), and with the same weights (fp32 ones rounded to bf16)
    both compute the same operations on the same values: equal logits (bit for bit on the CPU;
    math §10's bound for the same math). A layer that computed in its parameters' dtype where the
    spec says fp32 misses it (the KDA gate's projections in bf16: 6e-4)."""
    cfg = small_config(**GENERATION_CASES["hybrid"]).replace(dtype="bfloat16")
    cfg16 = cfg.replace(param_dtype="bfloat16")
    # jitted: op by op, every leaf's casts would compile their own programs
    rounded = jax.jit(functools.partial(
        jax.tree.map, lambda x: x.astype(jnp.bfloat16).astype(x.dtype)))(init(cfg, 5))
    shapes16 = abstract_variables(cfg16)
    kept_fp32 = {"A_log", "dt_bias"}
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes16["params"]):
        want = jnp.float32 if path[-1].key in kept_fp32 else jnp.bfloat16
        assert leaf.dtype == want, (jax.tree_util.keystr(path), leaf.dtype)
    v16 = jax.tree.map(lambda x, s: x.astype(s.dtype), rounded, shapes16)
    # One program for both models; their weights are separate arguments, which XLA cannot merge.
    want, got = jax.jit(lambda a, b, t: (_apply(cfg, a, t), _apply(cfg16, b, t)))(
        rounded, v16, _tokens(5))
    assert got.dtype == jnp.bfloat16  # the compute dtype's logits
    assert rel_rms(want, got) < FP32_TOL


def test_abstract_variables_transfer_nothing_to_a_device():
    """The shapes come from a trace: no array is sent to a device (on a GPU the process's first
    transfer sets up its allocator, seconds that would come before the train step's trace)."""
    cfg = small_config(**GENERATION_CASES["hybrid"])
    with jax.transfer_guard("disallow"):
        shapes, axes = abstract_variables_and_axes(cfg, (2, 16))
        assert jax.tree.structure(shapes) == jax.tree.structure(abstract_variables(cfg, (2, 16)))
    assert jax.tree.structure(axes["params"], is_leaf=lambda x: isinstance(x, P)) == \
        jax.tree.structure(shapes["params"])


def _scanned_config():
    return small_config(num_layers=5, mla_every=2)  # kda,mla,kda,mla,mla: a scanned pair x2


def test_scanned_stack_equals_unrolled_stack():
    cfg = _scanned_config()
    plan = plan_stack(cfg)
    assert plan.repeats >= 2, plan
    v = host_variables(cfg, 3)
    unrolled_cfg = cfg.replace(scan_layers=False)
    v_unrolled = {"params": unroll_params(cfg, v["params"])}
    want = jax.tree.map(jnp.shape, abstract_variables(unrolled_cfg)["params"])
    assert jax.tree.map(jnp.shape, v_unrolled["params"]) == want
    tokens = _tokens(3)
    assert rel_rms(_forward(unrolled_cfg, v_unrolled, tokens), _forward(cfg, v, tokens)) < FP32_TOL


def test_remat_gives_the_same_values_and_gradients():
    """Both policies, on three scanned KDA layers (traced layer index) and the unrolled last MLA
    layer (static index), against one reference gradient. (AttnRes layers under remat:
    test_attnres.py.) The other tests' config: a scan compiles its layer once however many it
    repeats."""
    cfg = small_config()  # kda,kda,kda,mla
    plan = plan_stack(cfg)
    assert (plan.group, plan.repeats) == ((("kda", "dense"),), 3), plan
    v = host_variables(cfg, 4)
    tokens = _tokens(4)

    def loss(params, c):
        logits = _apply(c, {"params": params}, tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, tokens[..., None], -1)[..., 0])

    policies = ("full", "dots")
    configs = (cfg, *(cfg.replace(remat=policy) for policy in policies))
    # One program for the three, one compile: XLA merges none of their loops or products, so each
    # policy's recomputation stays its own.
    (l0, g0), *with_remat = jax.jit(
        lambda p: [jax.value_and_grad(loss)(p, c) for c in configs])(v["params"])
    for policy, (l1, g1) in zip(policies, with_remat, strict=True):
        np.testing.assert_allclose(l0, l1, rtol=1e-6, err_msg=policy)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            assert rel_rms(a, b) < FP32_TOL, policy


def test_applying_traces_each_kind_of_layer_once():
    """Applied (not initialised), every mixer and FFN runs under flax's lifted jit: the three
    unrolled KDA layers call one traced function, the four dense FFNs another and the MLA layer a
    third, so jax traces, differentiates and lowers each kind once. (The numbers are those of the
    other tests: every model test runs the lifted layers.)"""
    cfg = small_config(scan_layers=False)  # kda, kda, kda, mla; dense FFNs
    variables = abstract_variables(cfg)
    jaxpr = jax.make_jaxpr(lambda v: _apply(cfg, v, _tokens()))(variables)
    traces = collections.Counter(id(e.params["jaxpr"]) for e in jaxpr.jaxpr.eqns
                                 if e.params.get("name") == "core_fn")  # flax's lifted function
    assert sorted(traces.values()) == [1, 3, 4], traces


def test_bad_tokens_are_rejected_before_tracing():
    cfg = small_config()
    v = host_variables(cfg, 0)
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        _apply(cfg, v, jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="segment_ids"):
        _apply(cfg, v, jnp.zeros((2, 4), jnp.int32), segment_ids=jnp.zeros((2, 5), jnp.int32))


# The released shapes (kimi_linear_48b, k3_full) are traced by their parameter counts in
# test_accounting.py: ``count_params`` initialises them by eval_shape, which runs the forward.
PRESETS = ["k3_tiny", "k3_small", "k3_1b"]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_traces_with_eval_shape(name):
    """Initialisation and the forward traced together (``init_with_output``: one trace of the
    model, not one for ``init`` and another for ``apply``)."""
    cfg = importlib.import_module(f"configs.{name}").model_config()
    tokens = jnp.zeros((1, 8), jnp.int32)
    out, variables = jax.eval_shape(
        lambda r: K3Model(cfg).init_with_output({"params": r}, tokens), jax.random.key(0))
    assert out.shape == (1, 8, cfg.vocab_size) and out.dtype == jnp.dtype(cfg.dtype)
    assert jax.tree.leaves(variables["params"])
