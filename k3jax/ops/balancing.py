"""Expert load balancing (math §7): statistics, MaxVio, and the bias update rules.

The flow of one optimizer step (select with the old bias, update after):

    stats = zero_stats(cfg)                                  # or the first micro-batch's stats
    for each micro-batch:  stats = add_stats(stats, compute_stats(scores, ids, bias, cfg))
    stats = reduce_stats(stats, token_axes)                  # inside shard_map: the devices' sum
    bias  = update_bias(bias, stats, cfg)                    # used from the next step on

Statistics are a dict of arrays:
- ``"load"`` ``[E]`` int32, routed slots per expert (every rule; MaxVio and aux-free use it);
- ``"hist"`` ``[E, qb_bins]`` int32, histogram of the QB margins (``"quantile_hist"``);
- ``"margins"`` ``[N, E]`` fp32, the QB margins themselves (exact ``"quantile"``).
``load`` and ``hist`` combine by addition (micro-batches, and a ``psum`` over the mesh axes that
hold *different* tokens -- never over replicas of the same tokens). ``margins`` combine by
concatenation along the token axis (an ``all_gather`` across devices): the exact version keeps every
margin, so its statistics grow with the batch; it is the reference, the histogram the scalable rule.
Leading axes (a scanned layer stack: ``bias [L, E]``, ``load [L, E]``, ...) are accepted where a
whole collection is handled: :func:`zero_stats` (its ``leading``), :func:`add_stats`,
:func:`reduce_stats`, :func:`max_vio`, :func:`balance_metrics`, :func:`hist_edges`,
:func:`update_bias` and :func:`update_balance`. The statistics of one forward
(:func:`qb_margins`, :func:`margin_histogram`, :func:`compute_stats`) and the quantiles
(:func:`exact_quantiles`, :func:`hist_quantiles`) take one layer's arrays, as the shapes in their
docstrings say (a layer stack's forward is scanned, and :func:`update_bias` maps over the layers);
:func:`expert_loads` counts the ids of all its axes together.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

SUMMED = ("load", "hist")
CONCATENATED = ("margins",)


# -- statistics of one forward -----------------------------------------------------------------

def qb_margins(scores: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """QB margins ``r_tj = alpha_t - s_tj`` with ``alpha_t`` the (k+1)-th largest of ``s_t + bias``.

    ``r_tj`` is the bias expert j needs to reach token t's cutoff. Shapes ``[N, E]``, ``[E]`` ->
    ``[N, E]`` fp32 (no gradient).
    """
    scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
    biased = scores + bias.astype(jnp.float32)
    cutoff = jax.lax.top_k(biased, top_k + 1)[0][..., top_k]
    return cutoff[..., None] - scores


def hist_edges(bias: jax.Array, bins: int) -> tuple[jax.Array, jax.Array]:
    """K3's histogram range ``[min(bias) - 1, max(bias) + 1]``: -> ``(low [...], bin width [...])``.

    Every margin lies inside it, since sigmoid scores lie in (0, 1).
    """
    low = jnp.min(bias, axis=-1) - 1.0
    width = (jnp.max(bias, axis=-1) + 1.0 - low) / bins
    return low, width


def margin_histogram(margins: jax.Array, bias: jax.Array, bins: int) -> jax.Array:
    """Per-expert histogram of ``margins [N, E]`` over :func:`hist_edges`: -> ``[E, bins]``
    int32."""
    num_experts = margins.shape[-1]
    low, width = hist_edges(bias.astype(jnp.float32), bins)
    idx = jnp.clip(jnp.floor((margins - low) / width), 0, bins - 1).astype(jnp.int32)
    flat = idx + bins * jnp.arange(num_experts, dtype=jnp.int32)
    return jnp.bincount(flat.reshape(-1), length=num_experts * bins).reshape(num_experts, bins)


def expert_loads(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """Routed slots per expert: ``[..., k]`` int ids -> ``[E]`` int32."""
    return jnp.bincount(expert_ids.reshape(-1), length=num_experts).astype(jnp.int32)


def compute_stats(scores: jax.Array, expert_ids: jax.Array, bias: jax.Array, cfg) -> dict:
    """The statistics of one forward for ``cfg.balancing`` (see the module docstring).

    ``scores`` ``[N, E]`` fp32 sigmoid scores, ``expert_ids`` ``[N, k]`` chosen with ``bias [E]``.
    """
    stats = {"load": expert_loads(expert_ids, cfg.num_experts)}
    if cfg.balancing in ("quantile", "quantile_hist"):
        r = qb_margins(scores, bias, cfg.top_k)
        if cfg.balancing == "quantile":
            stats["margins"] = r
        else:
            stats["hist"] = margin_histogram(r, bias, cfg.qb_bins)
    return stats


def zero_stats(cfg, leading: Sequence[int] = ()) -> dict:
    """Statistics of no tokens (the identity of :func:`add_stats`), with optional leading axes."""
    lead = tuple(leading)
    stats = {"load": jnp.zeros(lead + (cfg.num_experts,), jnp.int32)}
    if cfg.balancing == "quantile":
        stats["margins"] = jnp.zeros(lead + (0, cfg.num_experts), jnp.float32)
    elif cfg.balancing == "quantile_hist":
        stats["hist"] = jnp.zeros(lead + (cfg.num_experts, cfg.qb_bins), jnp.int32)
    return stats


def _stat_name(path) -> str:
    key = path[-1]
    return str(getattr(key, "key", getattr(key, "name", key)))


def add_stats(a, b):
    """Combine the statistics of two disjoint sets of tokens (micro-batches of one step).

    Works on one statistics dict or on any tree of them (a whole ``'balance_stats'`` collection):
    each leaf is combined by its name -- ``load`` and ``hist`` add, ``margins`` concatenate along
    the token axis. Start an accumulation from :func:`zero_stats` or from the first micro-batch,
    never from ``zeros_like`` (zero margins would be counted as tokens).
    """
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise ValueError("add_stats: the two statistics trees differ (different rules or layers): "
                         f"{jax.tree.structure(a)} vs {jax.tree.structure(b)}")

    def combine(path, x, y):
        name = _stat_name(path)
        if name in SUMMED:
            return x + y
        if name in CONCATENATED:
            return jnp.concatenate([x, y], axis=-2)
        raise ValueError(f"add_stats: unknown statistic {name!r} at {jax.tree_util.keystr(path)}")

    return jax.tree_util.tree_map_with_path(combine, a, b)


def reduce_stats(stats, axis_names: str | Sequence[str]):
    """Combine statistics across the mesh axes that hold different tokens (inside ``shard_map``).

    The hook of the expert-parallel code (one statistics dict or a tree of them): pass only
    data-holding axes (data, fsdp, expert when it splits the tokens), never tensor-parallel
    replicas, or tokens are counted twice. ``load``/``hist`` are ``psum``-ed, ``margins`` gathered.
    """
    axes = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if not axes:
        return stats

    def combine(path, x):
        if _stat_name(path) in CONCATENATED:
            return jax.lax.all_gather(x, axes, axis=x.ndim - 2, tiled=True)
        return jax.lax.psum(x, axes)

    return jax.tree_util.tree_map_with_path(combine, stats)


# -- metrics -----------------------------------------------------------------------------------

def max_vio(load: jax.Array) -> jax.Array:
    """MaxVio ``(max_j load - mean load) / mean load`` over the last axis, fp32 (0 when empty)."""
    load = load.astype(jnp.float32)
    mean = jnp.mean(load, axis=-1)
    return jnp.where(mean > 0, (jnp.max(load, axis=-1) - mean) / jnp.maximum(mean, 1e-30), 0.0)


def balance_metrics(stats) -> dict:
    """Per-layer MaxVio from a ``'balance_stats'`` tree, keyed by the layer's path:
    ``{"layer_1/ffn/bias": array}``.

    A scanned stack keeps its layer axis (``[L]``); loads themselves are ``stats[...]["load"]``.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]:
        if _stat_name(path) == "load":
            out["/".join(str(getattr(k, "key", k)) for k in path[:-1])] = max_vio(leaf)
    return out


# -- bias updates ------------------------------------------------------------------------------

def exact_quantiles(margins: jax.Array, top_k: int) -> jax.Array:
    """Per-expert ``k/E`` quantile of ``margins [N, E]`` by sorting: -> ``[E]``.

    With ``c = N k / E`` the result is the midpoint of the c-th and (c+1)-th smallest margins
    (linear interpolation at sorted position ``c - 1/2``), so exactly ``c`` margins lie below it
    unless they tie.
    """
    n, num_experts = margins.shape
    if n == 0:
        return jnp.zeros((num_experts,), jnp.float32)
    pos = min(max(n * top_k / num_experts - 0.5, 0.0), n - 1.0)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    srt = jnp.sort(margins, axis=0)
    return srt[lo] + (pos - lo) * (srt[hi] - srt[lo])


def hist_quantiles(hist: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """Per-expert ``k/E`` quantile from ``hist [E, bins]`` (built over ``hist_edges(bias)``): ->
    ``[E]``.

    The quantile lies in the first bin whose cumulative count reaches ``c = N k / E``, placed inside
    it by linear interpolation; so between ``cum[i-1]`` and ``cum[i]`` margins lie below it.
    """
    num_experts, bins = hist.shape
    low, width = hist_edges(bias.astype(jnp.float32), bins)
    counts = hist.astype(jnp.float32)
    cum = jnp.cumsum(counts, axis=-1)
    target = cum[:, -1:] * (top_k / num_experts)                          # [E, 1]
    i = jnp.minimum(jnp.sum(cum < target, axis=-1), bins - 1)             # [E]
    cum_i = jnp.take_along_axis(cum, i[:, None], axis=-1)[:, 0]
    h_i = jnp.take_along_axis(counts, i[:, None], axis=-1)[:, 0]
    frac = jnp.clip((target[:, 0] - (cum_i - h_i)) / jnp.maximum(h_i, 1.0), 0.0, 1.0)
    return low + (i + frac) * width


def _update_one(bias: jax.Array, stats: dict, cfg) -> jax.Array:
    bias = bias.astype(jnp.float32)
    if cfg.balancing in ("quantile", "quantile_hist"):
        if cfg.balancing == "quantile":
            q = exact_quantiles(stats["margins"], cfg.top_k)
        else:
            q = hist_quantiles(stats["hist"], bias, cfg.top_k)
        new = q - jnp.mean(q)
        return jnp.where(jnp.sum(stats["load"]) > 0, new, bias)      # no tokens: keep the bias
    if cfg.balancing == "aux_free":
        load = stats["load"].astype(jnp.float32)
        return bias + cfg.aux_free_gamma * jnp.sign(jnp.mean(load) - load)
    return bias                                                           # "aux_loss", "none"


def update_bias(bias: jax.Array, stats: dict, cfg) -> jax.Array:
    """The bias of the next step from this step's combined statistics (math §7).

    ``bias`` ``[..., E]`` fp32 with matching leading axes in ``stats``; ``cfg`` is the MoEConfig.
    QB replaces the bias by the mean-subtracted per-expert quantiles; aux-free adds
    ``gamma * sign(mean load - load)``; ``"aux_loss"`` and ``"none"`` return it unchanged.
    """
    if bias.ndim > 1:
        return jax.vmap(lambda b, s: update_bias(b, s, cfg))(bias, stats)
    return _update_one(bias, stats, cfg)


def update_balance(balance: dict, stats: dict, cfg) -> dict:
    """Apply :func:`update_bias` to every bias in a ``'balance'`` collection.

    ``stats`` is the ``'balance_stats'`` collection: the same tree with each bias leaf replaced by
    its statistics dict (MoEBlock stores them under the same path).
    """
    return jax.tree.map(lambda b, s: update_bias(b, s, cfg), balance, stats)


__all__ = ["add_stats", "balance_metrics", "compute_stats", "exact_quantiles", "expert_loads",
           "hist_edges", "hist_quantiles", "margin_histogram", "max_vio", "qb_margins",
           "reduce_stats", "update_balance", "update_bias", "zero_stats"]
