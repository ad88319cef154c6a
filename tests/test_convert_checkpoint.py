"""``from-hf`` writes an ordinary k3jax workdir: evaluate reads it, train.py fine-tunes it, and
``to-hf`` writes its newest checkpoint back in the reference layout.

The model is a two-layer dense Kimi Linear (one KDA, one MLA layer) written with ``to-hf``'s
writer, so the training step compiles quickly; the MoE fixture's import is checked against
transformers in tests/test_convert.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

import train
from k3jax.convert import config_from_hf, export_variables, load_variables, read_config
from k3jax.convert.__main__ import main as convert_main
from k3jax.evaluate import evaluate_workdir, restore_workdir
from k3jax.model import abstract_variables

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "kimi_linear"
SETTINGS = ["data.task=mqar", "data.seq_len=16", "data.batch_size=8", "eval.batches=1",
            "eval.every=1", "train.steps=1", "train.log_every=1", "checkpoint.every=1",
            "checkpoint.async_save=false", "optim.warmup_steps=0", "model.dtype=float32",
            "model.kda.impl=reference"]


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _tiny_hf_dir(directory: Path) -> Path:
    """A random two-layer dense Kimi Linear in the released layout, with the fixture's token ids.
    Its weights are random values of the model's shapes (no initialiser to compile: what is tested
    is where each value goes, not what it is)."""
    original = json.loads((FIXTURE / "config.json").read_text())
    cfg, _ = config_from_hf({**original, "num_hidden_layers": 2, "hidden_size": 32,
                             "layer_types": ["linear_attention", "full_attention"],
                             "mlp_layer_types": ["dense", "dense"]})
    rng = np.random.default_rng(1)
    variables = jax.tree.map(lambda x: rng.normal(0.0, 0.1, x.shape).astype(x.dtype),
                             abstract_variables(cfg))
    export_variables(variables, cfg, directory, original_config=original)
    return directory


def test_from_hf_workdir_evaluates_fine_tunes_and_exports(tmp_path, restore_cache_config):
    hf_dir = _tiny_hf_dir(tmp_path / "source")
    out = tmp_path / "run"
    args = ["from-hf", str(hf_dir), "--out", str(out)]
    assert convert_main(args + [a for s in SETTINGS for a in ("--set", s)]) == 0
    assert convert_main(args) == 2  # never writes over an existing checkpoint

    cfg, state, meta = restore_workdir(out, log=lambda m: None)
    assert meta["step"] == 0 and int(state["step"]) == 0
    _, layout = read_config(hf_dir)
    direct = load_variables(hf_dir, cfg.model, layout)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(direct["params"]),
                                                    _leaves(state["params"])))

    result = evaluate_workdir(out, [], log=lambda m: None)
    assert result["step"] == 0 and np.isfinite(result["results"]["heldout"]["loss"])

    assert train.main(["--config", str(out / "config.json"), "--workdir", str(out)]) == 0
    tuned_cfg, tuned, tuned_meta = restore_workdir(out, log=lambda m: None)
    assert tuned_meta["step"] == 1 and tuned_cfg == cfg
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(direct["params"]),
                                                        _leaves(tuned["params"])))

    hf_out = tmp_path / "hf"
    assert convert_main(["to-hf", str(out), "--out", str(hf_out), "--dtype", "float32"]) == 0
    again = load_variables(hf_out, cfg.model, layout)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(tuned["params"]),
                                                    _leaves(again["params"])))
    exported = json.loads((hf_out / "config.json").read_text())
    original = json.loads((FIXTURE / "config.json").read_text())
    assert [exported[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")] == \
        [original[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")]


def test_from_hf_takes_a_preset_by_name(tmp_path):
    from configs.k3_tiny import get_config

    out = tmp_path / "run"
    assert convert_main(["from-hf", str(_tiny_hf_dir(tmp_path / "source")), "--out", str(out),
                         "--config", "k3_tiny"]) == 0
    cfg, _, _ = restore_workdir(out, log=lambda m: None)
    preset = get_config()
    assert (cfg.data, cfg.optim, cfg.train) == (preset.data, preset.optim, preset.train)
