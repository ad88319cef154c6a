"""Optimiser: AdamW, or Muon for matrix weights with AdamW for the rest; schedules; decay masks.

Parameters are fp32 master weights (the model computes in ``ModelConfig.dtype``), so the optimiser
states and updates are fp32 too. Which parameters get what is decided from their path names:

* no weight decay: norms, biases, ``A_log``, ``dt_bias``, AttnRes pseudo-queries (names containing
  ``query``), the router bias -- any path element containing one of :data:`NO_DECAY`;
* Muon (``name="muon"``): weights with at least two matrix axes that are not embeddings, the output
  head, short convolutions or no-decay parameters. A scanned stack adds a leading layer axis and the
  MoE an expert axis; those are batch axes of the orthogonalisation (the last two axes are the
  matrix, input then output, as ``x @ W``).

Muon here is :func:`grouped_muon`: the same update as ``optax.contrib.muon`` (Nesterov momentum,
Frobenius-normalised quintic Newton-Schulz, shape scaling, decoupled weight decay), but the
matrices of equal (transposed-to-wide) shape are stacked and orthogonalised by one batched
Newton-Schulz loop. optax runs one loop per parameter (~125 for k3_small), and XLA compiles each
of them separately; stacked, the train step holds a handful. The Newton-Schulz iterations run in
bf16 by default, as in Muon's and Moonlight's reference code (Jordan et al. 2024; Liu et al. 2025,
"Muon is Scalable for LLM Training"); ``ns_dtype=float32`` gives optax's fp32 iterations.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from k3jax.config.experiment import SCHEDULE_FIELDS

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (Keller Jordan; optax's default)

NO_DECAY = ("norm", "bias", "a_log", "dt_bias", "query", "scale")
NOT_MUON = ("embed", "head", "conv")


def path_name(path) -> str:
    """A parameter's path as its lower-case name, ``layer_0/mixer/a_log``, for the rules above."""
    return jax.tree_util.keystr(path, simple=True, separator="/").lower()


def decay_mask(params):
    """True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: not any(s in path_name(p) for s in NO_DECAY), params)


BATCH_AXES = ("layers", "exp")  # logical axes that stack independent matrices


def muon_dims(params, axes=None):
    """``MuonDimensionNumbers`` for each Muon parameter, None for the AdamW ones.

    ``axes`` (optional) is the tree of logical axis names (``k3jax.model.logical_axes``): the first
    axis that is not a batch axis (``layers``, ``exp``) is the input, the remaining ones the output
    (so ``w_kvb [kv_lora, heads, kv]`` is one ``kv_lora x (heads*kv)`` matrix). Without names the
    last two axes are the matrix.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = ([tuple(a) for a in jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))]
             if axes is not None else [None] * len(leaves))
    if len(names) != len(leaves):
        raise ValueError(f"muon_dims: {len(names)} axis-name entries for {len(leaves)} parameters")
    out = []
    for (path, x), axis_names in zip(leaves, names):
        name = path_name(path)
        if any(s in name for s in NO_DECAY + NOT_MUON) or x.ndim < 2:
            out.append(None)
            continue
        if axis_names is None or len(axis_names) != x.ndim:
            out.append(MuonDimensionNumbers(x.ndim - 2, x.ndim - 1))
            continue
        matrix = [i for i, a in enumerate(axis_names) if a not in BATCH_AXES]
        out.append(MuonDimensionNumbers(matrix[0], tuple(matrix[1:]))
                   if len(matrix) >= 2 else None)
    return jax.tree_util.tree_unflatten(treedef, out)


def muon_labels(params, axes=None):
    """'muon' or 'adam' per parameter (see :func:`muon_dims`)."""
    dims = muon_dims(params, axes)
    return jax.tree.map(lambda d, _: "adam" if d is None else "muon", dims, params,
                        is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers))


class MuonState(NamedTuple):
    """``count`` [] int32 (steps taken), ``mu`` the momentum (the parameters' tree)."""

    count: jax.Array
    mu: optax.Updates


def _axes(x, dims: MuonDimensionNumbers
          ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(batch, reduction, output) axes of ``x`` under ``dims`` (ints or tuples, may be negative)."""
    red, out = ((a,) if isinstance(a, int) else tuple(a) for a in dims)
    red, out = tuple(a % x.ndim for a in red), tuple(a % x.ndim for a in out)
    if x.ndim < 2 or not red or not out or set(red) & set(out):
        raise ValueError(f"Muon: dimension numbers {dims} do not name disjoint reduction and "
                         f"output axes of a parameter of shape {x.shape}")
    return tuple(a for a in range(x.ndim) if a not in red + out), red, out


def _to_wide(x, dims):
    """``x`` -> (``[b, m, n]`` with m <= n, inverse function): batch axes first, the matrix
    ``reduction x output`` transposed when it is tall (NS(X^T)^T = NS(X), and XX^T is smaller)."""
    batch, red, out = _axes(x, dims)
    perm = batch + red + out
    size = lambda axes: math.prod(x.shape[a] for a in axes)  # noqa: E731
    m, n = size(red), size(out)
    flat = x.transpose(perm).reshape(size(batch), m, n)
    tall = m > n
    if tall:
        flat = flat.swapaxes(1, 2)

    def inverse(y):
        y = y.swapaxes(1, 2) if tall else y
        return y.reshape(tuple(x.shape[a] for a in perm)).transpose(
            sorted(range(x.ndim), key=perm.__getitem__))

    return flat, inverse


def newton_schulz(x: jax.Array, steps: int = 5, eps: float = 1e-8, unroll: int | bool = True,
                  coeffs=NS_COEFFS, dtype=None) -> jax.Array:
    """Approximate orthogonalisation of each ``[m, n]`` matrix of ``x [b, m, n]`` (m <= n best):
    Frobenius-normalise (in ``x``'s dtype), then ``steps`` quintic iterations
    X <- (aI + bA + cA^2)X, A = XX^T, in ``dtype`` (default ``x``'s); returned in ``dtype``.
    ``unroll`` is :func:`jax.lax.fori_loop`'s (``True``: no loop; an int: iterations a trip)."""
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    a, b, c = (jnp.asarray(k, dtype) for k in coeffs)
    x = (x / (jnp.linalg.norm(x, axis=(1, 2), keepdims=True) + eps)).astype(dtype)
    a_eye = a * jnp.eye(x.shape[1], dtype=dtype)

    def step(_, x):
        # aI folded into the [m, m] polynomial: written aX + (bA + cA^2)X, the sum is one more
        # pass over the [m, n] iterate (XLA leaves it outside the product); aI rides in the pass
        # over the polynomial that XLA writes anyway.
        gram = jnp.einsum("bij,bkj->bik", x, x)
        poly = a_eye + b * gram + c * jnp.einsum("bij,bjk->bik", gram, gram)
        return jnp.einsum("bij,bjk->bik", poly, x)

    return jax.lax.fori_loop(0, steps, step, x, unroll=unroll)


def orthogonalize_grouped(tree, dims_tree, steps: int = 5, eps: float = 1e-8,
                          unroll: int | bool = True, ns_dtype=None):
    """Newton-Schulz of every leaf of ``tree`` (matrices per ``dims_tree``, a tree of
    ``MuonDimensionNumbers`` matching ``tree``'s leaves), one batched loop per distinct
    ``(m, n, dtype)``: same-shaped matrices are concatenated along the batch axis. The iterations
    run in ``ns_dtype`` (default: the leaves'); every leaf comes back in its own dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    dims = treedef.flatten_up_to(dims_tree)
    wide = [_to_wide(x, d) for x, d in zip(leaves, dims)]
    groups: dict[tuple, list[int]] = {}
    for i, (flat, _) in enumerate(wide):
        groups.setdefault(flat.shape[1:] + (flat.dtype,), []).append(i)
    out = [None] * len(leaves)
    for idx in groups.values():
        stacked = jnp.concatenate([wide[i][0] for i in idx]) if len(idx) > 1 else wide[idx[0]][0]
        done = newton_schulz(stacked, steps, eps, unroll, dtype=ns_dtype).astype(stacked.dtype)
        ends = list(itertools.accumulate(wide[i][0].shape[0] for i in idx))
        for i, part in zip(idx, jnp.split(done, ends[:-1])):
            out[i] = wide[i][1](part)
    return jax.tree.unflatten(treedef, out)


def _shape_scale(x, dims, consistent_rms: float | None) -> float:
    """optax's Muon update scale: ``sqrt(max(fan_in, fan_out)) * consistent_rms``, or without it
    ``sqrt(max(1, fan_out / fan_in))``."""
    _, red, out = _axes(x, dims)
    fan_in, fan_out = math.prod(x.shape[a] for a in red), math.prod(x.shape[a] for a in out)
    if consistent_rms is None:
        return math.sqrt(max(1.0, fan_out / fan_in))
    return math.sqrt(max(fan_in, fan_out)) * consistent_rms


def scale_by_grouped_muon(dims_fn, beta: float = 0.95, eps: float = 1e-8, ns_steps: int = 5,
                          consistent_rms: float | None = None, unroll: int | bool = True,
                          ns_dtype=jnp.bfloat16) -> optax.GradientTransformation:
    """Nesterov momentum (bias-corrected), orthogonalised and shape-scaled, as
    ``optax.contrib.scale_by_muon`` followed by its ``scale_by_shape``. ``dims_fn(updates)`` gives
    the ``MuonDimensionNumbers`` of every leaf; the Newton-Schulz iterations run in
    ``ns_dtype``."""

    def init(params):
        return MuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                              optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                              optax.tree.bias_correction(updates, beta, count))
        dims = dims_fn(updates)
        ortho = orthogonalize_grouped(mu_hat, dims, ns_steps, eps, unroll, ns_dtype)
        leaves, treedef = jax.tree.flatten(ortho)
        scaled = [x * _shape_scale(x, d, consistent_rms)
                  for x, d in zip(leaves, treedef.flatten_up_to(dims))]
        return jax.tree.unflatten(treedef, scaled), MuonState(count, mu)

    return optax.GradientTransformation(init, update)


def grouped_muon(learning_rate, beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
                 dims_fn=None, consistent_rms: float | None = None, ns_steps: int = 5,
                 unroll: int | bool = True, ns_dtype=jnp.bfloat16) -> optax.GradientTransformation:
    """Muon for parameters that are all matrices (``dims_fn`` gives their dimension numbers):
    ``optax.contrib.muon`` without its AdamW branch, orthogonalising by shape group, with the
    Newton-Schulz iterations in ``ns_dtype`` (``float32``: optax's)."""
    return optax.chain(
        scale_by_grouped_muon(dims_fn, beta, eps, ns_steps, consistent_rms, unroll, ns_dtype),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate))


def phases(cfg, total_steps: int) -> tuple[int, int, int]:
    """``(warmup, rest, decay)`` steps of :func:`schedule`: ``warmup`` linear steps, then ``rest``
    steps of which a WSD schedule spends the last ``decay`` decaying."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    rest = max(total_steps - warmup, 1)
    return warmup, rest, max(int(round(cfg.decay_fraction * rest)), 1)


def schedule_args(cfg, total_steps: int) -> dict[str, np.ndarray]:
    """The numbers of ``cfg``'s learning-rate schedule over ``total_steps``: data of the train step,
    not constants of its program, so runs that differ only in them (a learning-rate grid, token
    budgets, WSD branches) share one compiled step.

    Each value is the constant optax's own schedule functions would fold into the program,
    computed the same way (differences in float64 first, then rounded to float32), so
    :func:`learning_rate` compiled alone returns their values bit for bit. Inside a larger program
    XLA may compile the same multiply-add differently: a step's learning rate can then differ from
    a constant schedule's in the last bit (k3_tiny: at 14 of 60 steps).
    """
    peak, floor, alpha = cfg.lr, cfg.lr * cfg.min_lr_ratio, cfg.min_lr_ratio
    warmup, rest, decay = phases(cfg, total_steps)
    f32, i32 = np.float32, np.int32
    return {"peak": f32(peak), "floor": f32(floor), "decay_span": f32(peak - floor),
            "cos_span": f32(1 - alpha), "alpha": f32(alpha), "warmup": i32(warmup),
            "rest": i32(rest), "decay": i32(decay)}


def without_schedule_numbers(cfg):
    """``cfg`` (an OptimConfig) with the numbers :func:`schedule_args` makes step data (the peak
    and floor rates, warmup and decay lengths) at their defaults: configs differing only in them
    build one train-step program, and describe it alike (the executable cache's key)."""
    numbers = set(SCHEDULE_FIELDS) - {"schedule"}  # the schedule's kind is the program's
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name in numbers}
    return dataclasses.replace(cfg, **defaults)


def _linear(count, span, end, steps):
    """optax's ``linear_schedule(init, end, steps)`` at ``count`` with ``span = init - end``."""
    frac = 1 - jnp.clip(count, 0, steps) / steps
    return span * frac + end


def learning_rate(kind: str, count, args: dict) -> jax.Array:
    """The schedule ``kind`` (``constant``, ``cosine`` or ``wsd``) at step ``count`` (an int32
    scalar, traced or not), from :func:`schedule_args` (numbers or traced scalars): linear warmup
    from 0, then constant, cosine decay to ``min_lr_ratio``, or warmup-stable-decay (flat, then
    linear to the floor over the last ``decay_fraction``)."""
    peak, warmup = args["peak"], args["warmup"]
    after = count - warmup  # steps since the warmup (negative during it)
    if kind == "constant":
        rest = peak
    elif kind == "cosine":
        t = jnp.minimum(after, args["rest"])
        cos = 0.5 * (1 + jnp.cos(jnp.pi * t / args["rest"]))
        rest = peak * (args["cos_span"] * cos + args["alpha"])
    else:
        stable = args["rest"] - args["decay"]
        rest = jnp.where(after < stable, peak,
                         _linear(after - stable, args["decay_span"], args["floor"], args["decay"]))
    # -peak is exact, as is the float64 0 - peak optax rounds; integers are exact too.
    warm = _linear(count, -peak, peak, jnp.maximum(warmup, 1))
    return jnp.where(count < warmup, warm, rest)


def schedule(cfg, total_steps: int, args: dict | None = None) -> optax.Schedule:
    """Learning rate per step for ``cfg`` (an OptimConfig): :func:`learning_rate` with ``args``
    (default: :func:`schedule_args` of ``cfg`` over ``total_steps``)."""
    args = schedule_args(cfg, total_steps) if args is None else args
    return lambda count: learning_rate(cfg.schedule, count, args)


def build_optimizer(cfg, total_steps: int | None, params, axes=None,
                    args: dict | None = None) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW or Muon+AdamW, with the learning rate of :func:`schedule`
    over ``total_steps``, or from ``args`` (:func:`schedule_args`, traced inside the train step).

    ``params`` (arrays or shape structs) fixes which parameter goes where; ``axes`` are their
    logical axis names (optional, see :func:`muon_dims`). The optimiser's state does not depend
    on the schedule.
    """
    lr = schedule(cfg, total_steps, args)
    adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    if cfg.name == "adamw":
        core = adamw
    else:
        dims = muon_dims(params, axes)
        labels = muon_labels(params, axes)
        is_dim = lambda d: d is None or isinstance(d, MuonDimensionNumbers)  # noqa: E731
        paths = {path_name(p): d for p, d in
                 jax.tree_util.tree_flatten_with_path(dims, is_leaf=is_dim)[0]}

        def dims_of(masked):  # the muon branch sees only its own parameters (others masked)
            return jax.tree_util.tree_map_with_path(lambda p, _: paths[path_name(p)], masked)

        # A rolled NS loop: k3_small's CPU step compiled ~5 s faster (55.5 -> 50.6 s) than
        # unrolled. Two iterations a trip: an iteration ends in a product whose output cannot
        # overwrite its own operand, so with one a trip XLA copied the iterate into the loop's
        # buffer every iteration; with two, the second product writes there directly.
        matrices = grouped_muon(lr, beta=cfg.b1, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                dims_fn=dims_of, consistent_rms=cfg.muon_consistent_rms,
                                unroll=2, ns_dtype=jnp.dtype(cfg.muon_ns_dtype))
        core = optax.partition({"muon": matrices, "adam": adamw}, labels)
    if cfg.clip_norm is None:
        return core
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), core)


__all__ = ["BATCH_AXES", "NO_DECAY", "NOT_MUON", "NS_COEFFS", "build_optimizer", "decay_mask",
           "grouped_muon", "muon_dims", "muon_labels", "newton_schulz", "orthogonalize_grouped",
           "learning_rate", "phases", "scale_by_grouped_muon", "schedule", "schedule_args"]
