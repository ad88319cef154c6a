"""Hugging Face ``config.json`` <-> :class:`~k3jax.config.ModelConfig`, both ways.

Two layouts are read: Kimi Linear (``model_type: kimi_linear``, as the released files and
transformers >= 5 write it) and Kimi K3 (``model_type: kimi_k3``, the text model under
``text_config``). Every field is either mapped, checked against the one value k3jax computes, or
known to leave the logits unchanged (token ids, cache switches, version stamps, RoPE settings under
NoPE); any other field is a :class:`ConfigError` naming it, so nothing that changes the maths is
dropped silently. Export writes the Kimi Linear layout only.

The MLA latent norms are not configured in either file: the released code builds them with the
RMSNorm default epsilon 1e-6 (``MLAConfig.latent_norm_eps``); the other norms use ``rms_norm_eps``.
"""

from __future__ import annotations

from typing import Any

from k3jax.config import (
    ConfigError,
    FFNConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    ResidualConfig,
)

LAYOUTS = ("kimi_linear", "kimi_k3")
LATENT_NORM_EPS = 1e-6

# Fields that do not change what a forward pass computes from token ids.
INERT = {"architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
         "transformers_version", "dtype", "torch_dtype", "model_max_length",
         "max_position_embeddings", "output_router_logits", "router_aux_loss_coef",
         "use_grouped_topk", "model_type", "initializer_range", "_name_or_path",
         "tokenizer_class", "chat_template"}
# RoPE settings, inert because the released MLA never rotates (``mla_use_nope``).
NOPE_INERT = {"rope_theta", "rope_scaling", "rope_parameters", "head_dim"}
K3_TOP_INERT = {"vision_config", "quantization_config", "media_placeholder_token_id",
                "ignore_index", "pad_token_id", "architectures", "auto_map", "model_type",
                "transformers_version", "dtype", "torch_dtype", "use_cache", "tie_word_embeddings",
                "_name_or_path"}
# Carried from the imported file on export (they steer tokenisation and generation, not logits).
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "model_max_length", "use_cache",
           "tokenizer_class", "chat_template")
HF_ACT = {"silu": "swiglu", "situ": "situ_glu"}
KDA, MLA_TYPE = "linear_attention", "full_attention"


class _Fields:
    """Reads fields of one config dict and remembers which were used, to name the rest."""

    def __init__(self, data: dict, where: str):
        self.data, self.where, self.used = data, where, set()

    def get(self, *names: str, default: Any = None) -> Any:
        """The first present of ``names`` (aliases), else ``default``."""
        self.used.update(names)
        for n in names:
            if n in self.data:
                return self.data[n]
        return default

    def need(self, *names: str) -> Any:
        value = self.get(*names, default=_MISSING)
        if value is _MISSING:
            raise ConfigError(f"{self.where}: missing field {names[0]!r}")
        return value

    def expect(self, name: str, allowed: tuple, why: str) -> Any:
        """A field k3jax represents only with the values ``allowed`` (absent: the first)."""
        value = self.get(name, default=allowed[0])
        if value not in allowed:
            raise ConfigError(f"{self.where}.{name}={value!r} cannot be represented in k3jax: "
                              f"{why}")
        return value

    def check_unknown(self, inert: set) -> None:
        unknown = sorted(set(self.data) - self.used - inert)
        if unknown:
            raise ConfigError(f"{self.where}: field(s) k3jax cannot represent (unknown to the "
                              f"converter, so their effect would be dropped): {unknown}")


_MISSING = object()


def config_from_hf(hf: dict) -> tuple[ModelConfig, str]:
    """A Hugging Face config dict -> ``(ModelConfig, layout)`` with ``layout`` in :data:`LAYOUTS`.

    Fields that only steer how k3jax runs (dtypes, kernels, scan, balancing rule) keep their
    defaults; change them with ``ModelConfig.replace`` or the CLI's ``--set model.X=...``.
    """
    kind = hf.get("model_type")
    if kind == "kimi_linear":
        return _text_config(_Fields(hf, "config"), "kimi_linear"), "kimi_linear"
    if kind == "kimi_k3":
        top = _Fields(hf, "config")
        text = top.need("text_config")
        top.check_unknown(K3_TOP_INERT)
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise ConfigError(f"config.text_config.model_type={text.get('model_type')!r}: "
                              "expected 'kimi_linear'")
        return _text_config(_Fields(text, "config.text_config"), "kimi_k3"), "kimi_k3"
    raise ConfigError(f"config.model_type={kind!r}: expected one of {LAYOUTS}")


def _text_config(f: _Fields, layout: str) -> ModelConfig:
    layers = f.need("num_hidden_layers")
    lin = _Fields(f.get("linear_attn_config", default={}) or {}, f"{f.where}.linear_attn_config")
    f.expect("tie_word_embeddings", (False,), "k3jax's head is untied")
    f.expect("attention_bias", (False,), "k3jax's projections have no bias")
    f.expect("attention_dropout", (0.0, 0), "k3jax has no dropout")
    f.expect("pretraining_tp", (1,), "tensor-parallel slicing of the reference is not mapped")
    f.expect("num_nextn_predict_layers", (0,), "multi-token-prediction layers are not modelled")
    f.expect("mla_use_nope", (True,), "the MLA of the released models is NoPE (never rotated)")
    act = f.get("hidden_act", default="silu")
    if act not in HF_ACT:
        raise ConfigError(f"{f.where}.hidden_act={act!r} cannot be represented in k3jax: expected "
                          f"one of {sorted(HF_ACT)}")
    glu = {"activation": HF_ACT[act]}
    if act == "situ":
        glu.update(situ_beta_gate=float(f.need("activation_situ_beta")),
                   situ_beta_up=float(f.need("activation_situ_linear_beta")))
    mla_layers = _mla_layers(f, lin, layers)
    kda = _kda_config(f, lin, layout)
    lin.check_unknown(set())
    heads = f.need("num_attention_heads")
    if f.get("num_key_value_heads", default=heads) != heads:
        raise ConfigError(f"{f.where}.num_key_value_heads={f.get('num_key_value_heads')!r} cannot "
                          f"be represented in k3jax: MLA has one latent per token and "
                          f"num_key_value_heads must equal num_attention_heads={heads}")
    mla = MLAConfig(num_heads=heads, q_lora_rank=f.get("q_lora_rank"),
                    kv_lora_rank=f.need("kv_lora_rank"),
                    qk_nope_head_dim=f.need("qk_nope_head_dim"),
                    qk_rope_head_dim=f.need("qk_rope_head_dim"), v_head_dim=f.need("v_head_dim"),
                    output_gate=bool(f.get("mla_use_output_gate", default=False)),
                    latent_norm_eps=LATENT_NORM_EPS)
    qk = f.get("qk_head_dim", default=mla.qk_head_dim)
    if qk != mla.qk_head_dim:
        raise ConfigError(f"{f.where}.qk_head_dim={qk} must equal qk_nope_head_dim + "
                          f"qk_rope_head_dim = {mla.qk_head_dim}")
    first_dense, moe = _moe_config(f, layers, glu)
    block = f.get("attn_res_block_size")
    residual = (ResidualConfig() if block is None
                else ResidualConfig(kind="attnres", block_size_layers=int(block)))
    every = _mla_every(mla_layers, layers)  # None: an explicit list, and mla_every goes unused
    cfg = ModelConfig(vocab_size=f.need("vocab_size"), d_model=f.need("hidden_size"),
                      num_layers=layers, mla_every=every or 4,
                      mla_layers=None if every else mla_layers,
                      first_k_dense=first_dense, kda=kda, mla=mla,
                      dense_ffn=FFNConfig(intermediate_size=f.need("intermediate_size"), **glu),
                      moe=moe, residual=residual, rms_eps=float(f.get("rms_norm_eps",
                                                                      default=1e-6)))
    f.check_unknown(INERT | NOPE_INERT)
    return cfg


def _mla_layers(f: _Fields, lin: _Fields, layers: int) -> tuple[int, ...]:
    """0-based MLA layers from ``layer_types`` or the 1-based lists of ``linear_attn_config``."""
    schedules = []
    types = f.get("layer_types")
    if types is not None:
        bad = sorted({t for t in types if t not in (KDA, MLA_TYPE)})
        if bad or len(types) != layers:
            raise ConfigError(f"{f.where}.layer_types: expected {layers} entries from "
                              f"{(KDA, MLA_TYPE)}; got {len(types)} with unknown {bad}")
        schedules.append(("layer_types", tuple(i for i, t in enumerate(types) if t == MLA_TYPE)))
    full, kda = lin.get("full_attn_layers"), lin.get("kda_layers")
    if full is not None or kda is not None:
        full, kda = list(full or []), list(kda or [])
        if sorted(full + kda) != list(range(1, layers + 1)):
            raise ConfigError(f"{lin.where}: full_attn_layers {full} and kda_layers {kda} "
                              f"(1-based) must together list every layer 1..{layers} once")
        schedules.append(("linear_attn_config", tuple(sorted(i - 1 for i in full))))
    if not schedules:
        raise ConfigError(f"{f.where}: no layer schedule (expected layer_types or "
                          "linear_attn_config.full_attn_layers / kda_layers)")
    if len({s for _, s in schedules}) > 1:
        raise ConfigError(f"{f.where}: the schedules disagree: " + "; ".join(
            f"{name} puts MLA at 0-based {s}" for name, s in schedules))
    return schedules[0][1]


def _mla_every(mla_layers: tuple[int, ...], layers: int) -> int | None:
    """The period ``p`` if the schedule is k3jax's rule (every ``p``-th and the last), else None."""
    for p in range(1, layers + 1):
        rule = {i for i in range(layers) if (i + 1) % p == 0} | {layers - 1}
        if rule == set(mla_layers):
            return p
    return None


def _kda_config(f: _Fields, lin: _Fields, layout: str) -> KDAConfig:
    heads = lin.get("num_heads", default=f.get("linear_num_heads", default=_MISSING))
    head_dim = lin.get("head_dim", default=f.get("linear_head_dim", default=_MISSING))
    conv = lin.get("short_conv_kernel_size", default=f.get("linear_conv_kernel_dim", default=4))
    if heads is _MISSING or head_dim is _MISSING:
        raise ConfigError(f"{f.where}: missing the KDA heads (linear_attn_config.num_heads and "
                          "head_dim, or linear_num_heads and linear_head_dim)")
    bound = lin.get("gate_lower_bound")
    gate = {"gate": "softplus"} if bound is None else {"gate": "lower_bound",
                                                       "lower_bound": float(bound)}
    full_gate = bool(lin.get("use_full_rank_gate", default=False))
    if layout == "kimi_linear" and (bound is not None or full_gate):
        raise ConfigError(f"{lin.where}: gate_lower_bound / use_full_rank_gate belong to the "
                          "kimi_k3 layout, not kimi_linear")
    # The released gates' bottlenecks (f_a, g_a) are head_dim wide.
    return KDAConfig(num_heads=heads, head_dim=head_dim, conv_size=conv, gate_rank=head_dim,
                     output_gate="full" if full_gate else "low_rank", output_gate_rank=head_dim,
                     **gate)


def _moe_config(f: _Fields, layers: int, glu: dict) -> tuple[int, MoEConfig | None]:
    """``(first_k_dense, MoEConfig or None)``: k3jax's FFN schedule is a dense prefix, then MoE."""
    types = f.get("mlp_layer_types")
    first = f.get("first_k_dense_replace")
    f.expect("moe_layer_freq", (1,), "every layer after the dense prefix is MoE in k3jax")
    if types is not None:
        dense = [i for i, t in enumerate(types) if t == "dense"]
        if (len(types) != layers or set(types) - {"dense", "sparse"}
                or dense != list(range(len(dense)))):
            raise ConfigError(f"{f.where}.mlp_layer_types={types} cannot be represented in k3jax: "
                              f"expected {layers} entries, 'dense' for a prefix, then 'sparse'")
        if first is not None and first != len(dense):
            raise ConfigError(f"{f.where}: first_k_dense_replace={first} disagrees with "
                              f"mlp_layer_types ({len(dense)} dense layers)")
        first = len(dense)
    first = 1 if first is None else first
    fields = ("num_experts", "num_local_experts", "num_experts_per_token", "num_experts_per_tok",
              "moe_intermediate_size", "num_shared_experts", "n_shared_experts",
              "routed_scaling_factor", "moe_renormalize", "norm_topk_prob", "num_expert_group",
              "n_group", "topk_group", "moe_router_activation_func", "routed_expert_hidden_size",
              "latent_moe_use_norm")
    if first >= layers:
        f.used.update(fields)  # no MoE layer: its settings change nothing
        return layers, None
    f.expect("moe_router_activation_func", ("sigmoid",), "k3jax's router is a sigmoid")
    renorm = f.get("moe_renormalize", "norm_topk_prob", default=True)
    if renorm is not True:
        raise ConfigError(f"{f.where}.moe_renormalize={renorm!r} cannot be represented in k3jax: "
                          "the top-k weights are always renormalised")
    groups, top_groups = f.get("num_expert_group", "n_group", default=1), f.get("topk_group")
    if groups != 1 and top_groups != groups:
        raise ConfigError(f"{f.where}: num_expert_group={groups} with topk_group={top_groups} "
                          "cannot be represented in k3jax (group-limited routing)")
    inter = f.need("moe_intermediate_size")
    latent = f.get("routed_expert_hidden_size")
    return first, MoEConfig(
        num_experts=f.need("num_experts", "num_local_experts"),
        top_k=f.need("num_experts_per_token", "num_experts_per_tok"),
        expert_intermediate=inter, latent_dim=latent,
        latent_norm=bool(f.get("latent_moe_use_norm", default=True)),
        shared_intermediate=inter * f.get("num_shared_experts", "n_shared_experts", default=0),
        routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)),
        balancing="aux_free" if latent is None else "quantile_hist", **glu)


# -- export --------------------------------------------------------------------------------------

def config_to_hf(cfg: ModelConfig, original: dict | None = None) -> dict:
    """A Kimi Linear ``config.json`` dict that transformers (>= 5) and the released code read.

    ``original``: the imported file's config, whose token ids and generation settings
    (:data:`CARRIED`) are kept; without it they are ``None`` (transformers' defaults are the
    released vocabulary's ids). Raises :class:`ConfigError` naming every k3jax setting the Kimi
    Linear layout cannot hold.
    """
    _check_exportable(cfg)
    k, m, moe = cfg.kda, cfg.mla, cfg.moe
    mla = [i for i, t in enumerate(cfg.layer_types) if t == "mla"]
    carried = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
               **{k: v for k, v in (original or {}).items() if k in CARRIED}}
    out = {
        **carried, "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers, "intermediate_size": cfg.dense_ffn.intermediate_size,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "mla_use_nope": True,
        "layer_types": [MLA_TYPE if i in mla else KDA for i in range(cfg.num_layers)],
        "mlp_layer_types": ["dense" if t == "dense" else "sparse" for t in cfg.mlp_types],
        "linear_num_heads": k.num_heads, "linear_head_dim": k.head_dim,
        "linear_conv_kernel_dim": k.conv_size,
        "linear_attn_config": {
            "num_heads": k.num_heads, "head_dim": k.head_dim,
            "short_conv_kernel_size": k.conv_size,
            "full_attn_layers": [i + 1 for i in mla],
            "kda_layers": [i + 1 for i in range(cfg.num_layers) if i not in mla]},
        "first_k_dense_replace": cfg.dense_layers, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
    }
    if moe is not None:
        out.update({
            "num_experts": moe.num_experts, "num_experts_per_token": moe.top_k,
            "moe_intermediate_size": moe.expert_intermediate,
            "num_shared_experts": moe.shared_intermediate // moe.expert_intermediate,
            "routed_scaling_factor": moe.routed_scaling_factor, "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1})
    return out


def _check_exportable(cfg: ModelConfig) -> None:
    k, m, moe = cfg.kda, cfg.mla, cfg.moe
    bad = []
    want = [("kda.gate", k.gate, "softplus"), ("kda.output_gate", k.output_gate, "low_rank"),
            ("kda.gate_rank", k.gate_rank, k.head_dim),
            ("kda.output_gate_rank", k.output_gate_rank, k.head_dim),
            ("kda.allow_neg_eigval", k.allow_neg_eigval, False), ("mla.rope", m.rope, False),
            ("mla.output_gate", m.output_gate, False),
            ("mla.latent_norm_eps", m.latent_norm_eps, LATENT_NORM_EPS),
            ("residual.kind", cfg.residual.kind, "plain"),
            ("dense_ffn.activation", cfg.dense_ffn.activation, "swiglu")]
    if moe is not None:
        want += [("moe.latent_dim", moe.latent_dim, None), ("moe.activation", moe.activation,
                                                            "swiglu")]
        if moe.shared_intermediate % moe.expert_intermediate:
            bad.append(f"moe.shared_intermediate={moe.shared_intermediate} (must be a multiple "
                       f"of moe.expert_intermediate={moe.expert_intermediate})")
    bad += [f"{name}={have!r} (the layout needs {need!r})" for name, have, need in want
            if have != need]
    if bad:
        raise ConfigError("the Kimi Linear layout cannot hold this model: " + "; ".join(bad))


__all__ = ["LAYOUTS", "config_from_hf", "config_to_hf"]
