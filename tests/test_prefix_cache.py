"""The prefix cache (k3jax.generate.prefix_cache): resuming equals a fresh prefill; LRU eviction.

Prompt lengths are chosen so that every recomputed piece is 16 or 8 tokens long (the grid and the
KDA chunk are 16), so the whole module compiles two prefill pieces and one decode step.

The model is the layers that keep a cache, KDA (recurrent and conv states) and MLA (latents), in a
scanned group of two repeated twice (caches stacked per group); the MoE and the AttnRes residual,
which keep nothing across time, are left out (test_generate.py runs them with a cache).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from helpers import host_variables, small_config

from k3jax.generate import decode, init_cache, prefill
from k3jax.generate.prefix_cache import PrefixCache, store_bytes_per_token
from k3jax.ops.tolerance import rel_rms

CACHED_FP32_TOL = 1e-5  # as in test_generate: same math in another order, fp32
MAX_LEN, GRID, CHUNK, NEW = 48, 16, 16, 3

_rng = np.random.default_rng(7)
A = _rng.integers(1, 64, 40).astype(np.int32)
B = np.concatenate([A[:24], _rng.integers(1, 64, 16)]).astype(np.int32)  # diverges after 24
C = A[:24].copy()  # a short shared prompt: ends off the grid
D = np.concatenate([C, _rng.integers(1, 64, 16)]).astype(np.int32)  # extends C; shares A's and B's


@functools.cache
def _model():
    """``(cfg, variables)``: KDA, MLA, KDA, MLA as one scanned group of two layers, fp32; the
    variables drawn on the host (:func:`helpers.host_variables`): the tests hold the cached steps
    to a fresh prefill on the same variables, whatever their values."""
    cfg = small_config(num_layers=4, mla_every=2)
    return cfg, host_variables(cfg, 1)


def _greedy(cfg, variables, logits, cache, n):
    out = []
    for _ in range(n):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(int(token[0]))
        logits, cache = decode(cfg, variables, token, cache)
    return out, np.asarray(logits)


def _fresh(cfg, variables, tokens):
    return prefill(cfg, variables, tokens[None], init_cache(cfg, 1, MAX_LEN), chunk=CHUNK)


def test_resumed_prefill_equals_fresh_prefill_and_greedy_tokens_agree():
    cfg, variables = _model()
    store = PrefixCache(cfg, MAX_LEN, GRID, budget_bytes=1 << 40)
    expect_resume = {"A": 0, "B": 16, "C": 16, "D": 24}  # D: C's prompt-end snapshot
    for name, tokens in (("A", A), ("B", B), ("C", C), ("D", D)):
        logits, cache, resumed = store.prefill(variables, tokens, chunk=CHUNK)
        if name == "A":  # the byte count the serving docs report, on a real store
            assert store.nbytes == store_bytes_per_token(cfg, len(A), GRID) * len(A)
        assert resumed == expect_resume[name], name
        ref_logits, ref_cache = _fresh(cfg, variables, tokens)
        assert rel_rms(np.asarray(ref_logits), np.asarray(logits)) <= CACHED_FP32_TOL, name
        got, got_last = _greedy(cfg, variables, logits, cache, NEW)
        want, want_last = _greedy(cfg, variables, ref_logits, ref_cache, NEW)
        assert got == want, name
        assert rel_rms(want_last, got_last) <= CACHED_FP32_TOL, name
    # the same prompt again: a full hit, nothing recomputed
    logits, _, resumed = store.prefill(variables, D, chunk=CHUNK)
    assert resumed == len(D)
    ends = sorted(s.length for s in store.snapshots)
    assert ends == [16, 24, 32, 32, 32, 40, 40, 40]  # A: 16 32 40; B: 32 40; C: 24; D: 32 40


def test_eviction_keeps_the_budget_and_drops_least_recently_used_leaves_first():
    cfg, variables = _model()
    store = PrefixCache(cfg, MAX_LEN, GRID, budget_bytes=1 << 40)
    for tokens in (A, B, C):
        store.prefill(variables, tokens, chunk=CHUNK)
    by_name = {(s.length, int(s.tokens[-1])): s for s in store.snapshots}
    a40, a32 = by_name[(40, int(A[-1]))], by_name[(32, int(A[31]))]
    b40, c24 = by_name[(40, int(B[-1]))], by_name[(24, int(C[-1]))]
    store.budget = store.nbytes - 1
    store._evict()
    assert a40 not in store.snapshots and store.nbytes <= store.budget  # the oldest leaf
    store.budget = store.nbytes - 1
    store._evict()
    assert a32 not in store.snapshots  # A's path is now a leaf and the least recently used
    assert b40 in store.snapshots and c24 in store.snapshots
    # the root snapshot has children: it outlives its leaves whatever its age
    assert min(store.snapshots, key=lambda s: s.length).length == 16
    # what is left still resumes exactly: D resumes from C's prompt-end snapshot
    logits, _, resumed = store.prefill(variables, D, chunk=CHUNK)
    assert resumed == 24
    ref_logits, _ = _fresh(cfg, variables, D)
    assert rel_rms(np.asarray(ref_logits), np.asarray(logits)) <= CACHED_FP32_TOL
    assert store.nbytes <= store.budget
