"""Attention Residuals as the model's residual rule (math §5), behind the seam of ``residual.py``.

State: ``AttnResState(blocks, partial)``. ``blocks`` is a Python tuple of the completed blocks (each
``[B, T, d]``, the embedding first); ``partial [B, T, d]`` is the running sum of the current block's
sub-layer outputs, ``None`` right after a commit. math §5's bookkeeping, with the commit of a block
done as soon as its last sub-layer has written (equivalent to math §5's commit at the next read,
since a block's first sub-layer reads the just-closed block as a source either way)::

    initial:  blocks = (embedding,); partial = None              # "j = 0 commits the embedding"
    read(j):  h = mix(blocks + (partial,), w_j)                   # no partial at a block start
    write(j): partial = out if partial is None else partial + out
              if (j + 1) % S == 0: blocks += (partial,); partial = None            # commit
    final:    h = mix(blocks + (partial,), w_out)

Every boundary tensor enters the softmax once: the partial sum is a source until it is committed,
then a block. The bookkeeping is pure (a tuple append), so rematerialisation never redoes it.

Scanned stacks. A commit changes the tuple's length, so it never happens inside a scan: the stack
(``k3jax/model.py``, plans in ``k3jax/stack.py``) runs block by block and only scans layers within
one block. A scan carries just ``partial`` (zeros at a block start); the tuple enters the scan as a
broadcast, loop-invariant input (:func:`split_state` / :func:`join_state`). With a traced ``j`` the
read masks the partial sum where ``j % S == 0`` and the write does not commit; the stack calls
:func:`settle` after the scan to commit the block the scan completed.

Gradients. Each read hands its sources on (:meth:`AttnResidual.read` returns the state with the
read's copies) and the next read reads those, so on the GPU kernels' path a read's backward adds
its gradient of a source to the one the later reads gave, in the pass that writes it. Inside a
scan the completed blocks are loop-invariant: the copies reach only the same layer's second read,
and autodiff sums the rest.

Memory. Each block array is created once; every later read refers to the same array, and
:func:`~k3jax.ops.attnres.depth_mix`'s custom VJP saves only its inputs and ``[n, B, T]``
statistics, so the backward pass keeps each block once (loop-invariant scan inputs are saved once,
not per iteration) plus, per sub-layer, what a plain residual keeps (its input ``h`` and the carry
``partial``): AttnRes adds ``O(L_sub + N)`` arrays of ``[B, T, d]``, never ``O(L_sub * N)``
(measured in tests/test_attnres.py and benchmarks/attnres.py).

Diagnostics (only when the ``diagnostics`` collection is mutable): each sub-layer's rule sows
``depth_weights [N + 1]`` (``N = ceil(L_sub / S)``), its depth-attention weights averaged over
tokens, slot ``i`` = block ``i`` (0: the embedding; ``i >= 1``: the ``i``-th block's sum of
sub-layer outputs, completed or the current partial sum), zero for blocks that do not exist yet; the
final read sows those of the final aggregation and ``block_rms [N + 1]``, the RMS of each of its
sources.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layers.param import ones, zeros
from k3jax.ops.attnres import depth_mix, depth_mix_norm


class AttnResState(NamedTuple):
    blocks: tuple[jax.Array, ...]  # completed blocks, each [B, T, d]; blocks[0] is the embedding
    partial: jax.Array | None      # [B, T, d] running sum of the current block; None after a commit


def num_block_slots(cfg: ModelConfig) -> int:
    """``N = ceil(L_sub / S)``: the final read has ``N + 1`` sources (embedding + ``N`` blocks)."""
    return -(-cfg.num_sublayers // block_size(cfg))


def block_size(cfg: ModelConfig) -> int:
    """The block size ``S`` in sub-layers."""
    s = cfg.residual.block_sublayers
    if cfg.residual.kind != "attnres" or s is None:
        raise ValueError(f"AttnRes needs residual.kind='attnres' with a block size; got "
                         f"{cfg.residual}")
    return s


def initial_state(cfg: ModelConfig, embedding: jax.Array) -> AttnResState:
    """The state before sub-layer 0: the embedding is committed as block 0, no partial sum."""
    block_size(cfg)
    return AttnResState((embedding,), None)


def settle(cfg: ModelConfig, state: AttnResState, next_j: int) -> AttnResState:
    """Commit the partial sum if sub-layer ``next_j`` (static) starts a block; else unchanged.

    Idempotent: after a commit the partial sum is ``None``.
    """
    if next_j % block_size(cfg) == 0 and state.partial is not None:
        return AttnResState(state.blocks + (state.partial,), None)
    return state


def split_state(state: AttnResState) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """``(carry, invariant)`` for a scan inside one block: the partial sum (zeros at a block start,
    masked by the traced reads) is carried; the completed blocks are loop-invariant."""
    partial = jnp.zeros_like(state.blocks[-1]) if state.partial is None else state.partial
    return partial, state.blocks


def join_state(carry: jax.Array, invariant: tuple[jax.Array, ...]) -> AttnResState:
    """The inverse of :func:`split_state`: the partial sum ``carry [B, T, d]`` and the completed
    blocks ``invariant`` (each ``[B, T, d]``) as one state."""
    return AttnResState(invariant, carry)


class _DepthMix(nn.Module):
    """Owns one aggregation's parameters: pseudo-query (zero-init) and key-norm weight
    (one-init)."""

    cfg: ModelConfig

    def setup(self):
        d, pdt = self.cfg.d_model, jnp.dtype(self.cfg.param_dtype)
        self.query = self.param("query", zeros(("embed",)), (d,), pdt)
        self.key_norm = self.param("key_norm", ones(("norm",)), (d,), pdt)

    def mix(self, state: AttnResState, partial_valid=True) -> jax.Array:
        """The read alone, ``h [B, T, d]``, of ``state``'s sources (what the released model's
        formula gives, checked against it on imported weights)."""
        return depth_mix(state.blocks, state.partial, self.query, self.key_norm, self.cfg.rms_eps,
                         partial_valid)[0]

    def normed(self, state: AttnResState, norm: nn.Module,
               partial_valid=True) -> tuple[jax.Array, AttnResState]:
        """``(norm(mix(state)), state)`` in one op (:func:`~k3jax.ops.attnres.depth_mix_norm`),
        the state's arrays as the op hands them on: later reads of them take their gradients
        into the read's backward pass."""
        x, weights, sources = depth_mix_norm(state.blocks, state.partial, self.query,
                                             self.key_norm, norm.weight(self.cfg.d_model),
                                             self.cfg.rms_eps, norm.eps, partial_valid)
        if _diagnosing(self):
            _sow(self, "depth_weights", jnp.pad(weights, (0, num_block_slots(self.cfg) + 1
                                                         - weights.shape[0])))
        blocks = sources[:len(state.blocks)]
        partial = None if state.partial is None else sources[-1]
        return x.astype(jnp.dtype(norm.dtype)), AttnResState(blocks, partial)


class AttnResidual(_DepthMix):
    """The rule of one sub-layer ``j``: ``read`` mixes the sources and applies the sub-layer's
    pre-norm, ``write`` does the bookkeeping.

    ``j`` is a Python int for unrolled layers (all bookkeeping static) or a traced int inside a
    scan, which must not cross a block boundary (the stack settles the state after it).
    """

    def read(self, state: AttnResState, j, norm: nn.Module) -> tuple[jax.Array, AttnResState]:
        if state.partial is None or isinstance(j, int):
            return self.normed(state, norm)
        return self.normed(state, norm, partial_valid=j % block_size(self.cfg) != 0)

    def write(self, state: AttnResState, out: jax.Array, j) -> AttnResState:
        blocks, partial = state
        if partial is None:
            return settle(self.cfg, AttnResState(blocks, out.astype(blocks[-1].dtype)), j + 1)
        out = out.astype(partial.dtype)
        if isinstance(j, int):
            return settle(self.cfg, AttnResState(blocks, partial + out), j + 1)
        return AttnResState(blocks, jnp.where(j % block_size(self.cfg) == 0, out, partial + out))

    def __call__(self, state, j, norm):  # lets linen initialise a rule used only via methods
        return self.read(state, j, norm)[0]


class AttnResFinalRead(_DepthMix):
    """The final aggregation (all completed blocks and the last partial sum) and the final
    norm."""

    def __call__(self, state: AttnResState, norm: nn.Module) -> jax.Array:
        """``norm`` of the read over every source of ``state``: ``[B, T, d]``."""
        if _diagnosing(self):
            sources = state.blocks + (() if state.partial is None else (state.partial,))
            _sow(self, "block_rms", jnp.stack([jnp.sqrt(jnp.mean(jnp.square(v.astype(jnp.float32))))
                                               for v in sources]))
        return self.normed(state, norm)[0]


def _diagnosing(module: nn.Module) -> bool:
    # Not at init: the initial variables should hold parameters, not one forward's statistics.
    return module.is_mutable_collection("diagnostics") and not module.is_initializing()


def _sow(module: nn.Module, name: str, value: jax.Array) -> None:
    """Store ``value`` as a plain array (each rule is called once per forward, nothing to
    reduce)."""
    module.sow("diagnostics", name, jax.lax.stop_gradient(value),
               reduce_fn=lambda _, x: x, init_fn=lambda: None)


__all__ = ["AttnResFinalRead", "AttnResState", "AttnResidual", "block_size", "initial_state",
           "join_state", "num_block_slots", "settle", "split_state"]
