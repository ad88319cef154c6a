"""How much filling a host's GPUs saves: 16 short runs on the MQAR task (no corpus needed), two
to a GPU, against the same runs in turn (``make bench-sweep`` runs both and reports their wall
times).

``hybrid_vs_mla.py``'s models (the 3:1 hybrid against pure MLA, four layers, plain residual) at
four widths (d_model 64-256) with a 256-token vocabulary, two seeds each, 1M tokens a run. The
runs are small, so the GPU is mostly idle between kernels and the start-up (compile) is most of a
run's time: what running side by side buys.
"""

import dataclasses

from configs.sweeps.hybrid_vs_mla import base as prose_base
from k3jax.config.experiment import CheckpointConfig, DataConfig, EvalConfig, ExperimentConfig
from k3jax.sweep import Budget, Executor, Ladder, Sweep, Variant


def base() -> ExperimentConfig:
    cfg = prose_base()
    return dataclasses.replace(
        cfg, model=cfg.model.replace(vocab_size=256),
        data=DataConfig(task="mqar", seq_len=256, batch_size=16),
        checkpoint=CheckpointConfig(every=1000, keep=1),
        eval=EvalConfig(every=1_000_000, batches=2))


def get_sweep() -> Sweep:
    return Sweep(
        name="fill_gpus",
        base=base(),
        ladder=Ladder(sizes=(64, 128, 192, 256), knob="width"),
        budget=Budget(tokens=(1_048_576,)),
        variants=(Variant("hybrid"), Variant("mla", ("model.mla_every=1",))),
        baseline="hybrid",
        seeds=(0, 1),
        executor=Executor(kind="local", devices="gpu", per_device=2))
