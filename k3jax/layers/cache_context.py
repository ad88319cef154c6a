"""What a decoder layer needs to extend its per-layer cache by ``T`` new tokens.

The model-level cache (``k3jax.generate.cache``) owns the bookkeeping shared by every layer: which
segment each cached position belongs to and where each row's segment stands. It turns that into
one :class:`CacheContext` per call, so a mixer only masks and writes:

* KDA: a conv state and a recurrent state belong to the segment of the previous token; where the
  first new token starts another segment they must not leak into it (``conv_keep``,
  ``state_keep``). Inside the new tokens, ``segment_ids`` resets them as in training.
* MLA: the new tokens' latents are written at the cache's ``length``; queries attend to cached
  and new positions of their own document (a run of equal ids), causally (``mask``);
  ``positions`` feed RoPE.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class CacheContext(NamedTuple):
    segment_ids: jax.Array  # [B, T] int32 segment of each new token
    positions: jax.Array  # [B, T] int32 position of each new token within its segment
    mask: jax.Array  # [B, 1, T, S] bool: new token t may attend to cache position s
    conv_keep: jax.Array  # [B, W-1] bool: conv state entry lies in the first new token's segment
    state_keep: jax.Array  # [B] bool: the recurrent state is in the first new token's segment
