"""Synthetic sequence tasks (Kimi Linear report, section 5.1, plus parity), for training and eval.

Each task draws a batch of ``[B, T]`` ``tokens``/``targets`` with ``weights`` = 1 exactly on the
answer positions (the loss and the accuracy count only those), ``segment_ids`` all 1 (one document
per row) and ``nbytes`` = number of answer tokens (bits per byte is not meaningful here; accuracy
is).

Token layout for a vocabulary of ``V`` ids: 0 pad, 1 separator, 2 push, 3 pop, 4 query (markers),
content tokens ``8 .. V-1``.

- ``palindrome``: random content tokens, a separator, then the same tokens reversed (answers: the
  reversed half).
- ``mqar`` (multi-query associative recall): key-value pairs (keys distinct), then queries of
  earlier keys, each followed by its value (answers: the values after queries).
- ``stack``: operations on several independent stacks, ``push s x`` and ``pop s``; after ``pop s``
  the answer is the top element of stack ``s`` (answers: the popped values).
- ``parity``: bits interleaved with the running parity, ``b1 p1 b2 p2 ...``, ``p_i = b1 xor .. bi``
  (answers: every ``p_i``); state tracking a diagonal-decay recurrence cannot do with positive
  eigenvalues only.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

PAD, SEP, PUSH, POP, QUERY = 0, 1, 2, 3, 4
FIRST_CONTENT = 8
NUM_STACKS = 4
MIN_VOCAB = 32


def _content(vocab: int) -> tuple[int, int]:
    if vocab < MIN_VOCAB:
        raise ValueError(f"synthetic tasks need model.vocab_size >= {MIN_VOCAB}, got {vocab}")
    return FIRST_CONTENT, vocab


def _finish(seq: np.ndarray, answer: np.ndarray) -> dict[str, np.ndarray]:
    """``seq`` [B, T+1] and ``answer`` [B, T+1] (True where ``seq`` is an answer token)."""
    weights = answer[:, 1:].astype(np.float32)
    return {"tokens": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32),
            "segment_ids": np.ones(weights.shape, np.int32), "weights": weights,
            "nbytes": np.float32(weights.sum())}


def palindrome(rng: np.random.Generator, batch: int, seq_len: int, vocab: int):
    lo, hi = _content(vocab)
    n = seq_len // 2
    x = rng.integers(lo, hi, size=(batch, n))
    seq = np.full((batch, seq_len + 1), PAD, np.int64)
    seq[:, :n], seq[:, n] = x, SEP
    seq[:, n + 1:2 * n + 1] = x[:, ::-1][:, :seq_len - n]
    answer = np.zeros_like(seq, bool)
    answer[:, n + 1:2 * n + 1] = True
    return _finish(seq, answer)


def mqar(rng: np.random.Generator, batch: int, seq_len: int, vocab: int):
    """Keys from the lower half of the content ids, values from the upper half."""
    lo, hi = _content(vocab)
    mid = (lo + hi) // 2
    pairs = max(1, min(mid - lo, (seq_len + 1) // 4))
    seq = np.full((batch, seq_len + 1), PAD, np.int64)
    answer = np.zeros_like(seq, bool)
    queries = (seq_len + 1 - 2 * pairs) // 2
    for b in range(batch):
        keys = rng.choice(np.arange(lo, mid), size=pairs, replace=False)
        values = rng.integers(mid, hi, size=pairs)
        seq[b, 0:2 * pairs:2], seq[b, 1:2 * pairs:2] = keys, values
        ask = rng.integers(0, pairs, size=queries)
        start = 2 * pairs
        seq[b, start:start + 2 * queries:2] = keys[ask]
        seq[b, start + 1:start + 2 * queries:2] = values[ask]
        answer[b, start + 1:start + 2 * queries:2] = True
    return _finish(seq, answer)


def stack(rng: np.random.Generator, batch: int, seq_len: int, vocab: int):
    """Ops are 3 tokens (``push s x``) or 2 (``pop s``, then the answer ``x``)."""
    lo, hi = _content(vocab)
    stack_ids = np.arange(lo, lo + NUM_STACKS)
    vlo = lo + NUM_STACKS
    seq = np.full((batch, seq_len + 1), PAD, np.int64)
    answer = np.zeros_like(seq, bool)
    for b in range(batch):
        stacks: list[list[int]] = [[] for _ in range(NUM_STACKS)]
        t = 0
        while t + 3 <= seq_len + 1:
            s = int(rng.integers(NUM_STACKS))
            if stacks[s] and rng.random() < 0.5:
                seq[b, t:t + 3] = (POP, stack_ids[s], stacks[s].pop())
                answer[b, t + 2] = True
            else:
                x = int(rng.integers(vlo, hi))
                stacks[s].append(x)
                seq[b, t:t + 3] = (PUSH, stack_ids[s], x)
            t += 3
    return _finish(seq, answer)


def parity(rng: np.random.Generator, batch: int, seq_len: int, vocab: int):
    lo, _ = _content(vocab)
    n = (seq_len + 1) // 2
    bits = rng.integers(0, 2, size=(batch, n))
    seq = np.full((batch, seq_len + 1), PAD, np.int64)
    seq[:, 0:2 * n:2] = lo + bits
    seq[:, 1:2 * n:2] = lo + np.cumsum(bits, axis=1) % 2
    answer = np.zeros_like(seq, bool)
    answer[:, 1:2 * n:2] = True
    return _finish(seq, answer)


TASKS: dict[str, Callable] = {"palindrome": palindrome, "mqar": mqar, "stack": stack,
                              "parity": parity}


def make_batch(task: str, rng: np.random.Generator, batch: int, seq_len: int, vocab: int):
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {sorted(TASKS)}")
    return TASKS[task](rng, batch, seq_len, vocab)


class SyntheticBatches:
    """Training batches of a synthetic task: batch ``i`` depends only on ``(seed, i)``."""

    def __init__(self, task: str, seq_len: int, batch_size: int, vocab: int, seed: int):
        make_batch(task, np.random.default_rng(0), 1, seq_len, vocab)  # validate early
        self.task, self.seq_len, self.batch_size = task, seq_len, batch_size
        self.vocab, self.seed = vocab, seed

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        return make_batch(self.task, rng, self.batch_size, self.seq_len, self.vocab)


def eval_batches(task: str, seq_len: int, batch_size: int, num_batches: int, vocab: int,
                 seed: int = 12345) -> list[dict[str, np.ndarray]]:
    """A fixed evaluation set, disjoint in seed from training streams."""
    rng = np.random.default_rng([seed, 1 << 20])
    return [make_batch(task, rng, batch_size, seq_len, vocab) for _ in range(num_batches)]
