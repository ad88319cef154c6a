"""Packed documents (math §2): a row of ``segment_ids [B, T]`` holds its documents as runs of
equal ids. A document starts wherever the id changes, so an id that comes back after another is
a new document: every mixer (KDA's state, the short convolutions, MLA's mask, the positions) reads
the ids this way."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """``[B, T]`` bool: True where a token starts a new document (never at ``t = 0``: the first
    token continues from whatever state precedes the row)."""
    first = jnp.zeros_like(segment_ids[:, :1], dtype=bool)
    return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def document_index(segment_ids: jax.Array) -> jax.Array:
    """``[B, T]`` int32: the document each token is in, counted from 0 in each row (tokens share
    a document exactly when their indices are equal)."""
    return jnp.cumsum(segment_starts(segment_ids), axis=1, dtype=jnp.int32)


__all__ = ["document_index", "segment_starts"]
