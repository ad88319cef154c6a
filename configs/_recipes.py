"""Experiment settings shared by presets (kept here so two presets never copy one recipe)."""

from __future__ import annotations


def released_scale_run(model):
    """The published recipe's shape of a run (Muon, WSD, 4K context, byte-level BPE) around a
    released-size model; for shape checks and accounting -- a real run needs a sharded multi-host
    setup and a corpus of its own (``--set data.sources=...`` or ``data.data_dir=...``)."""
    from k3jax.config.experiment import (
        CheckpointConfig,
        DataConfig,
        EvalConfig,
        ExperimentConfig,
        OptimConfig,
        TrainConfig,
    )

    return ExperimentConfig(
        model=model,
        data=DataConfig(tokenizer="bpe", seq_len=4096, batch_size=256),
        optim=OptimConfig(name="muon", lr=2e-3, schedule="wsd", warmup_steps=2000,
                          decay_fraction=0.2, weight_decay=0.1, clip_norm=1.0),
        train=TrainConfig(steps=100_000, micro_batches=8, log_every=10),
        checkpoint=CheckpointConfig(every=1000, keep=3),
        eval=EvalConfig(every=1000, batches=16),
    )
