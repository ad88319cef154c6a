"""Dotted ``--set`` overrides: typed by the dataclass fields, errors name the key and close
matches."""

import json

import pytest

from k3jax.config import ConfigError
from k3jax.config.experiment import (
    PRESETS,
    ExperimentConfig,
    apply_overrides,
    from_dict,
    load_config,
)


def test_overrides_are_typed_and_nested():
    cfg = apply_overrides(ExperimentConfig(), [
        "model.d_model=256", "train.steps=500", "optim.lr=1e-3", "model.mla_layers=1,3",
        "optim.clip_norm=none", "checkpoint.async_save=false", "eval.tasks=mqar,parity",
        "model.moe.num_experts=4", "data.tokenizer=bpe", "model.vocab_size=512"])
    assert cfg.model.d_model == 256 and isinstance(cfg.model.d_model, int)
    assert cfg.train.steps == 500 and cfg.optim.lr == 1e-3
    assert cfg.model.mla_layers == (1, 3) and cfg.optim.clip_norm is None
    assert cfg.checkpoint.async_save is False and cfg.eval.tasks == ("mqar", "parity")
    assert cfg.model.moe is not None and cfg.model.moe.num_experts == 4  # created on demand
    assert cfg.data.tokenizer == "bpe"


@pytest.mark.parametrize("item, must_mention", [
    ("model.d_modle=3", ["d_modle", "model.d_model"]),
    ("trian.steps=3", ["trian", "train.steps"]),
    ("optim.lrr=0.1", ["lrr", "optim.lr"]),
    ("model.d_model=abc", ["model.d_model", "'abc'", "integer"]),
    ("model.d_model=-1", ["model.d_model", "-1", "positive"]),
    ("train.steps=1.5", ["train.steps", "integer"]),
    ("optim.name=sgd", ["optim.name", "sgd", "adamw", "muon"]),
    ("checkpoint.async_save=maybe", ["checkpoint.async_save", "boolean"]),
    ("model.dtype=fp32", ["model.dtype", "fp32", "bfloat16"]),
    ("eval.tasks=mqar,lambada", ["eval.tasks", "lambada"]),
    ("train.steps", ["KEY=VALUE"]),
    ("train.steps.x=1", ["train.steps", "not a nested config"]),
    ("optim.lr=inf", ["optim.lr", "inf", "finite"]),
    ("optim.weight_decay=nan", ["optim.weight_decay", "finite"]),
    ("optim.clip_norm=inf", ["optim.clip_norm", "finite"]),
    ("data.seed=-3", ["data.seed", "-3", ">= 0"]),
    ("mesh.rules=((batch,data),)", ["mesh.rules", "a table", "preset file"]),
    ("train.seed=-1", ["train.seed", ">= 0"]),
])
def test_bad_overrides_name_the_key(item, must_mention):
    with pytest.raises(ConfigError) as err:
        apply_overrides(ExperimentConfig(), [item])
    for text in must_mention:
        assert text in str(err.value), (item, str(err.value))


@pytest.mark.parametrize("items, message", [
    (["train.steps=7", "train.steps=9"], "train.steps: set twice"),
    (["model.moe.top_k=4", "model.moe=default"], "model.moe: set field by field before"),
    (["model.moe=default", "model.moe.top_k=4"], "'moe' was already set as a whole"),
])
def test_an_override_never_silently_replaces_another(items, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(ExperimentConfig(), items)


def test_cross_field_validation_names_the_fields():
    with pytest.raises(ConfigError, match="micro_batches"):
        apply_overrides(ExperimentConfig(), ["data.batch_size=6", "train.micro_batches=4"])
    with pytest.raises(ConfigError, match="vocab_size"):
        apply_overrides(ExperimentConfig(), ["model.vocab_size=100"])


def test_json_round_trip_and_preset_loading(tmp_path, monkeypatch):
    cfg = apply_overrides(ExperimentConfig(), ["model.mla_layers=0,2", "eval.tasks=stack"])
    assert from_dict(ExperimentConfig, json.loads(json.dumps(cfg.to_dict()))) == cfg
    preset = tmp_path / "p.py"
    preset.write_text("from k3jax.config.experiment import ExperimentConfig, TrainConfig\n"
                      "def get_config():\n"
                      "    return ExperimentConfig(train=TrainConfig(steps=7))\n")
    assert load_config(preset).train.steps == 7
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.py")
    shipped = load_config(PRESETS / "k3_tiny.py")
    monkeypatch.chdir(tmp_path)  # not the repository root: the README's spelling still works
    assert load_config("k3_tiny") == load_config("k3_tiny.py") == shipped
    assert load_config("configs/k3_tiny.py") == shipped
    with pytest.raises(ConfigError, match="no such file"):
        load_config("elsewhere/k3_tiny.py")  # only the presets' own folder is looked up
    with pytest.raises(ConfigError, match=r"k3_nothing.: no such file \(.*/k3_nothing\.py\)"):
        load_config("k3_nothing")


def test_a_json_config_is_read_strictly(tmp_path):
    path = tmp_path / "config.json"
    recorded = ExperimentConfig().to_dict()
    recorded["data"]["corpus"] = {"kind": "byte"}  # what a run records beside its config
    path.write_text(json.dumps(recorded))
    assert load_config(path) == ExperimentConfig()
    recorded["optim"]["lrr"] = 1.0
    path.write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match=r"config.json'.*unknown key 'optim.lrr'.*optim.lr\?"):
        load_config(path)
    path.write_text("{'train': 1}")
    with pytest.raises(ConfigError, match="config.json'.*not valid JSON"):
        load_config(path)
