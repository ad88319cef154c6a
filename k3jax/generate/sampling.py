"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty.

Each rule is a pure function of ``logits [B, V]`` (fp32), applied in the order of
:func:`sample`: repetition penalty, temperature, top-k, top-p, then a categorical draw (or the arg
max at temperature 0). Draws take an explicit ``jax.random`` key, so a seed reproduces a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from k3jax.config.base import fail


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` keep every token;
    ``repetition_penalty=1`` changes nothing; a row stops generating at any of ``stop_tokens``."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)
    seed: int = 0

    def __post_init__(self):
        for name, (allowed, expected) in RULES.items():
            value = getattr(self, name)
            if not allowed(value):
                fail(self, name, value, expected)
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


# field -> (whether a value is allowed, what is expected); the command line checks its flags with
# them too. Written as "not below", not "above": a NaN is refused.
RULES = {
    "temperature": (lambda v: v >= 0, "expected >= 0 (0: greedy)"),
    "top_k": (lambda v: v >= 0, "expected >= 0 (0: no limit)"),
    "top_p": (lambda v: 0 < v <= 1, "expected in (0, 1]"),
    "repetition_penalty": (lambda v: v > 0, "expected > 0"),
}


def repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: float) -> jax.Array:
    """Make tokens already in the context (``seen [B, V]`` bool) less likely: a positive logit is
    divided by ``penalty``, a negative one multiplied (so both move down for ``penalty > 1``)."""
    penalised = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalised, logits)


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
    """Keep the ``k`` largest logits of each row (ties at the k-th value kept), the rest -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, -jnp.inf)


def top_p_filter(logits: jax.Array, p: float) -> jax.Array:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (nucleus);
    the most likely token is always kept."""
    if p >= 1.0:
        return logits
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the strictly more likely tokens
    keep_sorted = before < p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
        keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig,
           seen: jax.Array | None = None) -> jax.Array:
    """Next tokens ``[B]`` int32 from ``logits [B, V]``; ``seen [B, V]`` marks the context's tokens
    for the repetition penalty."""
    logits = logits.astype(jnp.float32)
    if cfg.repetition_penalty != 1.0 and seen is not None:
        logits = repetition_penalty(logits, seen, cfg.repetition_penalty)
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = top_p_filter(top_k_filter(logits / cfg.temperature, cfg.top_k), cfg.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


__all__ = ["RULES", "SamplingConfig", "repetition_penalty", "sample", "top_k_filter",
           "top_p_filter"]
