"""The model-level inference cache: a plain pytree of per-layer caches plus shared bookkeeping.

``init_cache(cfg, batch, max_len)`` returns an :class:`InferenceCache`:

* ``layers``: one cache per layer, keyed like the parameters: ``layer_i`` for an unrolled layer,
  ``{group name: {layer_k: cache stacked on axis 0}}`` for a scanned group. A KDA layer holds
  :class:`~k3jax.layers.kda.KDACache` (three conv states ``[B, W-1, H*D]`` and the fp32 state
  ``[B, H, K, V]``), an MLA layer :class:`~k3jax.layers.mla.MLACache` (the normalised latent
  ``[B, S, kv_lora]`` and the shared ``k_rope [B, S, rope]``: ``kv_lora + rope`` values per token,
  576 for K3). The AttnRes residual and the MoE keep nothing across time.
* ``last_segment [B]``: the segment id of each row's last written token (``-1`` before any);
  ``positions [B]``: the position, within its segment, of each row's next token if it continues
  the row's last segment; ``length``: tokens written so far, one count for the batch;
  ``max_len``: the positions the cache has room for (static).

Rows of one batch share ``length``: prompts of different lengths are left-padded
(:func:`left_pad`), so every row's last prompt token sits at the same position and each decode
step writes one position for all rows. Right-padding would leave the recurrent KDA state of a short
row after its padding, and a recurrent state cannot be rewound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from k3jax.config import ModelConfig
from k3jax.layers.cache_context import CacheContext
from k3jax.layers.kda import KDACache, KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.layers.rope import segment_positions
from k3jax.ops.documents import document_index
from k3jax.stack import plan_segments

PAD_SEGMENT = 0  # segment id of left padding; prompt tokens get 1 (see left_pad)


@struct.dataclass
class InferenceCache:
    layers: dict
    last_segment: jax.Array  # [B] int32
    positions: jax.Array  # [B] int32
    length: np.int32  # tokens written; kept on the host (steps.py says why)
    max_len: int = struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return self.last_segment.shape[0]


def _layer_cache(cfg: ModelConfig, mixer: str, batch: int, max_len: int):
    if mixer == "kda":
        # empty_cache shares one zeros array between the conv states; the steps donate the cache
        return KDACache(*(jnp.copy(a) for a in KDALayer.empty_cache(cfg, batch)))
    return MLALayer.empty_cache(cfg, batch, max_len)


def _stacked(tree, n: int):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), tree)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> InferenceCache:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens (prompt and generated)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch={batch} and max_len={max_len} must both be >= 1")
    layers: dict = {}
    for plan in plan_segments(cfg):
        for i in (*plan.prefix, *plan.suffix):
            layers[f"layer_{i}"] = _layer_cache(cfg, plan.specs[i][0], batch, max_len)
        if plan.repeats:
            layers[plan.name] = {f"layer_{k}": _stacked(_layer_cache(cfg, mixer, batch, max_len),
                                                        plan.repeats)
                                 for k, (mixer, _) in enumerate(plan.group)}
    return InferenceCache(layers, jnp.full((batch,), -1, jnp.int32),
                          jnp.zeros((batch,), jnp.int32), np.int32(0), max_len)


def left_pad(prompts: list[list[int]] | list[np.ndarray], pad_id: int = 0
             ) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of different lengths as ``tokens [B, T]`` and ``segment_ids [B, T]`` (int32), padded
    on the left: padding is segment :data:`PAD_SEGMENT`, every prompt segment 1."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("left_pad: prompts must be a non-empty list of non-empty token lists")
    t = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), t), pad_id, np.int32)
    segments = np.full((len(prompts), t), PAD_SEGMENT, np.int32)
    for row, p in enumerate(prompts):
        tokens[row, t - len(p):] = np.asarray(p, np.int32)
        segments[row, t - len(p):] = 1
    return tokens, segments


def cache_context(cfg: ModelConfig, cache: InferenceCache, segment_ids: jax.Array
                  ) -> tuple[CacheContext, InferenceCache]:
    """The :class:`CacheContext` for new tokens of ``segment_ids [B, T]`` after ``cache``, and the
    cache's bookkeeping advanced past them (the per-layer caches are the layers' to update)."""
    b, t = segment_ids.shape
    at = cache.length
    # positions restart at each segment start; the first run continues the cached segment
    first_run = document_index(segment_ids) == 0
    continues = first_run & (segment_ids[:, :1] == cache.last_segment[:, None])
    offset = jnp.where(continues, cache.positions[:, None], 0)
    positions = segment_positions(segment_ids, b, t) + offset
    s = cache.max_len
    # A document is a run of equal ids (math §2): each new token's document began ``positions``
    # tokens before it, so it attends to the cache from there on. Comparing ids instead would join
    # an id that comes back to its earlier run.
    query_at = at + jnp.arange(t)
    doc_start = query_at[None, :] - positions
    cols = jnp.arange(s)[None, None, None, :]
    mask = (cols >= doc_start[:, None, :, None]) & (cols <= query_at[None, None, :, None])
    width = cfg.kda.conv_size - 1
    back = at - width + jnp.arange(width)  # the conv state's positions, oldest first
    conv_keep = back[None, :] >= doc_start[:, :1]
    context = CacheContext(segment_ids.astype(jnp.int32), positions.astype(jnp.int32), mask,
                           conv_keep, continues[:, 0])
    advanced = cache.replace(last_segment=segment_ids[:, -1].astype(jnp.int32),
                             positions=positions[:, -1] + 1, length=at + t)
    return context, advanced


def cache_bytes(cache: InferenceCache) -> int:
    """Bytes held by the per-layer caches (the bookkeeping arrays not counted)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache.layers))


__all__ = ["PAD_SEGMENT", "InferenceCache", "cache_bytes", "cache_context", "init_cache",
           "left_pad"]
