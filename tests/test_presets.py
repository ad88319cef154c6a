"""Presets run on any machine: no corpus outside the repository, a stated fallback, synthetic tasks
at any vocabulary without bits per byte, and the tokenizer a run really used on record."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3jax.config.experiment import DataConfig, ExperimentConfig, apply_overrides, load_config
from k3jax.data import build_corpus, make_data
from k3jax.data import pipeline as pipeline_module
from k3jax.data.sources import STDLIB
from k3jax.train.loop import _eval_words, _recorded_config

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p for p in (ROOT / "configs").glob("*.py") if not p.name.startswith("_"))


class Stop(Exception):
    pass


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_needs_no_outside_corpus_and_says_what_it_trains_on(preset, monkeypatch,
                                                                   tmp_path):
    cfg = load_config(preset)
    assert cfg.data.sources == () and cfg.data.data_dir is None, cfg.data
    asked = {}

    def capture(sources, cache_dir, **kw):
        asked.update(sources=sources, **kw)
        raise Stop

    monkeypatch.setattr(pipeline_module, "cached_corpus", capture)
    lines = []
    with pytest.raises(Stop):
        make_data(cfg.data, cfg.model.vocab_size, tmp_path / "run", 1, log=lines.append)
    assert asked["sources"] == [STDLIB] and asked["tokenizer"] == cfg.data.tokenizer
    assert asked["vocab_size"] == cfg.model.vocab_size
    assert len(lines) == 1 and "no corpus given" in lines[0]
    assert "data.data_dir=DIR" in lines[0] and "python -m k3jax.data build" in lines[0]


def test_synthetic_task_takes_any_vocabulary_and_reports_no_bits_per_byte(tmp_path):
    cfg = apply_overrides(load_config(ROOT / "configs/k3_tiny.py"),
                          ["data.task=mqar", "model.vocab_size=64"])
    data = make_data(cfg.data, cfg.model.vocab_size, tmp_path, 1)
    assert not data.has_bytes and data.tokenizer is None
    assert int(data.train(0)["tokens"].max()) < 64
    words = _eval_words({"loss": 1.5, "accuracy": 0.25})
    assert "bits/byte" not in words and "accuracy 0.250" in words


def test_short_bpe_is_reported_and_the_run_records_the_tokenizer_it_used(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"d{i}.txt").write_text(f"note {i}: a few plain words, repeated. " * 30)
    lines = []
    corpus = build_corpus([str(src)], tmp_path / "corpus", tokenizer="bpe", vocab_size=4096,
                          heldout_fraction=0.2, log=lines.append)
    got = corpus.vocab_size
    assert got < 4096
    assert any(f"the BPE reached {got:,} tokens, fewer than the 4,096 asked" in m for m in lines)
    cfg = ExperimentConfig(data=DataConfig(data_dir=str(corpus.path), seq_len=16, batch_size=2))
    assert cfg.data.tokenizer == "byte"  # the default names what a build would use ...
    data = make_data(cfg.data, 4096, tmp_path, 1)
    recorded = _recorded_config(cfg, data)["data"]
    assert recorded["tokenizer"] == "bpe"  # ... the record says what made the tokens
    assert recorded["corpus"] == {"kind": "bpe", "vocab_size": got, "corpus": str(corpus.path)}
