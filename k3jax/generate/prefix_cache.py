"""A prefix cache of hybrid-model states: resume a prompt from the deepest stored prefix.

A KDA layer's recurrent state cannot be cut back to an earlier token, so the store keeps
*snapshots*: the whole cache of one sequence at a token position. They are taken

* on a grid of positions every ``grid`` tokens, a multiple of the KDA chunk size (so a long prompt
  is resumable from the last grid point before it diverges from a stored one), and
* at the end of every prompt, so a prompt shorter than the grid, e.g. a shared system prompt, is
  reused too (a block-granular store would give it no hit).

Snapshots form a tree: each one holds the KDA states and conv states at its position, the last
token's logits, and only the MLA latents of its own span (from its parent's position to its own);
resuming concatenates the spans along the path from the root. A request resumes from the deepest
snapshot whose tokens are a prefix of it and recomputes only the rest, storing new snapshots on the
way. The store keeps the total bytes under ``budget_bytes`` by evicting least recently used
snapshots that no other snapshot builds on (a resumed path counts as used, end to end).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.accounting import kda_state_bytes, kv_cache_bytes_per_token
from k3jax.config import ModelConfig
from k3jax.generate.cache import InferenceCache, init_cache
from k3jax.generate.steps import DEFAULT_CHUNK, prefill
from k3jax.layers.kda import KDACache
from k3jax.layers.mla import MLACache


def _is_layer_cache(x) -> bool:
    return isinstance(x, (KDACache, MLACache))


def _span(layer, lo: int, hi: int):
    """A layer cache's part kept by a snapshot: KDA whole, MLA the latents of ``[lo, hi)``.
    Always fresh arrays: the steps donate the cache's buffers."""
    if isinstance(layer, KDACache):
        return jax.tree.map(jnp.copy, layer)
    seq = layer.c.ndim - 2  # 1, or 2 for a scanned group's stacked caches
    return MLACache(jax.lax.slice_in_dim(layer.c, lo, hi, axis=seq),
                    jax.lax.slice_in_dim(layer.k_rope, lo, hi, axis=seq), None)


def _nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


@dataclass(eq=False)
class Snapshot:
    tokens: np.ndarray  # [p] the whole prefix
    parent: Snapshot | None
    layers: dict  # per-layer caches; MLA entries hold only the span [parent.length, length)
    logits: jax.Array  # [vocab] fp32 of the last token
    nbytes: int
    last_used: int = 0
    children: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)


def snapshot_fixed_bytes(cfg: ModelConfig) -> int:
    """What every snapshot holds whatever its span: the KDA states (fp32), the conv states (the
    compute dtype) and the last token's logits (fp32)."""
    k = cfg.kda
    conv = 3 * (k.conv_size - 1) * k.num_heads * k.head_dim * jnp.dtype(cfg.dtype).itemsize
    return kda_state_bytes(cfg) + cfg.layer_types.count("kda") * conv + cfg.vocab_size * 4


def store_bytes_per_token(cfg: ModelConfig, prompt_len: int, grid: int) -> float:
    """Bytes per cached token of one prompt's snapshots: one per grid point before its end and one
    at its end, plus its MLA latents once."""
    snapshots = (prompt_len - 1) // grid + 1
    latents = kv_cache_bytes_per_token(cfg, jnp.dtype(cfg.dtype).itemsize)
    return (snapshots * snapshot_fixed_bytes(cfg) + prompt_len * latents) / prompt_len


def naive_bytes_per_token(cfg: ModelConfig) -> int:
    """A state snapshot at every token (resumable anywhere) plus the token's latents."""
    return snapshot_fixed_bytes(cfg) + kv_cache_bytes_per_token(cfg, jnp.dtype(cfg.dtype).itemsize)


class PrefixCache:
    """Snapshots of one model's caches (batch 1), on a ``grid`` and at prompt ends, within
    ``budget_bytes``; caches it hands out hold ``max_len`` tokens."""

    def __init__(self, cfg: ModelConfig, max_len: int, grid: int, budget_bytes: int):
        if grid < 1 or grid % cfg.kda.chunk_size:
            raise ValueError(f"PrefixCache: grid={grid} must be a positive multiple of the KDA "
                             f"chunk size {cfg.kda.chunk_size}")
        if budget_bytes < 0:
            raise ValueError(f"PrefixCache: budget_bytes={budget_bytes} must be >= 0")
        self.cfg, self.max_len, self.grid, self.budget = cfg, max_len, grid, budget_bytes
        self.snapshots: list[Snapshot] = []
        self._clock = itertools.count(1)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    def lookup(self, tokens: np.ndarray) -> Snapshot | None:
        """The deepest snapshot whose tokens are a prefix of ``tokens`` (or equal to them)."""
        best = None
        for s in self.snapshots:
            if (s.length <= len(tokens) and (best is None or s.length > best.length)
                    and np.array_equal(tokens[:s.length], s.tokens)):
                best = s
        return best

    def restore(self, snap: Snapshot) -> InferenceCache:
        """A fresh cache of ``max_len`` holding the state after ``snap.tokens``."""
        path = []
        node = snap
        while node is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        p = snap.length
        empty = init_cache(self.cfg, 1, self.max_len)

        def rebuild(layer, *spans):
            if isinstance(layer, KDACache):
                return jax.tree.map(jnp.copy, spans[-1])  # the cache handed out gets donated
            seq = layer.c.ndim - 2
            c = jnp.concatenate([s.c for s in spans], axis=seq)
            kr = jnp.concatenate([s.k_rope for s in spans], axis=seq)
            return MLACache(jax.lax.dynamic_update_slice_in_dim(layer.c, c, 0, seq),
                            jax.lax.dynamic_update_slice_in_dim(layer.k_rope, kr, 0, seq),
                            jnp.full_like(layer.length, p))

        layers = jax.tree.map(rebuild, empty.layers, *(n.layers for n in path),
                              is_leaf=_is_layer_cache)
        # the snapshot's tokens are one request's prompt, which self.prefill hands to prefill
        # without segment ids: one segment, numbered 1, that the restored cache continues
        return InferenceCache(layers, jnp.ones((1,), jnp.int32), jnp.full((1,), p, jnp.int32),
                              np.int32(p), self.max_len)

    def prefill(self, variables: dict, tokens, chunk: int = DEFAULT_CHUNK):
        """``tokens [T]`` of one request -> ``(last logits [1, vocab], cache, resumed_at)``; the
        deepest stored prefix is resumed and snapshots are stored at grid points and at ``T``."""
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError(f"PrefixCache.prefill: tokens must be a non-empty [T]; got "
                             f"{tokens.shape}")
        if len(tokens) > self.max_len:
            raise ValueError(f"PrefixCache.prefill: a prompt of {len(tokens)} tokens exceeds "
                             f"max_len={self.max_len}")
        node = self.lookup(tokens)
        self._touch(node)
        at = resumed_at = 0 if node is None else node.length
        cache = init_cache(self.cfg, 1, self.max_len) if node is None else self.restore(node)
        logits = None if node is None else node.logits[None]
        stops = [g for g in range(self.grid * (at // self.grid + 1), len(tokens), self.grid)]
        for stop in stops + ([len(tokens)] if at < len(tokens) else []):
            logits, cache = prefill(self.cfg, variables, tokens[None, at:stop], cache, chunk=chunk)
            node = self._insert(tokens[:stop], node, cache, logits[0])
            at = stop
        self._evict()
        return logits, cache, resumed_at

    def _insert(self, tokens, parent, cache: InferenceCache, logits) -> Snapshot:
        lo = 0 if parent is None else parent.length
        layers = jax.tree.map(lambda layer: _span(layer, lo, len(tokens)), cache.layers,
                              is_leaf=_is_layer_cache)
        snap = Snapshot(np.array(tokens), parent, layers, logits,
                        _nbytes(layers) + _nbytes(logits), next(self._clock))
        if parent is not None:
            parent.children += 1
        self.snapshots.append(snap)
        return snap

    def _touch(self, node: Snapshot | None) -> None:
        stamp = next(self._clock)
        while node is not None:
            node.last_used = stamp
            node = node.parent

    def _evict(self) -> None:
        while self.nbytes > self.budget:
            leaves = [s for s in self.snapshots if s.children == 0]
            victim = min(leaves, key=lambda s: s.last_used)
            self.snapshots.remove(victim)
            if victim.parent is not None:
                victim.parent.children -= 1


__all__ = ["PrefixCache", "Snapshot", "naive_bytes_per_token", "snapshot_fixed_bytes",
           "store_bytes_per_token"]
