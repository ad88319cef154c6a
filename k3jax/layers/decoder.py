"""One decoder layer, built from three parts: a token mixer, an FFN and a residual rule.

New variants register here (``MIXERS``/``FFNS``) instead of editing the layer.

When a model is applied (not initialised), the mixer and the FFN run under flax's lifted ``jit``:
layers of one kind and shape then share one trace, so jax traces, differentiates and lowers each
kind of mixer and FFN once instead of once per layer; XLA inlines the calls before it optimises.
Initialisation stays unlifted: the lifted transform derives the parameters' random streams
differently, so a seed would give other weights.
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax

from k3jax.config import ModelConfig
from k3jax.layers.ffn import dense_ffn
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.layers.norms import RMSNorm
from k3jax.layers.residual import make_residual

Lift = Callable[[type[nn.Module]], type[nn.Module]]  # a transform of a module class


def _moe_ffn(cfg: ModelConfig, lift: Lift) -> nn.Module:
    from k3jax.layers.moe import MoEBlock  # the MoE pulls in routing and dispatch only when used
    return lift(MoEBlock)(cfg, name="ffn")


MIXERS: dict[str, Callable[[ModelConfig, Lift], nn.Module]] = {
    "kda": lambda cfg, lift: lift(KDALayer)(cfg, name="mixer"),
    "mla": lambda cfg, lift: lift(MLALayer)(cfg, name="mixer"),
}
FFNS: dict[str, Callable[[ModelConfig, Lift], nn.Module]] = {"dense": dense_ffn, "moe": _moe_ffn}

# One lifted class per module class, so every layer's call goes through one ``jax.jit`` cache.
# The Python flags of the calls are static: the FFNs' ``deterministic``, and ``return_cache`` of a
# mixer continuing a cache (prefill, decode).
_traced_once = functools.cache(
    functools.partial(nn.jit, static_argnames=("deterministic", "return_cache")))


def _unlifted(cls: type[nn.Module]) -> type[nn.Module]:
    return cls


class DecoderLayer(nn.Module):
    """``state -> state`` for decoder layer ``layer_index`` (two sub-layers: mixer, FFN).

    With a ``cache`` (this layer's mixer cache) and its ``context``
    (:class:`~k3jax.layers.cache_context.CacheContext`), the mixer continues the cached tokens and
    the layer returns ``(state, new cache)``; ``segment_ids`` is then ``context.segment_ids``.
    """

    cfg: ModelConfig
    mixer: str
    ffn: str

    @nn.compact
    def __call__(self, state, layer_index, segment_ids, deterministic: bool, cache=None,
                 context=None):
        """``state`` (the residual rule's: ``[B, T, d]`` or an AttnRes state of such arrays) ->
        the state after this layer's mixer and FFN (with ``cache``: ``(state, new cache)``);
        ``segment_ids [B, T]`` or None."""
        cfg = self.cfg
        j = 2 * layer_index
        res_mixer = make_residual(cfg, "residual_mixer")
        res_ffn = make_residual(cfg, "residual_ffn")
        norm_mixer = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.param_dtype, name="norm_mixer")
        norm_ffn = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.param_dtype, name="norm_ffn")

        lift = _unlifted if self.is_initializing() else _traced_once
        x, state = res_mixer.read(state, j, norm_mixer)
        mixer = MIXERS[self.mixer](cfg, lift)
        # The mixer's kind in the name stack: a profile can tell KDA ops from MLA ops (both
        # modules are named "mixer"), likewise for the FFN.
        with jax.named_scope(self.mixer):
            if cache is None:
                out = mixer(x, segment_ids)
            else:
                out, cache = mixer.cached(x, cache, context)
        state = res_mixer.write(state, out, j)

        x, state = res_ffn.read(state, j + 1, norm_ffn)
        with jax.named_scope(self.ffn):
            ffn = FFNS[self.ffn](cfg, lift)
            out = ffn(x, deterministic=deterministic)
        state = res_ffn.write(state, out, j + 1)
        return state if cache is None else (state, cache)
