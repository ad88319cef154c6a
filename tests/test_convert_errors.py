"""Conversion errors name what is wrong; MXFP4 decoding by hand; the config mapping both ways."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from k3jax.config import ConfigError
from k3jax.convert import ConversionError, config_from_hf, config_to_hf, load_variables, mxfp4

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
KIMI_LINEAR = FIXTURES / "kimi_linear"


def _hf_config() -> dict:
    return json.loads((KIMI_LINEAR / "config.json").read_text())


def _tensors() -> dict:
    with safe_open(KIMI_LINEAR / "model.safetensors", "numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle)


def _write(directory: Path, tensors: dict) -> Path:
    directory.mkdir(exist_ok=True)
    shutil.copy(KIMI_LINEAR / "config.json", directory / "config.json")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _load(directory: Path):
    cfg, layout = config_from_hf(_hf_config())
    return load_variables(directory, cfg, layout)


# -- MXFP4 -----------------------------------------------------------------------------------------

def test_mxfp4_hand_computed_example():
    # one row of 32 values: bytes 0x21 -> (code 1, code 2) = (0.5, 1.0); 0xF7 -> (6.0, -6.0);
    # 0x98 -> (-0.0, -0.5); then zeros. Scale exponent 129 -> 2 ** 2 = 4.
    packed = np.zeros((1, 16), np.uint8)
    packed[0, :3] = [0x21, 0xF7, 0x98]
    scale = np.array([[129]], np.uint8)
    want = np.zeros((1, 32), np.float32)
    want[0, :6] = [2.0, 4.0, 24.0, -24.0, -0.0, -2.0]
    got = mxfp4.dequantize(packed, scale)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[0, 4])
    # a second group with its own scale (exponent 126 -> 0.5)
    two = mxfp4.dequantize(np.full((1, 32), 0x33, np.uint8), np.array([[127, 126]], np.uint8))
    np.testing.assert_array_equal(two[0, :32], np.full(32, 1.5, np.float32))
    np.testing.assert_array_equal(two[0, 32:], np.full(32, 0.75, np.float32))


def test_mxfp4_equals_compressed_tensors_decoder():
    expected = np.load(FIXTURES / "expected.npz")
    index = json.loads((FIXTURES / "kimi_k3" / "model.safetensors.index.json").read_text())
    checked = 0
    for key in expected.files:
        if not key.startswith("mxfp4/"):
            continue
        base = key[len("mxfp4/"):-len(".weight")]
        parts = {}
        for suffix in (".weight_packed", ".weight_scale"):
            shard = index["weight_map"][base + suffix]
            with safe_open(FIXTURES / "kimi_k3" / shard, "numpy") as f:
                parts[suffix] = f.get_tensor(base + suffix)
        got = mxfp4.dequantize(parts[".weight_packed"], parts[".weight_scale"])
        np.testing.assert_array_equal(got, expected[key])
        checked += 1
    assert checked > 0


def test_mxfp4_scale_shape_is_named():
    with pytest.raises(ValueError, match=r"experts\.0\.w1.*weight_scale has shape \(2, 2\)"):
        mxfp4.dequantize(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8),
                         name="experts.0.w1")


# -- tensors ---------------------------------------------------------------------------------------

def test_missing_unknown_and_misshaped_tensors_are_named(tmp_path):
    tensors = _tensors()
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    tensors["model.layers.1.self_attn.surprise.weight"] = np.zeros(3, np.float32)
    tensors["model.norm.weight"] = np.zeros(7, np.float32)
    with pytest.raises(ConversionError) as err:
        _load(_write(tmp_path / "bad", tensors))
    msg = str(err.value)
    assert "missing 2 tensor(s)" in msg and "layers.2.self_attn.kv_b_proj.weight" in msg
    assert "layers.1.block_sparse_moe.experts.3.w2.weight" in msg
    assert "unknown 1 tensor(s): model.layers.1.self_attn.surprise.weight" in msg
    assert "mis-shaped 1 tensor(s): model.norm.weight: (7,), expected (64,)" in msg


def test_mistyped_tensors_are_named_from_the_headers(tmp_path, monkeypatch):
    from k3jax.convert.files import HFDirectory

    tensors = _tensors()
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    expert = "model.layers.1.block_sparse_moe.experts.0.w1"
    out, inp = tensors.pop(f"{expert}.weight").shape
    tensors[f"{expert}.weight_packed"] = np.zeros((out, inp // 2), np.float32)
    tensors[f"{expert}.weight_scale"] = np.full((out, inp // mxfp4.GROUP), 127, np.uint8)
    directory = _write(tmp_path / "typed", tensors)

    def no_data(*args):
        raise AssertionError("tensor data read before the headers were checked")

    monkeypatch.setattr(HFDirectory, "read", no_data)
    monkeypatch.setattr(HFDirectory, "iter_shard", no_data)
    with pytest.raises(ConversionError) as err:
        _load(directory)
    msg = str(err.value)
    assert "mis-typed 2 tensor(s)" in msg and "model.norm.weight: I32, expected one of F16" in msg
    assert f"{expert}.weight_packed: F32, expected U8" in msg


def test_a_log_padding_must_be_zero(tmp_path, capsys):
    from k3jax.convert.__main__ import main

    tensors = _tensors()
    name = "model.layers.0.self_attn.A_log"
    tensors[name] = np.concatenate([tensors[name].reshape(-1), np.array([0.0, 0.5], np.float32)])
    directory = _write(tmp_path / "pad", tensors)
    message = r"A_log: expected 2 head values then zero padding.*1 non-zero"
    with pytest.raises(ConversionError, match=message):
        _load(directory)
    capsys.readouterr()
    assert main(["from-hf", str(directory), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert re.match("error: .*" + message, err[-1]), err


# -- export ----------------------------------------------------------------------------------------

def test_export_refuses_a_directory_holding_files(tmp_path):
    from k3jax.convert import export_variables
    from k3jax.model import abstract_variables

    cfg, _ = config_from_hf(_hf_config())
    variables = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_variables(cfg))
    export_variables(variables, cfg, tmp_path, max_shard_bytes=100_000)  # sharded, with an index
    with pytest.raises(FileExistsError, match=f"--out {tmp_path} is not empty"):
        export_variables(variables, cfg, tmp_path)


def _workdir(directory: Path, model) -> Path:
    """A workdir's config.json without any checkpoint: what to-hf checks before restoring."""
    from k3jax.config.experiment import DataConfig, ExperimentConfig

    directory.mkdir()
    config = ExperimentConfig(model=model, data=DataConfig(task="mqar"))
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    return directory


@pytest.mark.parametrize("case, message", [
    ("attnres", r"residual.kind='attnres'"),
    ("out", r"--out .* is not empty"),
    ("shard0", r"--max-shard-gb=0.0 is invalid: expected a positive size in GiB"),
    ("shard-1", r"--max-shard-gb=-1.0 is invalid"),
])
def test_to_hf_refuses_before_restoring(tmp_path, capsys, case, message):
    from k3jax.convert.__main__ import main

    cfg, _ = config_from_hf(_hf_config())
    if case == "attnres":
        cfg = cfg.replace(residual=cfg.residual.__class__(kind="attnres", block_size_layers=1))
    out = tmp_path / "hf"
    out.mkdir()
    if case == "out":
        (out / "model.safetensors.index.json").write_text("{}")
    shard = {"shard0": "0", "shard-1": "-1"}.get(case, "5")
    rc = main(["to-hf", str(_workdir(tmp_path / "run", cfg)), "--out", str(out),
               "--max-shard-gb", shard])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(message, err), err  # not: no checkpoint in this workdir


# -- config ----------------------------------------------------------------------------------------

def test_config_round_trip_and_released_style_schedule():
    cfg, layout = config_from_hf(_hf_config())
    assert layout == "kimi_linear" and config_from_hf(config_to_hf(cfg))[0] == cfg
    assert cfg.layer_types == ("kda", "kda", "mla", "kda", "mla")
    assert cfg.mla.latent_norm_eps == 1e-6 and cfg.rms_eps == 1e-5
    released = {k: v for k, v in _hf_config().items() if k not in ("layer_types",
                                                                    "mlp_layer_types")}
    released["linear_attn_config"] = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                                      "full_attn_layers": [3, 5], "kda_layers": [1, 2, 4]}
    released["first_k_dense_replace"] = 1
    assert config_from_hf(released)[0] == cfg


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters_scaled": 2.0}, r"field\(s\) k3jax cannot represent.*rope_parameters_scaled"),
    ({"num_key_value_heads": 1}, r"num_key_value_heads=1 cannot be represented"),
    ({"moe_renormalize": False}, r"moe_renormalize=False cannot be represented"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' cannot be represented"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings=True cannot be represented"),
    ({"num_expert_group": 4, "topk_group": 2}, r"num_expert_group=4 with topk_group=2"),
    ({"mlp_layer_types": ["dense", "sparse", "dense", "sparse", "sparse"]},
     r"mlp_layer_types=.*cannot be represented"),
    ({"linear_attn_config": {"num_heads": 2, "head_dim": 16, "full_attn_layers": [3],
                             "kda_layers": [1, 2, 4, 5]}}, r"schedules disagree"),
])
def test_unrepresentable_config_fields_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**_hf_config(), **change})


def test_export_refuses_what_kimi_linear_cannot_hold():
    cfg, _ = config_from_hf(_hf_config())
    k3_like = cfg.replace(residual=cfg.residual.__class__(kind="attnres", block_size_layers=1))
    with pytest.raises(ConfigError, match=r"residual.kind='attnres'"):
        config_to_hf(k3_like)
