"""Generation for a batch of prompts: left-padded prefill, then sample-and-decode steps."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.generate.cache import init_cache, left_pad
from k3jax.generate.sampling import SamplingConfig, sample
from k3jax.generate.steps import DEFAULT_CHUNK, decode, prefill


@functools.lru_cache(maxsize=None)
def _sampler(cfg: SamplingConfig):
    """``(logits [B, V], key, seen [B, V]) -> (tokens [B], seen with them marked)``, compiled once
    per sampling config (the seen-token mask feeds the repetition penalty)."""
    def draw(logits, key, seen):
        new = sample(logits, key, cfg, seen)
        return new, seen.at[jnp.arange(seen.shape[0]), new].set(True)

    return jax.jit(draw)


def _seen(prompts, vocab: int) -> jax.Array:
    seen = np.zeros((len(prompts), vocab), bool)
    for row, p in enumerate(prompts):
        seen[row, np.asarray(p)] = True
    return jnp.asarray(seen)


def cache_length(prompt_len: int, max_new_tokens: int, max_len: int | None = None,
                 arg: str = "max_len") -> int:
    """The cache length for a (longest) prompt of ``prompt_len`` tokens and ``max_new_tokens``
    new ones: ``max_len``, or by default ``prompt_len + max_new_tokens - 1`` (the last sampled
    token is never fed back). A ValueError when ``max_new_tokens < 1`` or ``max_len`` (called
    ``arg`` in the message) is too short."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: expected >= 1")
    need = prompt_len + max_new_tokens - 1
    if max_len is not None and max_len < need:
        raise ValueError(f"a prompt of {prompt_len} tokens plus {max_new_tokens} new ones needs "
                         f"a cache of {need} tokens; {arg}={max_len}")
    return need if max_len is None else max_len


def generate(cfg: ModelConfig, variables: dict, prompts: list[list[int]], max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), max_len: int | None = None,
             on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
             chunk: int = DEFAULT_CHUNK) -> list[list[int]]:
    """Up to ``max_new_tokens`` new tokens per prompt (a row ends after emitting a stop token).

    ``max_len`` sizes the cache (default: longest prompt + ``max_new_tokens`` - 1, see
    :func:`cache_length`). ``on_tokens(tokens
    [B], active [B])`` is called after every step with the new tokens and which rows were still
    generating them, so a caller can stream text. Returns each row's new tokens (stop token
    included when one ended it).
    """
    tokens, segments = left_pad(prompts)
    if int(tokens.max()) >= cfg.vocab_size or int(tokens.min()) < 0:
        raise ValueError(f"generate: prompt token ids must lie in [0, vocab_size={cfg.vocab_size})")
    max_len = cache_length(tokens.shape[1], max_new_tokens, max_len)
    cache = init_cache(cfg, len(prompts), max_len)
    logits, cache = prefill(cfg, variables, tokens, cache, segments, chunk=chunk)
    draw, key = _sampler(sampling), jax.random.key(sampling.seed)
    seen = _seen(prompts, cfg.vocab_size)
    stops = np.asarray(sampling.stop_tokens, np.int64)
    active = np.ones(len(prompts), bool)
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        key, sub = jax.random.split(key)
        new, seen = draw(logits, sub, seen)
        host = np.asarray(new)
        for row in np.flatnonzero(active):
            out[row].append(int(host[row]))
        if on_tokens is not None:
            on_tokens(host, active.copy())
        active &= ~np.isin(host, stops)
        if not active.any() or step == max_new_tokens - 1:
            break
        logits, cache = decode(cfg, variables, new, cache)
    return out


__all__ = ["cache_length", "generate"]
