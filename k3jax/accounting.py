"""Parameter and FLOP accounting of any config, with nothing allocated (``jax.eval_shape``).

Conventions (SPEC 3.3, 6): a matmul with ``n`` weights costs ``2n`` FLOPs per token; routed experts
count ``top_k / num_experts`` of their weights as active; the input embedding is a lookup and is
excluded from "active"; the untied head counts. A training step is three forwards (forward plus a
backward twice its cost), the usual MFU convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from k3jax.config import ModelConfig
from k3jax.model import abstract_variables, logical_axes


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # excludes the input embedding; routed experts at top_k / num_experts
    embedding: int
    routed_experts: int  # all routed expert weights (the part that is sparsely active)


def _is_routed_expert(spec) -> bool:
    names = [a for a in tuple(spec) if a != "layers"]
    return bool(names) and names[0] == "exp"


def count_params(cfg: ModelConfig) -> ParamCounts:
    """Total and active parameters of ``cfg`` (shapes only; works for the 2.78T config)."""
    shapes = abstract_variables(cfg)["params"]
    specs = logical_axes(cfg)["params"]
    sizes = jax.tree.leaves(jax.tree.map(lambda s: int(np.prod(s.shape)), shapes))
    routed_flags = jax.tree.leaves(jax.tree.map(_is_routed_expert, specs,
                                                is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    total = sum(sizes)
    routed = sum(n for n, r in zip(sizes, routed_flags) if r)
    embedding = cfg.vocab_size * cfg.d_model
    active_routed = 0
    if cfg.moe is not None and routed:
        active_routed = routed * cfg.moe.top_k / cfg.moe.num_experts
    active = int(round(total - routed + active_routed - embedding))
    return ParamCounts(total=total, active=active, embedding=embedding, routed_experts=routed)


def kda_core_flops(cfg: ModelConfig, convention: str = "paper") -> float:
    """FLOPs per token of one KDA layer's chunked recurrence (all heads), SPEC 3.3."""
    k, c = cfg.kda.head_dim, cfg.kda.chunk_size
    v = k
    if convention == "paper":
        per_head = 6 * k * v + 3 * c * k + c * c
    elif convention == "implemented":
        per_head = 6 * k * v + 2 * k * (c + 16) + 2 * c * k + 4 * c * v + c * c / 3
    else:
        raise ValueError(f"convention={convention!r} is invalid: expected 'paper' or 'implemented'")
    return cfg.kda.num_heads * per_head


def mla_core_flops(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs per token of causal attention scores and weighted values in one MLA layer.

    Expanded form: ``2 * H * (qk + v)`` per attended token, with ``seq_len / 2`` tokens attended on
    average under the causal mask.
    """
    m = cfg.mla
    return 2.0 * m.num_heads * (m.qk_head_dim + m.v_head_dim) * seq_len / 2


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, kda_convention: str = "paper") -> float:
    """Forward FLOPs per token: weight matmuls of the active parameters plus the sequence mixers."""
    counts = count_params(cfg)
    matmul = 2.0 * counts.active
    mixers = sum(kda_core_flops(cfg, kda_convention) if t == "kda" else mla_core_flops(cfg, seq_len)
                 for t in cfg.layer_types)
    return matmul + mixers


def train_flops_per_token(cfg: ModelConfig, seq_len: int, kda_convention: str = "paper") -> float:
    """Training FLOPs per token (forward + backward = 3 forwards)."""
    return 3.0 * forward_flops_per_token(cfg, seq_len, kda_convention)


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_value: int = 2) -> int:
    """MLA latent cache per token over all MLA layers (SPEC 9): ``(kv_lora + rope) * bytes``."""
    m = cfg.mla
    return cfg.layer_types.count("mla") * (m.kv_lora_rank + m.qk_rope_head_dim) * bytes_per_value


def kda_state_bytes(cfg: ModelConfig) -> int:
    """Fixed fp32 KDA state per sequence over all KDA layers (SPEC 9): ``H K V * 4`` each."""
    k = cfg.kda
    return cfg.layer_types.count("kda") * k.num_heads * k.head_dim * k.head_dim * 4
