"""The Kimi Delta Attention layer (§3.1): projections, short convs, gate, beta, core op, output.

The core recurrence lives in :mod:`k3jax.ops.kda`; this module only builds its inputs and applies
the gated head-wise norm and output projection. Shapes follow the FLA layout ``[B, T, H, D]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layers.cache_context import CacheContext
from k3jax.layers.norms import GatedHeadRMSNorm
from k3jax.layers.param import normal, param_init
from k3jax.ops.fp32_projection import fp32_product, fp32_projection
from k3jax.ops.kda import kda, kda_decode
from k3jax.ops.kda_gate import kda_gate
from k3jax.ops.short_conv import conv_silu_projections, conv_silu_step


class KDACache(NamedTuple):
    """Decode state of one KDA layer: the three conv states and the fp32 recurrent state."""

    conv_q: jax.Array  # [B, W-1, H*K]
    conv_k: jax.Array  # [B, W-1, H*K]
    conv_v: jax.Array  # [B, W-1, H*V]
    state: jax.Array  # [B, H, K, V] fp32


def _a_log_init(gate: str):
    """Softplus form: ``A_log = log U(1, 16)``; lower-bound form: ``A_log = 0`` (math §3.1 step
    4)."""
    def init(key, shape, dtype=jnp.float32):
        if gate == "softplus":
            return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
        return jnp.zeros(shape, dtype)
    return init


def _dt_bias_init(key, shape, dtype=jnp.float32):
    """``inverse_softplus(dt)`` with ``dt`` log-uniform in ``[1e-3, 1e-1]``, clamped at 1e-4."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
    dt = jnp.maximum(dt, 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KDALayer(nn.Module):
    """KDA token mixer. ``__call__``: ``x [B, T, d] -> [B, T, d]`` (optionally with a cache)."""

    cfg: ModelConfig

    def setup(self):
        c, k = self.cfg, self.cfg.kda
        d, hk, hv = c.d_model, k.num_heads * k.head_dim, k.num_heads * k.head_dim
        pdt, std = jnp.dtype(c.param_dtype), c.init_std
        self.w_q = self.param("w_q", normal(std, ("embed", "heads")), (d, hk), pdt)
        self.w_k = self.param("w_k", normal(std, ("embed", "heads")), (d, hk), pdt)
        self.w_v = self.param("w_v", normal(std, ("embed", "heads")), (d, hv), pdt)
        conv_init = normal(1.0 / math.sqrt(k.conv_size), ("conv", "heads"))
        self.conv_q = self.param("conv_q", conv_init, (k.conv_size, hk), pdt)
        self.conv_k = self.param("conv_k", conv_init, (k.conv_size, hk), pdt)
        self.conv_v = self.param("conv_v", conv_init, (k.conv_size, hv), pdt)
        self.w_fa = self.param("w_fa", normal(std, ("embed", "rank")), (d, k.gate_rank), pdt)
        self.w_fb = self.param("w_fb", normal(std, ("rank", "heads")), (k.gate_rank, hk), pdt)
        self.dt_bias = self.param("dt_bias", param_init(_dt_bias_init, ("heads",)), (hk,),
                                  jnp.float32)
        self.A_log = self.param("A_log", param_init(_a_log_init(k.gate), ("norm",)),
                                (k.num_heads,), jnp.float32)
        self.w_beta = self.param("w_beta", normal(std, ("embed", "norm")), (d, k.num_heads), pdt)
        if k.output_gate == "full":
            self.w_g = self.param("w_g", normal(std, ("embed", "heads")), (d, hv), pdt)
        else:
            self.w_ga = self.param("w_ga", normal(std, ("embed", "rank")),
                                   (d, k.output_gate_rank), pdt)
            self.w_gb = self.param("w_gb", normal(std, ("rank", "heads")),
                                   (k.output_gate_rank, hv), pdt)
        self.out_norm = GatedHeadRMSNorm(c.rms_eps, c.dtype, c.param_dtype)
        self.w_o = self.param("w_o", normal(std, ("heads", "embed")), (hv, d), pdt)

    # -- pieces shared by the sequence and the decode paths -----------------------------------
    def _cast(self, w):
        return w.astype(jnp.dtype(self.cfg.dtype))

    def _heads(self, x):
        return x.reshape(*x.shape[:-1], self.cfg.kda.num_heads, self.cfg.kda.head_dim)

    @property
    def _gate_bound(self) -> float | None:
        """The KDA op's ``gate_lower_bound``: K3's bound for the lower-bound form, else None."""
        k = self.cfg.kda
        return k.lower_bound if k.gate == "lower_bound" else None

    def _gates(self, x):
        """``(gate [..., H, K], bias [H, K] or None, beta [..., H])`` fp32 from ``x [..., d]``: the
        gate is the log-decay ``g`` (softplus form) or, under :attr:`_gate_bound`, the logits
        ``z = exp(A_log) f`` less their bias ``exp(A_log) dt_bias``, which the KDA op adds and
        turns into ``g`` where it reads them (``exp(A_log)`` scales the up-projection's
        columns, so the product writes the logits itself)."""
        k, f32 = self.cfg.kda, jnp.float32
        # x's two fp32 projections side by side: one pass over x.
        both = fp32_projection(x, jnp.concatenate([self.w_fa, self.w_beta], axis=1))
        low, w_up, bias = both[..., :k.gate_rank], self.w_fb.astype(f32), self.dt_bias
        beta = jax.nn.sigmoid(both[..., k.gate_rank:])
        beta = 2.0 * beta if k.allow_neg_eigval else beta
        if self._gate_bound is None:
            f = fp32_product(low, w_up) + bias
            return kda_gate(self._heads(f), self.A_log, k.gate, k.lower_bound), None, beta
        a = jnp.repeat(jnp.exp(self.A_log.astype(f32)), k.head_dim)  # [H K]
        return self._heads(fp32_product(low, w_up * a)), self._heads(bias * a), beta

    def _output(self, x, o):
        """``W_o(RMSNorm_head(o) * w * sigmoid(G))`` for ``o [..., H, V]``."""
        if self.cfg.kda.output_gate == "full":
            gate = x @ self._cast(self.w_g)
        else:
            gate = (x @ self._cast(self.w_ga)) @ self._cast(self.w_gb)
        y = self.out_norm(o, self._heads(gate))
        return y.reshape(*y.shape[:-2], -1) @ self._cast(self.w_o)

    # -- sequence path (training, prefill) ---------------------------------------------------
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 cache: KDACache | None = None, return_cache: bool = False):
        """``x [B, T, d]``, ``segment_ids [B, T]`` -> ``y [B, T, d]`` (and the new cache if
        asked)."""
        k = self.cfg.kda
        x = x.astype(jnp.dtype(self.cfg.dtype))
        # q, k and v as one [B, T, 3, H K] product: its input's gradient is then one product too.
        qkv = jnp.einsum("...d,dpc->...pc", x,
                         self._cast(jnp.stack([self.w_q, self.w_k, self.w_v], axis=1)))
        states = None if cache is None else (cache.conv_q, cache.conv_k, cache.conv_v)
        (q, kk, v), (cq, ck, cv) = conv_silu_projections(
            qkv, (self.conv_q, self.conv_k, self.conv_v), segment_ids, states, k.impl,
            (k.head_dim, k.head_dim, None))  # q and k come L2-normalised per head
        gate, gate_bias, beta = self._gates(x)
        o, final = kda(self._heads(q), self._heads(kk), self._heads(v), gate, beta,
                       initial_state=None if cache is None else cache.state,
                       output_final_state=return_cache, segment_ids=segment_ids,
                       chunk_size=k.chunk_size, impl=k.impl, gate_lower_bound=self._gate_bound,
                       gate_bias=gate_bias)
        out = self._output(x, o.astype(x.dtype))
        return (out, KDACache(cq, ck, cv, final)) if return_cache else out

    # -- one-token decode ----------------------------------------------------------------------
    def decode_step(self, x: jax.Array, cache: KDACache):
        """``x [B, d]`` and the cache -> ``(y [B, d], new cache)``; the recurrence step of math
        §3.4."""
        x = x.astype(jnp.dtype(self.cfg.dtype))
        head_dim = self.cfg.kda.head_dim
        q, cq = conv_silu_step(x @ self._cast(self.w_q), self.conv_q, cache.conv_q, head_dim)
        kk, ck = conv_silu_step(x @ self._cast(self.w_k), self.conv_k, cache.conv_k, head_dim)
        v, cv = conv_silu_step(x @ self._cast(self.w_v), self.conv_v, cache.conv_v)
        gate, gate_bias, beta = self._gates(x)
        o, state = kda_decode(self._heads(q), self._heads(kk), self._heads(v), gate, beta,
                              cache.state, gate_lower_bound=self._gate_bound,
                              gate_bias=gate_bias)
        return self._output(x, o.astype(x.dtype)), KDACache(cq, ck, cv, state)

    # -- extending a cache (prefill chunks, decode steps) --------------------------------------
    def cached(self, x: jax.Array, cache: KDACache, context: CacheContext):
        """``x [B, T, d]`` after the tokens ``cache`` has seen -> ``(y [B, T, d], new cache)``.

        Several tokens go through the chunked op with the cache as initial state; one token is a
        decode step (the recurrence step, math §3.4). State of another segment is dropped first.
        """
        keep = context.conv_keep[..., None]
        cache = KDACache(*(jnp.where(keep, s, 0).astype(s.dtype) for s in cache[:3]),
                         jnp.where(context.state_keep[:, None, None, None], cache.state, 0.0))
        if x.shape[1] == 1:
            y, cache = self.decode_step(x[:, 0], cache)
            return y[:, None], cache
        return self(x, context.segment_ids, cache, return_cache=True)

    @staticmethod
    def empty_cache(cfg: ModelConfig, batch: int) -> KDACache:
        """A cache of no tokens for ``batch`` rows: zero convolution states ``[batch, W - 1,
        H K]`` for q, k and v and a zero recurrent state ``[batch, H, K, K]``."""
        k = cfg.kda
        hk = k.num_heads * k.head_dim
        conv = jnp.zeros((batch, k.conv_size - 1, hk), jnp.dtype(cfg.dtype))
        return KDACache(conv, conv, conv,
                        jnp.zeros((batch, k.num_heads, k.head_dim, k.head_dim), jnp.float32))
