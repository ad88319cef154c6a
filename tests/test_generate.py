"""Prefill then decode equals one forward over the whole sequence (k3jax.generate).

A covering set of tiny configs, each compiled once (forward, one prefill piece shape, one decode
step) and checked on ragged, left-padded prompts: every property appears in at least one case.

| case    | mixers        | residual | FFN         | dtype | stack            |
|---------|---------------|----------|-------------|-------|------------------|
| hybrid  | KDA + MLA     | AttnRes  | MoE         | fp32  | scanned group x2 |
| kda     | KDA only      | plain    | dense       | bf16  | scanned          |
| mla     | MLA only, RoPE| plain    | dense + MoE | fp32  | unrolled         |
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GENERATION_CASES, generation_case

from k3jax.generate import decode, forward_logits, init_cache, left_pad, prefill
from k3jax.ops.tolerance import BF16_OUT_TOL, rel_rms

# Same math, same dtype, another order of summation: far tighter than math §10's FP32_TOL.
CACHED_FP32_TOL = 1e-5
PROMPT_LENS = (32, 19, 2)  # 2 < the conv width - 1: the decode conv state straddles padding
NEW_TOKENS = 4
CHUNK = 16


def _prompts(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, vocab, n)) for n in PROMPT_LENS]


def cached_logits(cfg, variables, tokens, segments, n_prompt: int):
    """Every position's logits: prefill of ``[:, :n_prompt]`` in CHUNK pieces, then decodes."""
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1] + 4)
    logits, cache = prefill(cfg, variables, tokens[:, :n_prompt], cache, segments[:, :n_prompt],
                            chunk=CHUNK, all_logits=True)
    out = [np.asarray(logits)]
    for t in range(n_prompt, tokens.shape[1]):
        step, cache = decode(cfg, variables, jnp.asarray(tokens[:, t]), cache)
        out.append(np.asarray(step)[:, None])
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", list(GENERATION_CASES))
def test_prefill_then_decode_equals_one_forward(name):
    cfg, variables = generation_case(name)
    tokens, segments = left_pad(_prompts(cfg.vocab_size))
    rng = np.random.default_rng(1)
    more = rng.integers(1, cfg.vocab_size, (tokens.shape[0], NEW_TOKENS)).astype(np.int32)
    tokens = np.concatenate([tokens, more], axis=1)
    segments = np.concatenate([segments, np.ones_like(more)], axis=1)
    want = forward_logits(cfg, variables, tokens, segments)
    got = cached_logits(cfg, variables, tokens, segments, max(PROMPT_LENS))
    tol = BF16_OUT_TOL if cfg.dtype == "bfloat16" else CACHED_FP32_TOL
    for row, n in enumerate(PROMPT_LENS):  # real tokens only: padding's logits are never read
        real = slice(max(PROMPT_LENS) - n, None)
        assert rel_rms(want[row, real], got[row, real]) <= tol, (name, row)


def test_bad_requests_fail_clearly():
    cfg, variables = generation_case("kda")
    cache = init_cache(cfg, 2, 8)
    with pytest.raises(ValueError, match="exceed the cache's max_len=8"):
        prefill(cfg, variables, np.ones((2, 9), np.int32), cache)
    with pytest.raises(ValueError, match="tokens has 1 rows, the cache 2"):
        prefill(cfg, variables, np.ones((1, 4), np.int32), cache)
    with pytest.raises(ValueError, match="the cache is empty"):
        decode(cfg, variables, np.ones((2,), np.int32), cache)
    with pytest.raises(ValueError, match="non-empty token lists"):
        left_pad([[1, 2], []])


@pytest.mark.parametrize("name", ["hybrid", "mla"])
def test_an_id_that_comes_back_starts_a_new_document_in_the_cache(name):
    """Documents are runs of equal ids (math §2), in the cache as in training: a row packed as
    ids 1, 2, 1 holds three documents, and the last one's queries, prefilled a piece after the
    first (and decoded after it), must not attend to the first document's cached positions."""
    cfg, variables = generation_case(name)
    rng = np.random.default_rng(2)
    # The shapes of test_prefill_then_decode_equals_one_forward (rows, prompt and total length),
    # so the compiled forward, prefill piece and decode step are that test's.
    prompt, total = max(PROMPT_LENS), max(PROMPT_LENS) + NEW_TOKENS
    tokens = rng.integers(1, cfg.vocab_size, (len(PROMPT_LENS), total)).astype(np.int32)
    runs = np.repeat(np.array([1, 2, 1]), [12, 12, total - 24])  # the third starts inside piece 2
    segments = np.broadcast_to(runs, tokens.shape).astype(np.int32)
    want = forward_logits(cfg, variables, tokens, segments)
    got = cached_logits(cfg, variables, tokens, segments, prompt)
    assert rel_rms(want, got) <= CACHED_FP32_TOL, name


def test_decode_reads_nothing_back_from_the_device():
    """A decode checks the cache's room against a token count kept on the host: reading the
    count back from the device would make each step wait for the one before it, so a loop of
    decodes could never run ahead of the accelerator. (The transfer guard catches a read-back on
    an accelerator; on the CPU, where none is a transfer, the count's type does.)"""
    cfg, variables = generation_case("kda")
    tokens, segments = left_pad(_prompts(cfg.vocab_size))
    # The cache and prefill of test_prefill_then_decode_equals_one_forward: its compiled steps.
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1] + NEW_TOKENS + 4)
    _, cache = prefill(cfg, variables, tokens, cache, segments, chunk=CHUNK, all_logits=True)
    token = jnp.ones((tokens.shape[0],), jnp.int32)
    with jax.transfer_guard_device_to_host("disallow"):
        for step in range(1, 3):
            _, cache = decode(cfg, variables, token, cache)
            assert isinstance(cache.length, np.integer)
            assert cache.length == tokens.shape[1] + step
