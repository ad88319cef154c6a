"""Inference for trained K3 models: cache, prefill/decode, sampling, prefix cache and a CLI.

``python -m k3jax.generate --workdir RUN --prompt "..." --max-new-tokens N`` (see ``__main__``).
"""

from k3jax.generate.cache import InferenceCache, cache_bytes, init_cache, left_pad
from k3jax.generate.steps import decode, forward_logits, prefill

__all__ = ["InferenceCache", "cache_bytes", "decode", "forward_logits", "init_cache", "left_pad",
           "prefill"]
