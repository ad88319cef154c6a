"""Held-out loss, bits per byte and synthetic-task accuracy over fixed batches."""

from __future__ import annotations

import jax
import numpy as np

from k3jax.data.batches import bits_per_byte
from k3jax.data.synthetic import eval_batches
from k3jax.train.step import BATCH_KEYS


def evaluate_batches(eval_fn, params, balance, batches: list[dict]) -> dict:
    """Totals over ``batches`` -> ``loss`` (nats/token), ``bpb``, ``accuracy``, ``tokens`` and the
    mean of the model's diagnostics."""
    nats = tokens = correct = nbytes = 0.0
    diag = None
    for batch in batches:
        out = jax.device_get(eval_fn(params, balance, {k: batch[k] for k in BATCH_KEYS}))
        nats += float(out["sum_nats"])
        tokens += float(out["tokens"])
        correct += float(out["correct"])
        nbytes += float(batch["nbytes"])
        d = jax.tree.map(np.asarray, out["diag"])
        diag = d if diag is None else jax.tree.map(np.add, diag, d)
    n = max(len(batches), 1)
    return {"loss": nats / max(tokens, 1.0), "bpb": bits_per_byte(nats, nbytes),
            "accuracy": correct / max(tokens, 1.0), "tokens": tokens,
            "diag": jax.tree.map(lambda x: x / n, diag) if diag is not None else {}}


def task_batches(tasks, seq_len: int, batch_size: int, num_batches: int, vocab: int) -> dict:
    return {t: eval_batches(t, seq_len, batch_size, num_batches, vocab) for t in tasks}

