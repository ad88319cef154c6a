"""The KDA and MLA layers and the MoE block against plain fp32 references written from the math.

The other layer tests hold a layer's paths to each other (chunked vs recurrent, absorbed vs
expanded, ragged vs dense); a gate or norm misplaced in a piece every path shares passes them. Each
reference below is the equations of docs/math.md written out with plain jnp on the layer's own
parameters, read by name. Values and input gradients are held to ``FP32_TOL`` (math §10: the same
math in another order, fp32).
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import document_numbers, small_config

from k3jax.config import ModelConfig, MoEConfig
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import MLALayer
from k3jax.layers.moe import MoEBlock
from k3jax.ops.kda_reference import kda_reference
from k3jax.ops.tolerance import FP32_TOL, rel_rms

B, T = 2, 24
sigmoid = jax.nn.sigmoid


def _segments(middle_run: int) -> np.ndarray:
    """``[B, T]`` packed rows: row 0 holds two documents; row 1 three, the third under the first's
    id again after a run of ``middle_run`` tokens (a new run is a new document, math §2)."""
    seg = np.zeros((B, T), np.int32)
    seg[0, 10:] = 1
    seg[1, 5:5 + middle_run] = 1
    return seg


def _variables(module, x, **kw):
    """The module's initial variables with every parameter moved by N(0, 0.3^2): as initialised, the
    norm weights are 1 and the lower-bound gate's ``A_log`` is 0, so a weight applied in the wrong
    place, or ``A_log`` ignored, would pass."""
    v = nn.meta.unbox(_jitted_init(module, tuple(kw.items()))(jax.random.key(0), x))
    leaves, tree = jax.tree.flatten(v["params"])
    rng = np.random.default_rng(1)
    moved = [np.asarray(p) + 0.3 * rng.standard_normal(p.shape).astype(p.dtype) for p in leaves]
    return {**v, "params": jax.tree.unflatten(tree, moved)}


@functools.lru_cache(maxsize=None)
def _jitted_init(module, kw):
    """One compiled initialiser per module (modules of equal configs are equal)."""
    return jax.jit(functools.partial(module.init, **dict(kw)))


def _x(seed: int, shape, scale: float = 1.0) -> np.ndarray:
    return scale * np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_input_grad(f, args, x):
    """``f(*args, x)`` and the gradient of ``sum(f(*args, x) * c)`` with respect to ``x``, for a
    random cotangent ``c`` (which weighs every output). ``f`` is static (one compile per function
    object), its other arguments traced: cases that differ only in the parameters' values or the
    segment ids run one compiled program."""
    out, pull = jax.vjp(lambda x: f(*args, x), x)
    return out, pull(_x(99, x.shape))[0]


def _assert_layer_is_formula(layer, want, x, tol=FP32_TOL):
    """The ``layer`` (an ``(f, args)`` pair, run as ``f(*args, x)``) gives the formula's output
    and input gradient ``want`` (:func:`_value_and_input_grad` of the formula) within ``tol``."""
    got = _value_and_input_grad(*layer, x)
    for what, ref, out in zip(("output", "input gradient"), want, got):
        err = rel_rms(ref, out)
        assert err <= tol, f"{what}: relative RMS error {err:.3g} against the formula"


@functools.lru_cache(maxsize=None)
def _applied(module):
    """``(variables, segment_ids, x) -> module.apply(...)``, one function object per module (its
    compiled program shared by every case of that module)."""
    return lambda v, seg, x: module.apply(v, x, segment_ids=seg)


@functools.lru_cache(maxsize=None)
def _bound(formula, cfg: ModelConfig):
    """``formula(cfg, ...)`` with ``cfg`` bound: one function object per pair (its compiled
    program shared by the cases that differ in parameters or segment ids)."""
    return functools.partial(formula, cfg)


def _rms_norm(x, w, eps):
    # RMSNorm(x) = x (mean(x^2) + eps)^(-1/2) w over the last axis (math, Conventions).
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _split_heads(a, head_dim):
    return a.reshape(*a.shape[:-1], -1, head_dim)


def _merge_heads(a):
    return a.reshape(*a.shape[:-2], -1)


# -- KDA (math §3.1, with the recurrence of §3.2) -------------------------------------------------

def _conv_silu(u, w, doc):
    """Step 2: ``SiLU(sum_i w[W-1-i] u[t-i])``, a tap before the row or in another document
    reading zero. ``u [B, T, C]``, ``w [W, C]``, ``doc [B, T]``."""
    width, t = w.shape[0], u.shape[1]
    y = 0.0
    for i in range(width):  # i steps back
        back = jnp.pad(u, ((0, 0), (i, 0), (0, 0)))[:, :t]
        same_doc = jnp.pad(doc, ((0, 0), (i, 0)), constant_values=-1)[:, :t] == doc
        y = y + jnp.where(same_doc[..., None], back, 0.0) * w[width - 1 - i]
    return jax.nn.silu(y)


def _kda_formula(cfg: ModelConfig, p, doc, x):
    """``doc [B, T]``: :func:`~helpers.document_numbers` of the segment ids."""
    k = cfg.kda
    heads = functools.partial(_split_heads, head_dim=k.head_dim)
    # Steps 1-2: q = x W_q, k = x W_k, v = x W_v, each through its causal short conv and SiLU.
    q, kk, v = (heads(_conv_silu(x @ p[proj], p[conv], doc))
                for proj, conv in (("w_q", "conv_q"), ("w_k", "conv_k"), ("w_v", "conv_v")))

    # Step 3: q / sqrt(sum_c q_c^2 + 1e-6) per head, the same for k.
    def l2(a):
        return a / jnp.sqrt(jnp.sum(a * a, axis=-1, keepdims=True) + 1e-6)

    # Step 4: f = (x W_fa) W_fb + b_dt, then the log-decay g of the configured form.
    f = heads((x @ p["w_fa"]) @ p["w_fb"] + p["dt_bias"])
    a = jnp.exp(p["A_log"])[:, None]  # e^{A_h}, one per head
    if k.gate == "softplus":
        g = -a * jax.nn.softplus(f)
    else:
        g = k.lower_bound * sigmoid(a * f)
    # Step 5: beta = sigmoid(x W_beta).
    beta = sigmoid(x @ p["w_beta"])
    # Step 6: the recurrence of §3.2 with q scaled by K^(-1/2), the state reset at each document.
    o, _ = kda_reference(l2(q), l2(kk), v, g, beta, scale=k.head_dim ** -0.5, segment_ids=doc)
    # Step 7: y = RMSNorm_head(o) * sigmoid(G), G = x W_g (full) or (x W_ga) W_gb (low rank).
    gate = x @ p["w_g"] if k.output_gate == "full" else (x @ p["w_ga"]) @ p["w_gb"]
    y = _rms_norm(o, p["out_norm"]["scale"], cfg.rms_eps) * sigmoid(heads(gate))
    # Step 8: out = y W_o.
    return _merge_heads(y) @ p["w_o"]


def _check_kda(gate: str, output_gate: str, impls, seg: np.ndarray):
    """The layer with each core path in ``impls`` against one evaluation of the formula (the
    parameters do not depend on the path)."""
    cfg = small_config()
    cfg = cfg.replace(kda=dataclasses.replace(cfg.kda, gate=gate, output_gate=output_gate))
    x = _x(0, (B, T, cfg.d_model))
    v = _variables(KDALayer(cfg), x)
    doc = jnp.asarray(document_numbers(seg))
    formula = _value_and_input_grad(_bound(_kda_formula, cfg), (v["params"], doc), x)
    for impl in impls:
        layer = KDALayer(cfg.replace(kda=dataclasses.replace(cfg.kda, impl=impl)))
        _assert_layer_is_formula((_applied(layer), (v, jnp.asarray(seg))), formula, x)


@pytest.mark.parametrize("gate,output_gate", [("lower_bound", "full"), ("softplus", "low_rank")])
def test_kda_layer_is_its_formula(gate, output_gate):
    """K3's form (lower-bound gate, full-rank output gate) and Kimi Linear's (softplus, rank-limited
    output gate), each with both core paths (reference and chunked) against one evaluation of the
    formula, packed rows (an id returning after a run of 12 tokens); the chunked path crosses a
    chunk boundary (T = 24, C = 16)."""
    _check_kda(gate, output_gate, ("reference", "chunked"), _segments(middle_run=12))


def test_kda_conv_stops_at_a_document_whose_id_returns_soon():
    """An id back after a run shorter than the convolution's W - 1 = 3 taps: the returning
    document's first tokens must not read the earlier document of that id. (The segment ids are
    traced: the programs of the test above, run on other ids.)"""
    _check_kda("lower_bound", "full", ("reference",), _segments(middle_run=2))


# -- MLA (math §4) -------------------------------------------------------------------------------

def _mla_formula(cfg: ModelConfig, p, doc, x):
    """``doc [B, T]``: :func:`~helpers.document_numbers` of the segment ids."""
    m = cfg.mla
    nope, rope, lat, eps = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.latent_norm_eps
    # Query: c_q = RMSNorm(x W_qa), q = c_q W_qb; head h's query is [q_nope | q_rope].
    q = _split_heads(_rms_norm(x @ p["w_qa"], p["q_norm"]["scale"], eps) @ p["w_qb"], nope + rope)
    # Keys and values: [c_kv | k_rope] = x W_kva, c = RMSNorm(c_kv), [k_nope_h | v_h] = c W_kvb,h.
    kv = x @ p["w_kva"]
    c, k_rope = _rms_norm(kv[..., :lat], p["kv_norm"]["scale"], eps), kv[..., lat:]
    kv_heads = jnp.einsum("btl,lhe->bthe", c, p["w_kvb"])
    k_nope, v = kv_heads[..., :nope], kv_heads[..., nope:]
    # Head h's key is [k_nope_h | k_rope], the rope slice shared by every head, unrotated (NoPE).
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + (rope,))],
                        axis=-1)
    # Scores times (nope + rope)^(-1/2), softmax over the token and earlier ones of its document.
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(nope + rope)
    allowed = jnp.tril(jnp.ones((T, T), bool)) & (doc[:, None, :, None] == doc[:, None, None, :])
    o = jnp.einsum("bhts,bshd->bthd",
                   jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1), v)
    # K3's output gate o_h * sigmoid(x W_gate)_h, then out = [o_1 | ... | o_H] W_o.
    return (_merge_heads(o) * sigmoid(x @ p["w_gate"])) @ p["w_o"]


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_mla_layer_is_its_formula(scale):
    """Query LoRA, output gate, NoPE (K3's form); packed rows, one with an id returning after a
    run of 2 tokens. At ``scale = 1e-3`` the latents' mean square (about 3e-6) is near
    ``latent_norm_eps``, so the epsilon itself is checked: the decoder's 1e-5 in either latent norm
    moves the output by tens of percent."""
    cfg = small_config()
    assert cfg.mla.q_lora_rank and cfg.mla.output_gate and not cfg.mla.rope
    seg = _segments(middle_run=2)
    layer, x = MLALayer(cfg), _x(1, (B, T, cfg.d_model), scale)
    v = _variables(layer, x)
    want = _value_and_input_grad(_bound(_mla_formula, cfg), (v["params"], document_numbers(seg)),
                                 x)
    _assert_layer_is_formula((_applied(layer), (v, jnp.asarray(seg))), want, x)


# -- Stable LatentMoE and the plain MoE (math §6) -------------------------------------------------

def _glu_mlp(z, w_gate, w_up, w_down, mc: MoEConfig):
    """``act(z W_gate, z W_up) W_down``, SiTU-GLU or SwiGLU as math §6 writes them."""
    a, b = z @ w_gate, z @ w_up
    if mc.activation == "swiglu":
        h = jax.nn.silu(a) * b
    else:  # [beta_g tanh(a / beta_g) sigmoid(a)] [beta_u tanh(b / beta_u)]
        bg, bu = mc.situ_beta_gate, mc.situ_beta_up
        h = (bg * jnp.tanh(a / bg) * sigmoid(a)) * (bu * jnp.tanh(b / bu))
    return h @ w_down


def _moe_formula(p, bias, cfg: ModelConfig, x):
    """math §6, one token at a time (mapped over the tokens by ``vmap``)."""
    mc = cfg.moe
    glu = functools.partial(_glu_mlp, mc=mc)
    p = jax.tree.map(jnp.asarray, p)  # indexed below by traced expert ids

    def token(xn):
        s = sigmoid(xn @ p["router"])                               # s = sigmoid(x W_router)
        ids = jnp.argsort(-(s + bias))[:mc.top_k]                   # ids = top_k(s + bias)
        w = s[ids] / (jnp.sum(s[ids]) + 1e-20) * mc.routed_scaling_factor  # unbiased weights
        z = xn @ p["latent_down"] if mc.is_latent else xn           # z = x W_down
        u = sum(w[j] * glu(z, p["expert_gate"][e], p["expert_up"][e], p["expert_down"][e])
                for j, e in enumerate(ids))                         # u = sum_j w_j Expert_ids_j(z)
        if mc.is_latent:                                            # u = RMSNorm_latent(u) W_up
            u = _rms_norm(u, p["latent_norm"]["scale"], cfg.rms_eps) @ p["latent_up"]
        shared = p["shared"]                                        # + Shared(x), full width
        return u + glu(xn, shared["w_gate"], shared["w_up"], shared["w_down"])

    return jax.vmap(token)(x.reshape(-1, cfg.d_model)).reshape(x.shape)


@pytest.mark.parametrize("latent_dim,activation,rsf", [(16, "situ_glu", 1.0),
                                                       (None, "swiglu", 2.446)])
def test_moe_block_is_its_formula(latent_dim, activation, rsf):
    """Stable LatentMoE (K3: latent, SiTU-GLU, factor 1) and the plain MoE (Kimi Linear: SwiGLU,
    factor 2.446), with a router bias that changes the choice of a good share of the tokens, so a
    bias used in the weights, or not used to choose, shows."""
    mc = MoEConfig(num_experts=8, top_k=2, expert_intermediate=16, shared_intermediate=24,
                   latent_dim=latent_dim, activation=activation, routed_scaling_factor=rsf)
    cfg = ModelConfig(d_model=32, moe=mc, dtype="float32", init_std=0.1)
    block, x = MoEBlock(cfg), _x(2, (2, 8, cfg.d_model))
    v = _variables(block, x, deterministic=True)
    bias = 0.3 * np.random.default_rng(3).standard_normal(mc.num_experts).astype(np.float32)
    v = {**v, "balance": {"bias": bias}}

    def chosen(scores):
        return np.sort(np.argsort(-scores, axis=-1)[:, :mc.top_k], axis=-1)

    s = np.asarray(sigmoid(x.reshape(-1, cfg.d_model) @ v["params"]["router"]))
    assert np.mean(np.any(chosen(s + bias) != chosen(s), axis=-1)) >= 0.25

    formula = lambda p, bias, x: _moe_formula(p, bias, cfg, x)  # noqa: E731
    _assert_layer_is_formula((lambda v, x: block.apply(v, x, deterministic=True), (v,)),
                             _value_and_input_grad(formula, (v["params"], bias), x), x)
