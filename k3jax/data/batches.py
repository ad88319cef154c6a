"""Packed training batches with segment ids, and bits-per-byte accounting.

A batch row is a window of ``seq_len + 1`` consecutive tokens of a split (documents back to back):
``tokens = w[:-1]``, ``targets = w[1:]``. ``segment_ids`` number the documents inside the row from
1, so attention and the KDA state can stop at boundaries; ``weights`` is 0 where the target belongs
to another document than its input (the first token of a document is never predicted from the
previous one). Batch ``i`` is a pure function of ``(seed, i)``: an epoch-wise permutation of
windows, so the data position of a run is just the step and resuming replays nothing.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from k3jax.data.corpus import Split

LN2 = math.log(2.0)


def window_batch(split: Split, starts: np.ndarray, seq_len: int,
                 token_bytes: np.ndarray) -> dict[str, np.ndarray]:
    """Rows starting at token offsets ``starts`` [B] -> dict of [B, T] arrays plus ``nbytes``."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    window = np.asarray(split.tokens[idx.ravel()]).reshape(idx.shape).astype(np.int32)
    doc = np.searchsorted(split.docs, idx, side="right") - 1
    weights = (doc[:, 1:] == doc[:, :-1]).astype(np.float32)
    segment_ids = (doc[:, :-1] - doc[:, :1] + 1).astype(np.int32)
    targets = window[:, 1:]
    return {"tokens": window[:, :-1], "targets": targets, "segment_ids": segment_ids,
            "weights": weights,
            "nbytes": np.float32((token_bytes[targets] * weights).sum())}


class PackedBatches:
    """Training batches: batch ``i`` = ``batch_size`` windows from a seeded per-epoch
    permutation."""

    def __init__(self, split: Split, seq_len: int, batch_size: int, seed: int,
                 token_bytes: np.ndarray):
        self.split, self.seq_len, self.batch_size = split, seq_len, batch_size
        self.seed, self.token_bytes = seed, token_bytes
        self.num_windows = (len(split.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the training split has {len(split.tokens)} tokens, fewer than "
                             f"data.seq_len + 1 = {seq_len + 1}")

    @lru_cache(maxsize=2)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        flat = index * self.batch_size + np.arange(self.batch_size)
        epochs, pos = np.divmod(flat, self.num_windows)
        windows = np.array([self._permutation(int(e))[p] for e, p in zip(epochs, pos)])
        return window_batch(self.split, windows * self.seq_len, self.seq_len, self.token_bytes)


def heldout_batches(split: Split, seq_len: int, batch_size: int, num_batches: int,
                    token_bytes: np.ndarray) -> list[dict[str, np.ndarray]]:
    """The fixed evaluation set: the first ``num_batches * batch_size`` non-overlapping windows of
    the held-out split (fewer if the split is short; it must hold at least one window)."""
    available = (len(split.tokens) - 1) // seq_len
    if available < 1:
        raise ValueError(f"the held-out split has {len(split.tokens)} tokens, fewer than "
                         f"data.seq_len + 1 = {seq_len + 1}; raise data.heldout_fraction")
    rows = min(batch_size, available)  # every batch has the same shape: one compiled eval step
    starts = np.arange(min(num_batches, available // rows) * rows) * seq_len
    return [window_batch(split, starts[i:i + rows], seq_len, token_bytes)
            for i in range(0, len(starts), rows)]


def bits_per_byte(sum_nats: float, nbytes: float) -> float:
    """Total cross-entropy (nats) over the predicted tokens / (ln 2 * bytes they stand for)."""
    return float(sum_nats) / (LN2 * max(float(nbytes), 1.0))
