"""Residual rules: how a sub-layer reads the residual stream and writes its output back (§2, 5).

A rule is a small linen module per sub-layer with two methods, so the decoder layer never changes
when the rule does:

* ``read(state, j, norm) -> (x, state)``: the input of sub-layer ``j``, its pre-norm ``norm``
  (an :class:`~k3jax.layers.norms.RMSNorm`) applied to what it reads (a rule may fuse the two),
  and the state to go on with (AttnRes hands its sources on through the read, whose backward
  then sums their gradients; plain: the same state);
* ``write(state, out, j) -> state``: fold the sub-layer's output into the state.

``initial_state(cfg, embedding)`` starts the state and ``FinalRead(state, norm)`` produces the
final norm's output. ``j`` is the global sub-layer index (mixer of layer ``i`` is ``2i``, its FFN
``2i + 1``); it may be a traced integer when the stack is scanned.

Scans: ``split_state(cfg, state) -> (carry, invariant)`` separates what a scanned layer group
changes (carried) from what it only reads (broadcast into the scan, kept once for the backward
pass); ``join_state`` puts them back together and ``settle(cfg, state, next_j)`` finishes the
bookkeeping a traced ``j`` could not do, before sub-layer ``next_j`` (plain: nothing to do).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from k3jax.config import ModelConfig


class PlainResidual(nn.Module):
    """Pre-norm residual: the state is the stream ``x [B, T, d]``; ``x <- x + out``."""

    cfg: ModelConfig

    def read(self, state: jax.Array, j, norm: nn.Module) -> tuple[jax.Array, jax.Array]:
        return norm(state), state

    def write(self, state: jax.Array, out: jax.Array, j) -> jax.Array:
        return state + out.astype(state.dtype)

    def __call__(self, state, j, norm):  # lets linen initialise a rule used only via methods
        return self.read(state, j, norm)[0]


class PlainFinalRead(nn.Module):
    cfg: ModelConfig

    def __call__(self, state: jax.Array, norm: nn.Module) -> jax.Array:
        return norm(state)


def _attnres():
    from k3jax.layers import attnres  # imported lazily: the AttnRes rule lives in its own module
    return attnres


def make_residual(cfg: ModelConfig, name: str) -> nn.Module:
    if cfg.residual.kind == "attnres":
        return _attnres().AttnResidual(cfg, name=name)
    return PlainResidual(cfg, name=name)


def make_final_read(cfg: ModelConfig, name: str = "final_residual") -> nn.Module:
    if cfg.residual.kind == "attnres":
        return _attnres().AttnResFinalRead(cfg, name=name)
    return PlainFinalRead(cfg, name=name)


def initial_state(cfg: ModelConfig, embedding: jax.Array) -> Any:
    if cfg.residual.kind == "attnres":
        return _attnres().initial_state(cfg, embedding)
    return embedding


def split_state(cfg: ModelConfig, state: Any) -> tuple[Any, Any]:
    if cfg.residual.kind == "attnres":
        return _attnres().split_state(state)
    return state, None


def join_state(cfg: ModelConfig, carry: Any, invariant: Any) -> Any:
    if cfg.residual.kind == "attnres":
        return _attnres().join_state(carry, invariant)
    return carry


def settle(cfg: ModelConfig, state: Any, next_j: int) -> Any:
    if cfg.residual.kind == "attnres":
        return _attnres().settle(cfg, state, next_j)
    return state
