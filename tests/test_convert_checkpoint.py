"""``from-hf`` writes an ordinary k3jax workdir: evaluate reads it, train.py fine-tunes it, and
``to-hf`` writes its newest checkpoint back in the reference layout."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

import train
from k3jax.convert import load_variables, read_config
from k3jax.convert.__main__ import main as convert_main
from k3jax.evaluate import evaluate_workdir, restore_workdir

KIMI_LINEAR = Path(__file__).parent / "fixtures" / "hf" / "kimi_linear"
SETTINGS = ["data.task=mqar", "data.seq_len=16", "data.batch_size=8", "eval.batches=1",
            "eval.every=1", "train.steps=1", "train.log_every=1", "checkpoint.every=1",
            "checkpoint.async_save=false", "optim.warmup_steps=0", "model.dtype=float32",
            "model.kda.impl=reference"]


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_from_hf_workdir_evaluates_fine_tunes_and_exports(tmp_path):
    out = tmp_path / "run"
    args = ["from-hf", str(KIMI_LINEAR), "--out", str(out)]
    assert convert_main(args + [a for s in SETTINGS for a in ("--set", s)]) == 0
    assert convert_main(args) == 2  # never writes over an existing checkpoint

    cfg, state, meta = restore_workdir(out, log=lambda m: None)
    assert meta["step"] == 0 and int(state["step"]) == 0
    model, layout = read_config(KIMI_LINEAR)
    direct = load_variables(KIMI_LINEAR, cfg.model, layout)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(direct["params"]),
                                                    _leaves(state["params"])))
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(direct["balance"]),
                                                    _leaves(state["balance"])))

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
