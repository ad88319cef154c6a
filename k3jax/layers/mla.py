"""Multi-head latent attention (math §4): expanded training path and absorbed latent-cache decode.

Training runs through :func:`k3jax.ops.attention.causal_attention` (cuDNN's fused causal kernel on
Hopper GPUs), causal within each packed document. Decode
attends over the cached normalised latent ``c`` and the shared ``k_rope`` (kv_lora + rope = 576
values per token in K3) with ``W_kvb``'s key part folded into the query.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layers.cache_context import CacheContext
from k3jax.layers.norms import RMSNorm
from k3jax.layers.param import normal
from k3jax.layers.rope import apply_rope, segment_positions
from k3jax.ops.attention import attention_mask, causal_attention, masked_attention


class MLACache(NamedTuple):
    """Latent KV cache of one MLA layer, preallocated to ``max_len``."""

    c: jax.Array  # [B, S, kv_lora] normalised latent
    k_rope: jax.Array  # [B, S, rope]
    length: jax.Array  # [] int32, tokens written so far


def _write(buffer: jax.Array, new: jax.Array, at) -> jax.Array:
    """``new [B, T, .]`` written into ``buffer [B, S, .]`` at positions ``[at, at + T)``."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, new.astype(buffer.dtype), at, 1)


class MLALayer(nn.Module):
    """MLA token mixer. ``__call__``: ``x [B, T, d] -> [B, T, d]``."""

    cfg: ModelConfig

    def setup(self):
        c, m = self.cfg, self.cfg.mla
        pdt, std, h = jnp.dtype(c.param_dtype), c.init_std, m.num_heads
        if m.q_lora_rank is None:
            self.w_q = self.param("w_q", normal(std, ("embed", "heads")),
                                  (c.d_model, h * m.qk_head_dim), pdt)
        else:
            self.w_qa = self.param("w_qa", normal(std, ("embed", "q_lora")),
                                   (c.d_model, m.q_lora_rank), pdt)
            self.q_norm = RMSNorm(m.latent_norm_eps, c.dtype, c.param_dtype)
            self.w_qb = self.param("w_qb", normal(std, ("q_lora", "heads")),
                                   (m.q_lora_rank, h * m.qk_head_dim), pdt)
        self.w_kva = self.param("w_kva", normal(std, ("embed", "kv_lora")),
                                (c.d_model, m.kv_lora_rank + m.qk_rope_head_dim), pdt)
        self.kv_norm = RMSNorm(m.latent_norm_eps, c.dtype, c.param_dtype)
        # Stored per head as [k_nope | v] so the key and value parts split cleanly for absorption.
        self.w_kvb = self.param("w_kvb", normal(std, ("kv_lora", "heads", "kv")),
                                (m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim), pdt)
        if m.output_gate:
            self.w_gate = self.param("w_gate", normal(std, ("embed", "heads")),
                                     (c.d_model, h * m.v_head_dim), pdt)
        self.w_o = self.param("w_o", normal(std, ("heads", "embed")),
                              (h * m.v_head_dim, c.d_model), pdt)

    # -- shared pieces --------------------------------------------------------------------------
    def _cast(self, w):
        return w.astype(jnp.dtype(self.cfg.dtype))

    def _query(self, x, positions):
        """``q_nope [..., H, nope]``, ``q_rope [..., H, rope]`` from ``x [B, T, d]``."""
        m = self.cfg.mla
        if m.q_lora_rank is None:
            q = x @ self._cast(self.w_q)
        else:
            q = self.q_norm(x @ self._cast(self.w_qa)) @ self._cast(self.w_qb)
        q = q.reshape(*q.shape[:-1], m.num_heads, m.qk_head_dim)
        q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        if m.rope:
            q_rope = apply_rope(q_rope, positions, m.rope_theta)
        return q_nope, q_rope

    def _latent(self, x, positions):
        """Normalised latent ``c [B, T, kv_lora]`` and shared ``k_rope [B, T, rope]``."""
        m = self.cfg.mla
        kv = x @ self._cast(self.w_kva)
        c, k_rope = self.kv_norm(kv[..., :m.kv_lora_rank]), kv[..., m.kv_lora_rank:]
        if m.rope:
            k_rope = apply_rope(k_rope, positions, m.rope_theta)
        return c, k_rope

    def _output(self, x, o):
        """Optional sigmoid gate per head, then ``W_o``. ``o [B, T, H, v]``."""
        m = self.cfg.mla
        o = o.reshape(*o.shape[:-2], m.num_heads * m.v_head_dim)
        if m.output_gate:
            o = (o.astype(jnp.float32) * jax.nn.sigmoid(
                (x @ self._cast(self.w_gate)).astype(jnp.float32))).astype(o.dtype)
        return o @ self._cast(self.w_o)

    @property
    def scale(self) -> float:
        return self.cfg.mla.qk_head_dim ** -0.5

    # -- expanded training path -------------------------------------------------------------------
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        x, q_nope, q_rope, c, k_rope = self._whole_sequence(x, segment_ids)
        q, k, v = self._expanded(q_nope, q_rope, c, k_rope)
        return self._output(x, causal_attention(q, k, v, segment_ids, self.scale,
                                                self.cfg.mla.documents))

    def _whole_sequence(self, x, segment_ids):
        """``x [B, T, d]`` in the compute dtype, with its queries and latent at the positions of
        ``segment_ids``: ``(x, q_nope, q_rope, c, k_rope)``."""
        x = x.astype(jnp.dtype(self.cfg.dtype))
        b, t, _ = x.shape
        pos = segment_positions(segment_ids, b, t)
        return (x, *self._query(x, pos), *self._latent(x, pos))

    def _expanded(self, q_nope, q_rope, c, k_rope):
        """Queries, and keys and values expanded from the latent through ``W_kvb``:
        ``q_* [B, Tq, H, .]``, ``c [B, S, L]``, ``k_rope [B, S, R]`` ->
        ``(q, k [., H, nope + rope], v [B, S, H, v])`` in the compute dtype."""
        m = self.cfg.mla
        kv = jnp.einsum("btl,lhe->bthe", c, self._cast(self.w_kvb))
        k_nope, v = kv[..., :m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
        q = jnp.concatenate([q_nope, q_rope], -1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3]
                                                      + k_rope.shape[-1:])], -1)
        return q, k, v

    def _expanded_attend(self, q_nope, q_rope, c, k_rope, mask):
        """Attention over the expanded keys and values under ``mask [B, 1, Tq, S]`` (several new
        tokens over a cache): ``o [B, Tq, H, v]`` in the compute dtype."""
        return masked_attention(*self._expanded(q_nope, q_rope, c, k_rope), mask, self.scale)

    # -- absorbed path over the latent cache ------------------------------------------------------
    def _absorbed_attend(self, q_nope, q_rope, c, k_rope, mask):
        """Scores over the latent: ``q_nope`` absorbed through ``W_kvb``'s key part.

        ``q_* [B, Tq, H, .]``, ``c [B, S, L]``, ``k_rope [B, S, R]``, ``mask [B, 1, Tq, S]``.
        Returns ``o [B, Tq, H, v]`` in fp32.
        """
        m = self.cfg.mla
        w_kvb = self.w_kvb.astype(jnp.float32)
        w_k, w_v = w_kvb[..., :m.qk_nope_head_dim], w_kvb[..., m.qk_nope_head_dim:]
        q_lat = jnp.einsum("bqhn,lhn->bqhl", q_nope.astype(jnp.float32), w_k)
        s = (jnp.einsum("bqhl,bsl->bhqs", q_lat, c.astype(jnp.float32))
             + jnp.einsum("bqhr,bsr->bhqs", q_rope.astype(jnp.float32), k_rope.astype(jnp.float32)))
        s = jnp.where(mask, s * self.scale, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        ctx = jnp.einsum("bhqs,bsl->bqhl", p, c.astype(jnp.float32))
        return jnp.einsum("bqhl,lhv->bqhv", ctx, w_v)

    def absorbed(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """The whole sequence through the absorbed form (must equal ``__call__``)."""
        x, q_nope, q_rope, c, k_rope = self._whole_sequence(x, segment_ids)
        b, t, _ = x.shape
        o = self._absorbed_attend(q_nope, q_rope, c, k_rope, attention_mask(segment_ids, b, t))
        return self._output(x, o.astype(x.dtype))

    def cached(self, x: jax.Array, cache: MLACache, context: CacheContext):
        """``x [B, T, d]`` -> ``(y [B, T, d], cache)``: writes the new ``[c | k_rope]`` at
        ``cache.length``, then attends over the cache under ``context.mask``: the expanded form
        for several tokens (prefill), the absorbed form for one (decode)."""
        x = x.astype(jnp.dtype(self.cfg.dtype))
        q_nope, q_rope = self._query(x, context.positions)
        c_new, kr_new = self._latent(x, context.positions)
        c, kr = _write(cache.c, c_new, cache.length), _write(cache.k_rope, kr_new, cache.length)
        attend = self._absorbed_attend if x.shape[1] == 1 else self._expanded_attend
        o = attend(q_nope, q_rope, c, kr, context.mask)
        return self._output(x, o.astype(x.dtype)), MLACache(c, kr, cache.length + x.shape[1])

    @staticmethod
    def empty_cache(cfg: ModelConfig, batch: int, max_len: int) -> MLACache:
        """A cache of no tokens with room for ``max_len``: latents ``c [batch, max_len, L]`` and
        rotary keys ``[batch, max_len, R]``, length 0."""
        m, dt = cfg.mla, jnp.dtype(cfg.dtype)
        return MLACache(jnp.zeros((batch, max_len, m.kv_lora_rank), dt),
                        jnp.zeros((batch, max_len, m.qk_rope_head_dim), dt),
                        jnp.zeros((), jnp.int32))
