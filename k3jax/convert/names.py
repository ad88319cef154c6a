"""Which Hugging Face tensor holds which k3jax variable, and how the layouts differ.

:func:`tensor_map` lists one :class:`Entry` per Hugging Face tensor of a model: its name and torch
shape (``[out, in]`` for linear weights), the k3jax variable it fills (in the *unrolled* layout:
``("params", "layer_3", "mixer", "w_q")``; :func:`place` resolves scanned stacks), the expert index
when it is one routed expert's slice, and the two layout changes (``to_k3`` and ``to_hf``, plain
numpy functions of one array). The names follow the released files:

* prefix ``model.`` / ``lm_head.`` (Kimi Linear) or ``language_model.model.`` /
  ``language_model.lm_head.`` (K3);
* a layer's FFN is ``mlp.`` when dense and ``block_sparse_moe.`` when MoE (:func:`canonical` also
  accepts the other spelling, which transformers writes for dense layers);
* short convs stored separately ``[C, 1, W]``; experts one by one as ``w1`` (gate), ``w3`` (up),
  ``w2`` (down); the router bias ``gate.e_score_correction_bias`` (fp32, a buffer) goes to the
  ``balance`` collection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert.errors import ConversionError
from k3jax.stack import plan_segments

PREFIXES = {"kimi_linear": "", "kimi_k3": "language_model."}
# Tensors of a K3 file that the text model does not use.
IGNORED_PREFIXES = {"kimi_linear": (), "kimi_k3": ("vision_tower.", "mm_projector.")}
# Kept in fp32 in the released files and by transformers (the router and the KDA gate bias).
FP32_SUFFIXES = ("gate.weight", "gate.e_score_correction_bias", "self_attn.dt_bias")


def _t(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def _same(x: np.ndarray) -> np.ndarray:
    return x


@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor and the k3jax variable (or expert slice of one) it fills."""

    name: str
    shape: tuple[int, ...]
    target: tuple[str, ...]
    to_k3: Callable[[np.ndarray], np.ndarray] = _t
    to_hf: Callable[[np.ndarray], np.ndarray] = _t
    expert: int | None = None

    @property
    def keep_fp32(self) -> bool:
        return self.name.endswith(FP32_SUFFIXES)


def _linear(name: str, out: int, inp: int, target: tuple[str, ...], **kw) -> Entry:
    return Entry(f"{name}.weight", (out, inp), target, **kw)


def _vector(name: str, n: int, target: tuple[str, ...]) -> Entry:
    return Entry(name, (n,), target, _same, _same)


def _conv(name: str, channels: int, width: int, target: tuple[str, ...]) -> Entry:
    """``[C, 1, W]`` (torch depthwise conv, cross-correlation) <-> k3jax ``[W, C]``: both apply
    tap ``W - 1`` to the current token."""
    return Entry(f"{name}.weight", (channels, 1, width), target,
                 lambda x: _t(x[:, 0, :]), lambda w: np.ascontiguousarray(w.T[:, None, :]))


def a_log_to_k3(x: np.ndarray, heads: int, name: str) -> np.ndarray:
    """``A_log`` stored ``[1, 1, H, 1]``, ``[H]`` or flat with zero padding -> ``[H]``; padding
    that is not zero (only the data can tell) is a ConversionError naming ``name``."""
    flat = x.reshape(-1)
    if flat.size < heads or np.any(flat[heads:] != 0):
        raise ConversionError(f"{name}: expected {heads} head values then zero padding; got shape "
                         f"{tuple(x.shape)} with {np.count_nonzero(flat[heads:])} non-zero "
                         "padding entries")
    return flat[:heads].copy()


def _kda(cfg: ModelConfig, p: str, t: tuple[str, ...]) -> list[Entry]:
    k, d = cfg.kda, cfg.d_model
    hk = k.num_heads * k.head_dim
    out = [_linear(f"{p}q_proj", hk, d, t + ("w_q",)), _linear(f"{p}k_proj", hk, d, t + ("w_k",)),
           _linear(f"{p}v_proj", hk, d, t + ("w_v",)),
           _conv(f"{p}q_conv1d", hk, k.conv_size, t + ("conv_q",)),
           _conv(f"{p}k_conv1d", hk, k.conv_size, t + ("conv_k",)),
           _conv(f"{p}v_conv1d", hk, k.conv_size, t + ("conv_v",)),
           _linear(f"{p}f_a_proj", k.gate_rank, d, t + ("w_fa",)),
           _linear(f"{p}f_b_proj", hk, k.gate_rank, t + ("w_fb",)),
           Entry(f"{p}A_log", (1, 1, k.num_heads, 1), t + ("A_log",),
                 lambda x, h=k.num_heads, n=f"{p}A_log": a_log_to_k3(x, h, n),
                 lambda a: a.reshape(1, 1, -1, 1)),
           _vector(f"{p}dt_bias", hk, t + ("dt_bias",)),
           _linear(f"{p}b_proj", k.num_heads, d, t + ("w_beta",)),
           _vector(f"{p}o_norm.weight", k.head_dim, t + ("out_norm", "scale")),
           _linear(f"{p}o_proj", d, hk, t + ("w_o",))]
    if k.output_gate == "full":
        out.append(_linear(f"{p}g_proj", hk, d, t + ("w_g",)))
    else:
        out += [_linear(f"{p}g_a_proj", k.output_gate_rank, d, t + ("w_ga",)),
                _linear(f"{p}g_b_proj", hk, k.output_gate_rank, t + ("w_gb",))]
    return out


def _mla(cfg: ModelConfig, p: str, t: tuple[str, ...]) -> list[Entry]:
    m, d = cfg.mla, cfg.d_model
    h, kv = m.num_heads, m.qk_nope_head_dim + m.v_head_dim
    if m.q_lora_rank is None:
        out = [_linear(f"{p}q_proj", h * m.qk_head_dim, d, t + ("w_q",))]
    else:
        out = [_linear(f"{p}q_a_proj", m.q_lora_rank, d, t + ("w_qa",)),
               _vector(f"{p}q_a_layernorm.weight", m.q_lora_rank, t + ("q_norm", "scale")),
               _linear(f"{p}q_b_proj", h * m.qk_head_dim, m.q_lora_rank, t + ("w_qb",))]
    out += [_linear(f"{p}kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, d,
                    t + ("w_kva",)),
            _vector(f"{p}kv_a_layernorm.weight", m.kv_lora_rank, t + ("kv_norm", "scale")),
            # per head [k_nope | v] in both layouts
            _linear(f"{p}kv_b_proj", h * kv, m.kv_lora_rank, t + ("w_kvb",),
                    to_k3=lambda x, h=h, kv=kv: _t(x).reshape(x.shape[1], h, kv),
                    to_hf=lambda w: _t(w.reshape(w.shape[0], -1))),
            _linear(f"{p}o_proj", d, h * m.v_head_dim, t + ("w_o",))]
    if m.output_gate:
        out.append(_linear(f"{p}g_proj", h * m.v_head_dim, d, t + ("w_gate",)))
    return out


def _glu(p: str, d: int, m: int, t: tuple[str, ...]) -> list[Entry]:
    return [_linear(f"{p}gate_proj", m, d, t + ("w_gate",)),
            _linear(f"{p}up_proj", m, d, t + ("w_up",)),
            _linear(f"{p}down_proj", d, m, t + ("w_down",))]


def _moe(cfg: ModelConfig, p: str, t: tuple[str, ...], b: tuple[str, ...]) -> list[Entry]:
    mc, d = cfg.moe, cfg.d_model
    width, m = mc.latent_dim or d, mc.expert_intermediate
    out = [_linear(f"{p}gate", mc.num_experts, d, t + ("router",)),
           _vector(f"{p}gate.e_score_correction_bias", mc.num_experts, b + ("bias",))]
    for e in range(mc.num_experts):
        q = f"{p}experts.{e}."
        out += [_linear(f"{q}w1", m, width, t + ("expert_gate",), expert=e),
                _linear(f"{q}w3", m, width, t + ("expert_up",), expert=e),
                _linear(f"{q}w2", width, m, t + ("expert_down",), expert=e)]
    if mc.is_latent:
        out += [_linear(f"{p}routed_expert_down_proj", width, d, t + ("latent_down",)),
                _linear(f"{p}routed_expert_up_proj", d, width, t + ("latent_up",))]
        if mc.latent_norm:
            out.append(_vector(f"{p}routed_expert_norm.weight", width,
                               t + ("latent_norm", "scale")))
    if mc.shared_intermediate:
        out += _glu(f"{p}shared_experts.", d, mc.shared_intermediate, t + ("shared",))
    return out


def _attnres(p: str, d: int, t: tuple[str, ...]) -> list[Entry]:
    """Released mix: ``rmsnorm_noweight(v) . (norm.weight * proj.weight)`` = k3jax's
    ``query . RMSNorm_{key_norm}(v)`` with ``query = proj.weight[0]`` and
    ``key_norm = norm.weight``."""
    return [_vector(f"{p}_norm.weight", d, t + ("key_norm",)),
            Entry(f"{p}_proj.weight", (1, d), t + ("query",), lambda x: x[0].copy(),
                  lambda q: q[None, :].copy())]


def tensor_map(cfg: ModelConfig, layout: str) -> list[Entry]:
    """Every tensor of ``cfg`` in ``layout`` (``"kimi_linear"`` or ``"kimi_k3"``), in file order."""
    pre = PREFIXES[layout]
    d, attnres = cfg.d_model, cfg.residual.kind == "attnres"
    out = [Entry(f"{pre}model.embed_tokens.weight", (cfg.vocab_size, d), ("params", "embedding"),
                 _same, _same)]
    for i, (mixer, ffn) in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        p, t = f"{pre}model.layers.{i}.", ("params", f"layer_{i}")
        out += [_vector(f"{p}input_layernorm.weight", d, t + ("norm_mixer", "scale")),
                _vector(f"{p}post_attention_layernorm.weight", d, t + ("norm_ffn", "scale"))]
        out += (_kda if mixer == "kda" else _mla)(cfg, f"{p}self_attn.", t + ("mixer",))
        if ffn == "dense":
            out += _glu(f"{p}mlp.", d, cfg.dense_ffn.intermediate_size, t + ("ffn",))
        else:
            out += _moe(cfg, f"{p}block_sparse_moe.", t + ("ffn",),
                        ("balance", f"layer_{i}", "ffn"))
        if attnres:
            out += _attnres(f"{p}self_attention_res", d, t + ("residual_mixer",))
            out += _attnres(f"{p}mlp_res", d, t + ("residual_ffn",))
    out.append(_vector(f"{pre}model.norm.weight", d, ("params", "final_norm", "scale")))
    if attnres:
        out += _attnres(f"{pre}model.output_attn_res", d, ("params", "final_residual"))
    out.append(_linear(f"{pre}lm_head", cfg.vocab_size, d, ("params", "head")))
    return out


def canonical(name: str, known: set[str]) -> str:
    """``name`` as :func:`tensor_map` spells it: a layer's FFN may be stored as ``mlp.`` or
    ``block_sparse_moe.`` whatever its kind (transformers writes dense layers either way)."""
    if name in known:
        return name
    for a, b in ((".mlp.", ".block_sparse_moe."), (".block_sparse_moe.", ".mlp.")):
        other = name.replace(a, b, 1)
        if other in known:
            return other
    return name


def layer_places(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], int | None]]:
    """``"layer_i" -> (path inside a collection, index on the scanned axis or None)``."""
    out = {}
    for plan in plan_segments(cfg):
        for i in (*plan.prefix, *plan.suffix):
            out[f"layer_{i}"] = ((f"layer_{i}",), None)
        period = len(plan.group)
        for r in range(plan.repeats):
            for k in range(period):
                out[f"layer_{plan.scan_start + r * period + k}"] = ((plan.name, f"layer_{k}"), r)
    return out


def place(entry: Entry, places: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The variable path of ``entry`` and the leading indices (scan repeat, expert) it fills."""
    coll, *rest = entry.target
    index: tuple[int, ...] = ()
    if rest[0] in places:
        path, r = places[rest[0]]
        rest = [*path, *rest[1:]]
        index = () if r is None else (r,)
    if entry.expert is not None:
        index = (*index, entry.expert)
    return (coll, *rest), index


__all__ = [
    "IGNORED_PREFIXES",
    "Entry",
    "a_log_to_k3",
    "canonical",
    "layer_places",
    "place",
    "tensor_map",
]
