"""IsoFLOP comparison on one H200: the 3 KDA : 1 MLA hybrid against pure MLA at equal settings.

Four widths (d_model 128-384, four layers, 64-wide heads, dense FFN, plain residual, NoPE MLA in
both arms) at three compute budgets, on the English debtext corpus without its dictionaries
(byte-level BPE of 8192 tokens, built once into ``.data/debtext-prose-bpe8k``; see
docs/scaling.md). Four runs share the GPU at a time. ``hybrid`` is the baseline: a multiplier above
1 for ``mla`` would mean pure MLA is the more compute-efficient arm.
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
from k3jax.sweep import Budget, Executor, Ladder, Sweep, Variant, WidthRule

CORPUS = ".data/debtext-prose-bpe8k"


def base() -> ExperimentConfig:
    model = ModelConfig(
        vocab_size=8192, d_model=256, num_layers=4, mla_every=4,
        kda=KDAConfig(num_heads=4, head_dim=64, gate="lower_bound", lower_bound=-5.0,
                      gate_rank=32, output_gate="full", chunk_size=64),
        mla=MLAConfig(num_heads=4, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=64,
                      qk_rope_head_dim=32, v_head_dim=64, output_gate=True),
        dense_ffn=FFNConfig(intermediate_size=768, activation="situ_glu"),
        residual=ResidualConfig(kind="plain"))
    return ExperimentConfig(
        model=model,
        data=DataConfig(data_dir=CORPUS, tokenizer="bpe", seq_len=512, batch_size=32),
        optim=OptimConfig(name="adamw", lr=3e-3, schedule="wsd", warmup_steps=20,
                          decay_fraction=0.2, weight_decay=0.1, clip_norm=1.0),
        train=TrainConfig(log_every=25),
        checkpoint=CheckpointConfig(every=250, keep=2),
        eval=EvalConfig(every=1_000_000, batches=16))  # held-out loss at the start and the end


def get_sweep() -> Sweep:
    return Sweep(
        name="hybrid_vs_mla",
        base=base(),
        ladder=Ladder(sizes=(128, 192, 256, 384), knob="width"),
        budget=Budget(compute=(1e14, 3e14, 1e15)),
        variants=(Variant("hybrid"), Variant("mla", ("model.mla_every=1",))),
        baseline="hybrid",
        lr_rule=WidthRule(lr=3e-3, width=256, exponent=0.5),
        seeds=(0,),
        executor=Executor(kind="local", devices="gpu", per_device=4),
        flops_per_s=1.5e13)  # per run, a guess (about 1.5% MFU) until measured
