"""Parameter and FLOP accounting of any config, with nothing allocated (``jax.eval_shape``).

Conventions (math §3.3, 6): a matmul with ``n`` weights costs ``2n`` FLOPs per token; routed experts
count ``top_k / num_experts`` of their weights as active; the input embedding is a lookup and is
excluded from "active"; the untied head counts. A training step is three forwards (forward plus a
backward twice its cost), the usual MFU convention.

    python -m k3jax.accounting --config configs/k3_small.py [--seq-len T] [--json]

prints a preset's parameter, FLOP-per-token and cache tables (``--config`` also takes a preset's
name, e.g. ``k3_full``); ``--json`` prints one JSON object per row instead.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from k3jax.config import ConfigError, ModelConfig
from k3jax.config.experiment import load_config
from k3jax.model import abstract_variables_and_axes


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # excludes the input embedding; routed experts at top_k / num_experts
    embedding: int
    routed_experts: int  # all routed expert weights (the part that is sparsely active)


def _is_routed_expert(spec) -> bool:
    names = [a for a in tuple(spec) if a != "layers"]
    return bool(names) and names[0] == "exp"


@functools.lru_cache(maxsize=256)  # a whole-model trace each; sweeps and MFU ask repeatedly
def count_params(cfg: ModelConfig) -> ParamCounts:
    """Total and active parameters of ``cfg`` (shapes only; works for the 2.78T config)."""
    shapes, specs = (tree["params"] for tree in abstract_variables_and_axes(cfg))
    sizes = jax.tree.leaves(jax.tree.map(lambda s: int(np.prod(s.shape)), shapes))
    routed_flags = jax.tree.leaves(jax.tree.map(
        _is_routed_expert, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    total = sum(sizes)
    routed = sum(n for n, r in zip(sizes, routed_flags) if r)
    embedding = cfg.vocab_size * cfg.d_model
    active_routed = 0
    if cfg.moe is not None and routed:
        active_routed = routed * cfg.moe.top_k / cfg.moe.num_experts
    active = round(total - routed + active_routed - embedding)
    return ParamCounts(total=total, active=active, embedding=embedding, routed_experts=routed)


def kda_core_flops(cfg: ModelConfig, convention: str = "paper") -> float:
    """FLOPs per token of one KDA layer's chunked recurrence (all heads), math §3.3."""
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


def mixer_flops_per_token(cfg: ModelConfig, seq_len: int, kda_convention: str = "paper") -> float:
    """Forward FLOPs per token of the sequence mixers' cores (KDA recurrence, MLA attention)."""
    return sum(kda_core_flops(cfg, kda_convention) if t == "kda" else mla_core_flops(cfg, seq_len)
               for t in cfg.layer_types)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, kda_convention: str = "paper") -> float:
    """Forward FLOPs per token: weight matmuls of the active parameters plus the sequence mixers."""
    return 2.0 * count_params(cfg).active + mixer_flops_per_token(cfg, seq_len, kda_convention)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, kda_convention: str = "paper") -> float:
    """Training FLOPs per token (forward + backward = 3 forwards)."""
    return 3.0 * forward_flops_per_token(cfg, seq_len, kda_convention)


# Dense bf16 peak per GPU (datasheet, without sparsity): the figure MFU is quoted against.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def peak_bf16_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device kind (``jax.devices()[0].device_kind``), None if unknown."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_kind), None)


def mfu_fn(cfg: ModelConfig, seq_len: int, device_kind: str, num_devices: int = 1):
    """``tokens/s -> model FLOP utilisation`` over ``num_devices``, or None where the peak is
    unknown (the CPU)."""
    peak = peak_bf16_flops(device_kind)
    if peak is None:
        return None
    flops = train_flops_per_token(cfg, seq_len)
    return lambda tokens_per_s: flops * tokens_per_s / (peak * num_devices)


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_value: int = 2) -> int:
    """MLA latent cache per token over all MLA layers (math §9): ``(kv_lora + rope) * bytes``."""
    m = cfg.mla
    return cfg.layer_types.count("mla") * (m.kv_lora_rank + m.qk_rope_head_dim) * bytes_per_value


def kda_state_bytes(cfg: ModelConfig) -> int:
    """Fixed fp32 KDA state per sequence over all KDA layers (math §9): ``H K V * 4`` each."""
    k = cfg.kda
    return cfg.layer_types.count("kda") * k.num_heads * k.head_dim * k.head_dim * 4


KDA_CONVENTIONS = ("paper", "implemented")


def accounting_rows(cfg: ModelConfig, seq_len: int) -> list[dict]:
    """Every figure of the three tables as rows ``{"table": ..., ...}`` (nothing allocated)."""
    counts = count_params(cfg)
    rows = [{"table": "params", "total": counts.total, "active": counts.active,
             "embedding": counts.embedding, "routed_experts": counts.routed_experts}]
    for convention in KDA_CONVENTIONS:
        rows.append({"table": "flops_per_token", "kda_convention": convention, "seq_len": seq_len,
                     "forward": forward_flops_per_token(cfg, seq_len, convention),
                     "train": train_flops_per_token(cfg, seq_len, convention)})
    latent = kv_cache_bytes_per_token(cfg)
    rows.append({"table": "cache", "seq_len": seq_len,
                 "mla_layers": cfg.layer_types.count("mla"),
                 "kda_layers": cfg.layer_types.count("kda"),
                 "mla_latent_bytes_per_token": latent,
                 "mla_latent_bytes_per_sequence": latent * seq_len,
                 "kda_state_bytes_per_sequence": kda_state_bytes(cfg)})
    return rows


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3f}{unit}"
    return f"{x:.0f}"


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_tables(name: str, rows: list[dict]) -> str:
    """The rows of :func:`accounting_rows` as three plain-text tables."""
    params = rows[0]
    flops = [r for r in rows if r["table"] == "flops_per_token"]
    cache = rows[-1]
    lines = [f"{name}: parameters",
             f"  total           {params['total']:>18,}  ({_si(params['total'])})",
             f"  active          {params['active']:>18,}  ({_si(params['active'])})",
             f"  embedding       {params['embedding']:>18,}",
             f"  routed experts  {params['routed_experts']:>18,}",
             "",
             f"{name}: FLOPs per token at seq_len {flops[0]['seq_len']}",
             f"  {'KDA convention':<16}{'forward':>12}{'train (3x)':>14}"]
    lines += [f"  {r['kda_convention']:<16}{_si(r['forward']):>12}{_si(r['train']):>14}"
              for r in flops]
    sizes = (("MLA latent (bf16), per token", cache["mla_latent_bytes_per_token"]),
             (f"MLA latent, per {cache['seq_len']}-token sequence",
              cache["mla_latent_bytes_per_sequence"]),
             ("KDA state (fp32), per sequence", cache["kda_state_bytes_per_sequence"]))
    layers = f"{cache['mla_layers']} MLA, {cache['kda_layers']} KDA layers"
    lines += ["", f"{name}: inference cache ({layers})"]
    lines += [f"  {label:<40}{_bytes(n)}" for label, n in sizes]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3jax.accounting",
                                     description="Parameters, FLOPs per token and cache sizes "
                                                 "of a preset (shapes only, nothing allocated).")
    parser.add_argument("--config", required=True,
                        help="preset file (configs/k3_small.py) or preset name (k3_small)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="context for MLA's FLOPs and cache "
                             "(default: the preset's data.seq_len)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    try:
        experiment = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seq_len = experiment.data.seq_len if args.seq_len is None else args.seq_len
    if seq_len <= 0:
        print(f"error: --seq-len={seq_len} is invalid: expected a positive integer",
              file=sys.stderr)
        return 2
    rows = accounting_rows(experiment.model, seq_len)
    if args.json:
        print("\n".join(json.dumps({"config": args.config, **r}) for r in rows))
    else:
        print(format_tables(Path(args.config).stem, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
