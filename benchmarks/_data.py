"""Synthetic inputs shared by the benchmarks."""

from __future__ import annotations

import numpy as np


def packed_segments(batch: int, seq: int, docs: int, seed: int = 0) -> np.ndarray:
    """``[B, T]`` int32 segment ids as a packed corpus gives them: row ``b`` holds
    ``1 + b % docs`` documents (ids 0, 1, ... in runs), split at random tokens."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        for cut in rng.choice(np.arange(1, seq), b % docs, replace=False):
            seg[b, cut:] += 1
    return seg
