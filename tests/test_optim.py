"""Grouped Muon: the same updates as ``optax.contrib.muon`` (the reference), fewer compiled loops.

The parameter tree mixes what k3jax has: wide and tall matrices of one shape class (they share a
group after transposition), a scanned ``[layers, in, out]`` stack, ``[layers, experts, in, out]``
experts, a matrix with two output axes (``w_kvb``), and AdamW-only leaves (embedding, norm).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers, muon

from k3jax.config.experiment import OptimConfig
from k3jax.ops.tolerance import FP32_TOL, rel_rms
from k3jax.train.optim import (
    NS_COEFFS,
    build_optimizer,
    decay_mask,
    learning_rate,
    muon_dims,
    muon_labels,
    newton_schulz,
    orthogonalize_grouped,
    path_name,
    phases,
    schedule,
    schedule_args,
)

SHAPES = {  # name: (shape, logical axes)
    "embedding": ((32, 16), ("vocab", "embed")),
    "norm": ((16,), ("embed",)),
    "w_q": ((16, 24), ("embed", "heads")),
    "w_o": ((24, 16), ("heads", "embed")),   # tall: same group as w_q once transposed
    "w_k": ((16, 24), ("embed", "heads")),
    "w_kvb": ((8, 2, 12), ("kv_lora", "heads", "kv")),
    "scan": {"w_up": ((3, 16, 24), ("layers", "embed", "mlp")),
             "expert_up": ((3, 4, 16, 8), ("layers", "exp", "embed", "mlp"))},
}
STEPS = 3


def _is_spec(x):
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _tree(rng_seed=0):
    specs = jax.tree.leaves(SHAPES, is_leaf=_is_spec)
    treedef = jax.tree.structure(SHAPES, is_leaf=_is_spec)
    keys = jax.random.split(jax.random.key(rng_seed), len(specs))
    params = [jax.random.normal(k, s[0], jnp.float32) for k, s in zip(keys, specs)]
    axes = [s[1] for s in specs]
    return jax.tree.unflatten(treedef, params), jax.tree.unflatten(treedef, axes)


def _reference(cfg: OptimConfig, total_steps: int, params, axes):
    """The previous ``build_optimizer``: optax's muon (one Newton-Schulz per leaf) + AdamW."""
    lr = schedule(cfg, total_steps)
    adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    is_dim = lambda d: d is None or isinstance(d, MuonDimensionNumbers)  # noqa: E731
    paths = {path_name(p): d for p, d in
             jax.tree_util.tree_flatten_with_path(muon_dims(params, axes), is_leaf=is_dim)[0]}
    dims_of = lambda masked: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda p, _: paths[path_name(p)], masked)
    matrices = muon(lr, beta=cfg.b1, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    muon_weight_dimension_numbers=dims_of, consistent_rms=cfg.muon_consistent_rms)
    core = optax.partition({"muon": matrices, "adam": adamw}, muon_labels(params, axes))
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), core)


def _run(opt, params, grads_seq):
    state = jax.jit(opt.init)(params)  # jitted: one compile each, not one per leaf and op
    update, apply = jax.jit(opt.update), jax.jit(optax.apply_updates)
    out = []
    for g in grads_seq:
        u, state = update(g, state, params)
        params = apply(params, u)
        out.append(u)
    return out


def test_grouped_muon_matches_optax_muon():
    params, axes = _tree(0)
    grads = [_tree(i + 1)[0] for i in range(STEPS)]
    cfg = OptimConfig(name="muon", warmup_steps=0, weight_decay=0.1, clip_norm=1.0,
                      muon_consistent_rms=0.3, muon_ns_dtype="float32")  # optax iterates in fp32
    ours = _run(build_optimizer(cfg, 10, params, axes), params, grads)
    ref = _run(_reference(cfg, 10, params, axes), params, grads)
    assert muon_labels(params, axes)["w_kvb"] == "muon"
    assert muon_labels(params, axes)["embedding"] == "adam"
    for step, (u, r) in enumerate(zip(ours, ref)):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(u), jax.tree.leaves(r)):
            assert a.shape == b.shape
            err = rel_rms(np.asarray(b), np.asarray(a))
            assert err < FP32_TOL, (step, jax.tree_util.keystr(path), err)


def test_orthogonalize_grouped_equals_per_matrix_and_rolled_loop():
    """Stacking same-shaped matrices changes nothing; the rolled loop (one or two iterations a
    trip, the second with a remainder iteration after the loop) equals the unrolled one."""
    params, axes = _tree(4)
    dims = muon_dims(params, axes)
    is_dim = lambda d: d is None or isinstance(d, MuonDimensionNumbers)  # noqa: E731
    labels = muon_labels(params, axes)
    mats = {k: v for k, v in params.items() if k != "scan" and labels[k] == "muon"}
    mats["scan"] = params["scan"]
    mat_dims = {k: dims[k] for k in mats}

    @jax.jit  # the three ways in one compile, not one per op
    def orthogonalized(mats):
        alone = [optax.contrib._muon.orthogonalize_via_newton_schulz(
            x, jnp.asarray(NS_COEFFS), 5, dimension_numbers=d)
            for x, d in zip(jax.tree.leaves(mats), jax.tree.leaves(mat_dims, is_leaf=is_dim))]
        return (alone, orthogonalize_grouped(mats, mat_dims),
                orthogonalize_grouped(mats, mat_dims, unroll=False),
                orthogonalize_grouped(mats, mat_dims, unroll=2))

    alones, grouped, rolled, rolled2 = orthogonalized(mats)
    for (path, x), alone, g, r, r2 in zip(jax.tree_util.tree_leaves_with_path(mats), alones,
                                          *map(jax.tree.leaves, (grouped, rolled, rolled2))):
        assert rel_rms(np.asarray(alone), np.asarray(g)) < FP32_TOL, jax.tree_util.keystr(path)
        for loop in (r, r2):
            assert rel_rms(np.asarray(g), np.asarray(loop)) < FP32_TOL, jax.tree_util.keystr(path)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_newton_schulz_orthogonalises(dtype):
    """Singular values of the result lie near 1 (the quintic's band is about [0.7, 1.2]), with the
    iterations in fp32 or bf16."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 20))
    out = jax.jit(newton_schulz, static_argnames="dtype")(x, dtype=dtype)
    assert out.dtype == dtype
    s = np.linalg.svd(np.asarray(out, np.float32), compute_uv=False)
    assert s.min() > 0.5 and s.max() < 1.3, s


def test_bf16_newton_schulz_follows_fp32():
    """The default bf16 iterations give the fp32 iterations' update up to the quintic's own spread.

    Looser than math §10's bf16 bounds, for a stated reason: the quintic is tuned to push singular
    values into a band around 1 fast, not to converge, so bf16 rounding in its first steps moves
    each value within that band; the fp32 and bf16 results differ by 3-6% relative RMS on random
    matrices. The direction must still agree (a wrong transpose or scale shows as ~100%)."""
    params, axes = _tree(0)
    grads = [_tree(i + 1)[0] for i in range(2)]
    runs = {dt: _run(build_optimizer(OptimConfig(name="muon", warmup_steps=0, muon_ns_dtype=dt),
                                     10, params, axes), params, grads)
            for dt in ("float32", "bfloat16")}
    labels = muon_labels(params, axes)
    for u32, u16 in zip(runs["float32"], runs["bfloat16"]):
        for key in u32:
            if key != "scan" and labels[key] == "adam":
                np.testing.assert_array_equal(u32[key], u16[key])  # AdamW leaves: untouched
                continue
            for a, b in zip(jax.tree.leaves(u32[key]), jax.tree.leaves(u16[key])):
                assert a.dtype == b.dtype == jnp.float32
                assert rel_rms(np.asarray(a), np.asarray(b)) < 0.1, key


def test_one_newton_schulz_loop_per_shape():
    """The compile-time point: one Newton-Schulz loop (3 matmuls in its body) per distinct (m, n)
    shape, where optax has one per parameter. Here w_q, w_o, w_k and scan/w_up share [16, 24]."""
    params, axes = _tree(0)
    cfg = OptimConfig(name="muon", warmup_steps=0)

    def dots(opt):
        return str(jax.make_jaxpr(opt.update)(params, opt.init(params), params)).count(
            "dot_general")

    groups = 3  # [16, 24] (4 leaves), [8, 24] (w_kvb), [8, 16] (experts, transposed)
    n_muon = sum(v == "muon" for v in jax.tree.leaves(muon_labels(params, axes)))
    assert n_muon == 6
    assert dots(build_optimizer(cfg, 10, params, axes)) == 3 * groups
    assert dots(_reference(cfg, 10, params, axes)) == 3 * n_muon


def test_bad_dimension_numbers():
    with pytest.raises(ValueError, match="disjoint reduction and output axes"):
        orthogonalize_grouped({"w": jnp.ones((4, 4))}, {"w": MuonDimensionNumbers(0, 0)})


# -- the learning-rate schedule as step data -------------------------------------------------------

def _optax_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The schedule composed from optax's own functions, its numbers constants of the program:
    what :func:`learning_rate` must reproduce from :func:`schedule_args`."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup, rest, decay = phases(cfg, total_steps)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio)
    else:
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
            [rest - decay])
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)), after],
                                [warmup])


@pytest.mark.parametrize("kind", ["wsd", "cosine", "constant"])
def test_schedule_from_step_data_equals_optax_bit_for_bit(kind):
    """Every step of several runs (with and without warmup, a warmup past the run's end, odd
    learning rates and floors), from one compiled function of the schedule's numbers: bit for
    bit on the CPU; on a GPU, where optax's numbers are compile-time constants and ours are
    arguments, the cosine's results differed by up to 2 ulp."""
    runs = [(OptimConfig(lr=3e-3, warmup_steps=20, decay_fraction=0.3), 400),
            (OptimConfig(lr=0.0021, warmup_steps=0, decay_fraction=0.2, min_lr_ratio=0.07), 97),
            (OptimConfig(lr=1e-2, warmup_steps=50, min_lr_ratio=0.1), 30),
            (OptimConfig(lr=7.3e-4, warmup_steps=1, decay_fraction=1.0, min_lr_ratio=0.0), 3)]

    @jax.jit
    def ours(counts, args):
        return jax.vmap(lambda c: learning_rate(kind, c, args))(counts)

    for cfg, total in runs:
        cfg = dataclasses.replace(cfg, schedule=kind)
        counts = jnp.arange(total + 3, dtype=jnp.int32)
        want = jax.jit(jax.vmap(lambda c: jnp.asarray(_optax_schedule(cfg, total)(c),
                                                      jnp.float32)))(counts)
        got = ours(counts, schedule_args(cfg, total))
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(cfg))
        else:  # a GPU's cosine and fused multiply-adds round a constant and an argument apart
            np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=4)
