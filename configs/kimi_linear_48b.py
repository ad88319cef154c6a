"""Kimi Linear 48B-A3B shapes (SPEC section 1): about 48B total, 3B active."""

from k3jax.config import FFNConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=163840, d_model=2304, num_layers=27, mla_every=4, first_k_dense=1,
        kda=KDAConfig(num_heads=32, head_dim=128, conv_size=4, gate="softplus", gate_rank=128,
                      output_gate="low_rank", output_gate_rank=128),
        mla=MLAConfig(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=False),
        dense_ffn=FFNConfig(intermediate_size=9216, activation="swiglu"),
        moe=MoEConfig(num_experts=256, top_k=8, expert_intermediate=1024, latent_dim=None,
                      shared_intermediate=1024, routed_scaling_factor=2.446, activation="swiglu",
                      balancing="aux_free"),
        residual=ResidualConfig(kind="plain"),
        rms_eps=1e-5, remat="full",
    )


def get_config():
    """The published recipe's shape of a run (Muon, WSD, 4K context, byte-level BPE); for shape
    checks and accounting -- a real run needs a sharded multi-host setup."""
    from k3jax.config.experiment import (CheckpointConfig, DataConfig, EvalConfig,
                                         ExperimentConfig, OptimConfig, TrainConfig)

    model = model_config()
    return ExperimentConfig(
        model=model,
        data=DataConfig(sources=("../shared/data/debtext-150.tar.xz",), tokenizer="bpe",
                        seq_len=4096, batch_size=256),
        optim=OptimConfig(name="muon", lr=2e-3, schedule="wsd", warmup_steps=2000,
                          decay_fraction=0.2, weight_decay=0.1, clip_norm=1.0),
        train=TrainConfig(steps=100_000, micro_batches=8, log_every=10),
        checkpoint=CheckpointConfig(every=1000, keep=3),
        eval=EvalConfig(every=1000, batches=16),
    )
