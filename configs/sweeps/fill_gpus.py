"""How much filling a host's GPUs saves: 16 short runs on the MQAR task (no corpus needed), two
to a GPU, against the same runs in turn (``make bench-sweep`` runs both and reports their wall
times).

The 3:1 hybrid against pure MLA at four widths (d_model 64-256, four layers, dense FFN, plain
residual), two seeds each, 2M tokens a run. The runs are small, so the GPU is mostly idle between
kernels and the start-up (compile) is most of a run's time: what running side by side buys.
"""

from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, ResidualConfig
from k3jax.config.experiment import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ExperimentConfig,
    OptimConfig,
    TrainConfig,
)
from k3jax.sweep import Budget, Executor, Ladder, Sweep, Variant


def base() -> ExperimentConfig:
    model = ModelConfig(
        vocab_size=256, d_model=128, num_layers=4, mla_every=4,
        kda=KDAConfig(num_heads=2, head_dim=64, gate="lower_bound", lower_bound=-5.0,
                      gate_rank=16, output_gate="full", chunk_size=64),
        mla=MLAConfig(num_heads=2, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=64,
                      qk_rope_head_dim=32, v_head_dim=64, output_gate=True),
        dense_ffn=FFNConfig(intermediate_size=384, activation="situ_glu"),
        residual=ResidualConfig(kind="plain"))
    return ExperimentConfig(
        model=model,
        data=DataConfig(task="mqar", seq_len=256, batch_size=16),
        optim=OptimConfig(name="adamw", lr=3e-3, schedule="wsd", warmup_steps=20,
                          decay_fraction=0.2),
        train=TrainConfig(log_every=50),
        checkpoint=CheckpointConfig(every=1000, keep=1),
        eval=EvalConfig(every=1_000_000, batches=2))


def get_sweep() -> Sweep:
    return Sweep(
        name="fill_gpus",
        base=base(),
        ladder=Ladder(sizes=(64, 128, 192, 256), knob="width"),
        budget=Budget(tokens=(2_097_152,)),
        variants=(Variant("hybrid"), Variant("mla", ("model.mla_every=1",))),
        baseline="hybrid",
        seeds=(0, 1),
        executor=Executor(kind="local", devices="gpu", per_device=2))
