"""Prefill and decode: the model run over new tokens with the inference cache (pure functions).

* :func:`prefill` runs prompt tokens ``[B, T]`` in pieces of ``chunk`` tokens: KDA through the
  chunked op (the Pallas kernels on Hopper) with the cache's state as initial state and the final
  state kept; MLA through its expanded form over the cache, writing the absorbed latent cache.
* :func:`decode` runs one token per row: KDA's recurrence step, MLA's absorbed form.

Both are inference only: the model runs with ``deterministic=True`` and only the ``params`` and
``balance`` collections, none of them mutable, so the MoE router neither moves its bias nor gathers
balance statistics, and no loss or diagnostic is sown. Compiled functions are cached per model
config (and per piece shape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.generate.cache import InferenceCache, cache_context
from k3jax.model import K3Model

DEFAULT_CHUNK = 4096


def _inference_config(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(remat="none")  # nothing is differentiated: recomputation would only cost


def _forward(cfg: ModelConfig, variables, tokens, segment_ids, cache: InferenceCache):
    context, advanced = cache_context(cfg, cache, segment_ids)
    inference_vars = {k: variables[k] for k in ("params", "balance") if k in variables}
    logits, layers = K3Model(_inference_config(cfg)).apply(
        inference_vars, tokens, context.segment_ids, True, cache.layers, context)
    # The samplers' softmax, penalties and top-p sums read fp32 logits, where a bf16 model's are
    # bf16: widened here (in the compiled step, fused into the row it keeps).
    return logits.astype(jnp.float32), advanced.replace(layers=layers)


@functools.lru_cache(maxsize=None)
def _compiled(cfg: ModelConfig, keep_logits: str):
    def run(variables, tokens, segment_ids, cache):
        logits, cache = _forward(cfg, variables, tokens, segment_ids, cache)
        return (logits if keep_logits == "all" else logits[:, -1]), cache
    return jax.jit(run, donate_argnums=(3,))


def _check_room(cache: InferenceCache, new: int, what: str) -> int:
    # The count is a host number (init_cache, _host_length): reading it does not wait for the
    # device, so a loop of decodes stays ahead of the GPU.
    length = int(cache.length)
    if length + new > cache.max_len:
        raise ValueError(f"{what}: {new} new tokens after {length} cached ones exceed the cache's "
                         f"max_len={cache.max_len}; build the cache with a larger max_len")
    return length


def prefill(cfg: ModelConfig, variables: dict, tokens, cache: InferenceCache,
            segment_ids=None, chunk: int = DEFAULT_CHUNK, all_logits: bool = False):
    """Continue ``cache`` with ``tokens [B, T]`` (int), ``segment_ids [B, T]`` (ids >= 0, e.g.
    from :func:`~k3jax.generate.cache.left_pad`; None: one segment per row).

    Returns ``(logits, cache)``: the fp32 logits of the last token ``[B, vocab]`` (every token's,
    ``[B, T, vocab]``, with ``all_logits``) and the cache after the tokens. The cache passed in is
    consumed (its buffers are donated on accelerators).
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.shape[1] == 0:
        raise ValueError(f"prefill: tokens must be a non-empty integer array [B, T]; got "
                         f"{tokens.dtype}{tokens.shape}")
    if tokens.shape[0] != cache.batch:
        raise ValueError(f"prefill: tokens has {tokens.shape[0]} rows, the cache {cache.batch}")
    segment_ids = (jnp.ones(tokens.shape, jnp.int32) if segment_ids is None
                   else jnp.asarray(segment_ids, jnp.int32))
    if segment_ids.shape != tokens.shape or bool(jnp.any(segment_ids < 0)):
        raise ValueError(f"prefill: segment_ids must be ids >= 0 of tokens' shape {tokens.shape}")
    if chunk < 1:
        raise ValueError(f"prefill: chunk={chunk} must be >= 1")
    length = _check_room(cache, tokens.shape[1], "prefill")
    step = _compiled(cfg, "all" if all_logits else "last")
    pieces = []
    for lo in range(0, tokens.shape[1], chunk):
        logits, cache = step(variables, tokens[:, lo:lo + chunk], segment_ids[:, lo:lo + chunk],
                             cache)
        pieces.append(logits)
    logits = jnp.concatenate(pieces, axis=1) if all_logits else pieces[-1]
    return logits, _host_length(cache, length + tokens.shape[1])


@functools.lru_cache(maxsize=None)
def _compiled_decode(cfg: ModelConfig):
    def run(variables, token, cache):
        segment = cache.last_segment[:, None]
        logits, cache = _forward(cfg, variables, token[:, None], segment, cache)
        return logits[:, 0], cache
    return jax.jit(run, donate_argnums=(2,))


def decode(cfg: ModelConfig, variables: dict, token, cache: InferenceCache):
    """One token per row ``token [B]`` continuing each row's last segment -> ``(logits [B, vocab]
    fp32, cache)``. The cache must hold at least one token (a prefill comes first)."""
    token = jnp.asarray(token)
    if token.shape != (cache.batch,) or not jnp.issubdtype(token.dtype, jnp.integer):
        raise ValueError(f"decode: token must be integer [B={cache.batch}]; got "
                         f"{token.dtype}{token.shape}")
    length = _check_room(cache, 1, "decode")
    if length == 0:
        raise ValueError("decode: the cache is empty; prefill a prompt first")
    logits, cache = _compiled_decode(cfg)(variables, token, cache)
    return logits, _host_length(cache, length + 1)


def _host_length(cache: InferenceCache, length: int) -> InferenceCache:
    """``cache`` with its token count as a host number (the compiled steps return it on the
    device, where reading it back would wait for the step that wrote it)."""
    return cache.replace(length=np.int32(length))


@functools.lru_cache(maxsize=None)
def _compiled_forward(cfg: ModelConfig):
    return jax.jit(lambda variables, tokens, segment_ids: K3Model(cfg).apply(
        variables, tokens, segment_ids).astype(jnp.float32))


def forward_logits(cfg: ModelConfig, variables: dict, tokens, segment_ids=None) -> np.ndarray:
    """One ordinary forward (no cache): the reference the cached steps must reproduce."""
    inference_vars = {k: variables[k] for k in ("params", "balance") if k in variables}
    return np.asarray(_compiled_forward(cfg)(
        inference_vars, jnp.asarray(tokens), None if segment_ids is None else jnp.asarray(
            segment_ids)))


__all__ = ["DEFAULT_CHUNK", "decode", "forward_logits", "prefill"]
