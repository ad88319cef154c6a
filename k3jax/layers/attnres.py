"""Attention Residuals as the model's residual rule (SPEC 5), behind the seam of ``residual.py``.

State: ``AttnResState(blocks [N, B, T, d], partial [B, T, d])`` with ``N = ceil(L_sub / S)`` slots,
the number of blocks including the embedding (``L_sub`` sub-layers, block size ``S``). Sources for a
read are ``blocks[:count]`` and ``partial``, so at most ``N + 1``: the buffer grows with the number of
blocks, never with the number of sub-layers (except in Full AttnRes, where they coincide).

SPEC 5's bookkeeping, with ``count`` the number of blocks committed before sub-layer ``j`` reads::

    count(j) = ceil(j / S)                        # commits happen at j = 0, S, 2S, ...
    read(j):  h = mix(blocks[:count(j)] + [partial], w_j)        # j = 0: just the embedding
    write(j): if j % S == 0: blocks[j // S] = partial; partial = out     # j = 0 commits the embedding
              else:          partial = partial + out

``count`` is a function of ``j`` rather than carried, so a static ``j`` (unrolled layer) keeps all
bookkeeping static (Python branches, blocks change only at commits) while a traced ``j`` (``nn.scan``)
takes the same path through ``jnp.where`` and dynamic slot updates. The partial sum is a source of its
own and enters the buffer only when committed, so every boundary tensor enters the softmax once. The
bookkeeping is pure, so rematerialisation may recompute it without double counting.

Memory (measured, see benchmarks/attnres.py and the issue 3 report): a read's backward needs the
block buffer of that moment. Unrolled with static ``j``, reads between two commits share one buffer
value; under ``nn.scan`` (or remat, which traces ``j``) every write makes a new buffer value, so the
backward keeps about one ``[N, B, T, d]`` buffer per sub-layer: an ``O(L_sub * N * B * T * d)`` term,
``O(L^2 d / S)``. Removing it needs the stack to keep completed blocks out of the scan carry (scan
block by block with the buffer as a loop-invariant input); that is a change of the stack, not of
this rule.

Diagnostics (only when the ``diagnostics`` collection is mutable): each sub-layer's rule sows
``depth_weights [N + 1]``, its depth-attention weights averaged over tokens (slot ``i < N`` = block
``i``, block 0 the embedding; the last entry = the current partial sum; slots not yet committed are
0); the final read sows those of the final aggregation and ``block_rms [N + 1]``, the RMS of the
embedding, of every block's sum of sub-layer outputs and of the last block's (the final partial).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layers.param import ones, zeros
from k3jax.ops.attnres import depth_mix


class AttnResState(NamedTuple):
    blocks: jax.Array   # [N, B, T, d] completed blocks (slot 0: the embedding); later slots 0
    partial: jax.Array  # [B, T, d] running sum of the current block's sub-layer outputs


def num_block_slots(cfg: ModelConfig) -> int:
    """``N = ceil(L_sub / S)``: blocks committed over the whole stack, the embedding included."""
    s = _block(cfg)
    return -(-cfg.num_sublayers // s)


def _block(cfg: ModelConfig) -> int:
    s = cfg.residual.block_sublayers
    if cfg.residual.kind != "attnres" or s is None:
        raise ValueError(f"AttnRes needs residual.kind='attnres' with a block size; got "
                         f"{cfg.residual}")
    return s


def initial_state(cfg: ModelConfig, embedding: jax.Array) -> AttnResState:
    """The state before sub-layer 0: no committed block, the partial sum is the embedding."""
    blocks = jnp.zeros((num_block_slots(cfg),) + embedding.shape, embedding.dtype)
    return AttnResState(blocks, embedding)


class _DepthMix(nn.Module):
    """Owns one aggregation's parameters: pseudo-query (zero-init) and key-norm weight (one-init)."""

    cfg: ModelConfig

    def setup(self):
        d, pdt = self.cfg.d_model, jnp.dtype(self.cfg.param_dtype)
        self.query = self.param("query", zeros(("embed",)), (d,), pdt)
        self.key_norm = self.param("key_norm", ones(("norm",)), (d,), pdt)

    def mix(self, state: AttnResState, count) -> jax.Array:
        h, alpha = depth_mix(state.blocks, count, state.partial, self.query, self.key_norm,
                             self.cfg.rms_eps)
        if _diagnosing(self):
            _sow(self, "depth_weights", jnp.mean(alpha, axis=(1, 2)))
        return h


class AttnResidual(_DepthMix):
    """The rule of one sub-layer ``j``: ``read`` mixes the sources, ``write`` does the bookkeeping."""

    def read(self, state: AttnResState, j) -> jax.Array:
        return self.mix(state, _count(j, _block(self.cfg)))

    def write(self, state: AttnResState, out: jax.Array, j) -> AttnResState:
        s = _block(self.cfg)
        blocks, partial = state
        out = out.astype(partial.dtype)
        if isinstance(j, int):  # unrolled layer: static bookkeeping, blocks change only at commits
            if j % s == 0:
                return AttnResState(blocks.at[j // s].set(partial), out)
            return AttnResState(blocks, partial + out)
        commit = j % s == 0
        slot = jax.lax.dynamic_index_in_dim(blocks, j // s, keepdims=False)
        blocks = jax.lax.dynamic_update_index_in_dim(
            blocks, jnp.where(commit, partial, slot), j // s, axis=0)
        return AttnResState(blocks, jnp.where(commit, out, partial + out))

    def __call__(self, state, j):  # lets linen initialise a rule that is only used via methods
        return self.read(state, j)


class AttnResFinalRead(_DepthMix):
    """The final aggregation before the final norm: all ``N`` blocks and the last partial sum."""

    def __call__(self, state: AttnResState) -> jax.Array:
        if _diagnosing(self):
            sources = jnp.concatenate([state.blocks, state.partial[None]], axis=0).astype(jnp.float32)
            _sow(self, "block_rms", jnp.sqrt(jnp.mean(jnp.square(sources), axis=(1, 2, 3))))
        return self.mix(state, state.blocks.shape[0])


def _diagnosing(module: nn.Module) -> bool:
    # Not at init: the initial variables should hold parameters, not one forward's statistics.
    return module.is_mutable_collection("diagnostics") and not module.is_initializing()


def _sow(module: nn.Module, name: str, value: jax.Array) -> None:
    """Store ``value`` as a plain array (each rule is called once per forward, nothing to reduce)."""
    module.sow("diagnostics", name, jax.lax.stop_gradient(value),
               reduce_fn=lambda _, x: x, init_fn=lambda: None)


def _count(j, s: int):
    """Blocks committed before sub-layer ``j`` reads: ``ceil(j / S)`` (static if ``j`` is)."""
    return (j + s - 1) // s


__all__ = ["AttnResFinalRead", "AttnResState", "AttnResidual", "initial_state", "num_block_slots"]
