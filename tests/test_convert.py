"""Hugging Face import/export against the PyTorch reference (fixtures: scripts/make_hf_fixtures.py).

The fixtures hold a tiny random Kimi Linear saved by transformers with its logits, the names, shapes
and dtypes transformers writes in bf16, and a K3-layout model with MXFP4 experts plus the
compressed-tensors decoding and the released AttnRes mix. No torch is needed here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open

from k3jax.convert import export_variables, load_variables, read_config
from k3jax.convert.files import HFDirectory
from k3jax.convert.names import layer_places, place, tensor_map
from k3jax.model import K3Model
from k3jax.ops.tolerance import rel_rms

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
KIMI_LINEAR, K3 = FIXTURES / "kimi_linear", FIXTURES / "kimi_k3"
# Whole-model fp32 parity with transformers: the same maths in fp32 through different kernels
# (rel RMS, math §10's metric); tighter than the op-level FP32_TOL because the model is tiny.
MODEL_FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def expected():
    return dict(np.load(FIXTURES / "expected.npz"))


def fp32_reference(cfg):
    """fp32 compute through the token-by-token KDA reference (the fastest to compile on a CPU; the
    chunked and kernel paths are held to it in tests/test_kda_ops.py)."""
    return cfg.replace(dtype="float32", kda=dataclasses.replace(cfg.kda, impl="reference"))


@pytest.fixture(scope="module")
def kimi_linear():
    cfg, layout = read_config(KIMI_LINEAR)
    cfg = fp32_reference(cfg)
    return cfg, layout, load_variables(KIMI_LINEAR, cfg, layout)


@functools.cache
def _forward(cfg):
    return jax.jit(K3Model(cfg).apply)


def _logits(cfg, variables, tokens):
    return _forward(cfg)(variables, tokens)


def test_kimi_linear_logits_equal_transformers(kimi_linear, expected):
    cfg, _, variables = kimi_linear
    logits = _logits(cfg, variables, expected["tokens"])
    assert rel_rms(expected["logits"], logits) <= MODEL_FP32_TOL
    # the router biases are part of the parity: without them the top-k and the logits change
    unbiased = {**variables, "balance": jax.tree.map(np.zeros_like, variables["balance"])}
    assert rel_rms(expected["logits"], _logits(cfg, unbiased, expected["tokens"])) > 1e-3


def test_export_then_import_is_identity(kimi_linear, tmp_path):
    cfg, layout, variables = kimi_linear
    files = export_variables(variables, cfg, tmp_path, dtype="float32", max_shard_bytes=200_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    again_cfg, again_layout = read_config(tmp_path)
    assert (fp32_reference(again_cfg), again_layout) == (cfg, layout)
    again = load_variables(tmp_path, cfg, layout)
    flat, flat_again = (jax.tree_util.tree_flatten_with_path(v)[0] for v in (variables, again))
    assert [p for p, _ in flat] == [p for p, _ in flat_again]
    for (path, a), (_, b) in zip(flat, flat_again):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), path


def test_exported_file_has_the_reference_names_shapes_and_dtypes(kimi_linear, tmp_path):
    cfg, _, variables = kimi_linear
    export_variables(variables, cfg, tmp_path)  # defaults: bf16, one file at this size
    reference = {k: (tuple(s), d) for k, (s, d) in
                 json.loads((FIXTURES / "kimi_linear_bf16.json").read_text()).items()}
    files = HFDirectory(tmp_path)
    names = {"BF16": "bfloat16", "F32": "float32"}
    got = {k: (files.shapes[k], names[files.dtypes[k]]) for k in files.shapes}
    assert got == reference
    exported = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((KIMI_LINEAR / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "hidden_size", "num_experts", "rms_norm_eps",
                "linear_head_dim", "linear_num_heads", "q_lora_rank", "routed_scaling_factor"):
        assert exported[key] == original[key], key


def test_dense_ffn_under_block_sparse_moe_is_accepted(tmp_path, kimi_linear):
    """transformers itself writes a dense layer's FFN under ``block_sparse_moe.``."""
    from safetensors.numpy import save_file

    cfg, layout, variables = kimi_linear
    with safe_open(KIMI_LINEAR / "model.safetensors", "numpy") as f:
        tensors = {k.replace("layers.0.mlp.", "layers.0.block_sparse_moe."): f.get_tensor(k)
                   for k in f.keys()}  # noqa: SIM118 (a safe_open handle)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((KIMI_LINEAR / "config.json").read_text())
    again = load_variables(tmp_path, cfg, layout)
    dense = variables["params"]["layer_0"]["ffn"]["w_gate"]
    assert np.array_equal(again["params"]["layer_0"]["ffn"]["w_gate"], dense)


# -- K3 layout -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def k3():
    cfg, layout = read_config(K3)
    cfg = fp32_reference(cfg)
    return cfg, layout, load_variables(K3, cfg, layout)


def test_k3_config_maps_every_k3_feature(k3):
    cfg, layout, _ = k3
    assert layout == "kimi_k3"
    assert (cfg.kda.gate, cfg.kda.lower_bound, cfg.kda.output_gate) == ("lower_bound", -5.0,
                                                                         "full")
    assert cfg.mla.output_gate and cfg.mla.q_lora_rank == 16 and cfg.mla.latent_norm_eps == 1e-6
    assert (cfg.residual.kind, cfg.residual.block_sublayers) == ("attnres", 2)
    assert (cfg.moe.latent_dim, cfg.moe.latent_norm, cfg.moe.activation) == (32, True, "situ_glu")
    assert (cfg.dense_ffn.situ_beta_gate, cfg.dense_ffn.situ_beta_up) == (4.0, 25.0)


def test_k3_attnres_mix_equals_the_released_formula(k3, expected):
    """``softmax_i(rmsnorm_noweight(v_i) . (norm.weight * proj.weight)) v_i`` from the K3 file's
    weights equals the imported model's mix (layer 2's FFN read)."""
    from k3jax.layers.attnres import AttnResidual, AttnResState

    cfg, _, variables = k3
    (path, index) = place(next(e for e in tensor_map(cfg, "kimi_k3")
                               if e.name.endswith("layers.2.mlp_res_proj.weight")),
                          layer_places(cfg))
    assert index == ()
    params = variables
    for k in path[:-1]:
        params = params[k]
    v = expected["attnres/sources"]
    state = AttnResState(tuple(v[:-1]), v[-1])
    mix = jax.jit(lambda params, state: AttnResidual(cfg).apply(  # one compile, not one per op
        {"params": params}, state, method=AttnResidual.mix))(params, state)
    assert rel_rms(expected["attnres/mix"], mix) <= MODEL_FP32_TOL


def test_k3_mxfp4_experts_equal_compressed_tensors_decoding(k3, expected):
    cfg, _, variables = k3
    places = layer_places(cfg)
    entries = {e.name: e for e in tensor_map(cfg, "kimi_k3")}
    checked = 0
    for key, want in expected.items():
        if not key.startswith("mxfp4/"):
            continue
        path, index = place(entries[key[len("mxfp4/"):]], places)
        leaf = variables
        for k in path:
            leaf = leaf[k]
        assert np.array_equal(np.asarray(leaf[index]), want.T), key
        checked += 1
    assert checked == 3 * cfg.moe.num_experts


def test_k3_model_runs_and_a_log_padding_is_dropped(k3, expected):
    cfg, _, variables = k3
    with safe_open(K3 / "model-00001-of-00002.safetensors", "numpy") as f:
        name = next(k for k in f.keys() if k.endswith("layers.0.self_attn.A_log"))  # noqa: SIM118
        stored = f.get_tensor(name)
    assert stored.shape[0] > cfg.kda.num_heads
    np.testing.assert_array_equal(variables["params"]["layer_0"]["mixer"]["A_log"],
                                  stored[:cfg.kda.num_heads])
    logits = _logits(cfg, variables, expected["tokens"])
    assert logits.shape == (*expected["tokens"].shape, cfg.vocab_size)
    assert np.all(np.isfinite(logits))
