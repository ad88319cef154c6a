"""Optimiser: AdamW, or Muon for matrix weights with AdamW for the rest; schedules; decay masks.

Parameters are fp32 master weights (the model computes in ``ModelConfig.dtype``), so the optimiser
states and updates are fp32 too. Which parameters get what is decided from their path names:

* no weight decay: norms, biases, ``A_log``, ``dt_bias``, AttnRes pseudo-queries (names containing
  ``query``), the router bias -- any path element containing one of :data:`NO_DECAY`;
* Muon (``name="muon"``): weights with at least two matrix axes that are not embeddings, the output
  head, short convolutions or no-decay parameters. A scanned stack adds a leading layer axis and the
  MoE an expert axis; those are batch axes of the orthogonalisation (the last two axes are the
  matrix, input then output, as ``x @ W``).
"""

from __future__ import annotations

import jax
import optax
from optax.contrib import MuonDimensionNumbers, muon

NO_DECAY = ("norm", "bias", "a_log", "dt_bias", "query", "scale")
NOT_MUON = ("embed", "head", "conv")


def path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path).lower()


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


def schedule(cfg, total_steps: int) -> optax.Schedule:
    """Learning rate per step for ``cfg`` (an OptimConfig); warmup is linear from 0."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    rest = max(total_steps - warmup, 1)
    warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio)
    else:  # warmup-stable-decay: flat, then linear to the floor over the last decay_fraction
        decay = max(int(round(cfg.decay_fraction * rest)), 1)
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
            [rest - decay])
    if warmup == 0:
        return after
    return optax.join_schedules([warm, after], [warmup])


def build_optimizer(cfg, total_steps: int, params, axes=None) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW or Muon+AdamW, with the learning rate of :func:`schedule`.

    ``params`` (arrays or shape structs) fixes which parameter goes where; ``axes`` are their
    logical axis names (optional, see :func:`muon_dims`).
    """
    lr = schedule(cfg, total_steps)
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

        # Every parameter given to this muon() is a matrix, so its internal AdamW branch is empty.
        matrices = muon(lr, beta=cfg.b1, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        muon_weight_dimension_numbers=dims_of,
                        consistent_rms=cfg.muon_consistent_rms)
        core = optax.partition({"muon": matrices, "adam": adamw}, labels)
    if cfg.clip_norm is None:
        return core
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), core)


__all__ = ["BATCH_AXES", "NO_DECAY", "NOT_MUON", "build_optimizer", "decay_mask", "muon_dims",
           "muon_labels", "schedule"]
