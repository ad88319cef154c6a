"""The model-size ladder: one rule from a size knob to a model config, and each rung's accounting.

Width rule (``knob="width"``, size = ``d_model``): with ``r = size / base d_model``, the KDA and MLA
head counts become ``r`` times the base's (they must come out whole), head dims stay, and every
other width -- dense FFN, MLA latent ranks, KDA gate ranks, expert, shared and MoE latent widths --
is ``r`` times the base's rounded to the ladder's ``multiple``. Depth rule (``knob="depth"``, size =
``num_layers``): only the layer count changes, so the hybrid schedule rule (``mla_every``, the last
layer MLA) and the AttnRes block size carry over. Counts and FLOPs come from
:mod:`k3jax.accounting`: N is active non-embedding parameters, N_total all parameters.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from k3jax.config.base import ConfigError
from k3jax.config.model import ModelConfig
from k3jax.sweep.spec import Ladder, SweepError


@dataclass(frozen=True)
class Rung:
    size: int
    model: ModelConfig
    n: int  # active non-embedding parameters
    n_total: int
    flops_per_token: float  # training (forward + backward)


def _scaled(value: int, r: float, multiple: int) -> int:
    return max(multiple, round(value * r / multiple) * multiple)


def _heads(base: int, size: int, d0: int, what: str) -> int:
    if (base * size) % d0:
        raise SweepError(f"ladder rung d_model={size}: {what} (base {base} at d_model={d0}) does "
                         f"not scale to a whole number of heads; pick sizes that are multiples of "
                         f"{d0 // math.gcd(base, d0)}")
    return base * size // d0


def scale_width(model: ModelConfig, size: int, multiple: int) -> ModelConfig:
    d0, r = model.d_model, size / model.d_model
    s = lambda v: _scaled(v, r, multiple)
    kda = dataclasses.replace(model.kda, num_heads=_heads(model.kda.num_heads, size, d0,
                                                          "kda.num_heads"),
                              gate_rank=s(model.kda.gate_rank),
                              output_gate_rank=s(model.kda.output_gate_rank))
    m = model.mla
    mla = dataclasses.replace(m, num_heads=_heads(m.num_heads, size, d0, "mla.num_heads"),
                              kv_lora_rank=s(m.kv_lora_rank),
                              q_lora_rank=None if m.q_lora_rank is None else s(m.q_lora_rank))
    ffn = dataclasses.replace(model.dense_ffn,
                              intermediate_size=s(model.dense_ffn.intermediate_size))
    moe = model.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, expert_intermediate=s(moe.expert_intermediate),
            latent_dim=None if moe.latent_dim is None else min(s(moe.latent_dim), size),
            shared_intermediate=s(moe.shared_intermediate) if moe.shared_intermediate else 0)
    return dataclasses.replace(model, d_model=size, kda=kda, mla=mla, dense_ffn=ffn, moe=moe)


def scale_model(model: ModelConfig, ladder: Ladder, size: int) -> ModelConfig:
    """The rung ``size`` of ``model`` under ``ladder``'s rule (validated on construction)."""
    try:
        if ladder.knob == "width":
            return scale_width(model, size, ladder.multiple)
        if model.mla_layers is not None:
            raise SweepError(f"ladder rung num_layers={size}: the base lists mla_layers "
                             f"explicitly; a depth ladder needs the mla_every rule")
        return dataclasses.replace(model, num_layers=size)
    except SweepError:
        raise
    except ConfigError as e:
        raise SweepError(f"ladder rung {ladder.knob}={size}: the model cannot be built: {e}") \
            from None


def build_rung(model: ModelConfig, ladder: Ladder, size: int, seq_len: int) -> Rung:
    """Scale, build the model's shapes (nothing allocated) and count it."""
    from k3jax.accounting import count_params, train_flops_per_token

    scaled = scale_model(model, ladder, size)
    try:
        counts = count_params(scaled)
        flops = train_flops_per_token(scaled, seq_len)
    except Exception as e:  # noqa: BLE001 - any failure to trace the model is the rung's fault
        raise SweepError(f"ladder rung {ladder.knob}={size}: the model cannot be built: "
                         f"{type(e).__name__}: {e}") from None
    return Rung(size, scaled, counts.active, counts.total, flops)
